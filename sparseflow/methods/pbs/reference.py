"""PBS-Attn in plain PyTorch: the oracle the Triton and Flex backends are checked against.

Pipeline (every stage is a separately testable function, in a module of its own whose
docstring states that stage's conventions):

1. :func:`~.permutation.key_scores` -- proxy importance of every key, fp32 ``[B, Hp, N]``.
2. :func:`~.permutation.segment_permutation` -- per complete segment, keys sorted by descending
   score (stable); segment order kept, the tail stays in place. ``permutation[b, hp, j]`` =
   original position of the key at permuted slot ``j``.
3. :func:`~.block_selection.select_blocks` -- ``block_mask[b, h, qb, kb]`` over *permuted* key
   blocks: threshold selection over the candidate blocks (weighed by
   :func:`~.estimate.block_probabilities`) plus the forced ones (own segment / tail region, sink).
4. :func:`~.permuted_attention.permuted_block_attention` -- softmax attention of every query over
   the keys of its selected permuted blocks, element mask by original position
   (``orig_pos(k) <= pos(q)`` when causal), key padding applied, zeros for a query that sees no
   key. Differentiable in q, k, v.

This module runs them for a config: :func:`pbs_attention` (the ``reference`` backend),
:func:`pbs_selection` / :func:`pbs_selections` (the selection without the attention) and
:func:`pbs_report` (the :class:`Selection` every backend reports).

Conventions every stage shares:

* ``N = Nq = Nk``; blocks are ``[i*bs, min((i+1)*bs, N))`` for queries and permuted key slots
  alike, ``nB = ceil(N / bs)``. Because ``segment_size % block_size == 0`` no block straddles a
  segment boundary.
* **Effective length per batch row.** With a key padding mask, row ``b``'s segment structure is
  built on ``L_b = 1 + (last valid position)`` (``N`` without a mask, 0 for an all-padded row):
  its complete segments are the first ``floor(L_b / S)`` segments and everything from
  ``floor(L_b / S) * S`` on is its tail (the "region" after the last complete segment). Trailing
  padding is therefore never sorted as if it were a complete segment, and a right-padded row
  selects exactly what the unpadded, truncated sequence selects. Without trailing padding
  ``L_b = N`` (the plain rule).
* **Causality.** With ``causal_proxy=True`` the output is causal in keys and values: the output
  at query ``i`` depends on no key or value after ``i``: a segment's permutation depends on its own keys and the proxy queries only, a
  query block's candidates are earlier regions (its own region is forced whole, and the element
  mask hides its later keys). It still depends on *later queries*: the proxy rows are the last
  valid positions, and the block mean ``q̄_I`` pools the later rows of ``i``'s block. So the
  result is not causal at model level (a later token changes earlier outputs), and next-token
  KL over prompt positions measures prefill, where the proxy has seen each position's future.
  ``causal_proxy=False`` is not causal in keys either (the proxy softmax spans all segments).
* Selection is computed without gradient; the attention is differentiable in q, k and v.
* GQA is native: K/V are never repeated; per-query-head permutations index the shared KV head.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ...config import backend_config
from ...kernels.token_blocks import check_window
from ...selection import Selection
from .block_selection import selection_density, threshold_selections
from .config import PBSConfig
from .memory import check_selection_memory
from .permutation import config_permutation
from .permuted_attention import permuted_block_attention
from .tail import apply_tail, mark_tail

__all__ = [
    "pbs_attention",
    "pbs_selection",
    "pbs_selections",
    "pbs_report",
    "pbs_reference_selection",
]


def pbs_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    config: Optional[PBSConfig] = None,
    *,
    key_padding_mask: Optional[Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    return_selection: bool = False,
    **fields,
) -> Union[Tensor, Tuple[Tensor, Selection]]:
    """PBS-Attn prefill, plain PyTorch. ``q: [B, Hq, N, D]``, ``k, v: [B, Hkv, N, D]``; output
    ``[B, Hq, N, Dv]`` in ``q.dtype``. With ``return_selection`` also returns the
    :class:`Selection` (block mask over permuted key blocks, permutation, density)."""
    cfg = backend_config(PBSConfig, config, fields)
    check_selection_memory(q, cfg.block_size)
    check_window(cfg.sliding_window, cfg.chunk_size, is_causal)
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.to(torch.bool)
    perm, block_mask = pbs_selection(q, k, cfg, key_padding_mask=key_padding_mask, is_causal=is_causal, scale=scale)
    out = permuted_block_attention(
        q,
        k,
        v,
        perm,
        block_mask,
        key_padding_mask=key_padding_mask,
        is_causal=is_causal,
        scale=scale,
        block_size=cfg.block_size,
        sliding_window=cfg.sliding_window,
        chunk_size=cfg.chunk_size,
    )
    out, block_mask = apply_tail(
        out, block_mask, q, k, v, cfg, key_padding_mask=key_padding_mask, is_causal=is_causal, scale=scale, fp32=True
    )
    if not return_selection:
        return out
    return out, pbs_report(block_mask, perm, cfg, key_padding_mask=key_padding_mask, is_causal=is_causal)


def pbs_report(
    block_mask: Tensor, permutation: Tensor, cfg: PBSConfig, *, key_padding_mask: Optional[Tensor], is_causal: bool
) -> Selection:
    """The :class:`Selection` a PBS call reports (every backend's): its block mask over permuted
    key blocks, the permutation, the density and the call's local window."""
    window = dict(sliding_window=cfg.sliding_window, chunk_size=cfg.chunk_size)
    density = selection_density(
        block_mask,
        permutation,
        key_padding_mask=key_padding_mask,
        is_causal=is_causal,
        block_size=cfg.block_size,
        **window,
    )
    return Selection(
        method="pbs",
        density=density,
        block_size=cfg.block_size,
        is_causal=is_causal,
        num_keys=permutation.shape[2],
        block_mask=block_mask,
        permutation=permutation,
        key_padding_mask=key_padding_mask,
        **window,
    )


@torch.no_grad()
def pbs_reference_selection(
    q: Tensor,
    k: Tensor,
    cfg: PBSConfig,
    *,
    key_padding_mask: Optional[Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
) -> Selection:
    """The :class:`Selection` :func:`pbs_attention` reports, without the attention (the
    registry's ``selection``): the blocks chosen, the dense tail's rows marked."""
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.to(torch.bool)
    perm, block_mask = pbs_selection(q, k, cfg, key_padding_mask=key_padding_mask, is_causal=is_causal, scale=scale)
    block_mask = mark_tail(block_mask, cfg.dense_tail_blocks)
    return pbs_report(block_mask, perm, cfg, key_padding_mask=key_padding_mask, is_causal=is_causal)


@torch.no_grad()
def pbs_selection(
    q: Tensor,
    k: Tensor,
    cfg: PBSConfig,
    *,
    key_padding_mask: Optional[Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
) -> Tuple[Tensor, Tensor]:
    """``(permutation [B, Hp, N], block_mask [B, Hq, nB, nB])`` of :func:`pbs_attention`: what it
    selects (inside ``cfg``'s local window when it has one), without the attention (its density
    is :func:`selection_density` of the two)."""
    perm, masks = pbs_selections(
        q, k, cfg, [cfg.threshold], key_padding_mask=key_padding_mask, is_causal=is_causal, scale=scale
    )
    return perm, masks[0]


@torch.no_grad()
def pbs_selections(
    q: Tensor,
    k: Tensor,
    cfg: PBSConfig,
    thresholds: Sequence[float],
    *,
    key_padding_mask: Optional[Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
) -> Tuple[Tensor, List[Tensor]]:
    """:func:`pbs_selection` of ``cfg`` at each of ``thresholds`` (``cfg.threshold`` unused): one
    permutation and one set of block probabilities for all of them."""
    if cfg.gqa_permutation not in ("query_head", "kv_head"):
        raise ValueError(f"gqa_permutation must be 'query_head' or 'kv_head', got {cfg.gqa_permutation!r}")
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.to(torch.bool)
    qd, kd = q.detach(), k.detach()
    perm = config_permutation(qd, kd, cfg, key_padding_mask, scale)
    masks = threshold_selections(
        qd,
        kd,
        perm,
        thresholds,
        key_padding_mask=key_padding_mask,
        is_causal=is_causal,
        scale=scale,
        block_size=cfg.block_size,
        segment_size=cfg.segment_size,
        force_sink=cfg.force_sink,
        scoring=cfg.scoring,
        antidiagonal_stride=cfg.antidiagonal_stride,
        moments_sd=cfg.moments_sd,
        sliding_window=cfg.sliding_window,
        chunk_size=cfg.chunk_size,
    )
    return perm, masks
