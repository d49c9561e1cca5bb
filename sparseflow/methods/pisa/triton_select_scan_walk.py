"""The scan walk's middle stage by rows of queries: from the node-score table of
``triton_select_scan`` (stage 1) down to each query's leaf candidates, ``QR`` queries a program.

A level of one query's walk is ``CW`` candidates (16 at K=8): half of a warp's 32 lanes, and
Hopper holds at most 32 programs an SM. A program here walks ``QR`` queries side by side,
``[QR, CW]`` a level, on one warp: about the instructions of one query's level for ``QR`` times
the queries. The rules are the per-token walk's: a level's candidates are the children of the
nodes kept above, future / empty nodes and nodes wholly before the local window dropped, the
ancestors of the forced leaves kept without scoring, and the best-scoring others fill the level's
width (ties to the lower node id, by a sort of each row's scores: signed zeros order -0.0 below
+0.0). The level loop runs every level's keep unbranched: a level with no more valid candidates
than its width keeps them all.
Imported lazily; this module imports Triton.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...kernels.pdl import pdl_start
from .triton_select_common import _first_valid, _forced_leaves, _rows_compact
from .triton_select_per_token import _ancestor

__all__ = ["WALK_QUERIES", "scan_walk_rows_kernel"]

# queries a program of the rows walk (a power of two), on one warp: two queries of CW = 16
# candidates fill its 32 lanes (sm_90, K=8: 149 instructions a query a level, against the
# per-token kernel's 227; four queries take 141 at 72 registers, eight 133 at 96; on two warps
# Triton 3.6's thread-locality pass fails to compile it)
WALK_QUERIES = 2


@triton.jit
def _rows_sorted_keep(valid, forced, score, width):
    """Per row of ``[QR, CW]``: keep the forced entries and the best-scoring others, ``width`` in
    total, ties to the lower position (= lower node id), as the per-token walk's sorted keep
    does for one row (its ``_top_k_keep``): one bitonic sort a row of the scores' 32-bit
    order-preserving bits finds the width-th best; entries above it are kept, and of those equal
    to it the first ones in position order fill the rest. (A ``[QR, CW, CW]`` rank compare
    compiles to about twice the instructions here.)"""
    big = 3.0e38
    key = tl.where(score != score, -big, tl.minimum(tl.maximum(score, -big), big))
    key = tl.where(forced, float("inf"), key)
    key = tl.where(valid, key, float("-inf"))
    bits = key.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # float order as signed-int order
    srt = tl.sort(ordered, 1, descending=True)
    kth = tl.gather(srt, tl.zeros_like(ordered) + (width - 1), 1)  # each row's width-th best
    above = ordered > kth
    tied = ordered == kth
    tied_before = tl.cumsum(tied.to(tl.int32), axis=1) - tied.to(tl.int32)
    room = width - tl.sum(above.to(tl.int32), axis=1)
    return valid & (above | (tied & (tied_before < room[:, None])))


@triton.jit
def _visible_nodes(nfv_base, off, node, span, Nk, hz, first_leaf, lv, C: tl.constexpr, BR: tl.constexpr,
                   LOADED: tl.constexpr, HAS_WINDOW: tl.constexpr):  # fmt: skip
    """``[QR, W]``: whether each level-``lv`` node (``node``, ids in range) holds a key at or
    before its row's ``hz`` and ends at or after its row's window (``first_leaf``, ``[QR]``)."""
    vis = _first_valid(nfv_base, off, node, span, Nk, C, LOADED) <= hz[:, None]
    if HAS_WINDOW:
        vis = vis & (node >= _ancestor(first_leaf, lv, span, BR)[:, None])
    return vis


@triton.jit
def _rows_candidates(
    kept, ok, lv, lvl_off_ptr, lvl_span_ptr, nfv_base, Nk, hz, first_leaf, cur_f, prev_f, sink_f, here, ar_cw,
    QR: tl.constexpr, KP: tl.constexpr, CW: tl.constexpr, BR: tl.constexpr, BRP: tl.constexpr, C: tl.constexpr,
    LOADED: tl.constexpr, HAS_WINDOW: tl.constexpr,
):  # fmt: skip
    """Level ``lv``'s ``[QR, CW]`` candidate slots, ``BRP`` a kept node above (``kept``, ``ok``:
    ``[QR, KP]``): ``(off, cand, valid, forced, par_id)`` as the per-token walk's
    ``_level_candidates`` gives them for one query."""
    off = tl.load(lvl_off_ptr + lv)
    n_lv = tl.load(lvl_off_ptr + lv + 1) - off
    span = tl.load(lvl_span_ptr + lv)
    par = ar_cw // BRP
    j = (ar_cw % BRP)[None, :]
    slot = tl.zeros([QR, CW], dtype=tl.int32) + tl.minimum(par, KP - 1)[None, :]
    par_enc = tl.gather(tl.where(ok, kept, -1), slot, 1)  # each candidate's parent (-1: none)
    par_ok = (par < KP)[None, :] & (par_enc >= 0)
    par_id = tl.where(par_ok, par_enc, 0)
    cand = par_id * BR + j
    valid = par_ok & (j < BR) & (cand < n_lv)
    cand = tl.where(valid, cand, 0)
    valid = valid & _visible_nodes(nfv_base, off, cand, span, Nk, hz, first_leaf, lv, C, BR, LOADED, HAS_WINDOW)
    forced = (cand == _ancestor(cur_f, lv, span, BR)[:, None]) | (cand == _ancestor(prev_f, lv, span, BR)[:, None])
    forced = forced | (cand == _ancestor(sink_f, lv, span, BR)[:, None])
    forced = forced | (cand == _ancestor(here, lv, span, BR)[:, None])
    return off, cand, valid, forced & valid, par_id


@triton.jit
def scan_walk_rows_kernel(  # noqa: PLR0915
    pre_ptr,
    nfv_ptr,
    lvl_off_ptr,
    lvl_span_ptr,
    cand_ptr,
    count_ptr,
    rank_ptr,
    trace_ptr,
    stride_pbh,
    stride_pn,
    pre_col0,
    stride_cbh,
    stride_cn,
    stride_tbh,
    stride_tn,
    Nq,
    Nk,
    T,
    HKV,
    SLIDING,
    CHUNK,
    N_LEVELS: tl.constexpr,
    HAS_KPM: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    FORCE_SINK: tl.constexpr,
    FORCE_PREV: tl.constexpr,
    C: tl.constexpr,
    BR: tl.constexpr,
    BRP: tl.constexpr,
    TOPK: tl.constexpr,
    WIDE: tl.constexpr,
    KP: tl.constexpr,
    CW: tl.constexpr,
    QR: tl.constexpr,
    PAIR_SIBLINGS: tl.constexpr = False,
    PDL: tl.constexpr = False,
    HAS_WINDOW: tl.constexpr = False,
    TRACE: tl.constexpr = False,
):
    """``QR`` queries' walks from the start level down to their leaf candidates, every scored
    node's score read from the table (``pre_ptr``, ``[B*Hkv, Nq, T - pre_col0]``); writes each
    query's leaf candidates (``cand_ptr``, ``[B*Hkv, Nq, CW]``: -1 invalid, id | 2**30 forced,
    else id) and each scored pair's rank in its (batch x KV head, leaf) segment, or in its kept
    parent's with ``PAIR_SIBLINGS`` (``count_ptr`` / ``rank_ptr``, as the per-token kernel's
    ``PAIR_RANKS``). ``TRACE``: every level's kept nodes above the leaves to ``trace_ptr``
    (``[B*Hkv, Nq, N_LEVELS, KP]``, -1 where none). The walk's callers run it with more leaves
    than ``TOPK``, so its start level is above the leaves."""
    pdl_start(PDL)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // HKV
    i = tl.program_id(0) * QR + tl.arange(0, QR)
    row_ok = i < Nq
    p = i + Nk - Nq  # query positions (bottom-right aligned)
    if IS_CAUSAL:
        hz = p
    else:
        hz = tl.zeros([QR], dtype=tl.int32) + (Nk - 1)
    nfv_base = nfv_ptr + b * T
    LOADED: tl.constexpr = HAS_KPM  # else a node's first valid key is its first key
    n_leaves = tl.load(lvl_off_ptr + 1)
    cur_f, prev_f, sink_f, here, first_leaf = _forced_leaves(
        p, hz, n_leaves, nfv_base, Nk, SLIDING, CHUNK, C, FORCE_SINK, FORCE_PREV, LOADED, HAS_WINDOW
    )

    ar_kp = tl.arange(0, KP)
    ar_cw = tl.arange(0, CW)
    nodes = tl.zeros([QR, KP], dtype=tl.int32) + ar_kp[None, :]
    top = N_LEVELS - 1
    # the lowest level no wider than what it keeps keeps every visible node, as do the levels above
    start = top
    for lv in range(0, N_LEVELS - 1):
        n_lv = tl.load(lvl_off_ptr + lv + 1) - tl.load(lvl_off_ptr + lv)
        start = tl.where((n_lv <= tl.where(lv > 0, WIDE, TOPK)) & (start == top), lv, start)
    trace_rows = trace_ptr + bh * stride_tbh + i.to(tl.int64)[:, None] * stride_tn
    if TRACE:
        for t_lv in range(0, N_LEVELS):
            if t_lv >= start:
                t_off = tl.load(lvl_off_ptr + t_lv)
                t_in = nodes < tl.load(lvl_off_ptr + t_lv + 1) - t_off
                t_span = tl.load(lvl_span_ptr + t_lv)
                t_vis = t_in & _visible_nodes(
                    nfv_base, t_off, tl.where(t_in, nodes, 0), t_span, Nk, hz, first_leaf, t_lv, C, BR, LOADED,
                    HAS_WINDOW,
                )  # fmt: skip
                t_ids, t_ok = _rows_compact(nodes, t_vis, ar_kp)
                tl.store(trace_rows + t_lv * KP + ar_kp[None, :], tl.where(t_ok, t_ids, -1), mask=row_ok[:, None])
    s_off = tl.load(lvl_off_ptr + start)
    s_in = nodes < tl.load(lvl_off_ptr + start + 1) - s_off
    s_span = tl.load(lvl_span_ptr + start)
    s_vis = s_in & _visible_nodes(
        nfv_base, s_off, tl.where(s_in, nodes, 0), s_span, Nk, hz, first_leaf, start, C, BR, LOADED, HAS_WINDOW
    )
    kept, ok = _rows_compact(nodes, s_vis, ar_kp)

    pre_rows = pre_ptr + bh * stride_pbh + i.to(tl.int64)[:, None] * stride_pn - pre_col0
    lv = start - 1
    while lv >= 1:
        off, cand, valid, forced, _ = _rows_candidates(
            kept, ok, lv, lvl_off_ptr, lvl_span_ptr, nfv_base, Nk, hz, first_leaf, cur_f, prev_f, sink_f, here,
            ar_cw, QR, KP, CW, BR, BRP, C, LOADED, HAS_WINDOW,
        )  # fmt: skip
        # a level above the leaves keeps WIDE nodes; one with no more valid candidates keeps them all
        scoring = tl.sum(valid.to(tl.int32), axis=1) > WIDE
        score = tl.load(pre_rows + off + cand, mask=valid & (scoring & row_ok)[:, None], other=0.0)
        kept, ok = _rows_compact(cand, _rows_sorted_keep(valid, forced, score, WIDE), ar_kp)
        if TRACE:
            tl.store(trace_rows + lv * KP + ar_kp[None, :], tl.where(ok, kept, -1), mask=row_ok[:, None])
        lv -= 1

    _, cand, valid, forced, par_id = _rows_candidates(
        kept, ok, 0, lvl_off_ptr, lvl_span_ptr, nfv_base, Nk, hz, first_leaf, cur_f, prev_f, sink_f, here,
        ar_cw, QR, KP, CW, BR, BRP, C, LOADED, HAS_WINDOW,
    )  # fmt: skip
    enc = tl.where(valid, tl.where(forced, cand | (1 << 30), cand), -1)
    slots = bh * stride_cbh + i.to(tl.int64)[:, None] * stride_cn
    tl.store(cand_ptr + slots + ar_cw[None, :], enc, mask=row_ok[:, None])
    pair = valid & ~forced & ((tl.sum(valid.to(tl.int32), axis=1) > TOPK) & row_ok)[:, None]
    if PAIR_SIBLINGS:
        # a kept parent's children hold slots par * BRP + j: one rank per parent
        n_par = tl.load(lvl_off_ptr + 2) - n_leaves
        grp = tl.max(tl.reshape(pair.to(tl.int32), (QR, CW // BRP, BRP)), axis=2) > 0
        parent = tl.max(tl.reshape(par_id, (QR, CW // BRP, BRP)), axis=2)
        rank = tl.atomic_add(count_ptr + bh * n_par + parent, 1, mask=grp)
        tl.store(rank_ptr + slots + (tl.arange(0, CW // BRP) * BRP)[None, :], rank, mask=grp)
    else:
        rank = tl.atomic_add(count_ptr + bh * n_leaves + cand, 1, mask=pair)
        tl.store(rank_ptr + slots + ar_cw[None, :], rank, mask=pair)
