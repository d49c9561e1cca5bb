"""BSA, ``backend="triton"``: same signature and result as ``reference.bsa_attention``.

Selection: ``triton_select`` (the fused full-scan selector; selections equal the reference's up to
fp32 rounding, see its ``precision``).
Attention: ``token_sparse_triton`` (forward and dq/dk/dv backward in Triton), so training runs on
the kernels end to end; the selection itself carries no gradient.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...config import backend_config
from .config import BSAConfig
from ...kernels import token_blocks as tb
from ...kernels.token_sparse_triton import token_sparse_attention
from ...tuning import DEFAULT_TUNING, Tuning
from .triton_select import bsa_select

__all__ = ["bsa_attention"]


def bsa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    config: Optional[BSAConfig] = None,
    *,
    key_padding_mask: Optional[torch.Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    return_selection: bool = False,
    tuning: Tuning = DEFAULT_TUNING,
    **fields,
):
    """``tuning``: whether the attention's kernels chain (``pdl``, :class:`sparseflow.Tuning`)."""
    cfg = backend_config(BSAConfig, config, fields)
    block_size, top_k, force_sink = cfg.block_size, cfg.top_k, cfg.force_sink
    force_previous = cfg.force_previous
    window = dict(sliding_window=cfg.sliding_window, chunk_size=cfg.chunk_size)
    idx = bsa_select(
        q,
        k,
        key_padding_mask=key_padding_mask,
        is_causal=is_causal,
        scale=scale,
        block_size=block_size,
        top_k=top_k,
        force_sink=force_sink,
        force_previous=force_previous,
        index_dtype=torch.int32,
        **window,
    )
    out = token_sparse_attention(
        q,
        k,
        v,
        idx,
        key_padding_mask=key_padding_mask,
        is_causal=is_causal,
        scale=scale,
        block_size=block_size,
        pdl=tuning.pdl,
        **window,
    )
    if not return_selection:
        return out
    return out, tb.selection_for_indices(
        "bsa", idx.long(), q, k, key_padding_mask=key_padding_mask, is_causal=is_causal, block_size=block_size, **window
    )
