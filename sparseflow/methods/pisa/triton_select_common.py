"""What the PISA selection's walks share: the per-token walk (``triton_select_per_token``), the
tiled walk (``triton_select_tiled``) and the scan walk (``triton_select_scan``, whose middle
stage walks rows of queries, ``triton_select_scan_walk``, or the per-token kernel). The score
codes and row widths, the per-node score reductions, the per-row bookkeeping of the walks over tiles of queries, the kernel arguments
the per-token and the tiled walk take alike, and the rounded operands of the summary dots
(``Tuning.pisa_scores``: :func:`scores_mode`, :func:`_round_bits`, :func:`_scores_operand`,
:func:`_scores_dot`).

The selection's modules import one way: ``triton_select`` (the pyramid and the choice of walk)
above the walks, the walks above this module; of each other's, a walk imports only the per-token
kernel and its launch settings, which the scan runs. Imported lazily; this module imports Triton.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ...kernels._triton_env import interpreting
from ...kernels.token_sparse_triton import _window_lo

__all__ = [
    "SCORE_CODES",
    "LOG2E",
    "kept_slots",
    "candidate_width",
    "log2_scale",
    "walk_args",
    "walk_meta",
    "window_args",
    "rounded_summaries",
    "fast_log",
    "fma_exps",
    "summary_parts",
    "prefill_walk_table",
    "passes_int32",
    "scores_mode",
    "trace_args",
]


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


# --------------------------------------------------------------------------- node scores


LOG2E = 1.4426950408889634  # log2(e): a logit times it is in base-2 units
_LN2 = tl.constexpr(0.6931471805599453)  # a kernel reads only constexpr globals
_LOG2E = tl.constexpr(LOG2E)


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
def _lse2_scaled(logit, okk, scale, FAST_LOG: tl.constexpr = False, FMA_EXPS: tl.constexpr = 0):
    """:func:`_reduce`'s base-2 LSE (in natural units) of ``logit * scale`` (``scale > 0``, from
    :func:`log2_scale`) over the entries where ``okk``, from the unscaled logits: the scale
    multiplies the maxima only and joins each logit's subtraction in one fused multiply-add.
    ``FAST_LOG`` (GPU only): the log by the special function unit (:func:`_log2_approx`).
    ``FMA_EXPS``: the first ``FMA_EXPS`` entries of each unit take their exponential by
    :func:`_exp2_fma` (see :func:`fma_exps`), the rest by the special function unit."""
    masked = tl.where(okk, logit, float("-inf"))
    mx = tl.max(masked, axis=2) * scale
    mx_s = tl.where(mx == float("-inf"), 0.0, mx)
    shifted = tl.fma(masked, scale, -mx_s[:, :, None])
    if FMA_EXPS > 0:
        # a column's side is known at compile time where each register holds fixed columns
        # (the tensor cores' accumulator layout): the other side is never computed
        col = tl.arange(0, logit.shape[2])[None, None, :]
        by_fma = tl.where(okk, _exp2_fma(shifted), 0.0)  # clamped below: not 0 at -inf
        total = tl.sum(tl.where(col < FMA_EXPS, by_fma, tl.exp2(shifted)), axis=2)
    else:
        total = tl.sum(tl.exp2(shifted), axis=2)
    if FAST_LOG:
        out = (mx_s + _log2_approx(total)) * _LN2
    else:
        out = (mx_s + tl.log2(total)) * _LN2
    return out


@triton.jit
def _exp2_fma(x):
    """``2**x`` on the FMA units, not the special function unit, for the LSE's shifted logits
    (``x <= 0``, or a rounding above): ``x`` split into its nearest integer ``j`` (the
    round-to-nearest of adding ``1.5 * 2**23``, whose low bits then hold ``j``) and ``f`` in
    ``[-1/2, 1/2]``; ``2**f`` by a degree-5 polynomial (a minimax fit of the relative error with
    the constant term 1, rounded to fp32); times ``2**j`` built in the exponent bits. Relative
    error at most ``1.72e-7`` with fused multiply-adds (2.04 ulp; exact at the integers;
    test_pisa_walk_precision.py checks ``2**-22``, the special function unit's). ``x`` below
    -125 gives ``2**-125`` (the exponent's floor), which the LSE's largest term, 1, absorbs;
    NaN gives NaN, as ``tl.exp2`` does; ``x >= 128`` is outside its range."""
    x = tl.maximum(x, -125.0, propagate_nan=tl.PropagateNan.ALL)
    t = x + 12582912.0
    f = x - (t - 12582912.0)
    p = tl.fma(0.001326472731307149, f, 0.009671512991189957)
    p = tl.fma(p, f, 0.05550733581185341)
    p = tl.fma(p, f, 0.24022242426872253)
    p = tl.fma(p, f, 0.6931470036506653)
    p = tl.fma(p, f, 1.0)
    # t's low bits hold j: shifted into the exponent field they give 2**j (j + 127 >= 2)
    scale = ((t.to(tl.int32, bitcast=True) << 23) + 0x3F800000).to(tl.float32, bitcast=True)
    return p * scale  # a product, so a NaN in p stays NaN


@triton.jit
def _log2_approx(x):
    """``log2(x)`` by the special function unit (``lg2.approx.ftz.f32``: absolute error about
    ``2**-22`` over the LSE's sums, which lie in ``[1, J]``, or are 0 where no entry is valid:
    -inf, as ``tl.log2`` gives; ``tolerance`` allows 4 ulp of each logit's scale). Triton's
    ``tl.log2`` is the precise library log, a dozen fused multiply-adds an element. The CPU
    interpreter cannot run PTX: its walks take ``tl.log2``."""
    return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


# --------------------------------------------------------------------------- score precision


def scores_mode(scores: str) -> str:
    """The ``SCORES`` constexpr of the walks' summary dots for ``Tuning.pisa_scores``: ``"fp32"``
    (IEEE fp32 dots, the reference's arithmetic), ``"bf16"`` / ``"tf32"`` on a GPU (both operands
    rounded to nearest, ties to even, by :func:`_round_bits`, then one bf16 or tf32 tensor-core dot
    with fp32 accumulation). Under the interpreter, whose 16-bit and tf32 dots are not trusted,
    ``"bf16_ieee"`` / ``"tf32_ieee"``: the same rounded operands in an IEEE fp32 dot (their
    products are exact in fp32, so only the summation order differs from the GPU's)."""
    if scores not in ("fp32", "bf16", "tf32"):
        raise ValueError(f"pisa_scores must be one of ['fp32', 'bf16', 'tf32'], got {scores!r}")
    return scores + "_ieee" if scores != "fp32" and interpreting() else scores


def fma_exps(width: int, scores: str, dtype: torch.dtype) -> int:
    """``FMA_EXPS`` of a leaf-pairs LSE of ``width`` keys a unit for ``Tuning.pisa_scores`` =
    ``scores`` and queries of ``dtype``: an eighth of the exponentials by :func:`_exp2_fma`,
    below fp32 (a stated tolerance) with 16-bit queries (tensor-core dots), else none. Hopper's
    special function unit issues a warp's exponentials over 8 cycles, and the leaf pairs' loop
    (64 a thread in 417 instructions, compiled for sm_90) waits on it; the polynomial costs
    about 9 instructions, so an eighth balances the two. Widths under 64 would split columns
    that one register holds for some threads and not others: none."""
    if scores == "fp32" or dtype == torch.float32 or width < 64:
        return 0
    return width // 8


def fast_log(scores: str) -> bool:
    """Whether a kernel scoring for ``Tuning.pisa_scores`` = ``scores`` takes its LSE's log by
    the special function unit (``FAST_LOG``): below fp32 (a stated tolerance), on a GPU (the
    interpreter cannot run PTX)."""
    return scores != "fp32" and not interpreting()


def walk_summaries(summ: torch.Tensor, scores: str) -> torch.Tensor:
    """The node summaries a walk reads for ``Tuning.pisa_scores`` = ``scores``: bf16 for
    ``"bf16"`` (torch rounds to nearest, ties to even, as :func:`_round_bits` does, so the walk's
    dots see the same operands from half the bytes), else the fp32 table (which the leaf-pairs
    walk lays out again for its own dots: :func:`prefill_walk_table`)."""
    return summ.to(torch.bfloat16) if scores == "bf16" else summ


def summary_parts(summ: torch.Tensor) -> torch.Tensor:
    """``summ`` (fp32, ``[..., D]``) as three bf16 parts whose sum keeps about fp32's 24 bits,
    side by side in one row: ``[..., 3 * D]``, the largest first (the scan's ``_bf16x3_parts``
    split once a call). Dotted with bf16 queries each part's products are exact in fp32."""
    hi = summ.to(torch.bfloat16)
    rest = summ - hi.float()
    mid = rest.to(torch.bfloat16)
    lo = (rest - mid.float()).to(torch.bfloat16)
    return torch.cat([hi, mid, lo], dim=-1)


def prefill_walk_table(summ: torch.Tensor, scores: str, q_dtype: torch.dtype) -> Tuple[torch.Tensor, str]:
    """The table a prefill walk reads and its ``SCORES``: for fp32 scores with bf16 queries,
    :func:`summary_parts` and ``"bf16x3"``: three bf16 tensor-core dots a level, near fp32's
    accuracy (each part's products exact, fp32 sums), instead of IEEE fp32 dots on the CUDA cores,
    which spill (under the interpreter, whose bf16 dot is not the hardware's, ``"bf16x3_ieee"``:
    the same parts in fp32 dots); for tf32, :func:`rounded_summaries`; otherwise the table as it
    is. A decoding step keeps its cache's fp32 table (it would split the whole table each step)."""
    if scores == "fp32" and q_dtype == torch.bfloat16:
        return summary_parts(summ), "bf16x3_ieee" if interpreting() else "bf16x3"
    return rounded_summaries(summ, scores), scores_mode(scores)


def rounded_summaries(summ: torch.Tensor, scores: str) -> torch.Tensor:
    """The node summaries as a walk kernel launched with ``SUMM_ROUNDED = scores_mode(scores) ==
    "tf32"`` reads them: for tf32 on the GPU the table rounded once a call, before the launch, to
    nearest with ties to even (``tolerance.round_to_precision``, as :func:`_round_bits` does in a
    kernel), so that no level of the walk rounds its tile again (about eight integer operations
    an element, which made the tf32 walk the slower of the two lower precisions); otherwise
    ``summ`` as it is. For the prefill walks only: a decoding step would round its cache's whole
    table at every step."""
    if scores_mode(scores) != "tf32":
        return summ
    from .tolerance import round_to_precision

    return round_to_precision(summ.contiguous(), "tf32")


@triton.jit
def _round_bits(x, DROP: tl.constexpr):
    """``x`` (fp32) rounded to nearest, ties to even, to ``23 - DROP`` stored mantissa bits
    (``DROP`` 16: bf16, 13: tf32), as fp32: the fp32 bit pattern plus half the dropped bits'
    weight (less one unless the kept last bit is odd), the dropped bits cleared. Integer
    operations, so that the interpreter and every GPU round alike (Triton's tf32 dot truncates
    on sm_90), and as ``tolerance.round_to_precision`` does; inf and NaN keep their bits, a
    value past the format's largest rounds to inf."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + ((1 << (DROP - 1)) - 1) + ((bits >> DROP) & 1)) & ~((1 << DROP) - 1)
    finite = (bits & 0x7F800000) != 0x7F800000
    return tl.where(finite, rounded, bits).to(tl.float32, bitcast=True)


@triton.jit
def _scores_operand(x, SCORES: tl.constexpr):
    """An operand of :func:`_scores_dot` / :func:`_summary_scores` (``SCORES`` from
    :func:`scores_mode` or :func:`prefill_walk_table`): fp32 as is for ``"fp32"`` (and the
    queries of ``"bf16x3_ieee"``), bf16 queries as they are for ``"bf16x3"``, else rounded to the
    format (bf16 values as bf16 for the GPU's bf16 dot; a bf16 ``x``, such as
    :func:`walk_summaries`' table or bf16 queries, is one already and passes as is: rounding it
    again is the identity, at about eight integer operations an element)."""
    if SCORES == "bf16":
        if x.dtype == tl.bfloat16:
            out = x
        else:
            out = _round_bits(x.to(tl.float32), 16).to(tl.bfloat16)  # exact: a bf16 value
    elif SCORES == "fp32":
        out = x.to(tl.float32)
    elif SCORES == "bf16x3":  # bf16 queries (prefill_walk_table), exact in bf16
        out = x
    elif SCORES == "bf16x3_ieee":
        out = x.to(tl.float32)
    elif SCORES == "bf16_ieee":
        out = _round_bits(x.to(tl.float32), 16)
    else:  # "tf32", "tf32_ieee"
        out = _round_bits(x.to(tl.float32), 13)
    return out


@triton.jit
def _scores_dot(q_op, s, SCORES: tl.constexpr, S_ROUNDED: tl.constexpr = False):
    """``q_op @ s`` in fp32: ``q_op`` from :func:`_scores_operand`, ``s`` the summaries (fp32, or
    bf16 already rounded: :func:`walk_summaries`), rounded here the same way unless
    ``S_ROUNDED`` says they hold the format already (:func:`rounded_summaries`). ``"fp32"``: the
    IEEE fp32 dot of the reference's arithmetic."""
    if SCORES == "fp32":
        out = tl.dot(q_op, s, input_precision="ieee")
    elif SCORES == "bf16":
        out = tl.dot(q_op, _scores_operand(s, SCORES), out_dtype=tl.float32)
    elif SCORES == "tf32":
        if S_ROUNDED:
            out = tl.dot(q_op, s, input_precision="tf32")
        else:
            out = tl.dot(q_op, _scores_operand(s, SCORES), input_precision="tf32")
    else:  # the interpreter's: rounded operands, exact products, fp32 sums
        out = tl.dot(q_op, _scores_operand(s, SCORES), input_precision="ieee")
    return out


@triton.jit
def _summary_scores(q_s, rows, mask, offs_d, D: tl.constexpr, SCORES: tl.constexpr, S_ROUNDED: tl.constexpr):
    """``q_s @ s`` in fp32, ``s [DP, N]`` the summaries whose rows start at ``rows [1, N]``
    (pointers; ``mask [DP, N]``). ``"bf16x3"``: a row holds a summary's three bf16 parts D apart
    (:func:`summary_parts`), each dotted with the bf16 queries, the smallest first
    (``"bf16x3_ieee"``: the interpreter's, in IEEE fp32 dots); else :func:`_scores_dot` of the
    loaded tile."""
    ptrs = rows + offs_d[:, None]
    if SCORES == "bf16x3":
        out = tl.dot(q_s, tl.load(ptrs + 2 * D, mask=mask, other=0.0), out_dtype=tl.float32)
        out = tl.dot(q_s, tl.load(ptrs + D, mask=mask, other=0.0), out, out_dtype=tl.float32)
        out = tl.dot(q_s, tl.load(ptrs, mask=mask, other=0.0), out, out_dtype=tl.float32)
    elif SCORES == "bf16x3_ieee":
        out = tl.dot(q_s, tl.load(ptrs + 2 * D, mask=mask, other=0.0).to(tl.float32), input_precision="ieee")
        out = tl.dot(q_s, tl.load(ptrs + D, mask=mask, other=0.0).to(tl.float32), out, input_precision="ieee")
        out = tl.dot(q_s, tl.load(ptrs, mask=mask, other=0.0).to(tl.float32), out, input_precision="ieee")
    else:
        out = _scores_dot(q_s, tl.load(ptrs, mask=mask, other=0.0), SCORES, S_ROUNDED)
    return out


# --------------------------------------------------------------------------- per-row bookkeeping
# (the walks over tiles of queries: tiled and scan)


@triton.jit
def _rows_top_k_keep(valid, forced, score, ar_cw, width):
    """Per row of ``[BQ, CW]``: keep the forced entries and the best-scoring others, ``width`` in
    total, ties to the lower position (= lower node id). An entry is kept when fewer than
    ``width`` entries of its row rank above it (a ``[BQ, CW, CW]`` compare: no sort, whose
    interpreted form is slow and whose compiled form is no cheaper at these widths)."""
    big = 3.0e38
    key = tl.where(score != score, -big, tl.minimum(tl.maximum(score, -big), big))
    key = tl.where(forced, float("inf"), key)
    key = tl.where(valid, key, float("-inf"))
    mine = key[:, :, None]
    other = key[:, None, :]
    earlier = ar_cw[None, None, :] < ar_cw[None, :, None]
    above = (other > mine) | ((other == mine) & earlier)
    rank = tl.sum(above.to(tl.int32), axis=2)
    return valid & (rank < width)


@triton.jit
def _rows_compact(cand, keep, ar_kp):
    """Kept candidates of every row packed, ascending, into the first slots of ``[BQ, KP]``."""
    slot = tl.cumsum(keep.to(tl.int32), axis=1) - 1
    hit = keep[:, None, :] & (slot[:, None, :] == ar_kp[None, :, None])  # [BQ, KP, CW]
    ids = tl.sum(tl.where(hit, cand[:, None, :], 0), axis=2)
    return ids, ar_kp[None, :] < tl.sum(keep.to(tl.int32), axis=1)[:, None]


# --------------------------------------------------------------------------- walk kernel arguments


def passes_int32(t: torch.Tensor) -> bool:
    """Whether an element offset inside one (batch, head) slice of ``t`` (``[B, H, rows, D]``,
    any strides) can pass 2**31: the walks then take a row's offset in 64 bits (``I64_ROWS``)."""
    return (t.shape[2] - 1) * t.stride(2) + (t.shape[3] - 1) * t.stride(3) >= 2**31 - 1


@triton.jit
def _row_offsets(rows, stride, I64_ROWS: tl.constexpr):
    """``rows * stride``, the element offset of rows inside one (batch, head) slice, in 64 bits
    only where the slice passes 2**31 elements (``I64_ROWS``): a 64-bit product costs about six
    more instructions an element loaded, a tenth of a walk level's."""
    # (if/else, one return: Triton compiles the statements after a return in a constexpr branch)
    if I64_ROWS:
        out = rows.to(tl.int64) * stride
    else:
        out = rows * stride
    return out


def walk_args(q, k, kpm, summ, nfv, lvl_off, lvl_span, out, scale) -> tuple:
    """The positional arguments of the per-token and the tiled walk kernels (the same in both):
    pointers (``nfv`` stands in for an absent ``kpm``), strides, sizes and the scale."""
    ptrs = (q, k, kpm if kpm is not None else nfv, summ, nfv, lvl_off, lvl_span, out)
    strides = (*q.stride()[:3], *k.stride()[:3], *summ.stride()[:3], *out.stride()[:3])
    return (*ptrs, *strides, q.shape[2], k.shape[2], summ.shape[2], k.shape[1], scale)


def trace_args(placeholder: torch.Tensor, trace: Optional[torch.Tensor]) -> dict:
    """The kernel's trace arguments: ``trace`` (``[B*Hkv, Nq, levels, KP]`` int32) and its strides,
    or ``placeholder`` (never written: ``TRACE`` is off) and zeros."""
    if trace is None:
        return dict(trace_ptr=placeholder, stride_tbh=0, stride_tn=0)
    return dict(trace_ptr=trace, stride_tbh=trace.stride(0), stride_tn=trace.stride(1))


def window_args(sliding_window: int, chunk_size: int) -> dict:
    """The local window's kernel arguments, the same in every walk: its two sizes (runtime: one
    compiled kernel serves every window) and ``HAS_WINDOW``, which compiles the window's tests
    out of the unwindowed walks (they are instruction-bound)."""
    return dict(SLIDING=sliding_window, CHUNK=chunk_size, HAS_WINDOW=bool(sliding_window or chunk_size))


@triton.jit
def _window_first_leaf(p, SLIDING, CHUNK, C: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """The first leaf block of the local window of a query at position ``p``
    (``token_blocks.window_first_blocks``; 0 without a window): the walk's nodes wholly before it
    are no candidates of that query."""
    return _window_lo(p, SLIDING, CHUNK, HAS_WINDOW) // C


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
def _forced_leaves(p, hz, n_leaves, nfv_base, Nk, SLIDING, CHUNK, C: tl.constexpr, FORCE_SINK: tl.constexpr,
                   FORCE_PREV: tl.constexpr, LOADED: tl.constexpr, HAS_WINDOW: tl.constexpr):  # fmt: skip
    """The walks' forced leaves of queries at positions ``p`` (a scalar or a vector; reference:
    ``token_blocks.forced_leaf_blocks``), each -1 unless it holds a key at or before ``hz``:
    ``(current, previous, sink, the leaf holding p, the window's first leaf)``. With a local
    window a forced leaf before it is not forced (nor, through it, its ancestors); the current
    leaf is always inside."""
    cur = tl.where((p >= 0) & (p < n_leaves * C), p // C, -1)
    prev = tl.zeros_like(cur) - 1
    if FORCE_PREV:
        prev = tl.where(cur >= 1, cur - 1, -1)
    sink = tl.zeros_like(cur) - 1
    if FORCE_SINK:
        sink = tl.where(cur != 0, 0, -1)
        if FORCE_PREV:
            sink = tl.where(prev == 0, -1, sink)
    cur_f = tl.where((cur >= 0) & (_first_valid(nfv_base, 0, tl.maximum(cur, 0), 1, Nk, C, LOADED) <= hz), cur, -1)
    prev_f = tl.where((prev >= 0) & (_first_valid(nfv_base, 0, tl.maximum(prev, 0), 1, Nk, C, LOADED) <= hz), prev, -1)
    sink_f = tl.where((sink >= 0) & (_first_valid(nfv_base, 0, tl.maximum(sink, 0), 1, Nk, C, LOADED) <= hz), sink, -1)
    here = tl.where((p >= 0) & (p < Nk), p // C, -1)
    first_leaf = _window_first_leaf(p, SLIDING, CHUNK, C, HAS_WINDOW)
    if HAS_WINDOW:
        prev_f = tl.where(prev_f >= first_leaf, prev_f, -1)
        sink_f = tl.where(sink_f >= first_leaf, sink_f, -1)
    return cur_f, prev_f, sink_f, here, first_leaf


def walk_meta(
    q, k, kpm, summ, lvl_span, is_causal, score, force_sink, force_previous, block_size, branching, top_k, beam
) -> dict:
    """The compile-time arguments the two walk kernels share (the walk's shape and rules)."""
    d = q.shape[-1]
    return dict(
        I64_ROWS=any(passes_int32(t) for t in (q, k, summ)),
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
