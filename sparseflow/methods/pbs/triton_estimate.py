"""PBS-Attn strided block estimates in Triton: ``scoring="sampled_rows"`` and
``scoring="antidiagonal"`` (definitions: estimate.py's module docstring).

One pass of Q·K on tensor cores over the estimate's rows, never a ``[rows, N]`` score matrix:

* :func:`strided_estimate` -- one program per (tile of ``BLOCK_M`` consecutive estimate rows,
  batch * query head, span of key blocks: ``key_splits`` spans per tile, so that few long causal
  tiles do not leave the GPU waiting on the longest; :func:`default_key_splits`). A row is a
  sampled query row (``I*bs + t*s``) or a strided row (queries ``I*bs + r*s + s-1-t``,
  ``t < s``, against the strided key columns ``J*bs + c*s + t`` of the permuted keys: ``s``
  accumulated dots, the antidiagonal of each ``s x s`` tile, divided by its count of valid
  pairs). The program streams the permuted key
  blocks up to the tile's last candidate, masks per row (candidate region, key padding, slots
  past N) and writes, per row and key block, the block's log2-sum-exp2 of the row's logits
  (``lbm [B*HC, rows, nB]``, -inf where nothing is seen, the blocks past the tile's last
  candidate included; ``bs`` times smaller than the scores)
  and each row's log2-sum-exp2 over every candidate key (``lse [B*HC, rows]``; with several
  spans, ``_split_lse_kernel`` combines their partial row sums).
* :func:`_strided_prob_row` -- the block probabilities of one query block from those: the mean
  over its rows that see a candidate key (and, for sampled rows, are valid query rows: the
  reference's ``query_validity``) of ``exp2(lbm - lse)``. Used by ``triton_select``'s
  selection kernel (which then thresholds exactly as for ``scoring="mean"``) and by
  :func:`block_probabilities` (the reference's ``block_probabilities`` contract, for tests).

Under a local window (``sliding_window`` / ``chunk_size``) the estimate is the same per row and key
block; a row tile skips the segments that end before its earliest row's window (their blocks hold
no key inside any of its rows' windows), and :func:`_strided_prob_row` renormalises each row over
the candidate blocks inside the query block's window (``RENORM``), so the probabilities are the
reference's over those candidates.

The two launches are ``torch.library.triton_op`` custom ops, so ``torch.compile`` traces and
compiles them: ``sparseflow::pbs_strided_estimate`` (:func:`strided_estimate`) and
``sparseflow::pbs_strided_probs`` (:func:`block_probabilities`'s probabilities; the selection
kernel inlines :func:`_strided_prob_row` instead).

Rows are numbered per batch*head: row ``g`` belongs to query block ``g // RPB`` (RPB rows per
block: ``ceil(bs/s)`` sampled rows or ``bs/s`` strided rows), so a tile may span query blocks
and the short last block of a tile is just masked. Columns of one loop step: ``JB`` key blocks
of ``CPBP`` columns (``bs`` keys or ``bs/s`` strided columns, padded to a power of two).
Addresses are 64-bit; fp32 inputs use IEEE fp32 dots (the reference's fp32 matmul).

Per tile the key steps run in two loops: the interior ones (no padding, complete blocks, all
before the earliest row's own region: every (row, column) is a valid candidate pair) without
masks, then the rest masked. Cost: one Q·K pass, ``N^2 D / s`` multiply-adds per head for a
causal row (half of it for either scoring), i.e. ``1/(2s)`` of dense causal attention's FLOPs.
The sampled rows take one exp2 per (row, key) against a D-deep dot, so on Hopper they are bound by
the exponential unit about as much as by the tensor cores; the strided rows take one exp2 per
(row, strided column) against an ``s*D``-deep dot and are tensor-core bound.

Status: identical selections to the reference on the CPU interpreter
(tests/methods/pbs/test_pbs_triton_estimate.py) and on an H200 (benchmarks/check_pbs_estimate_cuda.py:
N = 4K and 16K, both scorings and GQA permutations, stride 8, threshold 0.9); compiled for sm_90
(tests/sm90_compile.py). The estimate alone takes 0.11-0.17 of cuDNN's dense causal attention at
8K-128K on an H200 (B=1, Hq=32, Hkv=8, D=128, bf16, stride 8): above the ``1/(2s)`` FLOP ratio
(0.0625).
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from .estimate import query_validity
from .reference_common import effective_lengths
from ...kernels._triton_env import interpreting
from ...kernels.launch_sizes import pow2_at_least, sm_count
from ...kernels.token_sparse_triton import _window_lo
from .config import PBSConfig
from .triton_gather import permute_kv

__all__ = [
    "strided_estimate",
    "block_probabilities",
    "estimate_plan",
    "rows_per_block",
    "pbs_strided_estimate",
    "pbs_strided_probs",
]

_LOG2E = 1.4426950408889634
_PAD_POS = tl.constexpr(2**31 - 1)  # triton_attention.PAD_POS: a padded slot in the key positions


def _default_tile() -> int:
    # estimate rows and key columns per tile (estimate_plan): smaller under the slow interpreter
    return 64 if interpreting() else 128


def rows_per_block(scoring: str, block_size: int, stride: int) -> int:
    """Estimate rows per query block: ``ceil(bs/s)`` sampled rows or ``bs/s`` strided rows."""
    if scoring == "sampled_rows":
        return -(-block_size // stride)
    return block_size // stride


def _check(scoring: str, block_size: int, stride) -> None:
    if scoring not in ("sampled_rows", "antidiagonal"):
        raise ValueError(f"scoring must be 'sampled_rows' or 'antidiagonal' here, got {scoring!r}")
    if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
        raise ValueError(f"antidiagonal_stride must be an int >= 1, got {stride!r}")
    if scoring == "antidiagonal" and block_size % stride:
        raise ValueError(f"antidiagonal_stride must divide block_size={block_size}, got {stride}")


@triton.jit
def _column_block(
    acc_s,
    ok,
    lbm_ptr,
    j0,
    m_run,
    l_run,
    NB,
    r_ok,
    BLOCK_M: tl.constexpr,
    JB: tl.constexpr,
    CPBP: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Per row and key block of one loop step: the block's log2-sum-exp2 of the masked logits
    ``acc_s [BLOCK_M, JB*CPBP]`` (log2 units), stored to ``lbm_ptr`` (row pointers) at blocks
    ``j0 .. j0+JB``; returns the rows' running max / sum of exp2 updated with them."""
    if MASKED:
        s = tl.where(ok, acc_s, float("-inf"))
    else:
        s = acc_s
    s3 = tl.reshape(s, [BLOCK_M, JB, CPBP])
    m_blk = tl.max(s3, 2)
    m_safe = tl.where(m_blk == float("-inf"), 0.0, m_blk)
    l_blk = tl.sum(tl.exp2(s3 - m_safe[:, :, None]), 2)
    lbm = tl.where(l_blk > 0.0, m_safe + tl.log2(tl.maximum(l_blk, 1.0e-30)), float("-inf"))
    jb = j0 + tl.arange(0, JB)
    tl.store(lbm_ptr[:, None] + jb[None, :], lbm, mask=r_ok[:, None] & (jb < NB)[None, :])
    m_new = tl.maximum(m_run, tl.max(lbm, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    l_run = l_run * tl.exp2(m_run - m_use) + tl.sum(tl.exp2(lbm - m_use[:, None]), 1)
    return m_new, l_run


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, INTERP: tl.constexpr):
    """``a · bᵀ`` fp32: IEEE fp32 for fp32 inputs (no TF32), tensor cores otherwise."""
    if INTERP:
        return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), input_precision="ieee")
    elif IEEE:
        return tl.dot(a, tl.trans(b), input_precision="ieee")
    else:
        return tl.dot(a, tl.trans(b))


