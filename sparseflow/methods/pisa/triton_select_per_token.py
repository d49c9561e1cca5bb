"""PISA's per-token selection walk (``Tuning(pisa_walk="per_token")``): one program per (query
token, batch x KV head) walks from the root to the leaves with its kept nodes in registers: the
candidates of a level are the children of the nodes kept at the level above, future / empty nodes
are dropped, the ancestors of the forced blocks are kept without scoring, and, when more than the
level's width remain, the best-scoring ones fill the rest (ties to the lower index). The width is
``top_k`` at the leaf level and ``beam * top_k`` above it (the reference's ``beam``); the
kept-node registers hold ``KP = next_pow2(beam * top_k)`` slots and a level's ``CW >= KP *
next_pow2(g)`` candidates. Scores are the reference's, summed over the ``G`` query heads of the
group, with the ``G`` heads as the rows of one ``tl.dot`` per level (fp32 summaries in IEEE fp32,
or with ``Tuning.pisa_scores`` "bf16" / "tf32" both operands rounded to that format for one
tensor-core dot, ``triton_select_common._scores_dot``; raw keys in their own 16-bit dtype, whose
products are exact in fp32, at every ``pisa_scores``). No query-key score matrix
is ever written: the only output is ``[B, Hkv, Nq, top_k]``. With a local window (``HAS_WINDOW``)
a query's candidates wholly before its window's first leaf, and its forced leaves there, are
dropped: the reference's walk inside the window.

The scan walk (``triton_select_scan``) runs this kernel as its middle stage (``PRE_SCORES``,
``LEAF_OUT``) where a level has more candidates than its rows walk takes, and for PISA-1
(``PRE_SCORES``); decoding (``pyramid_cache``, ``Nq = 1``) runs it as is: ``O(g * beam * K *
log(N / C))`` per token. Imported lazily; this module imports Triton.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from ...kernels._triton_env import interpreting
from ...kernels.pdl import pdl_start
from .config import PISAConfig
from .triton_select_common import (
    _LOG2E,
    _first_valid,
    _forced_leaves,
    _lse2_scaled,
    _p2,
    _reduce,
    _row_offsets,
    _scores_operand,
    _summary_scores,
    candidate_width,
    scores_mode,
    trace_args,
    walk_args,
    walk_meta,
    window_args,
)

__all__ = ["no_scan_args", "per_token_walk"]


def _launch(cw: int, warps: Optional[int] = None, leaf_bytes: Optional[int] = None) -> Tuple[int, int]:
    """(warps, leaf-chunk bytes) of the walk for ``cw`` candidates; None picks by ``cw``
    (``Tuning.pisa_warps`` / ``pisa_leaf_bytes``): 1 warp with 16 KB leaf chunks up to 16
    candidates, else 4 warps with 64 KB. On an H200 at 64K tokens and K=8 one warp takes about
    55% of 4 warps' time and under 40% of 8's; with K=32 (64 candidates) it takes twice 4's."""
    small = cw <= 16
    warps = (1 if small else 4) if warps is None else warps
    leaf_bytes = (16384 if small else 65536) if leaf_bytes is None else leaf_bytes
    return warps, leaf_bytes


