"""PBS reference, stage 3: the block selection.

:func:`select_blocks` gives ``block_mask[b, h, qb, kb]`` over *permuted* key blocks: the
threshold selection over the candidate blocks (:func:`candidate_blocks`, weighed by
:mod:`.estimate`'s block probabilities) plus the forced ones (:func:`forced_blocks`: own
segment / tail region, sink), inside the local window (:func:`window_blocks`) when the config
has one. :func:`selection_density` is the share of the visible block pairs a selection keeps.

* **Region** of a block in row ``b``: its segment index if it lies in a complete segment, else
  ``floor(L_b / S)`` (the tail). Causal candidates of query block ``I``: valid key blocks of a
  strictly smaller region; non-causal: valid key blocks of any other region. A key block is valid
  when it holds at least one valid (non-padded) key.
* **Threshold**: candidates sorted by probability, descending, ties to the lower block index;
  keep the smallest prefix whose cumulative mass reaches ``threshold`` (a block is kept iff the
  mass of the blocks before it is ``< threshold``; fp32). ``threshold >= 1`` keeps every
  candidate (exact mode, no floating-point cut-off).
* **Forced** (not counted toward the threshold): every block of the query block's own region
  and, with ``force_sink``, the permuted block holding the row's first valid token (token 0
  without padding; with left padding the first real token, the attention sink).
* **Density** ``[B, Hq]``: selected block pairs holding at least one visible (query, key)
  element divided by all block pairs holding one, in the permuted layout; visibility is
  ``visible_key_mask`` (causality and key padding; every query row counts, as in
  ``Selection.key_mask``). A row with no visible pair has density 1. The exact mode gives 1.0.
* **Local window** (``sliding_window`` W / ``chunk_size`` C of the config; causal only): query
  ``i`` sees key ``j`` iff ``lo(i) <= j <= i`` with ``lo`` of
  :func:`~sparseflow.kernels.token_blocks.window_lower_bounds` (sliding: ``i - W < j``; chunked:
  ``j`` in ``i``'s chunk). ``lo`` rises with the position, so the keys the queries of block ``I``
  see under the window are ``[lo(I*bs), last query of I]``, and a permuted key block is *inside
  the window* of query block ``I`` when it holds a valid key at or after ``lo(I*bs)``
  (:func:`window_blocks`; the causal side is the region rule's, as without a window). The
  selection is made among those blocks only: candidates and forced blocks (own region, sink)
  outside the window are dropped, and the block probabilities are the distribution over the
  candidates inside the window (the threshold is a share of the in-window mass). The
  permutation does not depend on the window. The attention masks every key element-wise by its
  original position (``lo(i) <= orig_pos(k) <= i``), so at ``threshold >= 1`` the output is the
  exact window's. The dense tail attends every key of its rows' windows; the density counts
  the block pairs inside the window.
"""

from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from ...kernels.token_blocks import check_window, window_lower_bounds
from .config import PBSConfig
from .estimate import block_probabilities
from .reference_common import (
    effective_lengths,
    first_valid,
    num_blocks,
    padded_permutation,
    permutation_head_of,
    slot_validity,
)

__all__ = [
    "block_regions",
    "candidate_blocks",
    "forced_blocks",
    "window_blocks",
    "block_last_keys",
    "query_block_window_starts",
    "threshold_blocks",
    "select_blocks",
    "threshold_selections",
    "selection_density",
]


