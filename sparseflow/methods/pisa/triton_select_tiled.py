"""PISA selection walk by query tiles (``Tuning.pisa_walk="tiled"``): the same selection as
``triton_select_per_token``'s walk and the reference, with the scoring shared by a tile.

One program walks ``BQ`` consecutive query tokens of one (batch, KV head) from the root to the
leaves. Every row keeps its own kept set (``[BQ, KP]`` registers) and its own candidates
(``[BQ, CW]``: the children of its kept nodes, future / empty nodes dropped, the ancestors of its
forced blocks kept without scoring, ties to the lower node id), exactly as the per-token walk
does. What the tile shares is the scoring of a level:

1. the *union* of the candidates that some row must score (rows with more candidates than the
   level's width; forced candidates excluded) is built in registers: the tile's ``BQ * CW``
   candidate ids, flattened, less those the previous row also wants (consecutive queries share
   most candidates; an id wanted by two rows that are not neighbours is scored twice, which costs
   work, not correctness), packed by a prefix sum into slots ``0 .. |union| - 1``;
2. the union is scored in chunks, each with ONE ``tl.dot`` whose rows are all the tile's
   queries times the ``G`` query heads of the group (``M = BQ * next_pow2(G)`` rows) and whose
   columns are the chunk's child summaries (intermediate ``lse`` / ``mean_var``: ``UN`` nodes x
   ``g`` children), node summaries (``mean``: ``UN`` nodes) or raw leaf keys (leaf ``lse`` /
   ``mean_var``: ``UL`` leaves x ``C`` keys); per-head scores are reduced over the children /
   keys, then summed over the group;
3. every row takes its candidates' scores from the union's and keeps its forced nodes plus its
   best ones, ties to the lower node id (a ``[BQ, CW, CW]`` rank compare: at these widths no
   cheaper than a sort compiled, and much cheaper interpreted).

Work per tile and level: loads of ``|union| * g`` summaries (or ``|union| * C`` keys at the
leaves) instead of ``BQ * CW * g`` (``BQ * CW * C``), and dots with ``M = BQ * G`` rows instead of
``G``. Consecutive queries share most of their coarse-level survivors (the coarse levels hold few
nodes, the forced sink / previous / current blocks are common to the tile), so ``|union|`` stays
near ``CW`` there and grows to at most ``BQ * CW`` at the leaves. The per-token walk issues
``M = G`` dots (``G = 16`` for Hq 32 / Hkv 2 is a single tensor-core tile row block, and for G <=
8 most of it is padding) and re-loads each shared key block once per query; here each key block
is loaded once per tile and the tensor cores see ``BQ`` times taller dots, which is where the
expected speed-up comes from. It is not free: packing the union (``[chunk, BQ * CW]`` selects per
chunk), the per-row matching (``[BQ, CW, chunk]`` compares) and the ranking are CUDA-core work
that grows with the tile, hence the tile bounds (``BQ * CW <= 256`` unless 16 dot rows need
more, ``M`` near 128 rows, leaf dots of at most 8192 fp32 logits; ``block_q`` of the launcher
overrides ``BQ``).

Numerics are the per-token walk's: with ``Tuning.pisa_scores="fp32"`` (the default), fp32
summaries in IEEE fp32 dots, 16-bit raw keys in their own dtype with fp32 accumulation on the
tensor cores (16-bit products are exact in fp32); fp32 keys in IEEE fp32 dots too: the
reference's selection exactly. What that costs: the summary dots run at the CUDA cores' fp32
FMA rate, about ``G * D * CW * g`` FMAs per query and scored intermediate level
(``16 * 64 * 16 * 2 = 32K`` at the benchmark shape; x ~11 levels x 256K queries x 2 KV heads at
256K tokens: ~2e11 FMAs, ~6 ms at the H200's ~67 TFLOP/s fp32 peak). The per-token walk does
the same FMAs (the tile does more where its union spills into a second chunk), but here they
become the bulk of the arithmetic (the leaf dots are tensor-core work). ``pisa_scores="bf16"``
/ ``"tf32"`` moves them to the tensor cores: both operands rounded to that format
(``triton_select_common._round_bits``, ties to even), one bf16 / tf32 dot with fp32
accumulation. That moves scores by far more than the summation order does and can flip a
selection among near-ties, within the selection contract's tolerance of that precision
(``tolerance_check``); the leaves' raw-key LSE is unchanged.

Every scored node lies entirely before the query of every row that reads its score (only the
node holding the query's position can straddle it, and it is forced), so the union's scores
need no per-row causal mask: a child / key counts when it holds a valid key.

Coverage: the tiled walk takes any shape the per-token walk takes as long as a row's candidate
width ``CW = max(16, next_pow2(beam * top_k) * next_pow2(g))`` is at most :data:`MAX_CW` and the
group has at most :data:`MAX_GROUP` query heads; other shapes fall back to the per-token walk
(logged). Decoding (``sparseflow.methods.pisa.pyramid_cache``) keeps the per-token walk.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from ...kernels._triton_env import interpreting
from .config import PISAConfig
from .triton_select_common import (
    _forced_leaves,
    _p2,
    _reduce,
    _row_offsets,
    _rows_compact,
    _rows_top_k_keep,
    _scores_dot,
    _scores_operand,
    candidate_width,
    scores_mode,
    trace_args,
    walk_args,
    walk_meta,
    window_args,
)

__all__ = ["DEFAULT_WARPS", "MAX_CW", "MAX_GROUP", "tiled_covers", "tile_rows", "leaf_chunk", "tiled_walk"]

# sm_90 (ptxas -v on the benchmark shape: G 16, D 64, C 64, K 8, bf16): 8 warps fit the tile in
# 216 registers a thread without spilling, 4 warps spill ~300 bytes; not yet timed
DEFAULT_WARPS = 8
MAX_CW = 64  # candidates per row: the [BQ, CW, chunk] matching tensors grow with it
MAX_GROUP = 64  # query heads per KV head: M = BQ * next_pow2(G) dot rows with BQ >= 1
_TARGET_ROWS = 128  # dot rows (queries x heads) per tile when the group leaves room
_MAX_BQ = 16  # queries per tile
_TILE_CANDIDATES = 256  # BQ * CW: the union's bookkeeping ([chunk, BQ * CW]) and the ranking ([BQ, CW, CW])
_LOGITS = 8192  # fp32 logits of one leaf-level dot (BQ * GP rows x UL * CP keys): 32 registers a thread at 8 warps


def tiled_covers(group: int, beam: int, top_k: int, branching: int) -> Optional[str]:
    """None when the tiled walk takes the shape, else why it does not (for the fallback's log)."""
    cw = candidate_width(beam, top_k, branching)
    if cw > MAX_CW:
        return f"{cw} candidates per row (beam*top_k={beam * top_k}, branching={branching}) > {MAX_CW}"
    if group > MAX_GROUP:
        return f"{group} query heads per KV head > {MAX_GROUP}"
    return None


def tile_rows(group: int, block_q: Optional[int] = None, cw: int = 16) -> int:
    """Queries per tile: ``block_q`` (a power of two) or the most that keep ``BQ * next_pow2(G)``
    near 128 dot rows and ``BQ * cw`` (the tile's candidates) within 256, at most 16 queries;
    either way at least 16 dot rows (tl.dot's minimum)."""
    gp = _p2(group)
    if block_q is not None:
        if isinstance(block_q, bool) or not isinstance(block_q, int):
            raise TypeError(f"block_q must be None or an int (a power of two), got {type(block_q).__name__}")
        if block_q < 1 or block_q & (block_q - 1):
            raise ValueError(f"block_q must be None or a power of two >= 1, got {block_q}")
        return max(block_q, _p2(-(-16 // gp)))
    return max(_p2(-(-16 // gp)), min(_MAX_BQ, max(1, _TARGET_ROWS // gp), max(1, _TILE_CANDIDATES // cw)))


def leaf_chunk(rows: int, cp: int) -> int:
    """Leaves per leaf-level dot: the largest power of two whose ``rows x (leaves * cp)`` fp32
    logits stay within ``_LOGITS`` (at least 1)."""
    leaves = max(1, _LOGITS // (rows * cp))
    return 1 << (leaves.bit_length() - 1)


# --------------------------------------------------------------------------- per-row bookkeeping


@triton.jit
def _rows_children(kept, ok, ar_kp, ar_cw, BR: tl.constexpr, BRP: tl.constexpr):
    """``(parent id, parent kept)`` of every candidate slot ``[BQ, CW]`` (slot = parent * BRP + j)."""
    par = ar_cw // BRP
    hit = par[None, :, None] == ar_kp[None, None, :]  # [1, CW, KP]
    par_id = tl.sum(tl.where(hit, kept[:, None, :], 0), axis=2)
    par_ok = tl.sum(tl.where(hit, ok[:, None, :].to(tl.int32), 0), axis=2) > 0
    return par_id, par_ok


@triton.jit
def _union(cand, want, BQ: tl.constexpr, CW: tl.constexpr):
    """The tile's wanted candidates with those the previous row also wants dropped (consecutive
    queries share most candidates; an id wanted by two non-adjacent rows only is scored twice,
    which costs work, not correctness: see :func:`_take_matches`), flattened to ``[BQ * CW]``,
    with each entry's slot in the packed union and the union's size."""
    ar_q = tl.arange(0, BQ)
    up = (ar_q[:, None] - 1 == ar_q[None, :])[:, :, None]  # [BQ, BQ, 1]: row r picks row r - 1
    prev_cand = tl.sum(tl.where(up, cand[None, :, :], 0), axis=1)
    prev_want = tl.sum(tl.where(up, want[None, :, :].to(tl.int32), 0), axis=1) > 0
    seen = tl.sum(((prev_cand[:, None, :] == cand[:, :, None]) & prev_want[:, None, :]).to(tl.int32), axis=2) > 0
    first = tl.reshape(want & ~seen, (BQ * CW,))
    slot = tl.cumsum(first.to(tl.int32), axis=0) - 1
    return tl.reshape(cand, (BQ * CW,)), first, slot, tl.sum(first.to(tl.int32), axis=0)


@triton.jit
def _union_chunk(flat, first, slot, n_u, c0, U: tl.constexpr):
    """``(ids [U], ok [U])``: the union entries of slots ``c0 .. c0 + U - 1``."""
    ar_u = tl.arange(0, U)
    hit = first[None, :] & (slot[None, :] == (c0 + ar_u)[:, None])  # [U, BQ * CW]
    return tl.sum(tl.where(hit, flat[None, :], 0), axis=1), c0 + ar_u < n_u


@triton.jit
def _spread(ids, ok, R: tl.constexpr, U: tl.constexpr):
    """``ids [U]`` repeated ``R`` times each (``[U * R]``, entry ``u * R + j`` = ``ids[u]``)."""
    owner = tl.arange(0, U * R) // R
    hit = owner[:, None] == tl.arange(0, U)[None, :]
    return (
        tl.sum(tl.where(hit, ids[None, :], 0), axis=1),
        tl.sum(tl.where(hit, ok[None, :].to(tl.int32), 0), axis=1) > 0,
    )


@triton.jit
def _group_sum(per_head, BQ: tl.constexpr, GP: tl.constexpr, G: tl.constexpr, U: tl.constexpr):
    """``[BQ * GP, U]`` per-head scores -> ``[BQ, U]`` summed over the group's ``G`` heads."""
    x = tl.reshape(per_head, (BQ, GP, U))
    return tl.sum(tl.where((tl.arange(0, GP) < G)[None, :, None], x, 0.0), axis=1)


@triton.jit
def _take_matches(score, cand, ids, u_ok, s_u):
    """``score [BQ, CW]`` with the chunk's scores ``s_u [BQ, U]`` taken where a row's candidate
    is one of the chunk's ``ids`` (an id present twice in the union has the same score twice)."""
    match = (cand[:, :, None] == ids[None, None, :]) & u_ok[None, None, :]
    n = tl.sum(match.to(tl.int32), axis=2)
    # a mean, not a max: a NaN score stays NaN (ranked as the per-token walk ranks it)
    got = tl.sum(tl.where(match, s_u[:, None, :], 0.0), axis=2) / tl.maximum(n, 1).to(tl.float32)
    return tl.where(n > 0, got, score)


# --------------------------------------------------------------------------- union scoring


@triton.jit
def _q_tile(q_ptrs, q_mask, TO_FP32: tl.constexpr):
    """The tile's query rows, read again for every dot: held in registers across the walk they
    made it spill (sm_90, 4 warps: ~2 KB a thread); re-reads hit L1."""
    q = tl.load(q_ptrs, mask=q_mask, other=0.0)
    if TO_FP32:
        q = q.to(tl.float32)
    return q


@triton.jit
def _score_union_means(
    q_ptrs,
    q_mask,
    flat,
    first,
    slot,
    n_u,
    off,
    summ_base,
    stride_mt,
    offs_d,
    d_ok,
    cand,
    qk_scale,
    BQ: tl.constexpr,
    GP: tl.constexpr,
    G: tl.constexpr,
    CW: tl.constexpr,
    UN: tl.constexpr,
    SCORES: tl.constexpr,
    I64_ROWS: tl.constexpr,
):
    """PISA-1 (``mean``) at any level: ``q . summary(node) * scale``, UN union nodes per dot."""
    score = tl.full([BQ, CW], float("-inf"), dtype=tl.float32)
    c0 = 0
    while c0 < n_u:  # (while: the interpreter cannot range() over a runtime bound)
        ids, u_ok = _union_chunk(flat, first, slot, n_u, c0, UN)
        s_t = tl.load(
            summ_base + _row_offsets(off + ids, stride_mt, I64_ROWS)[None, :] + offs_d[:, None],
            mask=u_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        q_s = _scores_operand(_q_tile(q_ptrs, q_mask, True), SCORES)
        logit = _scores_dot(q_s, s_t, SCORES) * qk_scale  # [BQ*GP, UN]
        score = _take_matches(score, cand, ids, u_ok, _group_sum(logit, BQ, GP, G, UN))
        c0 += UN
    return score


@triton.jit
def _score_union_nodes(
    q_ptrs,
    q_mask,
    flat,
    first,
    slot,
    n_u,
    coff,
    n_ch,
    summ_base,
    nfv_base,
    stride_mt,
    offs_d,
    d_ok,
    cand,
    qk_scale,
    Nk,
    SCORE: tl.constexpr,
    BQ: tl.constexpr,
    GP: tl.constexpr,
    G: tl.constexpr,
    CW: tl.constexpr,
    UN: tl.constexpr,
    BR: tl.constexpr,
    BRP: tl.constexpr,
    SCORES: tl.constexpr,
    I64_ROWS: tl.constexpr,
):
    """Intermediate ``lse`` / ``mean_var``: over each union node's children that hold a valid key;
    the UN nodes' UN * BRP child summaries are the columns of one dot."""
    score = tl.full([BQ, CW], float("-inf"), dtype=tl.float32)
    jc = tl.arange(0, UN * BRP) % BRP
    c0 = 0
    while c0 < n_u:
        ids, u_ok = _union_chunk(flat, first, slot, n_u, c0, UN)
        own_id, own_ok = _spread(ids, u_ok, BRP, UN)
        child = own_id * BR + jc
        c_ok = own_ok & (jc < BR) & (child < n_ch)
        child = tl.where(c_ok, child, 0)
        c_ok = c_ok & (tl.load(nfv_base + coff + child, mask=c_ok, other=Nk) < Nk)
        s_t = tl.load(
            summ_base + _row_offsets(coff + child, stride_mt, I64_ROWS)[None, :] + offs_d[:, None],
            mask=c_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        q_s = _scores_operand(_q_tile(q_ptrs, q_mask, True), SCORES)
        logit = _scores_dot(q_s, s_t, SCORES) * qk_scale  # [BQ*GP, UN*BRP]
        per_head = _reduce(tl.reshape(logit, (BQ * GP, UN, BRP)), tl.reshape(c_ok, (UN, BRP))[None, :, :], SCORE)
        score = _take_matches(score, cand, ids, u_ok, _group_sum(per_head, BQ, GP, G, UN))
        c0 += UN
    return score


@triton.jit
def _score_union_leaves(
    q_ptrs,
    q_mask,
    flat,
    first,
    slot,
    n_u,
    k_base,
    stride_kn,
    kpm_base,
    offs_d,
    d_ok,
    cand,
    qk_scale,
    Nk,
    SCORE: tl.constexpr,
    HAS_KPM: tl.constexpr,
    IEEE_KEYS: tl.constexpr,
    BQ: tl.constexpr,
    GP: tl.constexpr,
    G: tl.constexpr,
    CW: tl.constexpr,
    UL: tl.constexpr,
    C: tl.constexpr,
    CP: tl.constexpr,
    I64_ROWS: tl.constexpr,
):
    """Leaf ``lse`` / ``mean_var``: exact over each union leaf's valid raw keys; UL leaves' keys
    (UL * CP columns) per dot, each key block loaded once for the whole tile."""
    score = tl.full([BQ, CW], float("-inf"), dtype=tl.float32)
    kc = tl.arange(0, UL * CP) % CP
    c0 = 0
    while c0 < n_u:
        ids, u_ok = _union_chunk(flat, first, slot, n_u, c0, UL)
        leaf, l_ok = _spread(ids, u_ok, CP, UL)
        pos = leaf * C + kc
        kok = l_ok & (kc < C) & (pos < Nk)
        pos = tl.where(kok, pos, 0)
        if HAS_KPM:
            kok = kok & (tl.load(kpm_base + pos, mask=kok, other=0) != 0)
        k_rows = k_base + _row_offsets(pos, stride_kn, I64_ROWS)[None, :]
        k_t = tl.load(k_rows + offs_d[:, None], mask=kok[None, :] & d_ok[:, None], other=0.0)
        if IEEE_KEYS:
            logit = tl.dot(_q_tile(q_ptrs, q_mask, True), k_t.to(tl.float32), input_precision="ieee") * qk_scale
        else:
            # exact 16-bit products, fp32 sums
            logit = tl.dot(_q_tile(q_ptrs, q_mask, False), k_t, out_dtype=tl.float32) * qk_scale
        per_head = _reduce(tl.reshape(logit, (BQ * GP, UL, CP)), tl.reshape(kok, (UL, CP))[None, :, :], SCORE)
        score = _take_matches(score, cand, ids, u_ok, _group_sum(per_head, BQ, GP, G, UL))
        c0 += UL
    return score


# --------------------------------------------------------------------------- the walk


@triton.jit
def _anc(leaf, span):
    """The ancestor id at a level of leaf span ``span`` (-1 stays -1)."""
    return tl.where(leaf >= 0, leaf // span, -1)


@triton.jit
def _pisa_select_tiled_kernel(  # noqa: C901, PLR0912, PLR0915
    q_ptr,
    k_ptr,
    kpm_ptr,
    summ_ptr,
    nfv_ptr,
    lvl_off_ptr,
    lvl_span_ptr,
    out_ptr,
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
    BQ: tl.constexpr,
    UN: tl.constexpr,
    UL: tl.constexpr,
    IEEE_KEYS: tl.constexpr,
    HAS_WINDOW: tl.constexpr = False,
    SCORES: tl.constexpr = "fp32",
    TRACE: tl.constexpr = False,
    I64_ROWS: tl.constexpr = True,
):
    # SCORES: the summary dots' arithmetic (triton_select_common.scores_mode); TRACE: every
    # level's kept nodes go to trace_ptr ([B*Hkv, Nq, N_LEVELS, KP], -1 where none), for the
    # tests' contract check (triton_trace)
    # HAS_WINDOW: each row walks inside its local window (SLIDING / CHUNK keys), as the per-token
    # walk does; the union's scores do not depend on the window, so the tile still shares them
    # Inductor types a Python float argument fp64 (Triton's JIT: fp32): keep the math in fp32 either way
    qk_scale = tl.cast(qk_scale, tl.float32)
    # 64-bit offsets: batch x head strides, and a query / key / node position times its row stride,
    # pass 2**31 elements at long contexts
    bh = tl.program_id(1).to(tl.int64)
    b = bh // HKV
    hkv = bh % HKV
    i = tl.program_id(0) * BQ + tl.arange(0, BQ)  # the tile's query rows
    row_ok = i < Nq
    p = i + Nk - Nq  # query positions (bottom-right aligned)
    if IS_CAUSAL:
        hz = p
    else:
        hz = tl.zeros([BQ], dtype=tl.int32) + (Nk - 1)
    offs_d = tl.arange(0, DP)
    d_ok = offs_d < D
    # dot rows r = query * GP + head: the tile's queries times the group's heads
    ar_r = tl.arange(0, BQ * GP)
    r_i = tl.program_id(0) * BQ + ar_r // GP
    r_ok = (ar_r % GP < G) & (r_i < Nq)
    q_rows = q_ptr + b * stride_qb + (hkv * G + ar_r % GP)[:, None] * stride_qh + r_i.to(tl.int64)[:, None] * stride_qn
    q_ptrs = q_rows + offs_d[None, :]
    q_mask = r_ok[:, None] & d_ok[None, :]
    summ_base = summ_ptr + b * stride_mb + hkv * stride_mh
    nfv_base = nfv_ptr + b * T
    k_base = k_ptr + b * stride_kb + hkv * stride_kh
    kpm_base = kpm_ptr + b * Nk

    n_leaves = tl.load(lvl_off_ptr + 1)
    cur_f, prev_f, sink_f, here, first_leaf = _forced_leaves(  # [BQ] each: the nodes' first keys read
        p, hz, n_leaves, nfv_base, Nk, SLIDING, CHUNK, C, FORCE_SINK, FORCE_PREV, True, HAS_WINDOW
    )

    ar_kp = tl.arange(0, KP)
    ar_cw = tl.arange(0, CW)
    j = ar_cw % BRP
    top = N_LEVELS - 1
    root_ok = (tl.load(nfv_base + tl.load(lvl_off_ptr + top)) <= hz) & row_ok
    kept = tl.zeros([BQ, KP], dtype=tl.int32)
    ok = (ar_kp[None, :] == 0) & root_ok[:, None]
    trace_rows = trace_ptr + bh * stride_tbh + i.to(tl.int64)[:, None] * stride_tn + ar_kp[None, :]
    if TRACE:
        tl.store(trace_rows + top * KP, tl.where(ok, kept, -1), mask=row_ok[:, None])
    for it in range(0, N_LEVELS - 1):
        lv = top - 1 - it
        off = tl.load(lvl_off_ptr + lv)
        n_lv = tl.load(lvl_off_ptr + lv + 1) - off
        span = tl.load(lvl_span_ptr + lv)
        par_id, par_ok = _rows_children(kept, ok, ar_kp, ar_cw, BR, BRP)
        cand = par_id * BR + j[None, :]
        valid = par_ok & (j < BR)[None, :] & (cand < n_lv)
        cand = tl.where(valid, cand, 0)
        valid = valid & (tl.load(nfv_base + off + cand, mask=valid, other=Nk) <= hz[:, None])
        if HAS_WINDOW:  # the node's last leaf is at or after the row's window's first one
            valid = valid & (cand >= _anc(first_leaf, span)[:, None])
        forced = (cand == _anc(cur_f, span)[:, None]) | (cand == _anc(prev_f, span)[:, None])
        forced = forced | (cand == _anc(sink_f, span)[:, None]) | (cand == _anc(here, span)[:, None])
        forced = forced & valid
        width = tl.where(lv > 0, WIDE, TOPK)  # nodes kept at this level
        need = tl.sum(valid.to(tl.int32), axis=1) > width  # [BQ]: rows that must score
        if tl.sum(need.to(tl.int32), axis=0) > 0:
            flat, first, slot, n_u = _union(cand, valid & ~forced & need[:, None], BQ, CW)
            if SCORE == 1:
                score = _score_union_means(
                    q_ptrs,
                    q_mask,
                    flat,
                    first,
                    slot,
                    n_u,
                    off,
                    summ_base,
                    stride_mt,
                    offs_d,
                    d_ok,
                    cand,
                    qk_scale,
                    BQ,
                    GP,
                    G,
                    CW,
                    UN,
                    SCORES,
                    I64_ROWS,
                )
            elif lv > 0:
                coff = tl.load(lvl_off_ptr + lv - 1)
                score = _score_union_nodes(
                    q_ptrs,
                    q_mask,
                    flat,
                    first,
                    slot,
                    n_u,
                    coff,
                    off - coff,
                    summ_base,
                    nfv_base,
                    stride_mt,
                    offs_d,
                    d_ok,
                    cand,
                    qk_scale,
                    Nk,
                    SCORE,
                    BQ,
                    GP,
                    G,
                    CW,
                    UN,
                    BR,
                    BRP,
                    SCORES,
                    I64_ROWS,
                )
            else:
                score = _score_union_leaves(
                    q_ptrs,
                    q_mask,
                    flat,
                    first,
                    slot,
                    n_u,
                    k_base,
                    stride_kn,
                    kpm_base,
                    offs_d,
                    d_ok,
                    cand,
                    qk_scale,
                    Nk,
                    SCORE,
                    HAS_KPM,
                    IEEE_KEYS,
                    BQ,
                    GP,
                    G,
                    CW,
                    UL,
                    C,
                    CP,
                    I64_ROWS,
                )
            keep = _rows_top_k_keep(valid, forced, score, ar_cw, width)
        else:
            keep = valid
        kept, ok = _rows_compact(cand, keep, ar_kp)
        if TRACE:
            tl.store(trace_rows + lv * KP, tl.where(ok, kept, -1), mask=row_ok[:, None])
    out = tl.where(ok, kept, -1)
    dst = out_ptr + b * stride_ob + hkv * stride_oh + i.to(tl.int64)[:, None] * stride_on + ar_kp[None, :]
    tl.store(dst, out, mask=row_ok[:, None] & (ar_kp[None, :] < TOPK))


@triton_op("sparseflow::pisa_select_tiled_fwd", mutates_args={})
def pisa_select_tiled_fwd(
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
    block_q: Optional[int] = None,
    sliding_window: int = PISAConfig.sliding_window,
    chunk_size: int = PISAConfig.chunk_size,
    scores: str = "fp32",
) -> torch.Tensor:
    """The per-token op's contract (``triton_select_per_token._pisa_select_fwd``) by query tiles of
    ``block_q`` queries (None: :func:`tile_rows`); ``warps`` None: :data:`DEFAULT_WARPS`;
    ``sliding_window`` / ``chunk_size``: the walk inside each query's local window; ``scores``:
    ``Tuning.pisa_scores``."""
    return tiled_walk(
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
        block_q,
        sliding_window,
        chunk_size,
        scores,
    )


def tiled_walk(
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
    block_q: Optional[int] = None,
    sliding_window: int = PISAConfig.sliding_window,
    chunk_size: int = PISAConfig.chunk_size,
    scores: str = "fp32",
    trace: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The body of the op :func:`pisa_select_tiled_fwd` (its arguments); ``trace``: None, or an
    int32 ``[B*Hkv, Nq, levels, KP]`` tensor (-1 filled) that receives every level's kept nodes
    (``triton_trace``, tests only: not an op argument)."""
    b, hq, n_q, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    out = torch.empty(b, hkv, n_q, top_k, dtype=torch.int32, device=q.device)
    if n_q == 0:
        return out
    cw = candidate_width(beam, top_k, branching)
    bq = tile_rows(g, block_q, cw)
    # as in the per-token walk: 16-bit products are exact in fp32; the interpreter's 16-bit dot is not
    ieee = q.dtype == torch.float32 or interpreting()
    meta = walk_meta(
        q, k, kpm, summ, lvl_span, is_causal, score, force_sink, force_previous, block_size, branching, top_k, beam
    )
    wrap_triton(_pisa_select_tiled_kernel)[(triton.cdiv(n_q, bq), b * hkv)](
        *walk_args(q, k, kpm, summ, nfv, lvl_off, lvl_span, out, scale),
        **trace_args(nfv, trace),
        **meta,
        GP=_p2(g),
        CW=cw,
        BQ=bq,
        UN=16,
        UL=leaf_chunk(bq * _p2(g), meta["CP"]),
        IEEE_KEYS=ieee,
        **window_args(sliding_window, chunk_size),
        SCORES=scores_mode(scores),
        TRACE=trace is not None,
        num_warps=DEFAULT_WARPS if warps is None else warps,
    )
    return out


@pisa_select_tiled_fwd.register_fake
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
    block_q=None,
    sliding_window=PISAConfig.sliding_window,
    chunk_size=PISAConfig.chunk_size,
    scores="fp32",
):
    return q.new_empty(q.shape[0], k.shape[1], q.shape[2], top_k, dtype=torch.int32)