def _leaf_chunk(cw: int, cp: int, dp: int, elem_bytes: int, budget: int = 65536) -> int:
    """Candidate leaves scored per dot at the leaf level: their keys (LC * CP rows of DP) stay
    within ``budget`` bytes of shared memory (fp32 keys at D=128 need smaller chunks)."""
    return max(1, min(cw, budget // (cp * dp * elem_bytes)))


@triton.jit
def _top_k_keep(valid, forced, score, ar, width, BY_RANK: tl.constexpr = False):
    """Keep the forced entries and the best-scoring others, ``width`` (at most the row's length,
    a runtime value: the level's width) in total (ties to the lower position, i.e. the lower node
    id): returns the kept flags. One bitonic sort of the scores' 32-bit order-preserving bits
    finds the width-th best score; entries above it are kept, and of those equal to it the first
    ones in position order fill the rest (sorting 64-bit keys that carry the position costs more
    instructions, and the walk is bound by its instructions). ``BY_RANK``: the same keep by a
    ``[CW, CW]`` rank compare instead of the sort (an entry is kept when fewer than ``width``
    rank above it), which compiles to fewer instructions when the scores come from the level's
    own dot, and to more when they come from the scan's table (sm_90, ``CW`` 16); its
    ``[CW, CW]`` compare is for small widths only. The two differ on signed zeros alone: the sort
    orders -0.0 below +0.0, the rank compare ties them, as the reference's sort does."""
    big = 3.0e38
    key = tl.where(score != score, -big, tl.minimum(tl.maximum(score, -big), big))
    key = tl.where(forced, float("inf"), key)
    key = tl.where(valid, key, float("-inf"))
    # (if/else, no early return: Triton traces the statements after a return in a constexpr branch)
    if BY_RANK:
        ahead = (key[None, :] > key[:, None]) | ((key[None, :] == key[:, None]) & (ar[None, :] < ar[:, None]))
        keep = valid & (tl.sum(ahead.to(tl.int32), axis=1) < width)
    else:
        bits = key.to(tl.int32, bitcast=True)
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # float order as signed-int order
        srt = tl.sort(ordered, 0, descending=True)
        kth = tl.gather(srt, tl.zeros_like(ar) + (width - 1), 0)  # the width-th best, in every lane
        above = ordered > kth
        tied = ordered == kth
        tied_before = tl.cumsum(tied.to(tl.int32), axis=0) - tied.to(tl.int32)
        keep = valid & (above | (tied & (tied_before < width - tl.sum(above.to(tl.int32), axis=0))))
    return keep


@triton.jit
def _leaf_scores(
    q_raw,
    k_base,
    kpm_ptr,
    b,
    leaf,
    l_ok,
    Nk,
    hz,
    stride_kn,
    qk_scale,
    g_ok,
    offs_d,
    d_ok,
    GP: tl.constexpr,
    C: tl.constexpr,
    CP: tl.constexpr,
    LC: tl.constexpr,
    SCORE: tl.constexpr,
    HAS_KPM: tl.constexpr,
    IEEE_KEYS: tl.constexpr,
    I64_ROWS: tl.constexpr,
):
    """``[LC]``: each of ``LC`` candidate leaves' score for one query, the exact LSE (or mean +
    var/2) over its valid keys at or before ``hz``, summed over the group's heads (rows of
    ``q_raw [GP, DP]`` where ``g_ok``); ``l_ok`` false: no key loaded. The leaves share one
    ``[G, D] x [D, LC*C]`` dot, their keys gathered in one load (``k_base``: the KV head's keys)."""
    offs_c = tl.arange(0, CP)
    pos = tl.reshape(leaf[:, None] * C + offs_c[None, :], (LC * CP,))
    kok = tl.reshape(l_ok[:, None] & (offs_c[None, :] < C), (LC * CP,)) & (pos < Nk) & (pos <= hz)
    if HAS_KPM:
        kok = kok & (tl.load(kpm_ptr + b * Nk + pos, mask=kok, other=0) != 0)
    k_t = tl.load(
        k_base + _row_offsets(pos, stride_kn, I64_ROWS)[None, :] + offs_d[:, None],
        mask=kok[None, :] & d_ok[:, None],
        other=0.0,
    )
    if IEEE_KEYS:
        logit = tl.dot(q_raw.to(tl.float32), k_t.to(tl.float32), input_precision="ieee") * qk_scale
    else:
        logit = tl.dot(q_raw, k_t, out_dtype=tl.float32) * qk_scale  # exact 16-bit products
    per_head = _reduce(tl.reshape(logit, (GP, LC, CP)), tl.reshape(kok, (LC, CP))[None, :, :], SCORE)
    return tl.sum(tl.where(g_ok[:, None], per_head, 0.0), axis=0)


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
def _compact(cand, keep, ar_kp, ar_cw):
    """Kept candidates (ascending in ``cand`` order) packed into the first slots of a [KP] row."""
    slot = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    hit = keep[None, :] & (slot[None, :] == ar_kp[:, None])
    ids = tl.sum(tl.where(hit, cand[None, :], 0), axis=1)
    return ids, ar_kp < tl.sum(keep.to(tl.int32), axis=0)


@triton.jit
def _level_candidates(
    kept, ok, lv, lvl_off_ptr, lvl_span_ptr, nfv_base, Nk, hz, first_leaf, cur_f, prev_f, sink_f, here, ar_cw,
    KP: tl.constexpr, BR: tl.constexpr, BRP: tl.constexpr, C: tl.constexpr, LOADED: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):  # fmt: skip
    """Level ``lv``'s ``[CW]`` candidate slots, ``BRP`` a kept node above (``kept``, ``ok``:
    ``[KP]``): ``(off, cand, valid, forced, par_id)``, the level's first row in the pyramid, each
    slot's node id (0 where invalid), whether it is a node of the level with a key at or before
    ``hz`` (and inside the window), whether it is an ancestor of a forced leaf or of the query's
    own, and its parent's id."""
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
    if HAS_WINDOW:  # the node's last leaf is at or after the window's first one
        valid = valid & (cand >= _ancestor(first_leaf, lv, span, BR))
    forced = (cand == _ancestor(cur_f, lv, span, BR)) | (cand == _ancestor(prev_f, lv, span, BR))
    forced = forced | (cand == _ancestor(sink_f, lv, span, BR)) | (cand == _ancestor(here, lv, span, BR))
    return off, cand, valid, forced & valid, par_id


@triton.jit
def _node_scores(
    q_s, summ_base, nfv_base, lvl_off_ptr, lv, off, cand, valid, Nk, hz, stride_mt, qk_scale, g_ok, offs_d, d_ok,
    GP: tl.constexpr, D: tl.constexpr, CW: tl.constexpr, BR: tl.constexpr, BRP: tl.constexpr,
    SCORE: tl.constexpr, SCORES: tl.constexpr, SUMM_ROUNDED: tl.constexpr, I64_ROWS: tl.constexpr,
):  # fmt: skip
    """``[CW]``: each candidate node's score at level ``lv > 0`` (first row ``off``), the LSE (or
    mean + var/2) over its visible children's summaries, summed over the group's heads (rows of
    ``q_s [GP, DP]`` where ``g_ok``); one ``[GP, D] x [D, CW * BRP]`` dot."""
    coff = tl.load(lvl_off_ptr + lv - 1)
    n_ch = off - coff
    ar_ch = tl.arange(0, CW * BRP)
    owner = ar_ch // BRP
    jc = ar_ch % BRP
    # each child slot's candidate (-1: none), gathered within the warp
    own = tl.gather(tl.where(valid, cand, -1), owner, 0)
    child = own * BR + jc
    c_ok = (own >= 0) & (jc < BR) & (child < n_ch)
    child = tl.where(c_ok, child, 0)
    c_ok = c_ok & (tl.load(nfv_base + coff + child, mask=c_ok, other=Nk) <= hz)
    # every slot loads a row of the level (an invalid one its first, which every pyramid holds):
    # its column of the dot is masked out below, and a load without a row mask spares the
    # zeroing and predicates of each 16-byte load
    rows = summ_base + _row_offsets(coff + child, stride_mt, I64_ROWS)[None, :]
    logit = _summary_scores(q_s, rows, d_ok[:, None], offs_d, D, SCORES, SUMM_ROUNDED)  # unscaled
    logit = tl.reshape(logit, (GP, CW, BRP))
    okk = tl.reshape(c_ok, (CW, BRP))[None, :, :]
    NEAR_FP32: tl.constexpr = SCORES == "fp32" or SCORES == "bf16x3" or SCORES == "bf16x3_ieee"
    if SCORE == 0 and not NEAR_FP32:
        # a lower-precision walk (a stated tolerance) takes the LSE in base 2 on the special
        # function unit, as the scan's kernels do: a precise log costs a dozen fused multiply-adds
        # an element, most of a level's arithmetic. The fp32 walk keeps the reference's arithmetic
        per_head = _lse2_scaled(logit, okk, qk_scale * _LOG2E, SCORES == "bf16" or SCORES == "tf32")
    else:
        per_head = _reduce(logit * qk_scale, okk, SCORE)
    return tl.sum(tl.where(g_ok[:, None], per_head, 0.0), axis=0)


@triton.jit
def _pisa_select_kernel(  # noqa: C901, PLR0912, PLR0915
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
    trace_ptr,
    stride_tbh,
    stride_tn,
    SLIDING,
    CHUNK,
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
    HAS_WINDOW: tl.constexpr = False,
    SCORES: tl.constexpr = "fp32",
    TRACE: tl.constexpr = False,
    SUMM_ROUNDED: tl.constexpr = False,
    I64_ROWS: tl.constexpr = True,
):
    # SCORES: the summary dots' arithmetic (triton_select_common.scores_mode: "fp32", the
    # reference's IEEE dots; else operands rounded to bf16 / tf32; or prefill_walk_table's
    # "bf16x3" / "bf16x3_ieee": a table of three bf16 parts a summary). TRACE: every level's kept
    # nodes go to trace_ptr ([B*Hkv, Nq, N_LEVELS, KP], -1 where none; with LEAF_OUT the leaf
    # level is left to the caller), for the tests' contract check (triton_trace).
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
    # SUMM_ROUNDED: the summaries hold the scores' format already (rounded_summaries, tf32)
    # HAS_WINDOW: the walk inside the query's local window (SLIDING / CHUNK keys): no candidate
    # wholly before the window's first leaf, no forced leaf before it (reference's docstring)
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
    q_s = _scores_operand(q_raw, SCORES)  # q32 for fp32; bf16 queries as they are for bf16
    summ_base = summ_ptr + b * stride_mb + hkv * stride_mh
    k_base = k_ptr + b * stride_kb + hkv * stride_kh
    nfv_base = nfv_ptr + b * T

    LOADED: tl.constexpr = HAS_KPM or HAS_LEN  # else a node's first valid key is its first key
    LOWEST: tl.constexpr = 1 if LEAF_OUT else 0  # the lowest level the loop below walks
    n_leaves = tl.load(lvl_off_ptr + 1)
    cur_f, prev_f, sink_f, here, first_leaf = _forced_leaves(
        p, hz, n_leaves, nfv_base, Nk, SLIDING, CHUNK, C, FORCE_SINK, FORCE_PREV, LOADED, HAS_WINDOW
    )

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
    if HAS_WINDOW:
        s_vis = s_vis & (ar_kp >= _ancestor(first_leaf, start, s_span, BR))
    kept, ok = _compact(ar_kp, s_vis, ar_kp, ar_kp)
    if TRACE:
        # the start level and every level above it keep all their visible nodes (in the window)
        trace_row = trace_ptr + bh * stride_tbh + i.to(tl.int64) * stride_tn
        for t_lv in range(0, N_LEVELS):
            if t_lv >= start:
                t_off = tl.load(lvl_off_ptr + t_lv)
                t_in = ar_kp < tl.load(lvl_off_ptr + t_lv + 1) - t_off
                t_span = tl.load(lvl_span_ptr + t_lv)
                t_vis = t_in & (_first_valid(nfv_base, t_off, tl.where(t_in, ar_kp, 0), t_span, Nk, C, LOADED) <= hz)
                if HAS_WINDOW:
                    t_vis = t_vis & (ar_kp >= _ancestor(first_leaf, t_lv, t_span, BR))
                t_ids, t_ok = _compact(ar_kp, t_vis, ar_kp, ar_kp)
                tl.store(trace_row + t_lv * KP + ar_kp, tl.where(t_ok, t_ids, -1))
    if N_LEVELS > 1:  # one leaf: the start level is the leaves
        # from the level below the start down to the leaves (a loop over these levels only: a branch
        # around a level body that skips the others costs ptxas's divergence handling); with
        # LEAF_OUT the loop stops above the leaves, whose candidates are written after it (its
        # callers run it only with more leaves than TOPK, so the start is above the leaves and
        # ``kept`` holds level-1 nodes there: leaf_pairs_cover, leaf_split, the pyramid cache)
        lv = start - 1
        while lv >= LOWEST:
            off, cand, valid, forced, par_id = _level_candidates(
                kept, ok, lv, lvl_off_ptr, lvl_span_ptr, nfv_base, Nk, hz, first_leaf, cur_f, prev_f, sink_f, here,
                ar_cw, KP, BR, BRP, C, LOADED, HAS_WINDOW,
            )  # fmt: skip
            n_valid = tl.sum(valid.to(tl.int32), axis=0)
            width = tl.where(lv > 0, WIDE, TOPK)  # nodes kept at this level
            scoring = n_valid > width
            # the scan's walk (PRE_SCORES) and the walks that stop above the leaves (LEAF_OUT) run
            # every level's keep unbranched: a level that needs no scoring (no more valid
            # candidates than its width) keeps them all either way, and a branch around the keep's
            # warp shuffles costs ptxas's divergence handling (a third of the scan walk's
            # instructions)
            if scoring or PRE_SCORES or LEAF_OUT:
                if PRE_SCORES:
                    # this node's score for this query, from the tile scan (the leaves' too for PISA-1)
                    pre_row = pre_ptr + bh * stride_pbh + i.to(tl.int64) * stride_pn - pre_col0
                    score = tl.load(pre_row + off + cand, mask=valid & scoring, other=0.0)
                elif SCORE == 1:
                    # PISA-1: q . mean(node) * scale
                    rows = summ_base + _row_offsets(off + cand, stride_mt, I64_ROWS)[None, :]
                    mask = valid[None, :] & d_ok[:, None]
                    logit = _summary_scores(q_s, rows, mask, offs_d, D, SCORES, SUMM_ROUNDED) * qk_scale  # [GP, CW]
                    score = tl.sum(tl.where(g_ok[:, None], logit, 0.0), axis=0)
                elif LEAF_OUT or lv > 0:  # constant with LEAF_OUT: no leaf scoring compiled
                    score = _node_scores(
                        q_s, summ_base, nfv_base, lvl_off_ptr, lv, off, cand, valid, Nk, hz, stride_mt, qk_scale,
                        g_ok, offs_d, d_ok, GP, D, CW, BR, BRP, SCORE, SCORES, SUMM_ROUNDED, I64_ROWS,
                    )  # fmt: skip
                else:
                    # leaf: exact LSE (or mean + var/2) over its valid, visible raw keys, LC candidate
                    # leaves a dot (_leaf_scores)
                    score = tl.zeros([CW], dtype=tl.float32)
                    ar_lc = tl.arange(0, LC)
                    for c0 in range(0, CW, LC):
                        sub = c0 + ar_lc
                        pick = ar_cw[None, :] == sub[:, None]  # [LC, CW]
                        leaf = tl.sum(tl.where(pick, cand[None, :], 0), axis=1)
                        l_ok = tl.sum(tl.where(pick, valid[None, :].to(tl.int32), 0), axis=1) > 0
                        if tl.sum(l_ok.to(tl.int32), axis=0) > 0:
                            s_sub = _leaf_scores(
                                q_raw, k_base, kpm_ptr, b, leaf, l_ok, Nk, hz, stride_kn, qk_scale, g_ok, offs_d,
                                d_ok, GP, C, CP, LC, SCORE, HAS_KPM, IEEE_KEYS, I64_ROWS,
                            )  # fmt: skip
                            score += tl.sum(tl.where(pick, s_sub[:, None], 0.0), axis=0)
                keep = _top_k_keep(valid, forced, score, ar_cw, width, not PRE_SCORES and CW <= 32)
            else:
                keep = valid
            kept, ok = _compact(cand, keep, ar_kp, ar_cw)
            if TRACE:
                trace_row = trace_ptr + bh * stride_tbh + i.to(tl.int64) * stride_tn
                tl.store(trace_row + lv * KP + ar_kp, tl.where(ok, kept, -1))
            lv -= 1
        if LEAF_OUT:
            _, cand, valid, forced, par_id = _level_candidates(
                kept, ok, 0, lvl_off_ptr, lvl_span_ptr, nfv_base, Nk, hz, first_leaf, cur_f, prev_f, sink_f, here,
                ar_cw, KP, BR, BRP, C, LOADED, HAS_WINDOW,
            )  # fmt: skip
            enc = tl.where(valid, tl.where(forced, cand | (1 << 30), cand), -1)
            tl.store(cand_ptr + bh * stride_cbh + i.to(tl.int64) * stride_cn + ar_cw, enc)
            if PAIR_RANKS:
                pair = valid & ~forced & (tl.sum(valid.to(tl.int32), axis=0) > TOPK)
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
    sliding_window: int = PISAConfig.sliding_window,
    chunk_size: int = PISAConfig.chunk_size,
    scores: str = "fp32",
) -> torch.Tensor:
    return per_token_walk(
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
        warps,
        leaf_bytes,
        length,
        sliding_window,
        chunk_size,
        scores,
    )


def per_token_walk(
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
    sliding_window: int = PISAConfig.sliding_window,
    chunk_size: int = PISAConfig.chunk_size,
    scores: str = "fp32",
    trace: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The body of the op ``_pisa_select_fwd`` (its arguments); ``trace``: None, or an int32
    ``[B*Hkv, Nq, levels, KP]`` tensor (-1 filled) that receives every level's kept nodes
    (``triton_trace``, tests only: not an op argument)."""
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
        q, k, kpm, summ, lvl_span, is_causal, score, force_sink, force_previous, block_size, branching, top_k, beam
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
        **no_scan_args(nfv, trace),
        **window_args(sliding_window, chunk_size),
        SCORES=scores_mode(scores),
        TRACE=trace is not None,
        num_warps=warps,
    )
    return out


def no_scan_args(placeholder: torch.Tensor, trace: Optional[torch.Tensor] = None) -> dict:
    """The scan walk's kernel arguments for a walk that reads no precomputed scores and writes no
    leaf candidates (``placeholder``: any tensor of the call, never read), and the trace's
    (:func:`trace_args`; ``trace`` None: none)."""
    return dict(
        **trace_args(placeholder, trace),
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
    sliding_window=PISAConfig.sliding_window,
    chunk_size=PISAConfig.chunk_size,
    scores="fp32",
):
    return q.new_empty(q.shape[0], k.shape[1], q.shape[2], top_k, dtype=torch.int32)
