"""The attention every top-k block method (PISA, BSA) runs over its own selection, on each fast
backend: the method supplies its selection function, this module the rest (inputs, the
token-sparse attention, the reported :class:`~sparseflow.selection.Selection`).

A selection function is called as ``select(q, k, *, key_padding_mask, is_causal, scale,
**fields)`` with the config's fields (``min_seq_len`` aside, which the op applies) and returns
``[B, Hkv, Nq, K]`` block ids, ``-1`` padded. Kernel modules are imported on first use.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from .._config_base import AttentionConfig

__all__ = ["flex_top_k_attention", "triton_top_k_attention", "reference_top_k_selection", "selection_fields"]

Select = Callable[..., torch.Tensor]


def selection_fields(cfg: AttentionConfig) -> dict:
    """The config's fields a selection function takes (all but ``min_seq_len``, the op's)."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "min_seq_len"}


def _window(cfg: AttentionConfig) -> dict:
    return dict(sliding_window=cfg.sliding_window, chunk_size=cfg.chunk_size)


def reference_top_k_selection(
    method: str,
    select: Select,
    q: torch.Tensor,
    k: torch.Tensor,
    cfg: AttentionConfig,
    *,
    key_padding_mask: Optional[torch.Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
):
    """The :class:`~sparseflow.selection.Selection` of ``select`` on ``q``, ``k`` as the method's
    attention reports it, without the attention (a method's registry ``selection``)."""
    from ..kernels import token_blocks as tb

    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.to(device=q.device, dtype=torch.bool)
    geo = dict(key_padding_mask=key_padding_mask, is_causal=is_causal)
    with torch.no_grad():
        idx = select(q.detach(), k.detach(), scale=scale, **geo, **selection_fields(cfg))
    return tb.selection_for_indices(method, idx.long(), q, k, block_size=cfg.block_size, **geo, **_window(cfg))


def flex_top_k_attention(
    method: str,
    select: Select,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cfg: AttentionConfig,
    *,
    key_padding_mask: Optional[torch.Tensor],
    is_causal: bool,
    scale: Optional[float],
    return_selection: bool,
    q_tile: Optional[int] = None,
    kv_tile: Optional[int] = None,
):
    """The selection (without gradient), then compiled FlexAttention over it
    (:func:`sparseflow.kernels.flex_common.token_block_attention`)."""
    from ..kernels import flex_common as fc

    fc.check_flex_inputs(q, k, v)
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.to(device=q.device, dtype=torch.bool)
    geo = dict(key_padding_mask=key_padding_mask, is_causal=is_causal)
    idx = select(q.detach(), k.detach(), scale=scale, **geo, **selection_fields(cfg))
    out = fc.token_block_attention(
        q, k, v, idx, scale=scale, block_size=cfg.block_size, q_tile=q_tile, kv_tile=kv_tile, **geo, **_window(cfg)
    )
    if not return_selection:
        return out
    return out, fc.token_selection(method, idx, q, k, block_size=cfg.block_size, **geo, **_window(cfg))


def triton_top_k_attention(
    method: str,
    select: Select,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cfg: AttentionConfig,
    *,
    key_padding_mask: Optional[torch.Tensor],
    is_causal: bool,
    scale: Optional[float],
    return_selection: bool,
    pdl: bool,
):
    """The selection as the kernels' int32 ids, then the token-sparse Triton attention over it
    (forward and backward), its launches chained when ``pdl``."""
    from ..kernels import token_blocks as tb
    from ..kernels.token_sparse_triton import token_sparse_attention

    geo = dict(key_padding_mask=key_padding_mask, is_causal=is_causal)
    idx = select(q, k, scale=scale, index_dtype=torch.int32, **geo, **selection_fields(cfg))
    out = token_sparse_attention(q, k, v, idx, scale=scale, block_size=cfg.block_size, pdl=pdl, **geo, **_window(cfg))
    if not return_selection:
        return out
    return out, tb.selection_for_indices(method, idx.long(), q, k, block_size=cfg.block_size, **geo, **_window(cfg))
