"""PISA selection in Triton: the pyramid build and the fused coarse-to-fine walk.

Imported lazily (``backend="triton"``); this module imports Triton.

* ``build_pyramid``: two kernels. The first sums the valid keys of every leaf block (``C`` keys)
  and records its valid-key count and first valid position; the second fills every upper node of
  every level at once from the leaf sums (a node's summary is the mean of all valid keys under
  it, as in the reference). All levels live in one ``[B, Hkv, T, D]`` fp32 table, leaves first.
* ``pisa_select``: one program per (query token, batch x KV head) walks from the root to the
  leaves with its kept nodes in registers: the candidates of a level are the children of the
  nodes kept at the level above, future / empty nodes are dropped, the ancestors of the forced
  blocks are kept without scoring, and, when more than the level's width remain, the
  best-scoring ones fill the rest (ties to the lower index). The width is ``top_k`` at the leaf
  level and ``beam * top_k`` above it (the reference's ``beam``); the kept-node registers hold
  ``KP = next_pow2(beam * top_k)`` slots and a level's ``CW >= KP * next_pow2(g)`` candidates.
  Scores are the reference's, summed over the ``G`` query heads of the group, with the ``G``
  heads as the rows of one ``tl.dot`` per level (fp32 summaries in IEEE fp32; raw keys in their
  own 16-bit dtype, whose products are exact in fp32).
  No query-key score matrix is ever written: the only output is ``[B, Hkv, Nq, top_k]``.

``Tuning(pisa_walk="scan")`` (and ``"auto"`` on CUDA) runs this kernel as the middle stage of
``triton_select_scan``: the node scores from a scan by query tiles, the leaves scored by pairs
grouped per leaf. ``Tuning(pisa_walk="tiled")`` runs the walk by tiles of consecutive queries
(``triton_select_tiled``). All three select the same blocks.

The same kernel serves decoding (``Nq = 1``): the walk costs ``O(g * beam * K * log(N / C))`` per
token.
"""

from __future__ import annotations

import logging
import math
from typing import List, Optional, Tuple

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from ...kernels.block_summaries_triton import leaf_sums
from ...kernels.token_blocks import check_index_dtype, selection_width
from ...tuning import DEFAULT_TUNING, Tuning
from .reference import check_beam
from ...kernels._triton_env import interpreting
from ...kernels.pdl import pdl_start
from .config import PISAConfig

__all__ = ["build_pyramid", "pisa_select", "level_sizes", "pyramid_tables", "SCORE_CODES"]

_log = logging.getLogger("sparseflow")


def _launch(cw: int, warps: Optional[int] = None, leaf_bytes: Optional[int] = None) -> Tuple[int, int]:
    """(warps, leaf-chunk bytes) of the walk for ``cw`` candidates; None picks by ``cw``
    (``Tuning.pisa_warps`` / ``pisa_leaf_bytes``). Measured on the H200
    (benchmarks/results/pisa_h200_select_variants.json, 64K tokens, K=8): 1 warp with 16 KB leaf
    chunks 17.0 ms, 4 warps 30.7-31.4 ms, 8 warps 43-49 ms; with K=32 (64 candidates) 1 warp was
    2x slower than 4 (pisa_h200_k8_warps1.json vs pisa_h200.json)."""
    small = cw <= 16
    warps = (1 if small else 4) if warps is None else warps
    leaf_bytes = (16384 if small else 65536) if leaf_bytes is None else leaf_bytes
    return warps, leaf_bytes


SCORE_CODES = {"lse": 0, "mean": 1, "mean_var": 2}


def _p2(x: int, lo: int = 1) -> int:
    return max(lo, triton.next_power_of_2(int(x)))


def kept_slots(beam: int, top_k: int) -> int:
    """Kept-node slots of one row of the walk (``KP``): a power of two holding ``beam * top_k``,
    at least 2 (a one-element block -- one leaf, a prompt of at most one block -- fails Triton's
    coalesce pass on sm_90)."""
    return _p2(beam * top_k, 2)


def candidate_width(beam: int, top_k: int, branching: int) -> int:
    """Candidate slots of one row of the walk (``CW``): the children of the kept nodes, at least
    the 16 columns a dot needs."""
    return max(16, kept_slots(beam, top_k) * _p2(branching))


