"""The scan PISA walk (``Tuning(pisa_walk="scan")``; ``"auto"`` on CUDA): the per-token walk's
selection in three stages, so that what the per-token walk loads once per query token is loaded
once per tile of queries (node summaries) or per leaf (raw keys).

1. ``_tile_walk_kernel``: one program per (tile of ``BQ`` consecutive queries, batch x KV head)
   walks all the tile's rows from the root to the leaves at once. Each level lives on a dense
   ``[BQ, NP]`` grid of its nodes (``next_pow2(g)`` columns per node of the level above, so a
   row's candidates are its kept parents' columns expanded; columns past a parent's ``g``
   children or the level's end stay invalid): future / empty nodes are dropped per row, the
   forced ancestors kept unscored, and where a row has more candidates than the level keeps, the
   best-scoring ones fill the rest, ties to the lower id (one sort of 64-bit keys per row). A
   scored level's scores come from one ``[BQ * G, D] x [D, columns]`` dot per chunk of the
   tile's queries with the fp32 summaries of every node's children (tf32x3 on the tensor cores),
   reduced as the reference does (LSE or mean + var/2; PISA-1: the node's own mean) and summed
   over the group's heads. A node is scored only for rows it lies entirely before (others force
   it or drop it), so a child's visibility is whether it holds a valid key, the same for every
   row. At the leaves the kernel writes each row's leaf candidates (PISA-1: its selection).
2. :func:`leaf_pair_index` sorts the scored (query, leaf) pairs by leaf (torch, on the device) and
   ``_leaf_pairs_kernel`` scores them in chunks of one leaf: the leaf's raw keys loaded once, the
   chunk's query rows gathered, one ``[chunk * G, D] x [D, C]`` dot in the keys' 16-bit dtype
   (exact products), the exact LSE (or mean + var/2) per pair.
3. ``_leaf_keep_kernel``: each query keeps its forced leaves plus its best-scoring others,
   ``top_k`` in total, as the per-token walk does.

A tile scores every node of a scored level, before its queries or not, so the walk costs
``O(N / C)`` per query (``O(N**2 / C)`` in all, on the tensor cores) and a grid holds
``next_pow2(g) ** levels`` leaf columns: :func:`scan_covers` bounds it to :data:`MAX_GRID`.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from ...kernels._triton_env import interpreting
from .triton_select import _p2, candidate_width, level_sizes, walk_meta
from .triton_select_tiled import _group_sum, _reduce, _rows_compact, _rows_top_k_keep

__all__ = [
    "scan_covers",
    "queries_per_program",
    "tile_queries",
    "level_grid",
    "leaf_pair_index",
    "pisa_select_scan_fwd",
    "MAX_GRID",
    "LAUNCH",
]

# the widest level grid a tile holds (``[BQ, width]`` masks and keys in registers): 1024 leaf
# columns is 64K tokens at C 64, g 2; longer calls walk per token
MAX_GRID = 1024
# launch settings (a study may sweep them): dot rows of a tile and of a leaf-pair chunk (queries x
# the group's heads, padded to a power of two), grid cells a tile holds (rows x level width),
# summary columns per dot, the tile walk's and the leaf scorer's warps
LAUNCH = {"rows": 128, "pair_rows": 128, "cells": 8192, "cols": 64, "warps": 8, "leaf_warps": 4}


def queries_per_program(group: int, rows: int) -> int:
    """Queries of a tile or a leaf-pair chunk: about ``rows`` dot rows (queries x the group's
    heads padded to a power of two), at least 16 (tl.dot's minimum)."""
    gp = _p2(group)
    return max(_p2(-(-16 // gp)), rows // gp, 1)


def tile_queries(group: int, width: int) -> int:
    """Queries of a walk tile: :func:`queries_per_program`'s, fewer where the level grid is wide
    (``LAUNCH["cells"]`` grid cells), never below tl.dot's 16 rows."""
    bq = queries_per_program(group, LAUNCH["rows"])
    floor = _p2(-(-16 // _p2(group)))
    while bq > floor and bq * width > LAUNCH["cells"]:
        bq //= 2
    return bq


def level_grid(n_leaves: int, branching: int, top_k: int, beam: int, leaf_out: bool) -> dict:
    """The tile walk's levels, top-down from the root's children to the leaves: ``ids`` (the
    level), ``parents`` (the parent level's grid width: ``next_pow2(g)`` columns per node of the
    level above), ``scored`` (whether a row may have more candidates than the level keeps, and
    the kernel scores the level: the leaves' exact scores come from the pairs unless PISA-1);
    ``width`` is the leaves' grid width."""
    sizes = level_sizes(n_leaves, branching)
    brp = _p2(branching)
    ids, parents, scored = [], [], []
    for i in range(len(sizes) - 1):
        lv = len(sizes) - 2 - i
        ids.append(lv)
        parents.append(brp**i)
        scored.append(sizes[lv] > (beam * top_k if lv > 0 else top_k) and (lv > 0 or not leaf_out))
    return dict(ids=tuple(ids), parents=tuple(parents), scored=tuple(scored), width=brp ** (len(sizes) - 1))


def scan_covers(n_leaves: int, top_k: int, branching: int, candidate_slots: int) -> Optional[str]:
    """None when the scan walk takes the call, else why not (for the fallback's log).
    ``candidate_slots``: ``B * Hkv * Nq * CW``, indexed in int32 by the leaf-pair index."""
    if n_leaves <= top_k:
        return f"{n_leaves} leaf blocks <= top_k={top_k}: no leaf is scored"
    if candidate_slots >= 2**31:
        return f"{candidate_slots} leaf candidate slots exceed the pair index's int32"
    width = _p2(branching) ** (len(level_sizes(n_leaves, branching)) - 1)
    if width > MAX_GRID:
        return f"its leaf grid of {width} columns (next_pow2(branching) ** levels) exceeds {MAX_GRID}"
    return None


# --------------------------------------------------------------------------- stage 1


@triton.jit
def _anc(leaf, span):
    """The level's ancestor of each forced ``leaf`` (-1 stays -1)."""
    return tl.where(leaf >= 0, leaf // span, -1)


@triton.jit
def _chunk_of(x, c, NCH: tl.constexpr, CC: tl.constexpr):
    """Columns ``c * CC .. c * CC + CC - 1`` of ``x`` (``[NCH * CC]``)."""
    return tl.sum(tl.where((tl.arange(0, NCH) == c)[:, None], tl.reshape(x, (NCH, CC)), 0), axis=0)


@triton.jit
def _head_scores(
    q, rows_ptr, load_ok, ok, qk_scale, NX: tl.constexpr, J: tl.constexpr, SCORE: tl.constexpr, PREC: tl.constexpr
):
    """``[R, NX // J]`` per-head scores of the nodes whose ``J`` children (``J == 1``: the node
    itself, PISA-1) have the summary rows ``rows_ptr`` (``[DP, NX]`` pointers, loaded where
    ``load_ok``; ``ok [NX]``: the columns that count): one dot of the tile's query rows with the fp32 summaries, then the reference's
    reduction over each node's children. Below the 16 columns a dot needs, the columns repeat."""
    R: tl.constexpr = q.shape[0]
    if NX < 16:
        REP: tl.constexpr = 16 // NX
        DPR: tl.constexpr = rows_ptr.shape[0]
        rp = tl.reshape(tl.broadcast_to(rows_ptr[:, None, :], (DPR, REP, NX)), (DPR, 16))
        rok = tl.reshape(tl.broadcast_to(load_ok[:, None, :], (DPR, REP, NX)), (DPR, 16))
        s_t = tl.load(rp, mask=rok, other=0.0)
        lg = tl.dot(q, s_t, input_precision=PREC) * qk_scale
        first = (tl.arange(0, REP) == 0)[None, :, None]
        logit = tl.sum(tl.where(first, tl.reshape(lg, (R, REP, NX)), 0.0), axis=1)
    else:
        s_t = tl.load(rows_ptr, mask=load_ok, other=0.0)
        logit = tl.dot(q, s_t, input_precision=PREC) * qk_scale
    if J == 1:
        per_head = logit
    else:
        per_head = _reduce(tl.reshape(logit, (R, NX // J, J)), tl.reshape(ok, (NX // J, J))[None, :, :], SCORE)
    return per_head


@triton.jit
def _level_scores(
    q,
    summ_base,
    stride_mt,
    cols,
    ok,
    qk_scale,
    BQ: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    NX: tl.constexpr,
    J: tl.constexpr,
    MAXC: tl.constexpr,
    SCORE: tl.constexpr,
    PREC: tl.constexpr,
):
    """``[BQ, NX // J]``: each node's score summed over the group's heads, from the summaries of
    its ``J`` children at the columns ``cols`` (``[NX]``, valid where ``ok``), in dots of at most
    ``MAXC`` columns (the logits of one dot stay in registers)."""
    offs_d = tl.arange(0, DP)
    d_ok = (offs_d < D)[:, None]
    if NX <= MAXC:
        ptrs = summ_base + cols.to(tl.int64)[None, :] * stride_mt + offs_d[:, None]
        score = _group_sum(
            _head_scores(q, ptrs, ok[None, :] & d_ok, ok, qk_scale, NX, J, SCORE, PREC), BQ, GP, G, NX // J
        )
    else:
        NCH: tl.constexpr = NX // MAXC
        PC: tl.constexpr = MAXC // J
        parts = tl.zeros([BQ, NCH, PC], dtype=tl.float32)
        for c in tl.static_range(NCH):
            cols_c = _chunk_of(cols, c, NCH, MAXC)
            ok_c = _chunk_of(ok.to(tl.int32), c, NCH, MAXC) != 0
            ptrs = summ_base + cols_c.to(tl.int64)[None, :] * stride_mt + offs_d[:, None]
            per_head = _head_scores(q, ptrs, ok_c[None, :] & d_ok, ok_c, qk_scale, MAXC, J, SCORE, PREC)
            part = _group_sum(per_head, BQ, GP, G, PC)
            parts = tl.where((tl.arange(0, NCH) == c)[None, :, None], part[:, None, :], parts)
        score = tl.reshape(parts, (BQ, NX // J))
    return score


@triton.jit
def _dense_keep(valid, forced, score, n_valid, W: tl.constexpr, NP: tl.constexpr):
    """Per row of ``[BQ, NP]``: the valid entries when at most ``W`` are, else the forced ones and
    the best-scoring others, ``W`` in total, ties to the lower column (= the lower node id): the
    per-token walk's rule, in ``W`` rounds that each take a row's best remaining entry."""
    big = 3.0e38
    key = tl.where(score != score, -big, tl.minimum(tl.maximum(score, -big), big))
    key = tl.where(forced, float("inf"), key)
    ar = tl.arange(0, NP)[None, :]
    todo = (n_valid > W)[:, None]
    keep = valid & ~todo
    avail = valid & todo
    for _ in tl.static_range(W):
        best = tl.max(tl.where(avail, key, float("-inf")), axis=1)
        first = tl.min(tl.where(avail & (key == best[:, None]), ar, NP), axis=1)
        pick = ar == first[:, None]
        keep = keep | pick
        avail = avail & ~pick
    return keep


@triton.jit
def _walk_level(
    q,
    kept,
    ids,
    col_ok,
    hz,
    cur_f,
    prev_f,
    sink_f,
    here,
    t_ok,
    summ_base,
    nfv_base,
    lvl_off_ptr,
    lvl_span_ptr,
    stride_mt,
    Nk,
    qk_scale,
    cand_rows,
    out_rows,
    LV: tl.constexpr,
    NPP: tl.constexpr,
    SCORED: tl.constexpr,
    SCORE: tl.constexpr,
    LEAF_OUT: tl.constexpr,
    BR: tl.constexpr,
    BRP: tl.constexpr,
    BQ: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    TOPK: tl.constexpr,
    WIDE: tl.constexpr,
    KP: tl.constexpr,
    CW: tl.constexpr,
    MAXC: tl.constexpr,
    PREC: tl.constexpr,
):
    """One level of the tile's walk, every row at once on a dense ``[BQ, NP]`` grid of the
    level's nodes (``NP = NPP * BRP`` columns: ``BRP`` slots per parent column, real id
    ``parent * BR + j``): the candidates are the children of the row's kept parents, future /
    empty nodes dropped, the forced ancestors kept unscored, the best-scoring rest filling the
    level's width. Returns the next level's ``(kept, ids, col_ok)``; at the leaves, writes the
    leaf candidates (``LEAF_OUT``) or the selection (PISA-1, whose leaves score by their means)."""
    NP: tl.constexpr = NPP * BRP
    ar_b = tl.arange(0, BRP)
    off = tl.load(lvl_off_ptr + LV)
    n_lv = tl.load(lvl_off_ptr + LV + 1) - off
    ids2 = ids[:, None] * BR + ar_b[None, :]
    ok2 = col_ok[:, None] & (ar_b < BR)[None, :] & (ids2 < n_lv)
    ids = tl.reshape(tl.where(ok2, ids2, 0), (NP,))
    col_ok = tl.reshape(ok2, (NP,))
    nfv_l = tl.load(nfv_base + off + ids, mask=col_ok, other=Nk)
    parent = tl.reshape(tl.broadcast_to(kept[:, :, None], (BQ, NPP, BRP)), (BQ, NP))
    valid = (parent != 0) & col_ok[None, :] & (nfv_l[None, :] <= hz[:, None])
    span = tl.load(lvl_span_ptr + LV)
    forced = (ids[None, :] == _anc(cur_f, span)[:, None]) | (ids[None, :] == _anc(prev_f, span)[:, None])
    forced = forced | (ids[None, :] == _anc(sink_f, span)[:, None]) | (ids[None, :] == _anc(here, span)[:, None])
    forced = forced & valid
    n_valid = tl.sum(valid.to(tl.int32), axis=1)
    W: tl.constexpr = WIDE if LV > 0 else TOPK
    if SCORED:
        if SCORE == 1:
            # PISA-1: q . mean(node) * scale
            score = _level_scores(
                q,
                summ_base + off * stride_mt,
                stride_mt,
                ids,
                col_ok & (nfv_l < Nk),
                qk_scale,
                BQ,
                G,
                GP,
                D,
                DP,
                NP,
                1,
                MAXC,
                SCORE,
                PREC,
            )
        else:
            # LSE (or mean + var/2) over the children's summaries; a scored node lies entirely
            # before its row's query, so a child counts when it holds a valid key, for every row
            coff = tl.load(lvl_off_ptr + LV - 1)
            cids2 = ids[:, None] * BR + ar_b[None, :]
            cok2 = col_ok[:, None] & (ar_b < BR)[None, :] & (cids2 < off - coff)
            cids = tl.reshape(tl.where(cok2, cids2, 0), (NP * BRP,))
            cok = tl.reshape(cok2, (NP * BRP,))
            cok = cok & (tl.load(nfv_base + coff + cids, mask=cok, other=Nk) < Nk)
            score = _level_scores(
                q,
                summ_base + coff * stride_mt,
                stride_mt,
                cids,
                cok,
                qk_scale,
                BQ,
                G,
                GP,
                D,
                DP,
                NP * BRP,
                BRP,
                MAXC,
                SCORE,
                PREC,
            )
        keep = _dense_keep(valid, forced, score, n_valid, W, NP)
    else:
        keep = valid
    if LV == 0:
        if LEAF_OUT:
            # the leaf candidates, ascending (-1 invalid, id | 2**30 forced), for the leaf pairs
            enc = tl.where(forced, ids[None, :] | (1 << 30), ids[None, :])
            slot = tl.cumsum(valid.to(tl.int32), axis=1) - 1
            tl.store(cand_rows[:, None] + slot, enc, mask=valid & t_ok[:, None])
            ar_cw = tl.arange(0, CW)
            tl.store(cand_rows[:, None] + ar_cw[None, :], -1, mask=(ar_cw[None, :] >= n_valid[:, None]) & t_ok[:, None])
        else:
            n_keep = tl.sum(keep.to(tl.int32), axis=1)
            slot = tl.cumsum(keep.to(tl.int32), axis=1) - 1
            tl.store(out_rows[:, None] + slot, ids[None, :], mask=keep & t_ok[:, None])
            ar_kp = tl.arange(0, KP)
            pad = (ar_kp[None, :] >= n_keep[:, None]) & (ar_kp < TOPK)[None, :]
            tl.store(out_rows[:, None] + ar_kp[None, :], -1, mask=pad & t_ok[:, None])
    return keep.to(tl.int32), ids, col_ok


@triton.jit
def _tile_walk_kernel(
    q_ptr,
    summ_ptr,
    nfv_ptr,
    lvl_off_ptr,
    lvl_span_ptr,
    cand_ptr,
    out_ptr,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_mb,
    stride_mh,
    stride_mt,
    stride_cbh,
    stride_cn,
    stride_ob,
    stride_oh,
    stride_on,
    Nq,
    Nk,
    T,
    HKV,
    qk_scale,
    N_LEVELS: tl.constexpr,
    LEVEL_IDS: tl.constexpr,
    LEVEL_PARENTS: tl.constexpr,
    LEVEL_SCORED: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    SCORE: tl.constexpr,
    FORCE_SINK: tl.constexpr,
    FORCE_PREV: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    C: tl.constexpr,
    BR: tl.constexpr,
    BRP: tl.constexpr,
    TOPK: tl.constexpr,
    WIDE: tl.constexpr,
    KP: tl.constexpr,
    CW: tl.constexpr,
    BQ: tl.constexpr,
    MAXC: tl.constexpr,
    PREC: tl.constexpr,
    LEAF_OUT: tl.constexpr,
):
    """The walk of ``BQ`` consecutive queries of one (batch, KV head), root to leaves, every level
    on a dense grid of its nodes (see the module doc). For the levels top-down from ``N_LEVELS - 2``
    to the leaves: ``LEVEL_IDS[i]`` the level, ``LEVEL_PARENTS[i]`` its parent level's grid width,
    ``LEVEL_SCORED[i]`` whether a row may need its scores (more nodes than the level keeps)."""
    qk_scale = tl.cast(qk_scale, tl.float32)
    tile = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # 64-bit offsets: batch x head strides pass 2**31 elements
    b = bh // HKV
    hkv = bh % HKV
    R: tl.constexpr = BQ * GP
    rows = tl.arange(0, R)
    qi = tile * BQ + rows // GP
    g_row = rows % GP
    offs_d = tl.arange(0, DP)
    q = tl.load(
        q_ptr
        + b * stride_qb
        + (hkv * G + g_row)[:, None] * stride_qh
        + qi.to(tl.int64)[:, None] * stride_qn
        + offs_d[None, :],
        mask=((g_row < G) & (qi < Nq))[:, None] & (offs_d < D)[None, :],
        other=0.0,
    ).to(tl.float32)
    ti = tile * BQ + tl.arange(0, BQ)
    t_ok = ti < Nq
    p = ti + Nk - Nq  # query positions (bottom-right aligned)
    if IS_CAUSAL:
        hz = p
    else:
        hz = tl.full([BQ], Nk - 1, dtype=tl.int32)
    nfv_base = nfv_ptr + b * T
    # forced leaves (reference: token_blocks.forced_leaf_blocks) and the leaf holding p
    n_leaves = tl.load(lvl_off_ptr + 1)
    cur = tl.where((p >= 0) & (p < n_leaves * C), p // C, -1)
    prev = tl.full([BQ], -1, dtype=tl.int32)
    if FORCE_PREV:
        prev = tl.where(cur >= 1, cur - 1, -1)
    sink = tl.full([BQ], -1, dtype=tl.int32)
    if FORCE_SINK:
        sink = tl.where(cur != 0, 0, -1)
        if FORCE_PREV:
            sink = tl.where(prev == 0, -1, sink)
    cur_f = tl.where((cur >= 0) & (tl.load(nfv_base + tl.maximum(cur, 0)) <= hz), cur, -1)
    prev_f = tl.where((prev >= 0) & (tl.load(nfv_base + tl.maximum(prev, 0)) <= hz), prev, -1)
    sink_f = tl.where((sink >= 0) & (tl.load(nfv_base + tl.maximum(sink, 0)) <= hz), sink, -1)
    here = tl.where((p >= 0) & (p < Nk), p // C, -1)
    summ_base = summ_ptr + b * stride_mb + hkv * stride_mh
    cand_rows = cand_ptr + bh * stride_cbh + ti.to(tl.int64) * stride_cn
    out_rows = out_ptr + b * stride_ob + hkv * stride_oh + ti.to(tl.int64) * stride_on
    kept = tl.full([BQ, 1], 1, dtype=tl.int32)  # the root: its children's visibility implies its own
    ids = tl.zeros([1], dtype=tl.int32)
    col_ok = tl.full([1], 1, dtype=tl.int1)
    for it in tl.static_range(N_LEVELS - 1):
        kept, ids, col_ok = _walk_level(
            q,
            kept,
            ids,
            col_ok,
            hz,
            cur_f,
            prev_f,
            sink_f,
            here,
            t_ok,
            summ_base,
            nfv_base,
            lvl_off_ptr,
            lvl_span_ptr,
            stride_mt,
            Nk,
            qk_scale,
            cand_rows,
            out_rows,
            LEVEL_IDS[it],
            LEVEL_PARENTS[it],
            LEVEL_SCORED[it],
            SCORE,
            LEAF_OUT,
            BR,
            BRP,
            BQ,
            G,
            GP,
            D,
            DP,
            TOPK,
            WIDE,
            KP,
            CW,
            MAXC,
            PREC,
        )


# --------------------------------------------------------------------------- stage 3


@triton.jit
def _tile_candidates(
    cand_ptr, bh, tile, stride_cbh, stride_cn, Nq, TOPK: tl.constexpr, BQ: tl.constexpr, CW: tl.constexpr
):
    """The tile's leaf candidates as the walk wrote them: ``(ids, valid, forced, scored, rows)``,
    ``[BQ, CW]`` (scored: a valid, unforced candidate of a row with more valid ones than TOPK,
    as :func:`leaf_pair_index` counts them)."""
    rows = (tile * BQ + tl.arange(0, BQ)).to(tl.int64)
    enc = tl.load(
        cand_ptr + bh * stride_cbh + rows[:, None] * stride_cn + tl.arange(0, CW)[None, :],
        mask=(rows < Nq)[:, None],
        other=-1,
    )
    valid = enc >= 0
    forced = valid & (enc >= (1 << 30))
    cand = tl.where(valid, enc & ((1 << 30) - 1), 0)
    n_valid = tl.sum(valid.to(tl.int32), axis=1)
    scored = valid & (~forced) & (n_valid > TOPK)[:, None]
    return cand, valid, forced, scored, rows


@triton.jit
def _leaf_pairs_kernel(
    q_ptr,
    k_ptr,
    kpm_ptr,
    order_ptr,
    seg_ptr,
    chunk_end_ptr,
    prog_seg_ptr,
    score_ptr,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kn,
    Nq,
    Nk,
    HKV,
    n_leaves,
    n_segments,
    qk_scale,
    HAS_KPM: tl.constexpr,
    SCORE: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    C: tl.constexpr,
    CP: tl.constexpr,
    CW: tl.constexpr,
    QB: tl.constexpr,
    IEEE_KEYS: tl.constexpr,
):
    """Program p scores one chunk of ``QB`` (query, leaf) pairs of one segment (batch x KV head,
    leaf): the leaf's keys loaded once, the chunk's query rows gathered, one dot; each pair's
    score written at its candidate slot (``order`` holds the flat slot index of every scored
    pair, sorted by segment; ``seg`` the segments' starts, ``chunk_end`` their inclusive chunk
    counts, ``prog_seg`` each program's segment, ``n_segments`` past the last chunk)."""
    qk_scale = tl.cast(qk_scale, tl.float32)
    p = tl.program_id(0)
    sg = tl.load(prog_seg_ptr + p)
    if sg < n_segments:
        first_chunk = tl.load(chunk_end_ptr + sg - 1, mask=sg > 0, other=0)
        start = tl.load(seg_ptr + sg) + (p - first_chunk) * QB
        stop = tl.load(seg_ptr + sg + 1)
        bh = (sg // n_leaves).to(tl.int64)  # 64-bit offsets: batch x head strides pass 2**31 elements
        leaf = sg % n_leaves
        b = bh // HKV
        hkv = bh % HKV
        ar_e = start + tl.arange(0, QB)
        e_ok = ar_e < stop
        flat = tl.load(order_ptr + ar_e, mask=e_ok, other=0)  # the pair's slot in [B*Hkv, Nq, CW]
        row = (flat // CW) % Nq
        R: tl.constexpr = QB * GP
        ar_r = tl.arange(0, R)
        r_row = tl.reshape(tl.broadcast_to(row[:, None], (QB, GP)), (R,))
        r_ok = tl.reshape(tl.broadcast_to(e_ok[:, None], (QB, GP)), (R,)) & (ar_r % GP < G)
        offs_d = tl.arange(0, DP)
        q = tl.load(
            q_ptr
            + b * stride_qb
            + (hkv * G + ar_r % GP)[:, None] * stride_qh
            + r_row.to(tl.int64)[:, None] * stride_qn
            + offs_d[None, :],
            mask=r_ok[:, None] & (offs_d < D)[None, :],
            other=0.0,
        )
        offs_c = tl.arange(0, CP)
        pos = leaf * C + offs_c
        # a scored leaf lies before its queries' positions: all its valid keys are visible
        kok = (offs_c < C) & (pos < Nk)
        if HAS_KPM:
            kok = kok & (tl.load(kpm_ptr + b * Nk + pos, mask=kok, other=0) != 0)
        k_t = tl.load(
            k_ptr + b * stride_kb + hkv * stride_kh + pos.to(tl.int64)[None, :] * stride_kn + offs_d[:, None],
            mask=kok[None, :] & (offs_d < D)[:, None],
            other=0.0,
        )
        if IEEE_KEYS:
            logit = tl.dot(q.to(tl.float32), k_t.to(tl.float32), input_precision="ieee") * qk_scale
        else:
            logit = tl.dot(q, k_t, out_dtype=tl.float32) * qk_scale  # exact 16-bit products
        per_head = _reduce(tl.reshape(logit, (R, 1, CP)), tl.reshape(kok, (1, 1, CP)), SCORE)
        s_e = tl.reshape(_group_sum(per_head, QB, GP, G, 1), (QB,))
        tl.store(score_ptr + flat, s_e, mask=e_ok)


def leaf_pair_index(cand: torch.Tensor, top_k: int, n_leaves: int, qb: int):
    """The scored (query, leaf) pairs of ``cand`` ([B*Hkv, Nq, CW], the walk's encoding) grouped
    by segment = (batch x KV head, leaf), on the device (no host sync): ``(order, seg, chunk_end,
    prog_seg)`` for :func:`_leaf_pairs_kernel`, whose grid is ``prog_seg``'s length (an upper
    bound on the chunks of ``qb`` pairs; programs past the last chunk return at once)."""
    rows, n_q, cw = cand.shape
    n_seg = rows * n_leaves
    valid = cand >= 0
    scored = valid & (cand < (1 << 30)) & (valid.sum(-1, keepdim=True) > top_k)
    bh = torch.arange(rows, device=cand.device, dtype=torch.int32).view(rows, 1, 1)
    key = torch.where(scored, bh * n_leaves + cand, n_seg).view(-1)
    sorted_key, order = torch.sort(key)
    seg = torch.searchsorted(sorted_key, torch.arange(n_seg + 1, device=cand.device, dtype=key.dtype))
    chunks = torch.div(seg[1:] - seg[:-1] + qb - 1, qb, rounding_mode="floor")
    chunk_end = torch.cumsum(chunks, 0)
    bound = key.numel() // qb + n_seg
    prog_seg = torch.searchsorted(chunk_end, torch.arange(bound, device=cand.device, dtype=chunk_end.dtype), right=True)
    return order.to(torch.int32), seg.to(torch.int32), chunk_end.to(torch.int32), prog_seg.to(torch.int32)


@triton.jit
def _leaf_keep_kernel(
    cand_ptr,
    score_ptr,
    out_ptr,
    stride_cbh,
    stride_cn,
    stride_ob,
    stride_oh,
    stride_on,
    Nq,
    HKV,
    TOPK: tl.constexpr,
    KP: tl.constexpr,
    CW: tl.constexpr,
    BQ: tl.constexpr,
):
    """Each row of the tile keeps its forced leaves and its best-scoring others, TOPK in total
    (ties to the lower id), written ascending and -1 padded: the selection."""
    tile = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // HKV
    hkv = bh % HKV
    cand, valid, forced, scored, rows = _tile_candidates(cand_ptr, bh, tile, stride_cbh, stride_cn, Nq, TOPK, BQ, CW)
    ar_cw = tl.arange(0, CW)
    ar_kp = tl.arange(0, KP)
    score = tl.load(score_ptr + bh * stride_cbh + rows[:, None] * stride_cn + ar_cw[None, :], mask=scored, other=0.0)
    keep = _rows_top_k_keep(valid, forced, score, ar_cw, TOPK)
    kept, ok = _rows_compact(cand, keep, ar_kp)
    dst = out_ptr + b * stride_ob + hkv * stride_oh + rows[:, None] * stride_on + ar_kp[None, :]
    tl.store(dst, tl.where(ok, kept, -1), mask=(rows < Nq)[:, None] & (ar_kp < TOPK)[None, :])


# --------------------------------------------------------------------------- the op


@triton_op("sparseflow::pisa_select_scan_fwd", mutates_args={})
def pisa_select_scan_fwd(
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
) -> torch.Tensor:
    b, hq, n_q, d = q.shape
    hkv = k.shape[1]
    out = torch.empty(b, hkv, n_q, top_k, dtype=torch.int32, device=q.device)
    if n_q == 0:
        return out
    n_leaves = max(1, -(-k.shape[2] // block_size))
    cw = candidate_width(beam, top_k, branching)
    leaf_out = score != 1
    cand = torch.empty(b * hkv, n_q if leaf_out else 0, cw, dtype=torch.int32, device=q.device)
    ieee = q.dtype == torch.float32 or interpreting()
    meta = walk_meta(
        q, k, kpm, lvl_span, is_causal, score, force_sink, force_previous, block_size, branching, top_k, beam
    )
    group = hq // hkv
    grid = level_grid(n_leaves, branching, top_k, beam, leaf_out)
    bq = tile_queries(group, grid["width"])
    wrap_triton(_tile_walk_kernel)[(triton.cdiv(n_q, bq), b * hkv)](
        q,
        summ,
        nfv,
        lvl_off,
        lvl_span,
        cand,
        out,
        *q.stride()[:3],
        *summ.stride()[:3],
        cand.stride(0),
        cand.stride(1),
        *out.stride()[:3],
        n_q,
        k.shape[2],
        summ.shape[2],
        hkv,
        scale,
        N_LEVELS=meta["N_LEVELS"],
        LEVEL_IDS=grid["ids"],
        LEVEL_PARENTS=grid["parents"],
        LEVEL_SCORED=grid["scored"],
        IS_CAUSAL=is_causal,
        SCORE=score,
        FORCE_SINK=force_sink,
        FORCE_PREV=force_previous,
        G=group,
        GP=_p2(group),
        D=d,
        DP=meta["DP"],
        C=block_size,
        BR=branching,
        BRP=meta["BRP"],
        TOPK=top_k,
        WIDE=beam * top_k,
        KP=meta["KP"],
        CW=cw,
        BQ=bq,
        MAXC=LAUNCH["cols"],
        PREC="ieee" if interpreting() else "tf32x3",
        LEAF_OUT=leaf_out,
        num_warps=LAUNCH["warps"],
    )
    if leaf_out:
        scores = torch.empty(b * hkv, n_q, cw, dtype=torch.float32, device=q.device)
        qb = queries_per_program(group, LAUNCH["pair_rows"])
        order, seg, chunk_end, prog_seg = leaf_pair_index(cand, top_k, n_leaves, qb)
        wrap_triton(_leaf_pairs_kernel)[(prog_seg.numel(),)](
            q,
            k,
            kpm if kpm is not None else nfv,
            order,
            seg,
            chunk_end,
            prog_seg,
            scores,
            *q.stride()[:3],
            *k.stride()[:3],
            n_q,
            k.shape[2],
            hkv,
            n_leaves,
            b * hkv * n_leaves,
            scale,
            HAS_KPM=kpm is not None,
            SCORE=score,
            G=group,
            GP=_p2(group),
            D=d,
            DP=meta["DP"],
            C=block_size,
            CP=meta["CP"],
            CW=cw,
            QB=qb,
            IEEE_KEYS=ieee,
            num_warps=LAUNCH["leaf_warps"],
        )
        kq = queries_per_program(group, LAUNCH["rows"])
        wrap_triton(_leaf_keep_kernel)[(triton.cdiv(n_q, kq), b * hkv)](
            cand,
            scores,
            out,
            cand.stride(0),
            cand.stride(1),
            *out.stride()[:3],
            n_q,
            hkv,
            TOPK=top_k,
            KP=meta["KP"],
            CW=cw,
            BQ=kq,
            num_warps=4,
        )
    return out


@pisa_select_scan_fwd.register_fake
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
):
    return q.new_empty(q.shape[0], k.shape[1], q.shape[2], top_k, dtype=torch.int32)
