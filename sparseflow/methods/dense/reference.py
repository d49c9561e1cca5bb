"""The dense method's reference backend: exact attention inside a config's local window, by the
shared plain-PyTorch oracle (:mod:`sparseflow.kernels.masked_attention`)."""

from __future__ import annotations

from typing import Optional

import torch

from ...kernels.masked_attention import masked_attention


def window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    config=None,
    *,
    key_padding_mask: Optional[torch.Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    return_selection: bool = False,
    **fields,
):
    """The dense method's windowed call: exact causal attention within the config's local window
    (``sliding_window`` / ``chunk_size``), the oracle of the window backends."""
    from ...masks import window_mask

    cfg = _window_config(config, fields)
    wm = window_mask(q.shape[2], k.shape[2], cfg.sliding_window, cfg.chunk_size, q.device)
    out = masked_attention(
        q,
        k,
        v,
        key_padding_mask=key_padding_mask,
        is_causal=is_causal,
        scale=scale,
        key_mask=wm.expand(q.shape[0], q.shape[1], *wm.shape),
    )
    return (out, None) if return_selection else out


def _window_config(config, fields):
    from ...config import backend_config
    from .config import DenseConfig

    cfg = backend_config(DenseConfig, config, fields)
    if not cfg.has_window:
        raise ValueError("the dense method's window backends need sliding_window or chunk_size > 0")
    return cfg
