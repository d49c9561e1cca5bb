"""The scan PISA walk (``Tuning(pisa_walk="scan")``; ``"auto"`` on CUDA): the per-token walk's
selection in four stages, so that what the per-token walk loads once per query token is loaded
once per tile of queries (node summaries) or per leaf (raw keys).

1. ``_node_scan_kernel``: one program per (tile of ``BQ`` consecutive queries, batch x KV head)
   scores every node of every level the walk may score (levels wider than their kept width) for
   all the tile's queries at once: ``[BQ * G, D] x [D, nodes]`` dots of the queries with the
   fp32 summaries (near fp32 accuracy on the tensor cores: :func:`scan_dot`; with
   ``Tuning.pisa_scores`` "bf16" / "tf32" one dot of operands rounded to that format instead of
   the three-part fp32 emulation, the selection within its tolerance contract), the reference's
   per-node score (LSE or mean + var/2 over the children's logits, or the node's own logit for
   PISA-1) summed over the group's heads, written to a ``[B*Hkv, Nq, nodes]`` fp32 table. A node
   is scored only for queries it lies entirely before (others force it or drop it), so its
   children's visibility is whether they hold a valid key, the same for every query of the tile.
2. the walk (``triton_select_scan_walk.scan_walk_rows_kernel``, a few queries a program, or
   with more than ``ROWS_WALK_MAX_CANDIDATES`` candidates a level the per-token kernel,
   ``triton_select_per_token._pisa_select_kernel`` with ``PRE_SCORES`` and ``LEAF_OUT``) reads
   those scores instead of computing them and stops at the leaves, writing each query's leaf
   candidates (PISA-1, whose leaves are scored by their summaries too, walks per token to the
   selection).
3. the walk also counts each leaf's scored (query, leaf) pairs with atomics, giving every pair
   its rank in the leaf's segment; :func:`leaf_pair_index` turns the counts
   into chunks (two cumsums and a search, one launch on the device), :func:`pair_order` places each
   pair at its segment's start plus its rank, and ``_leaf_pairs_kernel`` scores them in chunks of
   one leaf: the leaf's raw keys loaded once, the chunk's query rows gathered, one
   ``[chunk * G, D] x [D, C]`` dot in the keys' 16-bit dtype (exact products), the exact LSE (or
   mean + var/2) per pair. With ``LAUNCH["pair_unit"] = "siblings"`` a pair is a query and a kept
   parent, whose children the walk writes to consecutive slots: one counter, one index slot and
   one query gather score all of them (:func:`pair_unit`).
4. ``_leaf_keep_kernel``: each query keeps its forced leaves plus its best-scoring others,
   ``top_k`` in total, as the per-token walk does.

A local window (``sliding_window`` / ``chunk_size``) is the walk's (stage 2, ``HAS_WINDOW``): it
writes only the candidates inside each query's window, which stages 3 and 4 read; the node scores
do not depend on the window, and stage 1 skips the nodes before every window of its tile.

Stages 1 and 3 pack a query's group of heads into consecutive dot rows and sum each query's
rows (``LAUNCH["heads"] = "packed"``), or run one dot a head over the queries' rows and sum the
heads in registers (``"loop"``: no gather, no padding, fewer registers); ``"auto"``, the
default, packs a power-of-two group (a reshape sums its rows) and loops over the others.

The table costs ``4 * Nq * nodes`` bytes per batch x KV head (``nodes`` about ``N / C``) and the
node scan grows as ``N**2``, so the scan serves short and middle lengths; :func:`scan_covers` says
where it applies.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from ...kernels._triton_env import interpreting
from ...kernels.pdl import pdl_launch, pdl_start
from .config import PISAConfig
from .triton_select_common import (
    _p2,
    _lse2_scaled,
    _reduce,
    _row_offsets,
    _rows_compact,
    _rows_top_k_keep,
    _scores_dot,
    _scores_operand,
    candidate_width,
    fast_log,
    fma_exps,
    log2_scale,
    _window_first_leaf,
    passes_int32,
    prefill_walk_table,
    scores_mode,
    trace_args,
    walk_args,
    walk_meta,
    window_args,
)
from .triton_select_per_token import _launch, _pisa_select_kernel

__all__ = [
    "scan_covers",
    "leaf_pairs_cover",
    "queries_per_program",
    "packed_rows",
    "dot_rows",
    "pair_unit",
    "leaf_pair_index",
    "pair_order",
    "pisa_select_scan_fwd",
    "scan_walk",
    "MAX_TABLE_BYTES",
    "LAUNCH",
]

# the node-score table's budget: 8K tokens x 3 KV heads x ~128 scored nodes is 12.6 MB
MAX_TABLE_BYTES = 1 << 30
# launch settings (a study may sweep them): dot rows of a node-scan tile and of a leaf-pair chunk
# (queries x the group's heads, packed: :func:`packed_rows`), rows of a keep tile (queries x the
# group padded to a power of two), the node scan's summary columns per dot,
# warps and dot precision (:func:`scan_dot`), the leaf scorer's warps, chunks per program and
# pipeline stages. Each is the fastest of those timed on an H200, or level with it: 128 rows beat
# 64 for node-scan tiles and leaf pairs, 4 warps beat 8 for the pairs; 32 columns beat 64 and 128,
# 8 warps tie 4 for the node scan; bf16x3 dots take half tf32x3's time; 4 chunks a program match
# the best of 1, 2, 8 and 16 at SmolLM2's 8K and 32K, and pipelining them gains nothing at 8K.
# The heads' layout (:func:`dot_rows`) is chosen by the instructions compiled for sm_90
LAUNCH = {
    "rows": 128,
    "keep_rows": 128,
    "pair_rows": 128,
    "scan_cols": 32,
    "scan_warps": 8,
    "leaf_warps": 4,
    "scan_dot": "bf16x3",
    "pair_chunks": 4,
    "pair_stages": 1,
    "pair_unit": "leaf",
    "heads": "auto",
}


def dot_rows(group: int, rows: int) -> Tuple[int, int, bool]:
    """``(queries, dot rows, head loop)`` of a node-scan tile or a leaf-pair chunk, by
    ``LAUNCH["heads"]``: ``"packed"``, the group's heads packed into about ``rows`` rows
    (:func:`packed_rows`, one dot, each query's rows summed by a reshape for a power-of-two group,
    else by a gather); ``"loop"``, one dot a head over the queries' rows (queries: ``rows / group``
    rounded up to a power of two, at least 16), summed in registers with no gather; ``"auto"``,
    packed for a power-of-two group, else the loop: compiled for sm_90, a gather of a group's
    rows costs more instructions a query than the loop's extra dots, and a wide power-of-two
    group (16 heads) makes the loop's dots the dearer (docs/results.md)."""
    choice = LAUNCH["heads"]
    if choice == "auto":
        choice = "packed" if group & (group - 1) == 0 else "loop"
    if choice == "packed":
        return (*packed_rows(group, rows), False)
    if choice == "loop":
        queries = max(16, _p2(-(-rows // group)))
        return queries, queries, True
    raise ValueError(f'LAUNCH["heads"] must be "auto", "packed" or "loop", got {choice!r}')


def pair_unit(branching: int) -> Tuple[int, int]:
    """``(leaves, candidate slots)`` one scored pair covers, by ``LAUNCH["pair_unit"]``:
    ``"leaf"``, one leaf (``(1, 1)``); ``"siblings"``, a kept parent's children, which the walk
    writes to consecutive slots (``(branching, next power of two)``). Siblings share the query
    gather, the pair index and the walk's counter; a sibling that is forced, dropped or absent for
    the query is scored too and never read."""
    choice = LAUNCH["pair_unit"]
    if choice == "leaf":
        return 1, 1
    if choice == "siblings":
        return branching, _p2(branching)
    raise ValueError(f'LAUNCH["pair_unit"] must be "leaf" or "siblings", got {choice!r}')


def scan_dot(dtype: torch.dtype, scores: str = "fp32") -> str:
    """The node scan's dot of the queries and the fp32 summaries. ``scores`` (``Tuning.pisa_scores``)
    "bf16" / "tf32": ONE dot of operands rounded to that format (``scores_mode``: a bf16 or tf32
    tensor-core dot, or its IEEE emulation interpreted). "fp32": near fp32 accuracy, IEEE fp32
    interpreted, else ``LAUNCH["scan_dot"]`` ("bf16x3" applies to bf16 queries only: fp16 ones
    are not exact in bf16; "tf32x3" for the others)."""
    if scores != "fp32":
        return scores_mode(scores)
    if interpreting():
        return "ieee"
    choice = LAUNCH["scan_dot"]
    if choice not in ("tf32x3", "bf16x3"):
        raise ValueError(f'LAUNCH["scan_dot"] must be "tf32x3" or "bf16x3", got {choice!r}')
    return choice if dtype == torch.bfloat16 else "tf32x3"


def queries_per_program(group: int, rows: int) -> int:
    """Queries of a keep or pair-order tile (a power of two: the tile is a ``tl.arange``): about
    ``rows`` rows of queries x the group's heads padded to a power of two, at least 16 rows."""
    gp = _p2(group)
    return max(_p2(-(-16 // gp)), rows // gp, 1)


def packed_rows(group: int, rows: int) -> Tuple[int, int]:
    """``(queries, dot rows)`` of a node-scan tile or a leaf-pair chunk whose dot rows are its
    queries' heads packed without padding (row ``i * group + g``: head ``g`` of query ``i``): as
    many queries as fill ``rows`` (a power of two, at least 16, tl.dot's minimum), at least one
    (a group of 3 heads fills 126 of 128 rows with 42 queries)."""
    rows = max(16, _p2(rows))
    queries = max(1, rows // group)
    return queries, max(rows, _p2(queries * group))


def leaf_pairs_cover(n_leaves: int, top_k: int, candidate_slots: int) -> Optional[str]:
    """None when stages 2-4 (the walk to the leaf candidates, the leaf pairs, the keep) take the
    call, else why not: a walk that keeps every leaf writes no candidate, and the pair index is
    int32. ``candidate_slots``: ``B * Hkv * Nq * CW``."""
    if n_leaves <= top_k:
        return f"{n_leaves} leaf blocks <= top_k={top_k}: no leaf is scored"
    if candidate_slots >= 2**31:
        return f"{candidate_slots} leaf candidate slots exceed the pair index's int32"
    return None


def scan_covers(n_leaves: int, top_k: int, table_bytes: int, candidate_slots: int) -> Optional[str]:
    """None when the scan walk takes the call, else why not (for the fallback's log): stages 2-4's
    rules (:func:`leaf_pairs_cover`) and the node-score table's budget."""
    why = leaf_pairs_cover(n_leaves, top_k, candidate_slots)
    if why is not None:
        return why
    if table_bytes > MAX_TABLE_BYTES:
        return f"its node-score table would take {table_bytes / 2**20:.0f} MiB (> {MAX_TABLE_BYTES >> 20} MiB)"
    return None


def table_shape(b: int, hkv: int, n_q: int, n_leaves: int, total_nodes: int, score: int) -> tuple:
    """``(rows, queries, columns, first column)`` of the node-score table: every node above the
    leaves (the leaves too for PISA-1, ``score == 1``, whose leaves are scored by their means)."""
    col0 = 0 if score == 1 else n_leaves
    return b * hkv, n_q, total_nodes - col0, col0


# --------------------------------------------------------------------------- stage 1


@triton.jit
def _bf16x3_parts(s):
    """``s`` (fp32) as three bf16 parts whose sum keeps about fp32's 24 bits."""
    hi = s.to(tl.bfloat16)
    rest = s - hi.to(tl.float32)
    mid = rest.to(tl.bfloat16)
    return hi, mid, (rest - mid.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _summary_dot(q, s_t, PREC: tl.constexpr):
    """``q @ s_t`` for fp32 summaries ``s_t`` near fp32 accuracy on the tensor cores. "bf16x3"
    (bf16 queries): each of the summaries' three bf16 parts dotted with the queries, whose bf16
    products are exact in the fp32 accumulator; half the time of "tf32x3" (Triton's three tf32
    dots, for other dtypes) on the H200. "ieee": the interpreter's. Any other ``PREC`` is a
    ``scores_mode`` ("bf16", "tf32" or their "_ieee" emulation): one dot of rounded operands
    (``Tuning.pisa_scores``; ``q`` already rounded by :func:`_dot_operand`)."""
    if PREC == "bf16x3":
        s_hi, s_mid, s_lo = _bf16x3_parts(s_t)
        acc = tl.dot(q, s_lo, out_dtype=tl.float32)  # the smallest part first
        acc = tl.dot(q, s_mid, acc, out_dtype=tl.float32)
        out = tl.dot(q, s_hi, acc, out_dtype=tl.float32)
    elif PREC == "tf32x3" or PREC == "ieee":
        out = tl.dot(q, s_t, input_precision=PREC)
    else:
        out = _scores_dot(q, s_t, PREC)
    return out


@triton.jit
def _sum_packed_heads(per_head, G: tl.constexpr, R: tl.constexpr, U: tl.constexpr, QP: tl.constexpr):
    """``[R, U]`` per-head scores in packed rows (row ``i * G + g``: head ``g`` of query ``i``)
    -> ``[QP, U]`` summed over each query's ``G`` heads in head order. Rows past the last whole
    query read a clipped row: the callers mask those queries out."""
    if QP * G == R:  # a power-of-two group fills the rows exactly: one reduction
        return tl.sum(tl.reshape(per_head, (QP, G, U)), axis=1)
    head0_row = tl.arange(0, QP)[:, None] * G + tl.zeros([QP, U], dtype=tl.int32)
    total = tl.gather(per_head, tl.minimum(head0_row, R - 1), 0)
    for g in tl.static_range(1, G):
        total += tl.gather(per_head, tl.minimum(head0_row + g, R - 1), 0)
    return total


@triton.jit
def _dot_rows_queries(
    q_ptr,
    row_q,
    q_ok,
    b,
    hkv,
    stride_qb,
    stride_qh,
    stride_qn,
    offs_d,
    D: tl.constexpr,
    G: tl.constexpr,
    R: tl.constexpr,
    HEAD_LOOP: tl.constexpr,
    PREC: tl.constexpr,
    I64_ROWS: tl.constexpr,
):
    """The queries' rows of the dots, a tuple: the ``G`` heads packed into one ``[R, DP]`` block
    (row ``i * G + g``: head ``g`` of query ``row_q[i * G + g]``), or with ``HEAD_LOOP`` one
    ``[R, DP]`` block a head (row ``i``: query ``row_q[i]``). ``q_ok`` masks the rows."""
    qs = ()
    if HEAD_LOOP:
        for g in tl.static_range(G):
            q = tl.load(
                q_ptr
                + b * stride_qb
                + (hkv * G + g) * stride_qh
                + _row_offsets(row_q, stride_qn, I64_ROWS)[:, None]
                + offs_d[None, :],
                mask=q_ok[:, None] & (offs_d < D)[None, :],
                other=0.0,
            )
            qs = qs + (_dot_operand(q, PREC),)
    else:
        q = tl.load(
            q_ptr
            + b * stride_qb
            + (hkv * G + tl.arange(0, R) % G)[:, None] * stride_qh
            + _row_offsets(row_q, stride_qn, I64_ROWS)[:, None]
            + offs_d[None, :],
            mask=q_ok[:, None] & (offs_d < D)[None, :],
            other=0.0,
        )
        qs = qs + (_dot_operand(q, PREC),)
    return qs


@triton.jit
def _dot_operand(x, PREC: tl.constexpr):
    """``x`` as :func:`_rows_dot` takes it: fp32 for the fp32 dots, as loaded for the 16-bit ones
    (bf16x3 and exact16 take 16-bit queries as they are), rounded for a ``scores_mode`` dot."""
    if PREC == "tf32x3" or PREC == "ieee":
        out = x.to(tl.float32)
    elif PREC == "bf16x3" or PREC == "exact16":
        out = x
    else:
        out = _scores_operand(x, PREC)
    return out


@triton.jit
def _rows_dot(q, k_t, PREC: tl.constexpr):
    """``q @ k_t`` in fp32: "exact16", two 16-bit operands (exact products); otherwise
    :func:`_summary_dot`'s precisions."""
    if PREC == "exact16":
        out = tl.dot(q, k_t, out_dtype=tl.float32)
    else:
        out = _summary_dot(q, k_t, PREC)
    return out


@triton.jit
def _group_scores(
    qs,
    k_t,
    okk,
    qk_scale,
    G: tl.constexpr,
    R: tl.constexpr,
    U: tl.constexpr,
    W: tl.constexpr,
    QP: tl.constexpr,
    SCORE: tl.constexpr,
    HEAD_LOOP: tl.constexpr,
    PREC: tl.constexpr,
    FAST_LOG: tl.constexpr = False,
    FMA_EXPS: tl.constexpr = 0,
):
    """``[QP, U]``: each query's score of ``U`` units of ``W`` columns of ``k_t`` (children's
    summaries or raw keys; ``okk [1, U, W]`` the valid ones), summed over the group's heads in
    head order: per-head dots then a sum in registers (``HEAD_LOOP``), or one dot over the packed
    rows then a gather of each query's rows (:func:`_sum_packed_heads`). ``W == 0``: PISA-1, the
    unit's own logit. ``FAST_LOG``, ``FMA_EXPS``: :func:`_lse2_scaled`'s."""
    if HEAD_LOOP:
        total = tl.zeros([QP, U], dtype=tl.float32)
        for g in tl.static_range(G):
            total += _head_scores(_rows_dot(qs[g], k_t, PREC), qk_scale, okk, R, U, W, SCORE, FAST_LOG, FMA_EXPS)
    else:
        per_head = _head_scores(_rows_dot(qs[0], k_t, PREC), qk_scale, okk, R, U, W, SCORE, FAST_LOG, FMA_EXPS)
        total = _sum_packed_heads(per_head, G, R, U, QP)
    return total


@triton.jit
def _head_scores(
    logit, qk_scale, okk, R: tl.constexpr, U: tl.constexpr, W: tl.constexpr, SCORE: tl.constexpr,
    FAST_LOG: tl.constexpr = False, FMA_EXPS: tl.constexpr = 0,
):  # fmt: skip
    """``[R, U]`` per-row scores of ``U`` units of ``W`` columns of unscaled logits (``W == 0``:
    the scaled logits themselves, PISA-1's); ``qk_scale`` from :func:`log2_scale`; ``FAST_LOG``,
    ``FMA_EXPS``: :func:`_lse2_scaled`'s."""
    if W == 0:
        out = logit * qk_scale
    elif SCORE == 0:
        out = _lse2_scaled(tl.reshape(logit, (R, U, W)), okk, qk_scale, FAST_LOG, FMA_EXPS)
    else:
        out = _reduce(tl.reshape(logit * qk_scale, (R, U, W)), okk, SCORE)
    return out


@triton.jit
def _node_scan_kernel(  # noqa: PLR0912, PLR0915
    q_ptr,
    summ_ptr,
    nfv_ptr,
    lvl_off_ptr,
    lvl_span_ptr,
    pre_ptr,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_mb,
    stride_mh,
    stride_mt,
    stride_pbh,
    stride_pn,
    Nq,
    Nk,
    T,
    HKV,
    pre_col0,
    qk_scale,
    SLIDING,
    CHUNK,
    N_LEVELS: tl.constexpr,
    HAS_KPM: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    SCORE: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    C: tl.constexpr,
    BR: tl.constexpr,
    BRP: tl.constexpr,
    TOPK: tl.constexpr,
    WIDE: tl.constexpr,
    BQ: tl.constexpr,
    BQP: tl.constexpr,
    R: tl.constexpr,
    NB: tl.constexpr,
    PREC: tl.constexpr,
    HEAD_LOOP: tl.constexpr = False,
    PDL: tl.constexpr = False,
    HAS_WINDOW: tl.constexpr = False,
    I64_ROWS: tl.constexpr = True,
    FAST_LOG: tl.constexpr = False,
):
    """Scores of every node the walk may score, for the tile's ``BQ`` queries, whose heads fill
    the ``R`` dot rows packed (:func:`packed_rows`), or one dot a head (``HEAD_LOOP``, ``R`` rows
    a query each; see the module doc). ``HAS_WINDOW``: the nodes wholly before the local window
    of the tile's first query (whose window starts first) are no candidate of any of its
    queries: they are not scored, and their columns are never read. ``FAST_LOG``: the LSE's log
    by the special function unit (a scan scoring in bf16 / tf32: a stated tolerance)."""
    pdl_start(PDL)
    qk_scale = tl.cast(qk_scale, tl.float32)
    tile = tl.program_id(0)
    if IS_CAUSAL:
        # causally a later tile scores more nodes (up to about twice an early one's work): the
        # heaviest start first, so the launch's last wave holds the lightest
        tile = tl.num_programs(0) - 1 - tile
    bh = tl.program_id(1).to(tl.int64)  # 64-bit offsets: batch x head strides pass 2**31 elements
    b = bh // HKV
    hkv = bh % HKV
    rows = tl.arange(0, R)
    offs_d = tl.arange(0, DP)
    if HEAD_LOOP:
        qi = tile * BQ + rows
        q_ok = (rows < BQ) & (qi < Nq)
    else:
        qi = tile * BQ + rows // G
        q_ok = (rows < BQ * G) & (qi < Nq)
    qs = _dot_rows_queries(
        q_ptr, qi, q_ok, b, hkv, stride_qb, stride_qh, stride_qn, offs_d, D, G, R, HEAD_LOOP, PREC, I64_ROWS
    )
    ar_t = tl.arange(0, BQP)
    t_ok = (ar_t < BQ) & (tile * BQ + ar_t < Nq)
    ar_nb = tl.arange(0, NB)
    # the tile's last query position bounds the nodes it can score (a scored node lies entirely
    # before its query: a node holding the query's position is forced, later ones are dropped)
    if IS_CAUSAL:
        hz = tl.minimum(tile * BQ + BQ, Nq) - 1 + Nk - Nq
    else:
        hz = Nk - 1
    summ_base = summ_ptr + b * stride_mb + hkv * stride_mh
    nfv_base = nfv_ptr + b * T
    pre_rows = pre_ptr + bh * stride_pbh + (tile * BQ + ar_t).to(tl.int64)[:, None] * stride_pn - pre_col0
    # window bounds never decrease with the position: the tile's first query's is the lowest
    first_leaf = _window_first_leaf(tile * BQ + Nk - Nq, SLIDING, CHUNK, C, HAS_WINDOW)
    for lv in range(0, N_LEVELS - 1):
        off = tl.load(lvl_off_ptr + lv)
        n_lv = tl.load(lvl_off_ptr + lv + 1) - off
        span = tl.load(lvl_span_ptr + lv).to(tl.int64)
        width = tl.where(lv > 0, WIDE, TOPK)
        n_hi = tl.minimum(n_lv, (tl.maximum(hz, 0) // (span * C)).to(tl.int32) + 1)
        todo = (n_lv > width) & (hz >= 0)
        if SCORE != 1:
            todo = todo & (lv > 0)  # the leaves are scored over their raw keys, in stage 3
        if todo:
            u0 = 0
            if HAS_WINDOW:
                u0 = (first_leaf // span).to(tl.int32)  # the first node the window reaches
            while u0 < n_hi:  # (while: the interpreter cannot range() over a runtime bound)
                u = u0 + ar_nb
                u_ok = u < n_hi
                if SCORE == 1:
                    # PISA-1: q . mean(node) * scale
                    s_t = tl.load(
                        summ_base + _row_offsets(off + u, stride_mt, I64_ROWS)[None, :] + offs_d[:, None],
                        mask=u_ok[None, :] & (offs_d < D)[:, None],
                        other=0.0,
                    )
                    score = _group_scores(qs, s_t, u_ok, qk_scale, G, R, NB, 0, BQP, SCORE, HEAD_LOOP, PREC)
                else:
                    coff = tl.load(lvl_off_ptr + lv - 1)
                    ar_ch = tl.arange(0, NB * BRP)
                    owner = u0 + ar_ch // BRP
                    jc = ar_ch % BRP
                    child = owner * BR + jc
                    in_lv = (jc < BR) & (owner < n_hi) & (child < off - coff)
                    child = tl.where(in_lv, child, 0)
                    # the summaries load whatever the children hold (an empty node's mean is 0), so
                    # that this load need not wait for the next one; a slot outside the level loads
                    # its first child (masked out of the scores below): a load without a row mask
                    # spares each 16-byte load its zeroing and predicate
                    s_t = tl.load(
                        summ_base + _row_offsets(coff + child, stride_mt, I64_ROWS)[None, :] + offs_d[:, None],
                        mask=(offs_d < D)[:, None],
                        other=0.0,
                    )
                    # a scored node's children are all before its query: visible iff they hold a valid key
                    if HAS_KPM:
                        c_ok = in_lv & (tl.load(nfv_base + coff + child, mask=in_lv, other=Nk) < Nk)
                    else:  # without key padding every node of a level holds a valid key
                        c_ok = in_lv
                    okc = tl.reshape(c_ok, (NB, BRP))[None, :, :]
                    score = _group_scores(qs, s_t, okc, qk_scale, G, R, NB, BRP, BQP, SCORE, HEAD_LOOP, PREC, FAST_LOG)
                tl.store(pre_rows + off + u[None, :], score, mask=t_ok[:, None] & u_ok[None, :])
                u0 += NB


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
    seg_end_ptr,
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
    n_units,
    n_segments,
    qk_scale,
    HAS_KPM: tl.constexpr,
    SCORE: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    C: tl.constexpr,
    CP: tl.constexpr,
    CW: tl.constexpr,
    UN: tl.constexpr,
    UP: tl.constexpr,
    QB: tl.constexpr,
    QBP: tl.constexpr,
    R: tl.constexpr,
    CHUNKS: tl.constexpr,
    STAGES: tl.constexpr,
    PREC: tl.constexpr,
    INTERP: tl.constexpr,
    HEAD_LOOP: tl.constexpr = False,
    PDL: tl.constexpr = False,
    FAST_LOG: tl.constexpr = False,
    I64_ROWS: tl.constexpr = True,
    FMA_EXPS: tl.constexpr = 0,
):
    """Program p scores up to ``CHUNKS`` chunks of ``QB`` (query, unit) pairs of one segment
    (batch x KV head, unit of ``UN`` sibling leaves: :func:`pair_unit`): the unit's keys loaded
    once, then per chunk its queries' heads gathered into the ``R`` dot rows packed
    (:func:`packed_rows`) and one dot, or one dot a head (``HEAD_LOOP``; the chunks' loads
    pipelined over ``STAGES``). Each pair's ``UN`` leaf scores are written from its unit's first
    candidate slot on (a sibling that is not scored for the query gets a score the keep never
    reads). ``order`` holds the flat slot index of every scored pair, grouped by segment;
    ``seg_end`` and ``chunk_end`` the segments' inclusive pair and program counts, ``prog_seg``
    each program's segment, ``n_segments`` past the last program's work. ``FAST_LOG``: the
    LSE's log by the special function unit (a walk scoring in bf16 / tf32: a stated tolerance);
    ``FMA_EXPS``: how many of each leaf's first keys take their exponentials on the FMA units
    (``fma_exps``)."""
    pdl_start(PDL)
    qk_scale = tl.cast(qk_scale, tl.float32)
    p = tl.program_id(0)
    sg = tl.load(prog_seg_ptr + p)
    if sg < n_segments:
        first_chunk = tl.load(chunk_end_ptr + sg - 1, mask=sg > 0, other=0)
        start = tl.load(seg_end_ptr + sg - 1, mask=sg > 0, other=0) + (p - first_chunk) * (QB * CHUNKS)
        stop = tl.minimum(tl.load(seg_end_ptr + sg), start + QB * CHUNKS)
        bh = (sg // n_units).to(tl.int64)  # 64-bit offsets: batch x head strides pass 2**31 elements
        unit = sg % n_units
        b = bh // HKV
        hkv = bh % HKV
        # the unit's keys first: their load depends on the segment only, not on the pair order
        offs_d = tl.arange(0, DP)
        ar_k = tl.arange(0, UP * CP)
        child = ar_k // CP
        offs_c = ar_k % CP
        pos = (unit * UN + child) * C + offs_c
        # a scored leaf lies before its queries' positions: all its valid keys are visible
        kok = (child < UN) & (offs_c < C) & (pos < Nk)
        if HAS_KPM:
            kok = kok & (tl.load(kpm_ptr + b * Nk + pos, mask=kok, other=0) != 0)
        k_t = tl.load(
            k_ptr + b * stride_kb + hkv * stride_kh + _row_offsets(pos, stride_kn, I64_ROWS)[None, :] + offs_d[:, None],
            mask=kok[None, :] & (offs_d < D)[:, None],
            other=0.0,
        )
        k_t = _dot_operand(k_t, PREC)
        row0 = (bh * Nq).to(tl.int32)  # the segment's first row of cand's [B*Hkv*Nq, CW] slots
        # every key of the unit valid (all but a segment's last unit, without key padding): a
        # constant mask, which compiles the LSE's masking out of the loop (a tenth of it)
        full = (tl.min(kok.to(tl.int32), axis=0) > 0) & (UP == UN and CP == C)
        if full:
            _score_pair_chunks(
                q_ptr, k_t, tl.full((1, UP, CP), True, tl.int1), order_ptr, score_ptr, start, stop, row0, b,
                hkv, stride_qb, stride_qh, stride_qn, qk_scale, offs_d, SCORE, G, D, CW, UN, UP, CP, QB, QBP, R,
                CHUNKS, STAGES, PREC, INTERP, HEAD_LOOP, FAST_LOG, I64_ROWS, FMA_EXPS,
            )  # fmt: skip
        else:
            _score_pair_chunks(
                q_ptr, k_t, tl.reshape(kok, (1, UP, CP)), order_ptr, score_ptr, start, stop, row0, b, hkv,
                stride_qb, stride_qh, stride_qn, qk_scale, offs_d, SCORE, G, D, CW, UN, UP, CP, QB, QBP, R, CHUNKS,
                STAGES, PREC, INTERP, HEAD_LOOP, FAST_LOG, I64_ROWS, FMA_EXPS,
            )  # fmt: skip


@triton.jit
def _score_pair_chunks(
    q_ptr, k_t, okk, order_ptr, score_ptr, start, stop, row0, b, hkv, stride_qb, stride_qh, stride_qn, qk_scale,
    offs_d,
    SCORE: tl.constexpr, G: tl.constexpr, D: tl.constexpr, CW: tl.constexpr, UN: tl.constexpr, UP: tl.constexpr,
    CP: tl.constexpr, QB: tl.constexpr, QBP: tl.constexpr, R: tl.constexpr, CHUNKS: tl.constexpr,
    STAGES: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr, HEAD_LOOP: tl.constexpr, FAST_LOG: tl.constexpr,
    I64_ROWS: tl.constexpr, FMA_EXPS: tl.constexpr,
):  # fmt: skip
    """:func:`_leaf_pairs_kernel`'s chunks ``[start, stop)`` of its segment's pairs, ``QB`` a
    chunk, against the unit's keys ``k_t`` (``okk [1, UP, CP]``: the valid ones): each pair's
    ``UN`` leaf scores stored from its slot on (the interpreter cannot range() over a runtime
    bound: it runs ``CHUNKS`` chunks, those past the segment's end masked out)."""
    ar_r = tl.arange(0, R)
    r_pair = ar_r if HEAD_LOOP else ar_r // G  # the row's pair in the chunk
    ar_e = tl.arange(0, QBP)
    ar_u = tl.arange(0, UP)
    every_row = tl.full([R], True, tl.int1)
    for c in tl.range(0, CHUNKS if INTERP else tl.cdiv(stop - start, QB), num_stages=STAGES):
        chunk_start = start + c * QB
        r_ok = (r_pair < QB) & (chunk_start + r_pair < stop)
        # the pair's slot in [B*Hkv, Nq, CW], read by each of its head rows (L1 serves the repeats),
        # less the segment's first row (a subtraction, not a division by Nq); a row past the
        # chunk reads query 0, whose scores are not stored: the queries' load needs no row mask
        r_row = tl.load(order_ptr + chunk_start + r_pair, mask=r_ok, other=row0 * CW) // CW - row0
        qs = _dot_rows_queries(
            q_ptr, r_row, every_row, b, hkv, stride_qb, stride_qh, stride_qn, offs_d, D, G, R, HEAD_LOOP, PREC,
            I64_ROWS,
        )  # fmt: skip
        s_e = _group_scores(qs, k_t, okk, qk_scale, G, R, UP, CP, QBP, SCORE, HEAD_LOOP, PREC, FAST_LOG, FMA_EXPS)
        e_ok = (ar_e < QB) & (chunk_start + ar_e < stop)
        flat = tl.load(order_ptr + chunk_start + ar_e, mask=e_ok, other=0)
        tl.store(score_ptr + flat[:, None] + ar_u[None, :], s_e, mask=e_ok[:, None] & (ar_u < UN)[None, :])


# most segments each program of the pair index holds in registers; above, torch
_PAIR_INDEX_MAX_SEGMENTS = 4096
_PAIR_INDEX_BLOCK = 1024  # programs of the leaf pairs a program of the index places


def leaf_pair_index(counts: torch.Tensor, slots: int, qb: int, chain: Optional[dict] = None):
    """The chunks of the scored (query, leaf) pairs, from the walk's per-segment pair counts
    (``counts [B*Hkv * n_leaves]``, segment = (batch x KV head, leaf)), on the device (no host
    sync): ``(seg_end, chunk_end, prog_seg)``, the inclusive pair and chunk counts per segment
    and each program's segment for :func:`_leaf_pairs_kernel`, whose grid is ``prog_seg``'s
    length (an upper bound on the chunks of ``qb`` pairs for ``slots`` candidate slots; programs
    past the last chunk hold the segment count and return at once). One Triton launch on a GPU
    and under the interpreter up to ``_PAIR_INDEX_MAX_SEGMENTS`` segments (torch takes about ten
    launches, a measurable share of a short layer's selection); :func:`leaf_pair_index_torch`
    otherwise. ``chain``: the launch arguments of a link of a PDL chain (:func:`pdl_launch`)."""
    n_seg = counts.numel()
    if not (counts.is_cuda or interpreting()) or n_seg > _PAIR_INDEX_MAX_SEGMENTS:
        return leaf_pair_index_torch(counts, slots, qb)
    seg_end = torch.empty(n_seg, dtype=torch.int32, device=counts.device)
    chunk_end = torch.empty_like(seg_end)
    prog_seg = torch.empty(slots // qb + n_seg, dtype=torch.int32, device=counts.device)
    wrap_triton(_pair_index_kernel)[(triton.cdiv(prog_seg.numel(), _PAIR_INDEX_BLOCK),)](
        counts,
        seg_end,
        chunk_end,
        prog_seg,
        n_seg,
        prog_seg.numel(),
        qb,
        SEG_P=_p2(n_seg, 16),
        LOG_SEG=_p2(n_seg, 16).bit_length() - 1,
        BLOCK=_PAIR_INDEX_BLOCK,
        num_warps=4,
        **(chain or {}),
    )
    return seg_end, chunk_end, prog_seg


def leaf_pair_index_torch(counts: torch.Tensor, slots: int, qb: int):
    """:func:`leaf_pair_index` in torch ops (two cumsums and a searchsorted)."""
    seg_end = torch.cumsum(counts, 0, dtype=torch.int32)
    chunk_end = torch.cumsum(torch.div(counts + (qb - 1), qb, rounding_mode="floor"), 0, dtype=torch.int32)
    bound = torch.arange(slots // qb + counts.numel(), device=counts.device, dtype=torch.int32)
    prog_seg = torch.searchsorted(chunk_end, bound, right=True, out_int32=True)
    return seg_end, chunk_end, prog_seg


@triton.jit
def _pair_index_kernel(
    counts_ptr,
    seg_end_ptr,
    chunk_end_ptr,
    prog_seg_ptr,
    n_segments,
    n_programs,
    QB,
    SEG_P: tl.constexpr,
    LOG_SEG: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """:func:`leaf_pair_index`, ``BLOCK`` leaf-pair programs a program: each program sums every
    segment's chunks in registers (a few thousand integers: cheaper than a second launch), the
    first also writes the two sums, and each finds the segment of its ``BLOCK`` programs, the
    number of segments whose chunks end at or before it (``searchsorted(right=True)``), by a
    binary search over the chunk ends (the blocks' searches run side by side, not one after
    another)."""
    pdl_start(PDL)
    ar = tl.arange(0, SEG_P)
    ok = ar < n_segments
    c = tl.load(counts_ptr + ar, mask=ok, other=0)
    ends = tl.cumsum((c + QB - 1) // QB, axis=0)
    first = tl.program_id(0) == 0
    tl.store(seg_end_ptr + ar, tl.cumsum(c, axis=0), mask=ok & first)
    tl.store(chunk_end_ptr + ar, ends, mask=ok & first)
    ends = tl.where(ok, ends, 2**31 - 1)  # past the last segment: after every program
    prog = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    below = tl.zeros([BLOCK], dtype=tl.int32)  # segments known to end at or before prog
    for i in tl.static_range(LOG_SEG + 1):
        probe = below + (SEG_P >> i)  # does the probe-th segment end at or before prog?
        end = tl.gather(ends, tl.minimum(probe, SEG_P) - 1, 0)
        below = tl.where((probe <= SEG_P) & (end <= prog), probe, below)
    tl.store(prog_seg_ptr + prog, below, mask=prog < n_programs)


@triton.jit
def _pair_order_kernel(
    cand_ptr,
    rank_ptr,
    seg_end_ptr,
    order_ptr,
    stride_cbh,
    stride_cn,
    Nq,
    n_leaves,
    TOPK: tl.constexpr,
    CW: tl.constexpr,
    BQ: tl.constexpr,
    UN: tl.constexpr,
    UP: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Every scored pair's flat candidate slot written at its place in ``order``: its segment's
    start plus the rank the walk gave it (``cand`` / ``rank``: ``[B*Hkv, Nq, CW]``, contiguous).
    A pair is a (query, unit of ``UN`` sibling leaves) whose ``UP`` candidate slots hold a scored
    leaf: one leaf (``UN == UP == 1``) or a parent's children (``BR``, ``BRP``); its slot is the
    unit's first, its segment the unit's (batch x KV head, leaf // UN)."""
    pdl_start(PDL)
    tile = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    cand, valid, forced, scored, rows = _tile_candidates(cand_ptr, bh, tile, stride_cbh, stride_cn, Nq, TOPK, BQ, CW)
    if UP > 1:
        scored = tl.max(tl.reshape(scored.to(tl.int32), (BQ, CW // UP, UP)), axis=2) > 0
        unit = tl.max(tl.reshape(tl.where(valid, cand // UN, 0), (BQ, CW // UP, UP)), axis=2)
    else:
        unit = cand
    n_units = tl.cdiv(n_leaves, UN)
    slot = bh * stride_cbh + rows[:, None] * stride_cn + (tl.arange(0, CW // UP) * UP)[None, :]
    rank = tl.load(rank_ptr + slot, mask=scored, other=0)
    sg = bh * n_units + unit
    start = tl.load(seg_end_ptr + sg - 1, mask=scored & (sg > 0), other=0)
    tl.store(order_ptr + start + rank, slot.to(tl.int32), mask=scored)


def pair_order(
    cand: torch.Tensor,
    rank: torch.Tensor,
    seg_end: torch.Tensor,
    top_k: int,
    n_leaves: int,
    bq: int,
    chain: Optional[dict] = None,
    unit: Tuple[int, int] = (1, 1),
):
    """``order [cand.numel() // unit[1]]``: the flat slots of the scored pairs grouped by segment
    (the first ``seg_end[-1]`` entries; the rest unwritten), by tiles of ``bq`` queries.
    ``unit``: ``(leaves, slots)`` a pair covers (:func:`pair_unit`). ``chain``: as for
    :func:`leaf_pair_index`."""
    rows, n_q, cw = cand.shape
    order = torch.empty(cand.numel() // unit[1], dtype=torch.int32, device=cand.device)
    wrap_triton(_pair_order_kernel)[(triton.cdiv(n_q, bq), rows)](
        cand,
        rank,
        seg_end,
        order,
        cand.stride(0),
        cand.stride(1),
        n_q,
        n_leaves,
        TOPK=top_k,
        CW=cw,
        BQ=bq,
        UN=unit[0],
        UP=unit[1],
        **(chain or {}),
    )
    return order


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
    PDL: tl.constexpr = False,
):
    """Each row of the tile keeps its forced leaves and its best-scoring others, TOPK in total
    (ties to the lower id), written ascending and -1 padded: the selection."""
    pdl_start(PDL)
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
    pdl: bool = False,
    sliding_window: int = PISAConfig.sliding_window,
    chunk_size: int = PISAConfig.chunk_size,
    scores: str = "fp32",
) -> torch.Tensor:
    return scan_walk(
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
        pdl,
        sliding_window,
        chunk_size,
        scores,
    )


def scan_walk(
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
    pdl: bool = False,
    sliding_window: int = PISAConfig.sliding_window,
    chunk_size: int = PISAConfig.chunk_size,
    scores: str = "fp32",
    trace: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The body of the op :func:`pisa_select_scan_fwd` (its arguments); ``trace``: None, or an
    int32 ``[B*Hkv, Nq, levels, KP]`` tensor (-1 filled) that receives the walk's kept nodes of
    every level above the leaves (``triton_trace``, tests only: not an op argument)."""
    b, hq, n_q, d = q.shape
    hkv = k.shape[1]
    out = torch.empty(b, hkv, n_q, top_k, dtype=torch.int32, device=q.device)
    if n_q == 0:
        return out
    n_leaves = max(1, -(-k.shape[2] // block_size))
    rows, _, cols, col0 = table_shape(b, hkv, n_q, n_leaves, summ.shape[2], score)
    pre = torch.empty(rows, n_q, cols, dtype=torch.float32, device=q.device)
    meta = walk_meta(
        q, k, kpm, summ, lvl_span, is_causal, score, force_sink, force_previous, block_size, branching, top_k, beam
    )
    chain = pdl_launch(q, pdl)
    window = window_args(sliding_window, chunk_size)
    scan_q, scan_rows, head_loop = dot_rows(hq // hkv, LAUNCH["rows"])
    wrap_triton(_node_scan_kernel)[(triton.cdiv(n_q, scan_q), b * hkv)](
        q,
        summ,
        nfv,
        lvl_off,
        lvl_span,
        pre,
        *q.stride()[:3],
        *summ.stride()[:3],
        pre.stride(0),
        pre.stride(1),
        n_q,
        k.shape[2],
        summ.shape[2],
        hkv,
        col0,
        log2_scale(scale, score),  # the LSE's exponentials in base 2
        **window,
        N_LEVELS=meta["N_LEVELS"],
        HAS_KPM=kpm is not None,
        IS_CAUSAL=is_causal,
        SCORE=score,
        G=hq // hkv,
        D=d,
        DP=meta["DP"],
        C=block_size,
        BR=branching,
        BRP=meta["BRP"],
        TOPK=top_k,
        WIDE=beam * top_k,
        BQ=scan_q,
        BQP=_p2(scan_q, 1),
        R=scan_rows,
        NB=max(1, LAUNCH["scan_cols"] // meta["BRP"]),
        PREC=scan_dot(q.dtype, scores),
        I64_ROWS=meta["I64_ROWS"],
        FAST_LOG=fast_log(scores),
        HEAD_LOOP=head_loop,
        num_warps=LAUNCH["scan_warps"],
        **chain,
    )
    walk = WalkCall(q, k, kpm, summ, nfv, lvl_off, lvl_span, out, scale, meta, chain, window)
    return walk_then_leaf_pairs(walk, (pre, col0), beam, None, scores, trace)


class WalkCall(NamedTuple):
    """What stages 2-4 take from the call: its tensors (``out``, the selection, written by the
    leaf keep, or by the walk itself when no leaf is scored by pairs), the scale, the walk's
    compile-time shape (``walk_meta``), the launch chain (``pdl_launch``) and the window's
    arguments (``window_args``)."""

    q: torch.Tensor
    k: torch.Tensor
    kpm: Optional[torch.Tensor]
    summ: torch.Tensor
    nfv: torch.Tensor
    lvl_off: torch.Tensor
    lvl_span: torch.Tensor
    out: torch.Tensor
    scale: float
    meta: dict
    chain: dict
    window: dict


def walk_then_leaf_pairs(
    call: WalkCall,
    table: Optional[Tuple[torch.Tensor, int]],
    beam: int,
    warps: Optional[int],
    scores: str,
    trace: Optional[torch.Tensor],
) -> torch.Tensor:
    """Stages 2-4: the walk down to each query's leaf candidates, then the scored (query, leaf)
    pairs a leaf at a time and each query's keep (PISA-1, whose leaves are scored by their
    summaries, has the per-token walk write the selection). ``table``: stage 1's ``(scores,
    first column)``, which the walk reads instead of scoring the nodes above the leaves (by rows
    of queries, ``triton_select_scan_walk``, up to ``ROWS_WALK_MAX_CANDIDATES`` candidates a
    level; else, and for PISA-1, per token with the candidate width's ``warps``; ``scores`` is
    the table's); None: the per-token walk
    scores them itself in ``scores``' arithmetic with ``warps`` (``Tuning.pisa_warps``), as the
    per-token walk does. Returns ``call.out``."""
    q, k, nfv, out, meta = call.q, call.k, call.nfv, call.out, call.meta
    b, _, n_q, _ = q.shape
    hkv = k.shape[1]
    top_k, score = meta["TOPK"], meta["SCORE"]
    n_leaves = max(1, -(-k.shape[2] // meta["C"]))
    rows = b * hkv
    cw = candidate_width(beam, top_k, meta["BR"])
    leaf_out = score != 1  # PISA-1 scores its leaves by their summaries: the walk writes the selection
    cand = torch.empty(rows, n_q, cw, dtype=torch.int32, device=q.device) if leaf_out else nfv
    unit = pair_unit(meta["BR"])
    n_units = -(-n_leaves // unit[0])
    # the walk's per-(batch x KV head, unit) counters of scored pairs, and each pair's rank in its segment
    counts = torch.zeros(rows * n_units if leaf_out else 0, dtype=torch.int32, device=q.device)
    rank = torch.empty_like(cand) if leaf_out else cand
    if table is not None and leaf_out and cw <= ROWS_WALK_MAX_CANDIDATES:
        _rows_walk(call, table, cand, counts, rank, cw, unit, trace)
    else:
        _token_walk(call, table, cand, counts, rank, cw, unit, warps, scores, trace)
    if leaf_out:
        _leaf_pairs_then_keep(call, cand, rank, counts, cw, unit, n_units, n_leaves, scores)
    return out


def _token_walk(call: WalkCall, table, cand, counts, rank, cw: int, unit, warps, scores: str, trace) -> None:
    """Stage 2 per token (``triton_select_per_token._pisa_select_kernel``): from stage 1's table,
    or scoring the nodes itself (``table`` None, in ``scores``' arithmetic on ``warps``); with
    PISA-1 (``cand`` is then ``call.nfv``, a placeholder) it writes the selection to ``call.out``."""
    q, k, kpm, summ, nfv, out, meta = call.q, call.k, call.kpm, call.summ, call.nfv, call.out, call.meta
    b, hq, n_q, _ = q.shape
    leaf_out = meta["SCORE"] != 1
    if table is None:
        # the walk scores the nodes itself, from the summaries as prefill_walk_table lays them out
        pre, col0 = nfv, 0  # nfv: a placeholder, never read
        walk_summ, walk_scores = prefill_walk_table(summ, scores, q.dtype)
        meta = {**meta, "I64_ROWS": meta["I64_ROWS"] or passes_int32(walk_summ)}
    else:
        (pre, col0), walk_summ, walk_scores, warps = table, summ, "fp32", None
    warps, _ = _launch(cw, warps)
    args = walk_args(q, k, kpm, walk_summ, nfv, call.lvl_off, call.lvl_span, out, call.scale)
    wrap_triton(_pisa_select_kernel)[(n_q, b * k.shape[1])](
        *args[:8],
        nfv,  # no device length
        *args[8:],
        pre_ptr=pre,
        cand_ptr=cand,
        stride_pbh=pre.stride(0) if table is not None else 0,
        stride_pn=pre.stride(1) if table is not None else 0,
        pre_col0=col0,
        stride_cbh=cand.stride(0) if leaf_out else 0,
        stride_cn=cand.stride(1) if leaf_out else 0,
        count_ptr=counts if leaf_out else cand,
        rank_ptr=rank,
        **trace_args(nfv, trace),
        **meta,
        GP=_p2(hq // k.shape[1], 16),
        CW=cw,
        LC=1,  # LC and IEEE_KEYS set the leaf scoring, which LEAF_OUT leaves to stage 3
        IEEE_KEYS=False,
        HAS_LEN=False,
        PRE_SCORES=table is not None,
        LEAF_OUT=leaf_out,
        PAIR_RANKS=leaf_out,
        PAIR_SIBLINGS=unit[1] > 1,
        SCORES=walk_scores,
        SUMM_ROUNDED=walk_scores == "tf32",
        **call.window,
        TRACE=trace is not None,
        num_warps=warps,
        **call.chain,
    )


# widest candidate rows the rows walk takes (K=8 with branching 2); wider ones (K=32, or a beam)
# walk per token on 4 warps: on one warp the rows walk's [rows, KP, CW] compaction spills
ROWS_WALK_MAX_CANDIDATES = 16


# the walk's shape and rules (walk_meta) the rows walk takes
_ROWS_WALK_META = (
    "N_LEVELS",
    "HAS_KPM",
    "IS_CAUSAL",
    "FORCE_SINK",
    "FORCE_PREV",
    "C",
    "BR",
    "BRP",
    "TOPK",
    "WIDE",
    "KP",
)


def _rows_walk(call: WalkCall, table: Tuple[torch.Tensor, int], cand, counts, rank, cw: int, unit, trace) -> None:
    """Stage 2 from stage 1's table (``(scores, first column)``), ``WALK_QUERIES`` queries a program
    (``triton_select_scan_walk``): each query's leaf candidates into ``cand`` and its scored pairs'
    ranks into ``rank``, counted in ``counts``."""
    from .triton_select_scan_walk import WALK_QUERIES, scan_walk_rows_kernel

    pre, col0 = table
    q, k, meta = call.q, call.k, call.meta
    b, _, n_q, _ = q.shape
    wrap_triton(scan_walk_rows_kernel)[(triton.cdiv(n_q, WALK_QUERIES), b * k.shape[1])](
        pre,
        call.nfv,
        call.lvl_off,
        call.lvl_span,
        cand,
        counts,
        rank,
        **trace_args(call.nfv, trace),
        stride_pbh=pre.stride(0),
        stride_pn=pre.stride(1),
        pre_col0=col0,
        stride_cbh=cand.stride(0),
        stride_cn=cand.stride(1),
        Nq=n_q,
        Nk=k.shape[2],
        T=call.summ.shape[2],
        HKV=k.shape[1],
        **call.window,
        **{key: meta[key] for key in _ROWS_WALK_META},
        CW=cw,
        QR=WALK_QUERIES,
        PAIR_SIBLINGS=unit[1] > 1,
        TRACE=trace is not None,
        num_warps=1,
        **call.chain,
    )


def _leaf_pairs_then_keep(
    call: WalkCall, cand, rank, counts, cw: int, unit, n_units: int, n_leaves: int, scores: str
) -> None:
    """Stages 3 and 4: the walk's scored (query, leaf) pairs grouped by leaf and scored a leaf's
    keys at a time, then each query's forced leaves plus its best-scoring others into
    ``call.out``. ``scores``: ``Tuning.pisa_scores``; a lower precision than fp32 (a stated
    tolerance) takes the LSE's log by the special function unit on the GPU, and with 16-bit
    queries an eighth of its exponentials on the FMA units (``fma_exps``)."""
    q, k, kpm, nfv, out, meta, chain = call.q, call.k, call.kpm, call.nfv, call.out, call.meta, call.chain
    b, hq, n_q, d = q.shape
    hkv = k.shape[1]
    group, top_k, rows = hq // hkv, meta["TOPK"], b * hkv
    ieee = q.dtype == torch.float32 or interpreting()
    _, _, head_loop = dot_rows(group, LAUNCH["rows"])
    leaf_scores = torch.empty(rows, n_q, cw, dtype=torch.float32, device=q.device)
    qb, pair_rows, _ = dot_rows(group, LAUNCH["pair_rows"])
    n_pairs = cand.numel() // unit[1]  # at most one pair a unit's slots
    seg_end, chunk_end, prog_seg = leaf_pair_index(counts, n_pairs, qb * LAUNCH["pair_chunks"], chain)
    # the keep's and the pair order's tiles: queries padded to a power of two of rows
    bq = queries_per_program(group, LAUNCH["keep_rows"])
    tiles = (triton.cdiv(n_q, bq), b * hkv)
    order = pair_order(cand, rank, seg_end, top_k, n_leaves, bq, chain, unit)
    wrap_triton(_leaf_pairs_kernel)[(prog_seg.numel(),)](
        q,
        k,
        kpm if kpm is not None else nfv,
        order,
        seg_end,
        chunk_end,
        prog_seg,
        leaf_scores,
        *q.stride()[:3],
        *k.stride()[:3],
        n_q,
        k.shape[2],
        hkv,
        n_units,
        rows * n_units,
        log2_scale(call.scale, meta["SCORE"]),
        HAS_KPM=kpm is not None,
        SCORE=meta["SCORE"],
        G=group,
        D=d,
        DP=meta["DP"],
        C=meta["C"],
        CP=meta["CP"],
        CW=cw,
        UN=unit[0],
        UP=unit[1],
        QB=qb,
        QBP=_p2(qb, 1),
        R=pair_rows,
        CHUNKS=LAUNCH["pair_chunks"],
        STAGES=LAUNCH["pair_stages"],
        PREC="ieee" if ieee else "exact16",
        INTERP=interpreting(),
        HEAD_LOOP=head_loop,
        FAST_LOG=fast_log(scores),
        I64_ROWS=meta["I64_ROWS"],
        FMA_EXPS=fma_exps(meta["CP"], scores, q.dtype),
        num_warps=LAUNCH["leaf_warps"],
        **chain,
    )
    wrap_triton(_leaf_keep_kernel)[tiles](
        cand,
        leaf_scores,
        out,
        cand.stride(0),
        cand.stride(1),
        *out.stride()[:3],
        n_q,
        hkv,
        TOPK=top_k,
        KP=meta["KP"],
        CW=cw,
        BQ=bq,
        num_warps=8,  # its [rows, CW, CW] rank compare: at 4 warps, 110 registers a thread
        **chain,
    )


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
    pdl=False,
    sliding_window=PISAConfig.sliding_window,
    chunk_size=PISAConfig.chunk_size,
    scores="fp32",
):
    return q.new_empty(q.shape[0], k.shape[1], q.shape[2], top_k, dtype=torch.int32)
