"""The dense method's windowed calls on the fast backends: exact causal attention within the
config's local window, as block-sparse attention over the window's own block lists (no
selection pass): :func:`sparseflow.kernels.token_blocks.window_block_indices` gives each query the
blocks its window touches, and the kernels bound the keys element-wise."""

from __future__ import annotations

from typing import Optional

import torch

from ...kernels.token_blocks import window_block_indices
from .reference import _window_config

__all__ = ["flex_window_attention", "triton_window_attention", "WINDOW_BLOCK"]

WINDOW_BLOCK = 64  # key block of the window's lists: a 512-key window touches 9 of them


def _window_lists(q: torch.Tensor, k: torch.Tensor, cfg) -> torch.Tensor:
    ids = window_block_indices(q.shape[2], k.shape[2], WINDOW_BLOCK, cfg.sliding_window, cfg.chunk_size, q.device)
    return ids.expand(q.shape[0], k.shape[1], -1, -1)


def flex_window_attention(
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
    """The window on compiled FlexAttention (:func:`sparseflow.kernels.flex_common.token_block_attention`)."""
    from ...kernels import flex_common as fc

    cfg = _window_config(config, fields)
    fc.check_flex_inputs(q, k, v)
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.to(device=q.device, dtype=torch.bool)
    out = fc.token_block_attention(
        q,
        k,
        v,
        _window_lists(q, k, cfg).long(),
        key_padding_mask=key_padding_mask,
        is_causal=is_causal,
        scale=scale,
        block_size=WINDOW_BLOCK,
        sliding_window=cfg.sliding_window,
        chunk_size=cfg.chunk_size,
    )
    return (out, None) if return_selection else out


def triton_window_attention(
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
    """The window on the token-sparse Triton kernels (forward and backward)."""
    from ...kernels.token_sparse_triton import token_sparse_attention

    cfg = _window_config(config, fields)
    out = token_sparse_attention(
        q,
        k,
        v,
        _window_lists(q, k, cfg),
        key_padding_mask=key_padding_mask,
        is_causal=is_causal,
        scale=scale,
        block_size=WINDOW_BLOCK,
        sliding_window=cfg.sliding_window,
        chunk_size=cfg.chunk_size,
    )
    return (out, None) if return_selection else out