def block_regions(
    key_padding_mask: Optional[Tensor], batch: int, n: int, *, block_size: int, segment_size: int, device=None
) -> Tensor:
    """``[B, nB]`` int64: the region of each block (segment index, or ``floor(L_b/S)`` = tail)."""
    n_blocks = num_blocks(n, block_size)
    lengths = effective_lengths(key_padding_mask, batch, n, device)
    start = torch.arange(n_blocks, device=lengths.device) * block_size
    seg = start // segment_size
    return torch.minimum(seg[None, :], (lengths // segment_size)[:, None])


@torch.no_grad()
def candidate_blocks(
    permutation: Tensor,
    hq: int,
    *,
    key_padding_mask: Optional[Tensor] = None,
    is_causal: bool = True,
    block_size: int = PBSConfig.block_size,
    segment_size: int = PBSConfig.segment_size,
) -> Tensor:
    """``[B, Hq, nB, nB]`` bool: key block ``J`` (permuted) is a scored candidate of query block ``I``."""
    bsz, hp, n = permutation.shape
    region = block_regions(
        key_padding_mask, bsz, n, block_size=block_size, segment_size=segment_size, device=permutation.device
    )
    rq, rk = region[:, :, None], region[:, None, :]
    cand = (rk < rq) if is_causal else (rk != rq)  # [B, nB, nB]
    kvalid = _key_block_valid(permutation, key_padding_mask, block_size)  # [B, Hp, nB]
    kvalid = kvalid[:, permutation_head_of(hq, hp).to(permutation.device)]  # [B, Hq, nB]
    return cand[:, None] & kvalid[:, :, None, :]


def _key_block_valid(permutation: Tensor, key_padding_mask: Optional[Tensor], block_size: int) -> Tensor:
    bsz, hp, n = permutation.shape
    nb = num_blocks(n, block_size)
    if key_padding_mask is None:
        return torch.ones(bsz, hp, nb, dtype=torch.bool, device=permutation.device)
    kpm = key_padding_mask.bool()
    valid_slot = torch.gather(kpm[:, None, :].expand(bsz, hp, n), 2, permutation)  # [B, Hp, N]
    pad = valid_slot.new_zeros(bsz, hp, nb * block_size - n)
    return torch.cat([valid_slot, pad], dim=-1).view(bsz, hp, nb, block_size).any(dim=-1)


def block_last_keys(permutation: Tensor, key_padding_mask: Optional[Tensor], block_size: int) -> Tensor:
    """``[B, Hp, nB]`` int64: the latest original position of a valid key in each permuted block
    (-1 where it holds none)."""
    bsz, hp, n = permutation.shape
    nb = num_blocks(n, block_size)
    ok = slot_validity(permutation, key_padding_mask, nb, block_size)
    pos = padded_permutation(permutation, nb, block_size)
    return torch.where(ok, pos, torch.full_like(pos, -1)).view(bsz, hp, nb, block_size).amax(dim=-1)


def query_block_window_starts(n: int, block_size: int, sliding_window: int, chunk_size: int, device=None) -> Tensor:
    """``[nB]`` int64: the window's lower bound of each query block's first query, the earliest
    key any query of the block sees (the bound rises with the position)."""
    starts = torch.arange(num_blocks(n, block_size), device=device) * block_size
    return window_lower_bounds(starts, sliding_window, chunk_size)


@torch.no_grad()
def window_blocks(
    permutation: Tensor,
    hq: int,
    *,
    key_padding_mask: Optional[Tensor] = None,
    block_size: int = PBSConfig.block_size,
    sliding_window: int = PBSConfig.sliding_window,
    chunk_size: int = PBSConfig.chunk_size,
) -> Optional[Tensor]:
    """``[B, Hq, nB, nB]`` bool: permuted key block ``J`` is inside the local window of query
    block ``I`` -- it holds a valid key at or after the window's lower bound of ``I``'s first
    query (see the module docstring); None without a window (every block is)."""
    if not (sliding_window or chunk_size):
        return None
    n = permutation.shape[2]
    last = block_last_keys(permutation, key_padding_mask, block_size)  # [B, Hp, nB]
    lo = query_block_window_starts(n, block_size, sliding_window, chunk_size, permutation.device)  # [nB]
    inside = last[:, :, None, :] >= lo[None, None, :, None]  # [B, Hp, nB, nB]
    return inside[:, permutation_head_of(hq, permutation.shape[1]).to(permutation.device)]


@torch.no_grad()
def forced_blocks(
    permutation: Tensor,
    hq: int,
    *,
    key_padding_mask: Optional[Tensor] = None,
    block_size: int = PBSConfig.block_size,
    segment_size: int = PBSConfig.segment_size,
    force_sink: bool = PBSConfig.force_sink,
) -> Tensor:
    """``[B, Hq, nB, nB]`` bool: own region of every query block, plus the sink block."""
    bsz, hp, n = permutation.shape
    dev = permutation.device
    nb = num_blocks(n, block_size)
    region = block_regions(key_padding_mask, bsz, n, block_size=block_size, segment_size=segment_size, device=dev)
    forced = (region[:, :, None] == region[:, None, :])[:, None].expand(bsz, hq, nb, nb).clone()
    if force_sink:
        first = first_valid(key_padding_mask, bsz, n, dev)  # [B]
        has = first >= 0
        slot = (permutation == first.clamp_min(0)[:, None, None]).to(torch.int8).argmax(dim=-1)  # [B, Hp]
        sink_block = (slot // block_size)[:, permutation_head_of(hq, hp).to(dev)]  # [B, Hq]
        onehot = torch.nn.functional.one_hot(sink_block, nb).bool() & has[:, None, None]  # [B, Hq, nB]
        forced |= onehot[:, :, None, :]
    return forced


@torch.no_grad()
def threshold_blocks(probs: Tensor, candidates: Tensor, threshold: float) -> Tensor:
    """Keep, per query block, the smallest prefix of candidates (sorted by probability, descending,
    ties to the lower index) whose cumulative mass reaches ``threshold``; all of them if
    ``threshold >= 1``. ``probs``/``candidates``: ``[..., nKB]``. Returns bool ``[..., nKB]``."""
    if float(threshold) >= 1.0:
        return candidates.clone()
    key = torch.where(candidates, probs.float(), torch.full_like(probs, -1.0, dtype=torch.float32))
    sorted_p, order = torch.sort(key, dim=-1, descending=True, stable=True)
    sorted_cand = torch.gather(candidates, -1, order)
    mass = torch.where(sorted_cand, sorted_p, torch.zeros_like(sorted_p))
    before = torch.cumsum(mass, dim=-1) - mass  # exclusive prefix sum
    keep_sorted = sorted_cand & (before < float(threshold))
    keep = torch.zeros_like(candidates)
    keep.scatter_(-1, order, keep_sorted)
    return keep


@torch.no_grad()
def select_blocks(
    q: Tensor,
    k: Tensor,
    permutation: Tensor,
    *,
    key_padding_mask: Optional[Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    block_size: int = PBSConfig.block_size,
    segment_size: int = PBSConfig.segment_size,
    threshold: float = PBSConfig.threshold,
    force_sink: bool = PBSConfig.force_sink,
    scoring: str = PBSConfig.scoring,
    antidiagonal_stride: int = PBSConfig.antidiagonal_stride,
    moments_sd: float = PBSConfig.moments_sd,
    sliding_window: int = PBSConfig.sliding_window,
    chunk_size: int = PBSConfig.chunk_size,
) -> Tensor:
    """``[B, Hq, nB, nB]`` bool over permuted key blocks: threshold selection among the
    candidates, plus the forced blocks (own region, sink); with a local window (causal only)
    both among the blocks inside the window (:func:`window_blocks`)."""
    return threshold_selections(
        q,
        k,
        permutation,
        [threshold],
        key_padding_mask=key_padding_mask,
        is_causal=is_causal,
        scale=scale,
        block_size=block_size,
        segment_size=segment_size,
        force_sink=force_sink,
        scoring=scoring,
        antidiagonal_stride=antidiagonal_stride,
        moments_sd=moments_sd,
        sliding_window=sliding_window,
        chunk_size=chunk_size,
    )[0]


def threshold_selections(
    q,
    k,
    permutation,
    thresholds,
    *,
    key_padding_mask,
    is_causal,
    scale,
    block_size,
    segment_size,
    force_sink,
    scoring,
    antidiagonal_stride,
    moments_sd=PBSConfig.moments_sd,
    sliding_window=PBSConfig.sliding_window,
    chunk_size=PBSConfig.chunk_size,
) -> List[Tensor]:
    """:func:`select_blocks` at each of ``thresholds``; the block probabilities (which do not
    depend on the threshold) are computed once."""
    check_window(sliding_window, chunk_size, is_causal)
    hq = q.shape[1]
    geo = dict(key_padding_mask=key_padding_mask, block_size=block_size, segment_size=segment_size)
    cand = candidate_blocks(permutation, hq, is_causal=is_causal, **geo)
    forced = forced_blocks(permutation, hq, force_sink=force_sink, **geo)
    inside = window_blocks(
        permutation,
        hq,
        key_padding_mask=key_padding_mask,
        block_size=block_size,
        sliding_window=sliding_window,
        chunk_size=chunk_size,
    )
    if inside is not None:  # the selection is made inside the window: the probabilities too
        cand, forced = cand & inside, forced & inside
    probs = None
    out = []
    for threshold in thresholds:
        if float(threshold) >= 1.0:
            out.append(cand | forced)
            continue
        if probs is None:
            probs = block_probabilities(
                q,
                k,
                permutation,
                cand,
                key_padding_mask=key_padding_mask,
                scale=scale,
                block_size=block_size,
                scoring=scoring,
                antidiagonal_stride=antidiagonal_stride,
                moments_sd=moments_sd,
            )
        out.append(threshold_blocks(probs, cand, threshold) | forced)
    return out


@torch.no_grad()
def selection_density(
    block_mask: Tensor,
    permutation: Tensor,
    *,
    key_padding_mask: Optional[Tensor] = None,
    is_causal: bool = True,
    block_size: int = PBSConfig.block_size,
    sliding_window: int = PBSConfig.sliding_window,
    chunk_size: int = PBSConfig.chunk_size,
) -> Tensor:
    """``[B, Hq]`` float32: selected block pairs with a visible element / block pairs with one;
    under a local window the pairs whose key block is inside the query block's window
    (:func:`window_blocks`)."""
    bsz, hq, nb, _ = block_mask.shape
    hp, n = permutation.shape[1], permutation.shape[2]
    dev = block_mask.device
    perm_p = padded_permutation(permutation, nb, block_size)  # [B, Hp, total]
    big = n + 1
    slot_ok = perm_p >= 0
    if key_padding_mask is not None:
        kpm_ext = torch.cat([key_padding_mask.bool(), key_padding_mask.new_zeros(bsz, 1).bool()], dim=-1)
        slot_ok &= torch.gather(
            kpm_ext[:, None, :].expand(bsz, hp, n + 1), 2, torch.where(perm_p < 0, torch.full_like(perm_p, n), perm_p)
        )
    kmin = torch.where(slot_ok, perm_p, torch.full_like(perm_p, big)).view(bsz, hp, nb, block_size).amin(-1)
    kmin = kmin[:, permutation_head_of(hq, hp).to(dev)]  # [B, Hq, nB]
    qmax = (torch.arange(nb, device=dev) * block_size + block_size - 1).clamp_max(n - 1)  # [nB]
    if is_causal:
        vis = kmin[:, :, None, :] <= qmax[None, None, :, None]
    else:
        vis = (kmin < big)[:, :, None, :].expand(bsz, hq, nb, nb)
    inside = window_blocks(
        permutation,
        hq,
        key_padding_mask=key_padding_mask,
        block_size=block_size,
        sliding_window=sliding_window,
        chunk_size=chunk_size,
    )
    if inside is not None:
        vis = vis & inside
    num = (block_mask & vis).sum(dim=(-1, -2)).float()
    den = vis.sum(dim=(-1, -2)).float()
    return torch.where(den > 0, num / den.clamp_min(1.0), torch.ones_like(num))
