"""PISA, ``backend="triton"``: same signature and result as ``reference.pisa_attention``.

Selection: ``triton_select`` (pyramid build + fused walk; selections equal the reference's).
Attention: ``token_sparse_triton`` (forward and dq/dk/dv backward in Triton), so training runs on
the kernels end to end; the selection itself carries no gradient.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...config import backend_config
from .config import PISAConfig
from ...tuning import DEFAULT_TUNING, Tuning
from ...kernels import token_blocks as tb
from ...kernels.token_sparse_triton import token_sparse_attention
from .triton_select import pisa_select

__all__ = ["pisa_attention"]


def pisa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    config: Optional[PISAConfig] = None,
    *,
    key_padding_mask: Optional[torch.Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    return_selection: bool = False,
    tuning: Tuning = DEFAULT_TUNING,
    **fields,
):
    """``tuning``: the selection walk's launch settings and whether the kernels chain
    (:class:`sparseflow.Tuning`)."""
    cfg = backend_config(PISAConfig, config, fields)
    block_size, top_k, branching = cfg.block_size, cfg.top_k, cfg.branching
    score, force_sink, force_previous = cfg.score, cfg.force_sink, cfg.force_previous
    beam = cfg.beam
    window = dict(sliding_window=cfg.sliding_window, chunk_size=cfg.chunk_size)
    idx = pisa_select(
        q,
        k,
        key_padding_mask=key_padding_mask,
        is_causal=is_causal,
        scale=scale,
        block_size=block_size,
        top_k=top_k,
        branching=branching,
        score=score,
        force_sink=force_sink,
        force_previous=force_previous,
        beam=beam,
        **window,
        tuning=tuning,
        index_dtype=torch.int32,
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
        "pisa",
        idx.long(),
        q,
        k,
        key_padding_mask=key_padding_mask,
        is_causal=is_causal,
        block_size=block_size,
        **window,
    )