@triton.jit
def _estimate_step(  # noqa: PLR0912
    j0,
    q,
    q_base,
    k_base,
    kpos_base,
    qv_base,
    rows,
    r_ok,
    region_q,
    n_seg,
    lbm_ptr,
    m_run,
    l_run,
    N,
    NB,
    qk_scale,
    segment_size,
    stride_qn,
    stride_kn,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BS: tl.constexpr,
    STRIDE: tl.constexpr,
    CPB: tl.constexpr,
    CPBP: tl.constexpr,
    JB: tl.constexpr,
    ANTI: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_PAD: tl.constexpr,
    EXACT_CNT: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Key blocks ``j0 .. j0+JB`` against the tile's rows (see the module docstring). Without
    ``MASKED`` every (row, column) of the step is a valid candidate pair (the caller's interior
    range): no masks are built."""
    ci = tl.arange(0, JB * CPBP)
    blk = j0 + ci // CPBP
    c = ci % CPBP
    c_in = (c < CPB) & (blk < NB)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    region_k = tl.minimum((blk * BS) // segment_size, n_seg)
    if IS_CAUSAL:
        cand = region_k[None, :] < region_q[:, None]
    else:
        cand = region_k[None, :] != region_q[:, None]
    if ANTI:
        acc = tl.zeros([BLOCK_M, JB * CPBP], dtype=tl.float32)
        if not EXACT_CNT:
            cnt = tl.zeros([BLOCK_M, JB * CPBP], dtype=tl.float32)
        for t in range(STRIDE):  # a K-loop of STRIDE head-dim slices (pipelined, not unrolled)
            qpos = rows.to(tl.int64) * STRIDE + (STRIDE - 1 - t)
            if HAS_PAD:
                qv = r_ok & (tl.load(qv_base + qpos, mask=r_ok, other=0) != 0)
            else:
                qv = r_ok & (qpos < N)
            qt = tl.load(
                q_base + qpos[:, None] * stride_qn + offs_d[None, :], mask=qv[:, None] & d_ok[None, :], other=0.0
            )
            slot = blk.to(tl.int64) * BS + c * STRIDE + t
            kv = c_in & (slot < N)
            if HAS_PAD:
                kv = kv & (tl.load(kpos_base + slot, mask=kv, other=_PAD_POS) != _PAD_POS)
            kt = tl.load(
                k_base + slot[:, None] * stride_kn + offs_d[None, :], mask=kv[:, None] & d_ok[None, :], other=0.0
            )
            acc += _dot(qt, kt, IEEE, INTERP)
            if not EXACT_CNT:
                cnt += (qv[:, None] & kv[None, :]).to(tl.float32)
        if EXACT_CNT:  # every query and key valid: STRIDE pairs per antidiagonal
            s = acc / STRIDE * qk_scale
            ok = cand & c_in[None, :] & r_ok[:, None]
        else:
            s = acc / tl.maximum(cnt, 1.0) * qk_scale
            ok = cand & (cnt > 0.0)
    else:
        slot = blk.to(tl.int64) * BS + c
        kv = c_in & (slot < N)
        kt = tl.load(k_base + slot[:, None] * stride_kn + offs_d[None, :], mask=kv[:, None] & d_ok[None, :], other=0.0)
        if HAS_PAD:
            kv = kv & (tl.load(kpos_base + slot, mask=kv, other=_PAD_POS) != _PAD_POS)
        s = _dot(q, kt, IEEE, INTERP) * qk_scale
        ok = cand & kv[None, :] & r_ok[:, None]
    return _column_block(s, ok, lbm_ptr, j0, m_run, l_run, NB, r_ok, BLOCK_M, JB, CPBP, MASKED)


@triton.jit
def _estimate_loop(
    j_lo,
    j_hi,
    q,
    q_base,
    k_base,
    kpos_base,
    qv_base,
    rows,
    r_ok,
    region_q,
    n_seg,
    lbm_ptr,
    m_run,
    l_run,
    N,
    NB,
    qk_scale,
    segment_size,
    stride_qn,
    stride_kn,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BS: tl.constexpr,
    STRIDE: tl.constexpr,
    CPB: tl.constexpr,
    CPBP: tl.constexpr,
    JB: tl.constexpr,
    ANTI: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_PAD: tl.constexpr,
    EXACT_CNT: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
    MASKED: tl.constexpr,
):
    """The steps ``j_lo, j_lo+JB, .. < j_hi``; returns the rows' running max / sum."""
    if INTERP:  # (the interpreter cannot range() over a computed bound)
        j0 = j_lo
        while j0 < j_hi:
            m_run, l_run = _estimate_step(
                j0,
                q,
                q_base,
                k_base,
                kpos_base,
                qv_base,
                rows,
                r_ok,
                region_q,
                n_seg,
                lbm_ptr,
                m_run,
                l_run,
                N,
                NB,
                qk_scale,
                segment_size,
                stride_qn,
                stride_kn,
                HEAD_DIM,
                BLOCK_D,
                BLOCK_M,
                BS,
                STRIDE,
                CPB,
                CPBP,
                JB,
                ANTI,
                IS_CAUSAL,
                HAS_PAD,
                EXACT_CNT,
                IEEE,
                INTERP,
                MASKED,
            )
            j0 += JB
    else:
        for j0 in tl.range(j_lo, j_hi, JB):
            m_run, l_run = _estimate_step(
                j0,
                q,
                q_base,
                k_base,
                kpos_base,
                qv_base,
                rows,
                r_ok,
                region_q,
                n_seg,
                lbm_ptr,
                m_run,
                l_run,
                N,
                NB,
                qk_scale,
                segment_size,
                stride_qn,
                stride_kn,
                HEAD_DIM,
                BLOCK_D,
                BLOCK_M,
                BS,
                STRIDE,
                CPB,
                CPBP,
                JB,
                ANTI,
                IS_CAUSAL,
                HAS_PAD,
                EXACT_CNT,
                IEEE,
                INTERP,
                MASKED,
            )
    return m_run, l_run


@triton.jit
def _strided_estimate_kernel(  # noqa: PLR0915
    Q,
    K,
    KPOS,
    QV,
    LENS,
    LBM,
    LSE,
    H0,
    HC,
    HP_GROUP,
    HP,
    N,
    NB,
    NROWS,
    NTILES,
    SPAN,
    LSE_SPLIT_STRIDE,
    qk_scale,
    segment_size,
    SLIDING,
    CHUNK,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kn,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BS: tl.constexpr,
    STRIDE: tl.constexpr,
    RPB: tl.constexpr,
    CPB: tl.constexpr,
    CPBP: tl.constexpr,
    JB: tl.constexpr,
    ANTI: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_PAD: tl.constexpr,
    EXACT_CNT: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
    HAS_WINDOW: tl.constexpr = False,
):
    """One program per (batch * head of the chunk ``[H0, H0+HC)``, tile of BLOCK_M estimate rows,
    span of ``SPAN`` key blocks): ``LBM [B*HC, NROWS, NB]`` per-row per-key-block log2-mass (each
    block's own, so spans write disjoint columns) and the rows' log2-mass over the span,
    ``LSE [splits, B*HC, NROWS]`` (split ``s`` at ``s * LSE_SPLIT_STRIDE``; the caller sums the
    splits). Splitting the keys keeps the GPU busy when there are few row tiles. ``HAS_WINDOW``
    (a local window of ``SLIDING`` / ``CHUNK`` keys): the key blocks of segments that end before
    every row's window are not streamed (no mass in ``LBM``; ``LSE`` then leaves them out too,
    and the selection renormalises each row over the blocks inside its window anyway)."""
    # Inductor types a Python float argument fp64 (Triton's JIT: fp32): keep the math in fp32 either way
    qk_scale = tl.cast(qk_scale, tl.float32)
    # heads vary fastest (the query heads of a KV group stream the same keys together), tiles
    # from the longest (latest) down
    bh = tl.program_id(0)
    tile = NTILES - 1 - tl.program_id(1)
    j_lo = tl.program_id(2) * SPAN
    j_hi = tl.minimum(j_lo + SPAN, NB)
    b = bh // HC
    h = H0 + bh % HC
    p = h // HP_GROUP
    b64 = b.to(tl.int64)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    r_ok = rows < NROWS
    qblk = rows // RPB
    if HAS_PAD:
        n_seg = tl.load(LENS + b) // segment_size
    else:
        n_seg = N // segment_size
    region_q = tl.minimum((qblk * BS) // segment_size, n_seg)
    if IS_CAUSAL:  # candidates lie before the region of the tile's last row
        j_end = tl.minimum((tl.max(tl.where(r_ok, region_q, 0), 0) * segment_size) // BS, NB)
    else:
        j_end = NB + 0 * tile
    j_stop = tl.minimum(j_end, j_hi)  # this span's last streamed block + 1
    q_base = Q + b64 * stride_qb + h.to(tl.int64) * stride_qh
    k_base = K + b64 * stride_kb + p.to(tl.int64) * stride_kh
    kpos_base = KPOS + (b64 * HP + p) * N
    qv_base = QV + b64 * NB * BS
    lbm_ptr = LBM + (bh.to(tl.int64) * NROWS + rows) * NB
    j_begin = j_lo  # this span's first streamed block
    if HAS_WINDOW:
        # a permuted block holds keys of its own segment only: the segments that end before the
        # earliest row's window hold nothing inside any row's window
        lo_min = tl.min(tl.where(r_ok, _window_lo(qblk * BS, SLIDING, CHUNK, HAS_WINDOW), N), 0)
        j_win = (lo_min // segment_size * segment_size) // BS // JB * JB  # (steps start on multiples of JB)
        j_begin = tl.maximum(j_lo, tl.minimum(j_win, j_stop))
        _fill_unseen(lbm_ptr, r_ok, j_lo, j_begin, BLOCK_M, JB, INTERP)
    if ANTI:
        q = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)  # (strided rows load q per stride step)
    else:
        qpos = qblk.to(tl.int64) * BS + (rows % RPB) * STRIDE
        offs_d = tl.arange(0, BLOCK_D)
        q = tl.load(
            q_base + qpos[:, None] * stride_qn + offs_d[None, :],
            mask=(r_ok & (qpos < N))[:, None] & (offs_d < HEAD_DIM)[None, :],
            other=0.0,
        )
    m_run = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_run = tl.zeros([BLOCK_M], dtype=tl.float32)
    # interior steps: every row of the tile sees every column as a valid candidate (no padding,
    # blocks complete and in range, before the earliest row's own region) -- no masks. (Strided
    # rows past N would need their zero counts masked: with a partial last block all steps mask.)
    if HAS_PAD or CPB != CPBP or (ANTI and not EXACT_CNT):
        j_mid = 0 * tile
    else:
        first_own = tl.min(tl.where(r_ok, (region_q * segment_size) // BS, NB), 0)
        j_mid = tl.minimum(tl.minimum(first_own, (N // BS)), j_end) // JB * JB
    j_free = tl.maximum(j_begin, tl.minimum(j_mid, j_stop))  # (span starts are multiples of JB)
    m_run, l_run = _estimate_loop(
        j_begin,
        j_free,
        q,
        q_base,
        k_base,
        kpos_base,
        qv_base,
        rows,
        r_ok,
        region_q,
        n_seg,
        lbm_ptr,
        m_run,
        l_run,
        N,
        NB,
        qk_scale,
        segment_size,
        stride_qn,
        stride_kn,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_M,
        BS,
        STRIDE,
        CPB,
        CPBP,
        JB,
        ANTI,
        IS_CAUSAL,
        HAS_PAD,
        EXACT_CNT,
        IEEE,
        INTERP,
        False,
    )
    m_run, l_run = _estimate_loop(
        j_free,
        j_stop,
        q,
        q_base,
        k_base,
        kpos_base,
        qv_base,
        rows,
        r_ok,
        region_q,
        n_seg,
        lbm_ptr,
        m_run,
        l_run,
        N,
        NB,
        qk_scale,
        segment_size,
        stride_qn,
        stride_kn,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_M,
        BS,
        STRIDE,
        CPB,
        CPBP,
        JB,
        ANTI,
        IS_CAUSAL,
        HAS_PAD,
        EXACT_CNT,
        IEEE,
        INTERP,
        True,
    )
    _fill_unseen(lbm_ptr, r_ok, tl.maximum(j_lo, j_end), j_hi, BLOCK_M, JB, INTERP)
    lse = tl.where(l_run > 0.0, m_run + tl.log2(tl.maximum(l_run, 1.0e-30)), float("-inf"))
    lse_ptr = LSE + tl.program_id(2).to(tl.int64) * LSE_SPLIT_STRIDE + bh.to(tl.int64) * NROWS + rows
    tl.store(lse_ptr, lse, mask=r_ok)


@triton.jit
def _fill_unseen(lbm_ptr, r_ok, j_lo, j_hi, BLOCK_M: tl.constexpr, JB: tl.constexpr, INTERP: tl.constexpr):
    """-inf (no mass) for the key blocks ``[j_lo, j_hi)`` of the span the tile never streams
    (past its last candidate), so every element of ``LBM`` is defined whatever reads it."""
    none = tl.full([BLOCK_M, JB], float("-inf"), dtype=tl.float32)
    if INTERP:
        j0 = j_lo
        while j0 < j_hi:
            jb = j0 + tl.arange(0, JB)
            tl.store(lbm_ptr[:, None] + jb[None, :], none, mask=r_ok[:, None] & (jb < j_hi)[None, :])
            j0 += JB
    else:
        for j0 in tl.range(j_lo, j_hi, JB):
            jb = j0 + tl.arange(0, JB)
            tl.store(lbm_ptr[:, None] + jb[None, :], none, mask=r_ok[:, None] & (jb < j_hi)[None, :])


@triton.jit
def _split_lse_kernel(PARTS, LSE, TOTAL, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """``LSE[i] = log2(sum_s exp2(PARTS[s, i]))`` over the key splits' row masses (log2 units;
    -inf where every split is): one launch instead of a chain of torch reductions."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < TOTAL
    m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        m = tl.maximum(m, tl.load(PARTS + s * TOTAL + offs, mask=ok, other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.exp2(tl.load(PARTS + s * TOTAL + offs, mask=ok, other=float("-inf")) - m_safe)
    tl.store(LSE + offs, tl.where(acc > 0.0, m_safe + tl.log2(tl.maximum(acc, 1.0e-30)), float("-inf")), mask=ok)


@triton.jit
def _strided_prob_row(
    LBM,
    LSE,
    QV,
    bh64,
    b64,
    qb,
    offs,
    cand,
    N,
    NB,
    NROWS,
    BS: tl.constexpr,
    STRIDE: tl.constexpr,
    RPB: tl.constexpr,
    RC: tl.constexpr,
    BLOCK_B: tl.constexpr,
    ROW_QV: tl.constexpr,
    HAS_PAD: tl.constexpr,
    RENORM: tl.constexpr = False,
):
    """``[BLOCK_B]`` fp32 block probabilities of query block ``qb`` over the key blocks ``offs``:
    the mean over its rows that see a candidate key (and are valid query rows when ``ROW_QV``)
    of ``exp2(lbm - lse)``; 0 where ``cand`` is false. ``RENORM``: ``cand`` is a subset of the
    estimate's candidates (those inside a local window), so each row's normaliser is its mass
    over ``cand``, summed here from ``lbm``, not the estimate's ``lse``."""
    acc = tl.zeros([BLOCK_B], dtype=tl.float32)
    n_ok = tl.sum(tl.zeros([RC], dtype=tl.int32), 0)
    for r0 in tl.static_range(0, RPB, RC):
        r = r0 + tl.arange(0, RC)
        grow = qb * RPB + r
        r_in = r < RPB
        if RENORM:
            # the row's log2-mass over ``cand``: max first, then the sum of exp2, as the estimate
            # combines its blocks (written out here: helpers stay one call deep for Inductor)
            row_lbm = tl.load(
                LBM + (bh64 * NROWS + grow)[:, None] * NB + offs[None, :],
                mask=r_in[:, None] & cand[None, :],
                other=float("-inf"),
            )
            m = tl.max(row_lbm, 1)
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            total = tl.sum(tl.exp2(row_lbm - m_safe[:, None]), 1)
            lse = tl.where(total > 0.0, m_safe + tl.log2(tl.maximum(total, 1.0e-30)), float("-inf"))
        else:
            lse = tl.load(LSE + bh64 * NROWS + grow, mask=r_in, other=float("-inf"))
        ok = r_in & (lse > float("-inf"))
        if ROW_QV:
            pos = qb * BS + r * STRIDE
            if HAS_PAD:
                ok = ok & (tl.load(QV + b64 * NB * BS + pos, mask=ok, other=0) != 0)
            else:
                ok = ok & (pos < N)
        m2 = ok[:, None] & cand[None, :]
        lbm = tl.load(LBM + (bh64 * NROWS + grow)[:, None] * NB + offs[None, :], mask=m2, other=float("-inf"))
        pr = tl.where(m2, tl.exp2(lbm - tl.where(ok, lse, 0.0)[:, None]), 0.0)
        acc += tl.sum(pr, 0)
        n_ok += tl.sum(ok.to(tl.int32), 0)
    return acc / tl.maximum(n_ok, 1).to(tl.float32)


@triton.jit
def _strided_probs_kernel(
    LBM,
    LSE,
    QV,
    LENS,
    PROBS,
    HC,
    N,
    NB,
    NROWS,
    segment_size,
    BS: tl.constexpr,
    STRIDE: tl.constexpr,
    RPB: tl.constexpr,
    RC: tl.constexpr,
    BLOCK_B: tl.constexpr,
    ROW_QV: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_PAD: tl.constexpr,
):
    """One program per (query block, batch * head of the chunk): its row of block probabilities
    ``PROBS [B*HC, NB, NB]`` (the region rule decides the candidates; a key block without a
    valid key gets no mass)."""
    qb = tl.program_id(0)
    bh = tl.program_id(1)
    b64 = (bh // HC).to(tl.int64)
    offs = tl.arange(0, BLOCK_B)
    kb_ok = offs < NB
    if HAS_PAD:
        n_seg = tl.load(LENS + b64) // segment_size
    else:
        n_seg = N // segment_size
    region_k = tl.minimum((offs * BS) // segment_size, n_seg)
    region_q = tl.minimum((qb * BS) // segment_size, n_seg)
    if IS_CAUSAL:
        cand = kb_ok & (region_k < region_q)
    else:
        cand = kb_ok & (region_k != region_q)
    prob = _strided_prob_row(
        LBM, LSE, QV, bh.to(tl.int64), b64, qb, offs, cand, N, NB, NROWS, BS, STRIDE, RPB, RC, BLOCK_B, ROW_QV, HAS_PAD
    )
    tl.store(PROBS + (bh.to(tl.int64) * NB + qb) * NB + offs, prob, mask=kb_ok)


def estimate_plan(
    scoring: str,
    block_size: int,
    stride: int,
    block_m: Optional[int] = None,
    block_n: Optional[int] = None,
    num_warps: Optional[int] = None,
    num_stages: Optional[int] = None,
) -> dict:
    """Launch geometry (host-side): rows per block, columns per key block (padded to a power of
    two), key blocks per loop step (``block_n`` columns, at least one block), rows per tile, warps
    and pipeline stages. GPU defaults: 128 x 128 tiles, 8 warps (the sampled rows keep their Q
    tile resident and stream K as flash attention does; the strided rows run a GEMM K-loop over
    ``s`` head-dim slices, 2 stages of 64 KB); the interpreter uses 64 x 64 (fewer masked lanes
    on tiny test shapes)."""
    rpb = rows_per_block(scoring, block_size, stride)
    cpb = block_size if scoring == "sampled_rows" else block_size // stride
    cpbp = triton.next_power_of_2(cpb)
    block_m = _default_tile() if block_m is None else block_m
    block_n = _default_tile() if block_n is None else block_n
    jb = max(1, max(16, block_n) // cpbp)
    anti = scoring == "antidiagonal"
    return dict(
        RPB=rpb,
        CPB=cpb,
        CPBP=cpbp,
        JB=jb,
        BLOCK_M=block_m,
        num_warps=(8 if block_m * jb * cpbp >= 128 * 128 else 4) if num_warps is None else num_warps,
        num_stages=(2 if anti else 3) if num_stages is None else num_stages,
    )


def strided_estimate(
    q: torch.Tensor,
    k_perm: torch.Tensor,
    kpos: Optional[torch.Tensor],
    lens: Optional[torch.Tensor],
    qvalid: Optional[torch.Tensor],
    *,
    scoring: str,
    stride: int,
    hp: int,
    h0: int = 0,
    hc: Optional[int] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    block_size: int = PBSConfig.block_size,
    segment_size: int = PBSConfig.segment_size,
    block_m: Optional[int] = None,
    block_n: Optional[int] = None,
    num_warps: Optional[int] = None,
    num_stages: Optional[int] = None,
    key_splits: Optional[int] = None,
    sliding_window: int = PBSConfig.sliding_window,
    chunk_size: int = PBSConfig.chunk_size,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(lbm [B*HC, rows, nB], lse [B*HC, rows])`` fp32 in log2 units for the query heads
    ``[h0, h0+hc)``. ``k_perm [B, Hp, N, D]`` permuted keys; with padding (``lens`` not None)
    ``kpos [B, Hp, N]`` int32 (``PAD_POS`` where padded), ``lens [B]`` int32 effective lengths and
    ``qvalid [B, nB*bs]`` int8 (the reference's ``query_validity``); all None without.
    ``block_m``/``block_n``/``num_warps``/``num_stages``: tile overrides (:func:`estimate_plan`);
    ``block_m`` None: :func:`default_row_tile`. ``key_splits``: programs per row tile, each over
    its own span of key blocks (their row masses summed after); None: :func:`default_key_splits`.
    ``sliding_window`` / ``chunk_size``: a local window (causal only): the key blocks of segments
    that end before a row tile's windows are not streamed (their ``lbm`` is -inf, and ``lse``
    leaves them out). Launches ``sparseflow::pbs_strided_estimate`` (defaults resolved here, so
    the op's arguments are the whole launch)."""
    _check(scoring, block_size, stride)
    hc = q.shape[1] - h0 if hc is None else hc
    block_m = default_row_tile(q, scoring, stride, hc, block_size) if block_m is None else block_m
    block_n = _default_tile() if block_n is None else block_n
    plan = estimate_plan(scoring, block_size, stride, block_m, block_n, num_warps, num_stages)
    sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if key_splits is None:
        key_splits = default_key_splits(q, scoring, stride, hc, block_size, block_m, plan["JB"])
    elif type(key_splits) is not int or key_splits < 1:
        raise ValueError(f"key_splits must be an int >= 1 or None, got {key_splits!r}")
    return torch.ops.sparseflow.pbs_strided_estimate(
        q,
        k_perm,
        kpos,
        lens,
        qvalid,
        scoring,
        stride,
        hp,
        h0,
        hc,
        bool(is_causal),
        sc,
        block_size,
        segment_size,
        block_m,
        block_n,
        plan["num_warps"],
        plan["num_stages"],
        key_splits,
        int(sliding_window),
        int(chunk_size),
    )


# programs below which the estimate halves its row tile (per SM): at 8K tokens and Hq 9 the
# 128-row tiles make 72 programs for an H200's 132 SMs, and 64-row tiles take a third less time
_PROGRAMS_PER_SM = 2
# programs (per SM) the key splits aim for: causal row tiles differ in length up to N/bs steps,
# and the longest one bounds the launch unless its keys are split (H200, 8K, Hq 9: 4 splits of
# 64-row tiles halve the kernel's time against one)
_SPLIT_PROGRAMS_PER_SM = 4
_MAX_KEY_SPLITS = 8


def default_row_tile(q: torch.Tensor, scoring: str, stride: int, hc: int, block_size: int) -> int:
    """Rows per estimate tile: ``_default_tile()``, halved (to 64) on a GPU for head dims up to 64
    or where full tiles would leave fewer than ``_PROGRAMS_PER_SM`` programs per SM."""
    tile = _default_tile()
    if q.device.type != "cuda" or interpreting():
        return tile
    if q.shape[-1] <= 64:  # (H200, D=64: 64-row tiles on 4 warps are the fastest at 8K-64K)
        return tile // 2
    (bsz_hc, nrows, _), _ = _estimate_shapes(q, scoring, stride, hc, block_size)
    if bsz_hc * -(-nrows // tile) < sm_count(q.device) * _PROGRAMS_PER_SM:
        return tile // 2
    return tile


def default_key_splits(
    q: torch.Tensor, scoring: str, stride: int, hc: int, block_size: int, block_m: int, jb: int
) -> int:
    """Key splits per row tile: 1 off the GPU, else :func:`splits_for` of the launch."""
    if q.device.type != "cuda" or interpreting():
        return 1
    (bsz_hc, nrows, nb), _ = _estimate_shapes(q, scoring, stride, hc, block_size)
    return splits_for(bsz_hc * -(-nrows // block_m), -(-nb // jb), sm_count(q.device))


def splits_for(programs: int, steps: int, sms: int) -> int:
    """The smallest power of two of key splits that gives ``_SPLIT_PROGRAMS_PER_SM`` programs per
    SM, at most ``_MAX_KEY_SPLITS`` and no more than the row tile's key steps."""
    splits = 1
    while programs * splits < sms * _SPLIT_PROGRAMS_PER_SM and splits * 2 <= min(_MAX_KEY_SPLITS, steps):
        splits *= 2
    return splits


def _key_span(nb: int, jb: int, splits: int) -> int:
    """Key blocks per split: a multiple of ``jb`` (so every span starts on a loop step)."""
    per = -(-nb // max(splits, 1))
    return max(jb, -(-per // jb) * jb)


def _estimate_shapes(q: torch.Tensor, scoring: str, stride: int, hc: int, block_size: int):
    """``(lbm, lse)`` shapes of the estimate of ``hc`` query heads of ``q [B, Hq, N, D]``."""
    nb = -(-q.shape[2] // block_size)
    nrows = nb * rows_per_block(scoring, block_size, stride)
    return (q.shape[0] * hc, nrows, nb), (q.shape[0] * hc, nrows)


@triton_op("sparseflow::pbs_strided_estimate", mutates_args={})
def pbs_strided_estimate(
    q: torch.Tensor,
    k_perm: torch.Tensor,
    kpos: Optional[torch.Tensor],
    lens: Optional[torch.Tensor],
    qvalid: Optional[torch.Tensor],
    scoring: str,
    stride: int,
    hp: int,
    h0: int,
    hc: int,
    is_causal: bool,
    scale: float,
    block_size: int,
    segment_size: int,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    key_splits: int = 1,
    sliding_window: int = PBSConfig.sliding_window,
    chunk_size: int = PBSConfig.chunk_size,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The launch behind :func:`strided_estimate` (every argument resolved; ``scale`` is the
    softmax scale)."""
    # the settings that shape the kernel are compile-time constants: a symbolic one (Dynamo makes
    # Python ints of a closure symbols under dynamic=True) is specialised here, with a guard
    stride, block_size, block_m, block_n, num_warps, num_stages, key_splits = map(
        int, (stride, block_size, block_m, block_n, num_warps, num_stages, key_splits)
    )
    bsz, hq, n, d = q.shape
    plan = estimate_plan(scoring, block_size, stride, block_m, block_n, num_warps, num_stages)
    lbm_shape, lse_shape = _estimate_shapes(q, scoring, stride, hc, block_size)
    nb, nrows = lbm_shape[2], lbm_shape[1]
    ntiles = -(-nrows // block_m)
    has_pad = lens is not None
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_perm.stride(-1) != 1:
        k_perm = k_perm.contiguous()
    lbm = torch.empty(lbm_shape, dtype=torch.float32, device=q.device)
    span = _key_span(nb, plan["JB"], key_splits)
    splits = -(-nb // span)
    # the rows' log2-mass per span, summed below (one span: the result itself)
    lse_parts = torch.empty(lse_shape if splits == 1 else (splits, *lse_shape), dtype=torch.float32, device=q.device)
    # (a separate placeholder for the unused padding pointers, so no input aliases an output)
    dummy = torch.empty(1, dtype=torch.int32, device=q.device) if not has_pad else None
    wrap_triton(_strided_estimate_kernel)[(bsz * hc, ntiles, splits)](
        q,
        k_perm,
        kpos if has_pad else dummy,
        qvalid if has_pad else dummy,
        lens if has_pad else dummy,
        lbm,
        lse_parts,
        h0,
        hc,
        hq // hp,
        hp,
        n,
        nb,
        nrows,
        ntiles,
        span,
        bsz * hc * nrows,
        scale * _LOG2E,
        segment_size,
        int(sliding_window),
        int(chunk_size),
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k_perm.stride(0),
        k_perm.stride(1),
        k_perm.stride(2),
        HEAD_DIM=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        BS=block_size,
        STRIDE=stride,
        ANTI=scoring == "antidiagonal",
        IS_CAUSAL=is_causal,
        HAS_PAD=has_pad,
        EXACT_CNT=bool((not has_pad) and n % block_size == 0),
        IEEE=q.dtype == torch.float32,
        INTERP=interpreting(),
        HAS_WINDOW=bool(sliding_window or chunk_size),
        **plan,
    )
    if splits == 1:
        return lbm, lse_parts
    total = bsz * hc * nrows
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    block = 1024
    wrap_triton(_split_lse_kernel)[(triton.cdiv(total, block),)](lse_parts, lse, total, SPLITS=splits, BLOCK=block)
    return lbm, lse


@pbs_strided_estimate.register_fake
def _(
    q,
    k_perm,
    kpos,
    lens,
    qvalid,
    scoring,
    stride,
    hp,
    h0,
    hc,
    is_causal,
    scale,
    block_size,
    segment_size,
    block_m,
    block_n,
    num_warps,
    num_stages,
    key_splits=1,
    sliding_window=PBSConfig.sliding_window,
    chunk_size=PBSConfig.chunk_size,
):
    torch._check(q.dim() == 4 and k_perm.dim() == 4, lambda: "q and k_perm must be 4-D")
    torch._check(
        lens is None or (kpos is not None and qvalid is not None), lambda: "with lens, kpos and qvalid are needed too"
    )
    lbm_shape, lse_shape = _estimate_shapes(q, scoring, stride, hc, block_size)
    return q.new_empty(lbm_shape, dtype=torch.float32), q.new_empty(lse_shape, dtype=torch.float32)


def padding_inputs(
    key_padding_mask: Optional[torch.Tensor],
    permutation: torch.Tensor,
    block_size: int,
    kpos: Optional[torch.Tensor] = None,
):
    """``(kpos, lens, qvalid)`` for :func:`strided_estimate` (all None without padding)."""
    if key_padding_mask is None:
        return None, None, None
    from .triton_attention import key_positions

    bsz, n = key_padding_mask.shape
    kpm = key_padding_mask.to(torch.bool)
    if kpos is None:
        kpos = key_positions(permutation, kpm)
    lens = effective_lengths(kpm, bsz, n, kpm.device).to(torch.int32).contiguous()
    qvalid = query_validity(kpm, block_size).to(torch.int8).contiguous()
    return kpos.contiguous(), lens, qvalid


def prob_meta(scoring: str, block_size: int, stride: int, block_b: int) -> dict:
    """Constexprs of :func:`_strided_prob_row` for a kernel with ``block_b`` key-block lanes."""
    rpb = rows_per_block(scoring, block_size, stride)
    rc = max(1, min(triton.next_power_of_2(rpb), max(1, 8192 // block_b)))
    return dict(STRIDE=stride, RPB=rpb, RC=rc, ROW_QV=scoring == "sampled_rows")


def block_probabilities(
    q: torch.Tensor,
    k: torch.Tensor,
    permutation: torch.Tensor,
    *,
    key_padding_mask: Optional[torch.Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    block_size: int = PBSConfig.block_size,
    segment_size: int = PBSConfig.segment_size,
    scoring: str = "sampled_rows",
    antidiagonal_stride: int = PBSConfig.antidiagonal_stride,
    block_m: Optional[int] = None,
    block_n: Optional[int] = None,
) -> torch.Tensor:
    """fp32 ``[B, Hq, nB, nB]``: the reference's ``block_probabilities`` for its candidates
    (``candidate_blocks``) with the strided scorings, from the Triton estimate (``block_m``,
    ``block_n``: tile overrides)."""
    bsz, hq, n, _ = q.shape
    hp = permutation.shape[1]
    nb = -(-n // block_size)
    kpm = key_padding_mask if key_padding_mask is not None and not bool(key_padding_mask.all()) else None
    kpos, lens, qvalid = padding_inputs(kpm, permutation, block_size)
    lbm, lse = strided_estimate(
        q,
        permute_kv(k, permutation),
        kpos,
        lens,
        qvalid,
        scoring=scoring,
        stride=antidiagonal_stride,
        hp=hp,
        is_causal=is_causal,
        scale=scale,
        block_size=block_size,
        segment_size=segment_size,
        block_m=block_m,
        block_n=block_n,
    )
    probs = torch.ops.sparseflow.pbs_strided_probs(
        lbm, lse, qvalid, lens, scoring, antidiagonal_stride, hq, n, bool(is_causal), block_size, segment_size
    )
    return probs.view(bsz, hq, nb, nb)


@triton_op("sparseflow::pbs_strided_probs", mutates_args={})
def pbs_strided_probs(
    lbm: torch.Tensor,
    lse: torch.Tensor,
    qvalid: Optional[torch.Tensor],
    lens: Optional[torch.Tensor],
    scoring: str,
    stride: int,
    hc: int,
    n: int,
    is_causal: bool,
    block_size: int,
    segment_size: int,
) -> torch.Tensor:
    """fp32 ``[B*HC, nB, nB]`` block probabilities from :func:`strided_estimate`'s ``(lbm, lse)``
    of ``hc`` heads over ``n`` tokens (``qvalid``/``lens``: its padding inputs, None without)."""
    stride, block_size = int(stride), int(block_size)  # kernel constants (see pbs_strided_estimate)
    bhc, nrows, nb = lbm.shape
    has_pad = lens is not None
    probs = torch.empty(bhc, nb, nb, dtype=torch.float32, device=lbm.device)
    dummy = torch.empty(1, dtype=torch.int32, device=lbm.device) if not has_pad else None
    block_b = pow2_at_least(nb, 16)
    wrap_triton(_strided_probs_kernel)[(nb, bhc)](
        lbm,
        lse,
        qvalid if has_pad else dummy,
        lens if has_pad else dummy,
        probs,
        hc,
        n,
        nb,
        nrows,
        segment_size,
        BS=block_size,
        BLOCK_B=block_b,
        IS_CAUSAL=is_causal,
        HAS_PAD=has_pad,
        num_warps=4,
        **prob_meta(scoring, block_size, stride, block_b),
    )
    return probs


@pbs_strided_probs.register_fake
def _(lbm, lse, qvalid, lens, scoring, stride, hc, n, is_causal, block_size, segment_size):
    torch._check(lbm.dim() == 3 and lse.dim() == 2, lambda: "lbm must be 3-D and lse 2-D")
    return lbm.new_empty((lbm.shape[0], lbm.shape[2], lbm.shape[2]), dtype=torch.float32)