def _leaf_chunk(cw: int, cp: int, dp: int, elem_bytes: int, budget: int = 65536) -> int:
    """Candidate leaves scored per dot at the leaf level: their keys (LC * CP rows of DP) stay
    within ``budget`` bytes of shared memory (fp32 keys at D=128 need smaller chunks)."""
    return max(1, min(cw, budget // (cp * dp * elem_bytes)))


def level_sizes(n_leaves: int, branching: int) -> List[int]:
    """Node counts per level, leaves first, root (1 node) last."""
    sizes = [max(1, n_leaves)]
    while sizes[-1] > 1:
        sizes.append(-(-sizes[-1] // branching))
    return sizes


# --------------------------------------------------------------------------- pyramid


@triton.jit
def _node_kernel(
    sums_ptr,
    lcnt_ptr,
    lfv_ptr,
    summ_ptr,
    nfv_ptr,
    lvl_off_ptr,
    lvl_span_ptr,
    stride_sb,
    stride_sh,
    stride_st,
    stride_mb,
    stride_mh,
    stride_mt,
    n_leaves,
    T,
    HKV,
    Nk,
    N_LEVELS: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    BL: tl.constexpr,
):
    """One program per node of every level (leaves included): summary = sum of its leaves'
    key sums / their valid-key count; first valid position = min over its leaves."""
    t = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # 64-bit offsets: batch x head strides pass 2**31 elements at long contexts
    b = bh // HKV
    h = bh % HKV
    lv = 0
    for i in range(1, N_LEVELS):
        lv = tl.where(t >= tl.load(lvl_off_ptr + i), i, lv)
    u = t - tl.load(lvl_off_ptr + lv)
    span = tl.load(lvl_span_ptr + lv)
    first_leaf = u * span
    offs_d = tl.arange(0, DP)
    offs_l = tl.arange(0, BL)
    acc = tl.zeros([DP], dtype=tl.float32)
    cnt = 0
    fv = Nk
    l0 = 0
    while l0 < span:  # (while: the interpreter cannot range() over a runtime bound)
        leaf = first_leaf + l0 + offs_l
        ok = (l0 + offs_l < span) & (leaf < n_leaves)
        s = tl.load(
            # 64-bit: a leaf index times its row stride can pass 2**31 elements
            sums_ptr + b * stride_sb + h * stride_sh + leaf.to(tl.int64)[:, None] * stride_st + offs_d[None, :],
            mask=ok[:, None] & (offs_d[None, :] < D),
            other=0.0,
        )
        acc += tl.sum(s, axis=0)
        cnt += tl.sum(tl.load(lcnt_ptr + b * n_leaves + leaf, mask=ok, other=0), axis=0)
        fv = tl.minimum(fv, tl.min(tl.load(lfv_ptr + b * n_leaves + leaf, mask=ok, other=Nk), axis=0))
        l0 += BL
    mean = acc / tl.maximum(cnt, 1).to(tl.float32)
    row = summ_ptr + b * stride_mb + h * stride_mh + t.to(tl.int64) * stride_mt  # 64-bit: node id x row stride
    tl.store(row + offs_d, mean, mask=offs_d < D)
    if h == 0:
        tl.store(nfv_ptr + b * T + t, fv)


def pyramid_tables(n_leaves: int, branching: int, device) -> Tuple[List[int], List[int], torch.Tensor, torch.Tensor]:
    """Layout of every level in one table, leaves first: (node counts per level, level offsets
    (length levels + 1), the offsets and the leaf spans ``g**level`` as int32 tensors)."""
    sizes = level_sizes(n_leaves, branching)
    offs = [0]
    for s in sizes:
        offs.append(offs[-1] + s)
    return sizes, offs, *_device_tables(max(1, n_leaves), branching, len(sizes), device)


def _device_tables(n_leaves: int, branching: int, levels: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """The level offsets and leaf spans computed on ``device`` (a host list copied there would be
    a pageable copy: a host sync, and no CUDA-graph capture). Level ``i`` has
    ``ceil(n_leaves / g**i)`` nodes (repeated ceil-division), the same as :func:`level_sizes`.
    On a GPU (and under the interpreter) one Triton program writes both (torch takes nine small
    launches, a measurable share of a short layer's selection)."""
    if torch.device(device).type == "cuda" or interpreting():
        return torch.ops.sparseflow.pisa_level_tables(n_leaves, branching, levels, torch.device(device))
    return _device_tables_torch(n_leaves, branching, levels, device)


def _device_tables_torch(n_leaves: int, branching: int, levels: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`_device_tables` in torch ops."""
    span = torch.pow(branching, torch.arange(levels, device=device, dtype=torch.int64))
    counts = torch.div(n_leaves + span - 1, span, rounding_mode="floor").clamp_min(1)
    offs = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    # spans of the top levels exceed int32 only for absurd lengths; clamp
    return offs.to(torch.int32), span.clamp_max(2**30).to(torch.int32)


@triton.jit
def _level_tables_kernel(offs_ptr, span_ptr, n_leaves, branching, levels, LP: tl.constexpr):
    """``offs[i]`` (``i <= levels``): the nodes of the levels below ``i``; ``span[i]`` (``i <
    levels``): ``branching**i`` clamped to 2**30. Spans saturate at 2**31 while they are
    multiplied (every level at or above ``n_leaves`` has one node either way)."""
    ar = tl.arange(0, LP)
    span = tl.full([LP], 1, tl.int64)
    for lv in range(1, LP):  # LP (> levels) is a constant bound: the interpreter needs one
        span = tl.where(ar >= lv, tl.minimum(span * branching, 1 << 31), span)
    counts = tl.where(ar < levels, tl.maximum((n_leaves + span - 1) // span, 1), 0)
    tl.store(offs_ptr + ar, (tl.cumsum(counts, axis=0) - counts).to(tl.int32), mask=ar <= levels)
    tl.store(span_ptr + ar, tl.minimum(span, 1 << 30).to(tl.int32), mask=ar < levels)


@triton_op("sparseflow::pisa_level_tables", mutates_args={})
def _level_tables(
    n_leaves: int, branching: int, levels: int, device: torch.device
) -> Tuple[torch.Tensor, torch.Tensor]:
    offs = torch.empty(levels + 1, dtype=torch.int32, device=device)
    span = torch.empty(levels, dtype=torch.int32, device=device)
    wrap_triton(_level_tables_kernel)[(1,)](offs, span, n_leaves, branching, levels, LP=_p2(levels + 1, 16))
    return offs, span


@_level_tables.register_fake
def _(n_leaves, branching, levels, device):
    return (
        torch.empty(levels + 1, dtype=torch.int32, device=device),
        torch.empty(levels, dtype=torch.int32, device=device),
    )


@triton_op("sparseflow::pisa_pyramid_nodes", mutates_args={})
def _pisa_nodes(
    sums: torch.Tensor,
    cnt: torch.Tensor,
    lfv: torch.Tensor,
    lvl_off: torch.Tensor,
    lvl_span: torch.Tensor,
    n_k: int,
    total_nodes: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    b, hkv, n_leaves, d = sums.shape
    summ = torch.empty(b, hkv, total_nodes, d, dtype=torch.float32, device=sums.device)
    nfv = torch.empty(b, total_nodes, dtype=torch.int32, device=sums.device)
    wrap_triton(_node_kernel)[(total_nodes, b * hkv)](
        sums,
        cnt,
        lfv,
        summ,
        nfv,
        lvl_off,
        lvl_span,
        sums.stride(0),
        sums.stride(1),
        sums.stride(2),
        summ.stride(0),
        summ.stride(1),
        summ.stride(2),
        n_leaves,
        total_nodes,
        hkv,
        n_k,
        N_LEVELS=lvl_span.shape[0],
        D=d,
        DP=_p2(d, 16),
        BL=32,
    )
    return summ, nfv


@_pisa_nodes.register_fake
def _(sums, cnt, lfv, lvl_off, lvl_span, n_k, total_nodes):
    b, hkv, _, d = sums.shape
    return (sums.new_empty(b, hkv, total_nodes, d), cnt.new_empty(b, total_nodes))


def build_pyramid(k: torch.Tensor, *, block_size: int, branching: int, key_padding_mask: Optional[torch.Tensor] = None):
    """``(summaries [B, Hkv, T, D] fp32, first_valid [B, T] int32, sizes, lvl_off, lvl_span)``:
    every level's node means (leaves first), each node's first valid key position (``Nk`` if
    none), the node counts per level and the level offsets / leaf spans as int32 tensors."""
    n_leaves = max(1, -(-k.shape[2] // block_size))
    sizes, _, lvl_off, lvl_span = pyramid_tables(n_leaves, branching, k.device)
    kpm = None if key_padding_mask is None else key_padding_mask.to(device=k.device, dtype=torch.int8).contiguous()
    sums, cnt, lfv = leaf_sums(k, kpm, block_size)
    summ, nfv = _pisa_nodes(sums, cnt, lfv, lvl_off, lvl_span, k.shape[2], sum(sizes))
    return summ, nfv, sizes, lvl_off, lvl_span


# --------------------------------------------------------------------------- selection


LOG2E = 1.4426950408889634  # log2(e): a logit times it is in base-2 units
_LN2 = tl.constexpr(0.6931471805599453)  # a kernel reads only constexpr globals


def log2_scale(scale: float, score: int) -> float:
    """The dot's scale for :func:`_lse2_scaled` (LSE scores, ``score == 0``): the softmax scale
    times log2(e); other scores take the plain scale."""
    return scale * LOG2E if score == 0 else scale


@triton.jit
def _reduce(logit, okk, SCORE: tl.constexpr):
    """Per-head score ``[M, U]`` of ``logit [M, U, J]`` over the entries where ``okk [1, U, J]``:
    LSE (SCORE 0) or mean + 1/2 population variance (SCORE 2). (The scan's base-2 LSE of
    unscaled logits is :func:`_lse2_scaled`.)"""
    # (if/else throughout: Triton also traces the statements after a return in a constexpr branch)
    if SCORE == 0:
        masked = tl.where(okk, logit, float("-inf"))  # exp(-inf - max) is 0: no second mask
        mx = tl.max(masked, axis=2)
        mx_s = tl.where(mx == float("-inf"), 0.0, mx)
        out = mx_s + tl.log(tl.sum(tl.exp(masked - mx_s[:, :, None]), axis=2))
    else:
        nc = tl.maximum(tl.sum(okk.to(tl.float32), axis=2), 1.0)
        mean = tl.sum(tl.where(okk, logit, 0.0), axis=2) / nc
        dev = tl.where(okk, logit - mean[:, :, None], 0.0)
        out = mean + 0.5 * tl.sum(dev * dev, axis=2) / nc
    return out


@triton.jit
def _lse2_scaled(logit, okk, scale):
    """:func:`_reduce`'s base-2 LSE (in natural units) of ``logit * scale`` (``scale > 0``, from
    :func:`log2_scale`) over the entries where ``okk``, from the unscaled logits: the scale
    multiplies the maxima only and joins each logit's subtraction in one fused multiply-add."""
    masked = tl.where(okk, logit, float("-inf"))
    mx = tl.max(masked, axis=2) * scale
    mx_s = tl.where(mx == float("-inf"), 0.0, mx)
    return (mx_s + tl.log2(tl.sum(tl.exp2(tl.fma(masked, scale, -mx_s[:, :, None])), axis=2))) * _LN2


@triton.jit
def _top_k_keep(valid, forced, score, ar, width):
    """Keep the forced entries and the best-scoring others, ``width`` (at most the row's length,
    a runtime value: the level's width) in total (ties to the lower position, i.e. the lower node
    id): returns the kept flags. One bitonic sort of the scores' 32-bit order-preserving bits
    finds the width-th best score; entries above it are kept, and of those equal to it the first
    ones in position order fill the rest (sorting 64-bit keys that carry the position costs more
    instructions, and the walk is bound by its instructions)."""
    big = 3.0e38
    key = tl.where(score != score, -big, tl.minimum(tl.maximum(score, -big), big))
    key = tl.where(forced, float("inf"), key)
    key = tl.where(valid, key, float("-inf"))
    bits = key.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # float order as signed-int order
    srt = tl.sort(ordered, 0, descending=True)
    kth = tl.gather(srt, tl.zeros_like(ar) + (width - 1), 0)  # the width-th best, in every lane
    above = ordered > kth
    tied = ordered == kth
    tied_before = tl.cumsum(tied.to(tl.int32), axis=0) - tied.to(tl.int32)
    return valid & (above | (tied & (tied_before < width - tl.sum(above.to(tl.int32), axis=0))))


@triton.jit
def _ancestor(leaf, lv, span, BR: tl.constexpr):
    """The level-``lv`` ancestor of ``leaf`` (``-1`` stays ``-1``): ``leaf // span`` (``span =
    BR**lv``), a shift when ``BR`` is a power of two (a division by a runtime value costs tens of
    instructions, four times per level of a walk that is instruction-bound)."""
    up = leaf // span
    if (BR & (BR - 1)) == 0:
        if BR <= 128:
            log_br: tl.constexpr = (BR > 1) + (BR > 2) + (BR > 4) + (BR > 8) + (BR > 16) + (BR > 32) + (BR > 64)
            up = leaf >> tl.minimum(lv * log_br, 31)  # a leaf id is below 2**31
    return tl.where(leaf >= 0, up, -1)


@triton.jit
def _first_valid(nfv_base, off, u, span, Nk, C: tl.constexpr, LOADED: tl.constexpr):
    """First valid key position of node ``u`` (in range) of the level at ``off`` whose nodes
    cover ``span`` leaves: read from the table when ``LOADED`` (key padding or a device length),
    else computed, the node's first key (one dependent load fewer per level of the walk)."""
    if LOADED:
        return tl.load(nfv_base + off + u)
    first = u * (span * C)
    return tl.where(first < Nk, first, Nk)


@triton.jit
def _compact(cand, keep, ar_kp, ar_cw):
    """Kept candidates (ascending in ``cand`` order) packed into the first slots of a [KP] row."""
    slot = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    hit = keep[None, :] & (slot[None, :] == ar_kp[:, None])
    ids = tl.sum(tl.where(hit, cand[None, :], 0), axis=1)
    return ids, ar_kp < tl.sum(keep.to(tl.int32), axis=0)


@triton.jit
def _pisa_select_kernel(
    q_ptr,
    k_ptr,
    kpm_ptr,
    summ_ptr,
    nfv_ptr,
    lvl_off_ptr,
    lvl_span_ptr,
    out_ptr,
    len_ptr,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_mb,
    stride_mh,
    stride_mt,
    stride_ob,
    stride_oh,
    stride_on,
    Nq,
    Nk,
    T,
    HKV,
    qk_scale,
    pre_ptr,
    cand_ptr,
    stride_pbh,
    stride_pn,
    pre_col0,
    stride_cbh,
    stride_cn,
    count_ptr,
    rank_ptr,
    N_LEVELS: tl.constexpr,
    HAS_KPM: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    SCORE: tl.constexpr,
    FORCE_SINK: tl.constexpr,
    FORCE_PREV: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    C: tl.constexpr,
    CP: tl.constexpr,
    BR: tl.constexpr,
    BRP: tl.constexpr,
    TOPK: tl.constexpr,
    WIDE: tl.constexpr,
    KP: tl.constexpr,
    CW: tl.constexpr,
    LC: tl.constexpr,
    IEEE_KEYS: tl.constexpr,
    HAS_LEN: tl.constexpr,
    PRE_SCORES: tl.constexpr = False,
    LEAF_OUT: tl.constexpr = False,
    PAIR_RANKS: tl.constexpr = False,
    PAIR_SIBLINGS: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    # PRE_SCORES / LEAF_OUT: the scan walk's middle stage (triton_select_scan). PRE_SCORES reads
    # every scored node's score from pre_ptr ([B*Hkv, Nq, T - pre_col0], filled by its tile scan)
    # instead of computing it; LEAF_OUT stops at the leaf level and writes the leaf candidates
    # (-1 invalid, id | 2**30 forced, else id) to cand_ptr ([B*Hkv, Nq, CW]) for the scan's
    # leaf-pair scoring and keep, which write the selection.
    # PAIR_RANKS (with LEAF_OUT): each scored leaf candidate (valid, unforced, in a row with more
    # valid ones than TOPK) takes the next rank of its (batch x KV head, leaf) counter
    # (count_ptr, [B*Hkv * n_leaves], zeroed), stored at its slot of rank_ptr (cand_ptr's layout):
    # where the scan's pair index places it, with no sort. PAIR_SIBLINGS: the counter is the
    # (batch x KV head, parent) one of each kept parent with a scored child ([B*Hkv * parents]),
    # and the rank is stored at the parent's first child slot: its children are scored together.
    # PDL: launched as a link of a programmatic-dependent chain (kernels.pdl)
    pdl_start(PDL)
    # Inductor types a Python float argument fp64 (Triton's JIT: fp32): keep the math in fp32 either way
    qk_scale = tl.cast(qk_scale, tl.float32)
    if HAS_LEN:
        # a preallocated KV buffer (Nk = its capacity) holding len_ptr[0] keys: the length is read
        # on the device so that one compiled launch (or a CUDA graph) serves every decoding step
        Nk = tl.minimum(tl.load(len_ptr), Nk)
    i = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # 64-bit offsets: batch x head strides pass 2**31 elements at long contexts
    b = bh // HKV
    hkv = bh % HKV
    # KP >= WIDE kept-node slots (WIDE = beam * TOPK nodes kept above the leaves, TOPK at the
    # leaves); CW >= KP * BRP candidate slots: BRP children of each of KP kept nodes (slots past
    # KP * BRP, there only because tl.dot needs 16 columns, have no parent and stay invalid)
    p = i + Nk - Nq  # query position (bottom-right aligned)
    if IS_CAUSAL:
        hz = p
    else:
        hz = Nk - 1
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, DP)
    g_ok = offs_g < G
    d_ok = offs_d < D
    q_rows = (
        q_ptr + b * stride_qb + (hkv * G + offs_g)[:, None] * stride_qh + i.to(tl.int64) * stride_qn + offs_d[None, :]
    )
    q_raw = tl.load(q_rows, mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    q32 = q_raw.to(tl.float32)
    summ_base = summ_ptr + b * stride_mb + hkv * stride_mh
    k_base = k_ptr + b * stride_kb + hkv * stride_kh
    nfv_base = nfv_ptr + b * T

    # forced leaves (reference: token_blocks.forced_leaf_blocks) and the leaf holding p
    n_leaves = tl.load(lvl_off_ptr + 1)
    cur = tl.where((p >= 0) & (p < n_leaves * C), p // C, -1)
    prev = -1
    if FORCE_PREV:
        prev = tl.where(cur >= 1, cur - 1, -1)
    sink = -1
    if FORCE_SINK:
        sink = tl.where(cur != 0, 0, -1)
        if FORCE_PREV:
            sink = tl.where(prev == 0, -1, sink)
    LOADED: tl.constexpr = HAS_KPM or HAS_LEN  # else a node's first valid key is its first key
    cur_f = tl.where((cur >= 0) & (_first_valid(nfv_base, 0, tl.maximum(cur, 0), 1, Nk, C, LOADED) <= hz), cur, -1)
    prev_f = tl.where((prev >= 0) & (_first_valid(nfv_base, 0, tl.maximum(prev, 0), 1, Nk, C, LOADED) <= hz), prev, -1)
    sink_f = tl.where((sink >= 0) & (_first_valid(nfv_base, 0, tl.maximum(sink, 0), 1, Nk, C, LOADED) <= hz), sink, -1)
    here = tl.where((p >= 0) & (p < Nk), p // C, -1)

    ar_kp = tl.arange(0, KP)
    ar_cw = tl.arange(0, CW)
    top = N_LEVELS - 1
    # a level no wider than what it keeps keeps every visible node, and so does every level above
    # it (sizes shrink upward, widths do not): the walk starts at the lowest such level with its
    # visible nodes, skipping the unscored levels above (the root when none fits)
    start = top
    for lv in range(0, N_LEVELS - 1):
        n_lv = tl.load(lvl_off_ptr + lv + 1) - tl.load(lvl_off_ptr + lv)
        start = tl.where((n_lv <= tl.where(lv > 0, WIDE, TOPK)) & (start == top), lv, start)
    s_off = tl.load(lvl_off_ptr + start)
    s_in = ar_kp < tl.load(lvl_off_ptr + start + 1) - s_off
    s_span = tl.load(lvl_span_ptr + start)
    s_vis = s_in & (_first_valid(nfv_base, s_off, tl.where(s_in, ar_kp, 0), s_span, Nk, C, LOADED) <= hz)
    kept, ok = _compact(ar_kp, s_vis, ar_kp, ar_kp)
    # from the level below the start down to the leaves (a loop over these levels only: a branch
    # around a level body that skips the others costs ptxas's divergence handling)
    if N_LEVELS > 1:  # one leaf: the start level is the leaves
        lv = start - 1
        while lv >= 0:
            off = tl.load(lvl_off_ptr + lv)
            n_lv = tl.load(lvl_off_ptr + lv + 1) - off
            span = tl.load(lvl_span_ptr + lv)
            par = ar_cw // BRP
            j = ar_cw % BRP
            # each candidate's parent, gathered within the warp (-1: no kept parent)
            par_enc = tl.gather(tl.where(ok, kept, -1), tl.minimum(par, KP - 1), 0)
            par_ok = (par < KP) & (par_enc >= 0)
            par_id = tl.where(par_ok, par_enc, 0)
            cand = par_id * BR + j
            valid = par_ok & (j < BR) & (cand < n_lv)
            cand = tl.where(valid, cand, 0)
            valid = valid & (_first_valid(nfv_base, off, cand, span, Nk, C, LOADED) <= hz)
            forced = (cand == _ancestor(cur_f, lv, span, BR)) | (cand == _ancestor(prev_f, lv, span, BR))
            forced = forced | (cand == _ancestor(sink_f, lv, span, BR)) | (cand == _ancestor(here, lv, span, BR))
            forced = forced & valid
            n_valid = tl.sum(valid.to(tl.int32), axis=0)
            width = tl.where(lv > 0, WIDE, TOPK)  # nodes kept at this level
            scoring = n_valid > width
            if LEAF_OUT:
                if lv == 0:
                    enc = tl.where(valid, tl.where(forced, cand | (1 << 30), cand), -1)
                    tl.store(cand_ptr + bh * stride_cbh + i.to(tl.int64) * stride_cn + ar_cw, enc)
                    if PAIR_RANKS:
                        pair = valid & ~forced & (n_valid > TOPK)
                        rank_row = rank_ptr + bh * stride_cbh + i.to(tl.int64) * stride_cn
                        if PAIR_SIBLINGS:
                            # a kept parent's children hold slots par * BRP + j: one rank per parent
                            n_par = tl.load(lvl_off_ptr + 2) - n_leaves
                            grp = tl.max(tl.reshape(pair.to(tl.int32), (CW // BRP, BRP)), axis=1) > 0
                            parent = tl.max(tl.reshape(par_id, (CW // BRP, BRP)), axis=1)
                            rank = tl.atomic_add(count_ptr + bh * n_par + parent, 1, mask=grp)
                            tl.store(rank_row + tl.arange(0, CW // BRP) * BRP, rank, mask=grp)
                        else:
                            rank = tl.atomic_add(count_ptr + bh * n_leaves + cand, 1, mask=pair)
                            tl.store(rank_row + ar_cw, rank, mask=pair)
                scoring = scoring & (lv > 0)
            # the scan's walk (PRE_SCORES) runs every level's keep unbranched: a level that needs no
            # scoring (no more valid candidates than its width) keeps them all either way, and a
            # branch around the keep's warp shuffles costs ptxas's divergence handling (a third of
            # the walk's instructions)
            if scoring or PRE_SCORES:
                score = tl.zeros([CW], dtype=tl.float32)
                if PRE_SCORES:
                    # this node's score for this query, from the tile scan (the leaves' too for PISA-1)
                    pre_row = pre_ptr + bh * stride_pbh + i.to(tl.int64) * stride_pn - pre_col0
                    score = tl.load(pre_row + off + cand, mask=valid & scoring, other=0.0)
                elif SCORE == 1:
                    # PISA-1: q . mean(node) * scale
                    s_t = tl.load(
                        # 64-bit: a node id times its row stride can pass 2**31 elements
                        summ_base + (off + cand).to(tl.int64)[None, :] * stride_mt + offs_d[:, None],
                        mask=valid[None, :] & d_ok[:, None],
                        other=0.0,
                    )
                    logit = tl.dot(q32, s_t, input_precision="ieee") * qk_scale  # [GP, CW]
                    score = tl.sum(tl.where(g_ok[:, None], logit, 0.0), axis=0)
                elif lv > 0:
                    # intermediate node: LSE (or mean + var/2) over its visible children's summaries
                    coff = tl.load(lvl_off_ptr + lv - 1)
                    n_ch = off - coff
                    ar_ch = tl.arange(0, CW * BRP)
                    owner = ar_ch // BRP
                    jc = ar_ch % BRP
                    own_id = tl.sum(tl.where(owner[:, None] == ar_cw[None, :], cand[None, :], 0), axis=1)
                    own_ok = (
                        tl.sum(tl.where(owner[:, None] == ar_cw[None, :], valid[None, :].to(tl.int32), 0), axis=1) > 0
                    )
                    child = own_id * BR + jc
                    c_ok = own_ok & (jc < BR) & (child < n_ch)
                    child = tl.where(c_ok, child, 0)
                    c_ok = c_ok & (tl.load(nfv_base + coff + child, mask=c_ok, other=Nk) <= hz)
                    s_t = tl.load(
                        # 64-bit: a node id times its row stride can pass 2**31 elements
                        summ_base + (coff + child).to(tl.int64)[None, :] * stride_mt + offs_d[:, None],
                        mask=c_ok[None, :] & d_ok[:, None],
                        other=0.0,
                    )
                    logit = tl.dot(q32, s_t, input_precision="ieee") * qk_scale  # [GP, CH]
                    logit = tl.reshape(logit, (GP, CW, BRP))
                    per_head = _reduce(logit, tl.reshape(c_ok, (CW, BRP))[None, :, :], SCORE)
                    score = tl.sum(tl.where(g_ok[:, None], per_head, 0.0), axis=0)
                else:
                    # leaf: exact LSE (or mean + var/2) over its valid, visible raw keys; LC candidate
                    # leaves at a time share one [G, D] x [D, LC*C] dot (their keys gathered in one load)
                    offs_c = tl.arange(0, CP)
                    ar_lc = tl.arange(0, LC)
                    for c0 in range(0, CW, LC):
                        sub = c0 + ar_lc
                        pick = ar_cw[None, :] == sub[:, None]  # [LC, CW]
                        leaf = tl.sum(tl.where(pick, cand[None, :], 0), axis=1)
                        l_ok = tl.sum(tl.where(pick, valid[None, :].to(tl.int32), 0), axis=1) > 0
                        if tl.sum(l_ok.to(tl.int32), axis=0) > 0:
                            pos = tl.reshape(leaf[:, None] * C + offs_c[None, :], (LC * CP,))
                            kok = (
                                tl.reshape(l_ok[:, None] & (offs_c[None, :] < C), (LC * CP,)) & (pos < Nk) & (pos <= hz)
                            )
                            if HAS_KPM:
                                kok = kok & (tl.load(kpm_ptr + b * Nk + pos, mask=kok, other=0) != 0)
                            k_t = tl.load(
                                # 64-bit: a key position times a row stride can pass 2**31 elements
                                k_base + pos.to(tl.int64)[None, :] * stride_kn + offs_d[:, None],
                                mask=kok[None, :] & d_ok[:, None],
                                other=0.0,
                            )
                            if IEEE_KEYS:
                                logit = tl.dot(q32, k_t.to(tl.float32), input_precision="ieee") * qk_scale
                            else:
                                logit = tl.dot(q_raw, k_t, out_dtype=tl.float32) * qk_scale  # exact 16-bit products
                            logit = tl.reshape(logit, (GP, LC, CP))
                            per_head = _reduce(logit, tl.reshape(kok, (LC, CP))[None, :, :], SCORE)
                            s_sub = tl.sum(tl.where(g_ok[:, None], per_head, 0.0), axis=0)  # [LC]
                            score += tl.sum(tl.where(pick, s_sub[:, None], 0.0), axis=0)
                keep = _top_k_keep(valid, forced, score, ar_cw, width)
            else:
                keep = valid
            kept, ok = _compact(cand, keep, ar_kp, ar_cw)
            lv -= 1
    if not LEAF_OUT:
        out = tl.where(ok, kept, -1)
        dst = out_ptr + b * stride_ob + hkv * stride_oh + i.to(tl.int64) * stride_on  # 64-bit: query index x row stride
        tl.store(dst + ar_kp, out, mask=ar_kp < TOPK)


@triton_op("sparseflow::pisa_select_fwd", mutates_args={})
def _pisa_select_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    kpm: Optional[torch.Tensor],
    summ: torch.Tensor,
    nfv: torch.Tensor,
    lvl_off: torch.Tensor,
    lvl_span: torch.Tensor,
    scale: float,
    is_causal: bool,
    score: int,
    block_size: int,
    branching: int,
    top_k: int,
    force_sink: bool,
    force_previous: bool,
    beam: int,
    warps: Optional[int] = None,
    leaf_bytes: Optional[int] = None,
    length: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    if length is not None and kpm is not None:  # length: k's first length[0] keys are the cache (decode_step_static)
        raise ValueError("the PISA walk takes a device length or a key padding mask, not both")
    b, hq, n_q, d = q.shape
    hkv = k.shape[1]
    out = torch.empty(b, hkv, n_q, top_k, dtype=torch.int32, device=q.device)
    if n_q == 0:
        return out
    cw = candidate_width(beam, top_k, branching)
    warps, leaf_bytes = _launch(cw, warps, leaf_bytes)
    # 16-bit products are exact in fp32, so 16-bit dots give the reference's logits up to
    # summation order; the interpreter's 16-bit dot is not trustworthy, so it gets fp32
    ieee = q.dtype == torch.float32 or interpreting()
    meta = walk_meta(
        q, k, kpm, lvl_span, is_causal, score, force_sink, force_previous, block_size, branching, top_k, beam
    )
    lc = _leaf_chunk(cw, meta["CP"], meta["DP"], 4 if ieee else 2, leaf_bytes)
    args = walk_args(q, k, kpm, summ, nfv, lvl_off, lvl_span, out, scale)
    wrap_triton(_pisa_select_kernel)[(n_q, b * hkv)](
        *args[:8],
        nfv if length is None else length,
        *args[8:],
        **meta,  # the length pointer follows out_ptr
        GP=_p2(hq // hkv, 16),
        CW=cw,
        LC=lc,
        IEEE_KEYS=ieee,
        HAS_LEN=length is not None,
        **no_scan_args(nfv),
        num_warps=warps,
    )
    return out


def no_scan_args(placeholder: torch.Tensor) -> dict:
    """The scan walk's kernel arguments for a walk that reads no precomputed scores and writes no
    leaf candidates (``placeholder``: any tensor of the call, never read)."""
    return dict(
        pre_ptr=placeholder,
        cand_ptr=placeholder,
        stride_pbh=0,
        stride_pn=0,
        pre_col0=0,
        stride_cbh=0,
        stride_cn=0,
        count_ptr=placeholder,
        rank_ptr=placeholder,
    )


def walk_args(q, k, kpm, summ, nfv, lvl_off, lvl_span, out, scale) -> tuple:
    """The positional arguments of the per-token and the tiled walk kernels (the same in both):
    pointers (``nfv`` stands in for an absent ``kpm``), strides, sizes and the scale."""
    ptrs = (q, k, kpm if kpm is not None else nfv, summ, nfv, lvl_off, lvl_span, out)
    strides = (*q.stride()[:3], *k.stride()[:3], *summ.stride()[:3], *out.stride()[:3])
    return (*ptrs, *strides, q.shape[2], k.shape[2], summ.shape[2], k.shape[1], scale)


def walk_meta(
    q, k, kpm, lvl_span, is_causal, score, force_sink, force_previous, block_size, branching, top_k, beam
) -> dict:
    """The compile-time arguments the two walk kernels share (the walk's shape and rules)."""
    d = q.shape[-1]
    return dict(
        N_LEVELS=lvl_span.shape[0],
        HAS_KPM=kpm is not None,
        IS_CAUSAL=is_causal,
        SCORE=score,
        FORCE_SINK=force_sink,
        FORCE_PREV=force_previous,
        G=q.shape[1] // k.shape[1],
        D=d,
        DP=_p2(d, 16),
        C=block_size,
        CP=_p2(block_size, 16),
        BR=branching,
        BRP=_p2(branching),
        TOPK=top_k,
        WIDE=beam * top_k,
        KP=kept_slots(beam, top_k),
    )


@_pisa_select_fwd.register_fake
def _(
    q,
    k,
    kpm,
    summ,
    nfv,
    lvl_off,
    lvl_span,
    scale,
    is_causal,
    score,
    block_size,
    branching,
    top_k,
    force_sink,
    force_previous,
    beam,
    warps=None,
    leaf_bytes=None,
    length=None,
):
    return q.new_empty(q.shape[0], k.shape[1], q.shape[2], top_k, dtype=torch.int32)


def pisa_select(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    key_padding_mask: Optional[torch.Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    block_size: int = PISAConfig.block_size,
    top_k: int = PISAConfig.top_k,
    branching: int = PISAConfig.branching,
    score: str = PISAConfig.score,
    force_sink: bool = PISAConfig.force_sink,
    force_previous: bool = PISAConfig.force_previous,
    beam: int = PISAConfig.beam,
    tuning: Tuning = DEFAULT_TUNING,
    index_dtype: torch.dtype = torch.long,
) -> torch.Tensor:
    """The reference's ``pisa_select`` contract in Triton: ``[B, Hkv, Nq, top_k]`` int64 leaf
    block ids per query token, ascending, ``-1`` padded; ``beam`` as in the reference (the walk
    keeps ``beam * top_k`` nodes above the leaves). ``tuning``: the walk's launch settings
    (``pisa_walk``: per-token, scan or tiled walk, ``pisa_warps``, ``pisa_leaf_bytes``).
    ``index_dtype``: ``torch.int32`` returns the kernel's own ids (what the attention kernel
    reads), saving a conversion each way."""
    check_beam(beam)
    check_index_dtype(index_dtype)
    if score not in SCORE_CODES:
        raise ValueError(f"score must be one of {list(SCORE_CODES)}, got {score!r}")
    if branching < 2:
        raise ValueError(f"branching must be >= 2, got {branching}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"the Triton PISA selection takes fp16, bf16 or fp32 q/k, got {q.dtype}")
    b, hq, n_q, d = q.shape
    n_k = k.shape[2]
    top_k = selection_width(top_k, n_k, block_size)
    if n_k == 0 or b == 0:
        return torch.full((b, k.shape[1], n_q, top_k), -1, dtype=index_dtype, device=q.device)
    sc = 1.0 / math.sqrt(d) if scale is None else float(scale)
    with torch.no_grad():
        kc = k.detach()
        summ, nfv, _, lvl_off, lvl_span = build_pyramid(
            kc, block_size=block_size, branching=branching, key_padding_mask=key_padding_mask
        )
        kpm = None if key_padding_mask is None else key_padding_mask.to(device=q.device, dtype=torch.int8).contiguous()
        args = (
            q.detach(),
            kc,
            kpm,
            summ,
            nfv,
            lvl_off,
            lvl_span,
            sc,
            bool(is_causal),
            SCORE_CODES[score],
            int(block_size),
            int(branching),
            int(top_k),
            bool(force_sink),
            bool(force_previous),
            int(beam),
        )
        if _use_scan_walk(tuning, q, k, summ, SCORE_CODES[score], block_size, top_k, beam, branching):
            from .triton_select_scan import pisa_select_scan_fwd

            idx = pisa_select_scan_fwd(*args, tuning.pdl)
        elif _use_tiled_walk(tuning, hq // k.shape[1], beam, top_k, branching):
            from .triton_select_tiled import pisa_select_tiled_fwd

            idx = pisa_select_tiled_fwd(*args, tuning.pisa_warps)
        else:
            idx = _pisa_select_fwd(*args, tuning.pisa_warps, tuning.pisa_leaf_bytes)
    return idx.to(index_dtype)


def _use_tiled_walk(tuning: Tuning, group: int, beam: int, top_k: int, branching: int) -> bool:
    """Whether ``tuning.pisa_walk`` asks for the tiled walk and it covers the shape ("auto": the
    per-token walk until the tiled one is timed on the H200); a shape it does not cover is logged."""
    if tuning.pisa_walk != "tiled":
        return False
    from .triton_select_tiled import tiled_covers

    why = tiled_covers(group, beam, top_k, branching)
    if why is not None:
        _log.info("PISA selection: pisa_walk='tiled' runs the per-token walk: %s", why)
    return why is None


def _use_scan_walk(
    tuning: Tuning, q, k, summ, score: int, block_size: int, top_k: int, beam: int, branching: int
) -> bool:
    """Whether ``tuning.pisa_walk`` asks for the scan walk (``"scan"``, or ``"auto"`` on CUDA:
    faster than the per-token walk at every shape timed on the H200, pisa_scan_walk_h200.log) and
    it covers the call; a call it does not cover runs per token, logged."""
    auto = tuning.pisa_walk == "auto" and q.is_cuda and not interpreting()
    if tuning.pisa_walk != "scan" and not auto:
        return False
    from .triton_select_scan import scan_covers, table_shape

    n_leaves = max(1, -(-k.shape[2] // block_size))
    rows, n_q, cols, _ = table_shape(q.shape[0], k.shape[1], q.shape[2], n_leaves, summ.shape[2], score)
    cw = candidate_width(beam, top_k, branching)
    why = scan_covers(n_leaves, top_k, 4 * rows * n_q * cols, rows * n_q * cw)
    if why is not None:
        _log.log(
            logging.DEBUG if auto else logging.INFO,
            "PISA selection: pisa_walk=%r runs the per-token walk: %s",
            tuning.pisa_walk,
            why,
        )
    return why is None
