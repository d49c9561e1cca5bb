"""BSA full-scan selector in Triton (PISA's full-scan baseline, made as fast as we can).

Imported lazily; this module imports Triton.

The group-summed score ``sum_h q_h . kbar_c * scale`` equals ``(sum_h q_h) . kbar_c * scale``, so
one program per (query tile, batch x KV head) sums the tile's ``G`` query heads once and streams
the leaf-block means in tiles of ``BLOCK_N`` blocks through one ``tl.dot`` each, keeping a
running top-K per row in registers: no score matrix is ever written. Each (score, block id) is
one int64 key, so a chunk merges into the running top-K by ``K`` rounds of one int64 row max
(the other merges of ``_SELECT_LAUNCH`` are measured beside it). A tile whose scores cannot
enter any row's top-K (none above the row's current K-th best) is skipped without merging.
Forced blocks enter with +inf, invisible ones never enter; ties go to the lower block id, as in
the reference.

``precision="tf32x3"`` (default) scores on the tensor cores from three tf32 products per fp32
product (the high and low tf32 parts of each operand; what is dropped, the low parts' product, is
about 2**-22 of it). That rounding is of the order of the differences fp32 summation order makes
already, so selections equal the reference's except between blocks whose scores tie to about
1e-6, as with any fp32 summation order; at twice the speed of ``"ieee"`` (IEEE fp32 on the CUDA
cores). H200, SmolLM2's shape (docs/results.md): 57 us against 117 us
at 8K, 578 against 1233 at 32K, with 1 row in 1e5 selecting otherwise than the reference on keys
with a drift and none on Gaussian keys. ``"bf16"`` rounds the summed queries and the means to
bf16: the fastest and the least faithful (1-4% of rows select another block).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from ...kernels.block_summaries_triton import leaf_sums
from ...kernels.token_blocks import check_index_dtype, check_window, selection_width
from ...kernels.token_sparse_triton import _window_lo
from ...kernels._triton_env import interpreting
from .config import BSAConfig

__all__ = ["bsa_select", "PRECISIONS"]

PRECISIONS = ("tf32x3", "ieee", "bf16")
_PRECISION_CODES = {"ieee": 0, "bf16": 1, "tf32x3": 2}
_BIG_ID = 2**30
# merge: how a chunk of scores enters the rows' running top-K -- "packed" (top_k rounds of one
# int64 row max over the packed keys), "bitonic" (two bitonic top-k passes, top_k <= 64) or
# "rounds" (top_k rounds of fp32 row maxima with separate ids)
# "packed" is the fastest merge timed on an H200 (SmolLM2's shape at 8K: Hq 9, Hkv 3, D 64, C 64;
# IEEE dots; kernel time from a CUDA graph), on 8 warps at K=8 and 4 at K=16. num_warps None: see
# _bsa_select_fwd.
_SELECT_LAUNCH = dict(block_m=32, block_n=64, num_warps=None, merge="packed")
_MERGES = {"rounds": 0, "bitonic": 1, "packed": 2}


def _p2(x: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(int(x)))


@triton.jit
def _forced_leaves(
    lfv_base,
    p,
    hz,
    row_ok,
    Nk,
    NB,
    C: tl.constexpr,
    FORCE_SINK: tl.constexpr,
    FORCE_PREV: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """The rows' forced leaves (token_blocks.forced_leaf_blocks): current / previous / sink, each
    -1 unless it holds a key the row may see."""
    cur = tl.where((p >= 0) & (p < NB * C), p // C, -1)
    prev = tl.full([BLOCK_M], -1, tl.int32)
    if FORCE_PREV:
        prev = tl.where(cur >= 1, cur - 1, -1)
    sink = tl.full([BLOCK_M], -1, tl.int32)
    if FORCE_SINK:
        sink = tl.where(cur != 0, 0, -1)
        if FORCE_PREV:
            sink = tl.where(prev == 0, -1, sink)
    cur = tl.where((cur >= 0) & (tl.load(lfv_base + tl.maximum(cur, 0), mask=row_ok, other=Nk) <= hz), cur, -1)
    prev = tl.where((prev >= 0) & (tl.load(lfv_base + tl.maximum(prev, 0), mask=row_ok, other=Nk) <= hz), prev, -1)
    sink = tl.where((sink >= 0) & (tl.load(lfv_base + tl.maximum(sink, 0), mask=row_ok, other=Nk) <= hz), sink, -1)
    return cur, prev, sink


@triton.jit
def _packed_keys(key, blk):
    """int64 sort keys, descending = (score descending, block id ascending): the fp32 ``key``'s
    bits made order-preserving as a signed int in the high word (-0.0 counted as +0.0, as a
    float comparison does), ``2**31 - 1 - blk`` in the low word."""
    key = tl.where(key == 0.0, 0.0, key)
    bits = key.to(tl.int32, bitcast=True)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - blk).to(tl.int64)[None, :]


@triton.jit
def _merge_top_k_bitonic(top, packed, KP: tl.constexpr, BLOCK_M: tl.constexpr):
    """Each row's best ``KP`` of its kept packed keys ``top [BLOCK_M, KP]`` and this chunk's
    ``packed [BLOCK_M, BLOCK_N]`` (``-(2**63) + 1``, below every real key, where a block cannot
    be kept): two bitonic top-k passes in registers, descending."""
    best = tl.topk(packed, KP, dim=1)
    both = tl.reshape(tl.join(top, best), [BLOCK_M, 2 * KP])
    return tl.topk(both, KP, dim=1)


@triton.jit
def _merge_top_k_packed(top, packed, offs_k, TOPK: tl.constexpr, KP: tl.constexpr, BLOCK_M: tl.constexpr):
    """Each row's best ``TOPK`` of its kept packed keys ``top [BLOCK_M, KP]`` and this chunk's
    ``packed [BLOCK_M, BLOCK_N]``, descending: ``TOPK`` rounds of one int64 row max (a row's keys
    are distinct, the block id being in the low word), each taking its winner out."""
    none = -9223372036854775807
    new = tl.full([BLOCK_M, KP], none, tl.int64)
    for t in range(TOPK):
        m = tl.maximum(tl.max(top, axis=1), tl.max(packed, axis=1))
        new = tl.where(offs_k[None, :] == t, m[:, None], new)
        top = tl.where(top == m[:, None], none, top)
        packed = tl.where(packed == m[:, None], none, packed)
    return new


@triton.jit
def _merge_top_k(top_v, top_i, key, blk, offs_k, TOPK: tl.constexpr, KP: tl.constexpr, BLOCK_M: tl.constexpr):
    """Each row's best ``TOPK`` of its kept ``(top_v, top_i)`` and this chunk's ``key`` over
    blocks ``blk``: ``TOPK`` rounds of a row max, ties to the lower block id."""
    new_v = tl.full([BLOCK_M, KP], float("-inf"), tl.float32)
    new_i = tl.full([BLOCK_M, KP], 1073741824, tl.int32)
    for t in range(TOPK):
        m = tl.maximum(tl.max(top_v, axis=1), tl.max(key, axis=1))
        id_old = tl.min(tl.where(top_v == m[:, None], top_i, 1073741824), axis=1)
        id_new = tl.min(tl.where(key == m[:, None], blk[None, :], 1073741824), axis=1)
        pick = tl.minimum(id_old, id_new)
        real = m > float("-inf")
        new_v = tl.where((offs_k[None, :] == t) & real[:, None], m[:, None], new_v)
        new_i = tl.where((offs_k[None, :] == t) & real[:, None], pick[:, None], new_i)
        top_v = tl.where(top_i == pick[:, None], float("-inf"), top_v)
        top_i = tl.where(top_i == pick[:, None], 1073741824, top_i)
        key = tl.where(blk[None, :] == pick[:, None], float("-inf"), key)
    return new_v, new_i


@triton.jit
def _bsa_select_kernel(  # noqa: C901, PLR0912, PLR0915
    q_ptr,
    sums_ptr,
    cnt_ptr,
    lfv_ptr,
    out_ptr,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_sb,
    stride_sh,
    stride_st,
    stride_ob,
    stride_oh,
    stride_on,
    Nq,
    Nk,
    NB,
    HKV,
    scale,
    SLIDING,
    CHUNK,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    FORCE_SINK: tl.constexpr,
    FORCE_PREV: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    C: tl.constexpr,
    TOPK: tl.constexpr,
    KP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    MERGE: tl.constexpr,
):
    # Inductor types a Python float argument fp64 (Triton's JIT: fp32): keep the math in fp32 either way
    scale = tl.cast(scale, tl.float32)
    qt = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HKV
    hkv = bh % HKV
    rows = qt * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < Nq
    p = rows + Nk - Nq
    if IS_CAUSAL:
        hz = p
    else:
        hz = p * 0 + (Nk - 1)
    offs_d = tl.arange(0, DP)
    d_ok = offs_d < D
    qs = tl.zeros([BLOCK_M, DP], dtype=tl.float32)
    for g in range(G):
        qs += tl.load(
            q_ptr + b * stride_qb + (hkv * G + g) * stride_qh + rows[:, None] * stride_qn + offs_d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        ).to(tl.float32)
    qs = qs * scale
    lfv_base = lfv_ptr + b * NB
    cur, prev, sink = _forced_leaves(lfv_base, p, hz, row_ok, Nk, NB, C, FORCE_SINK, FORCE_PREV, BLOCK_M)

    offs_k = tl.arange(0, KP)
    # blocks that can be visible to some row of the tile
    hz_max = tl.max(tl.where(row_ok, hz, -1), axis=0)
    nb_hi = tl.minimum(NB, hz_max // C + 1)
    kb0 = 0
    if HAS_WINDOW:
        # each row chooses among the blocks from its window's first one (token_blocks.window_first_blocks)
        first_blk = _window_lo(p, SLIDING, CHUNK, HAS_WINDOW) // C
        first_min = tl.min(tl.where(row_ok, first_blk, NB), axis=0)
        kb0 = (first_min // BLOCK_N) * BLOCK_N
    offs_n = tl.arange(0, BLOCK_N)
    if MERGE != 0:
        top = tl.full([BLOCK_M, KP], -9223372036854775807, tl.int64)  # no block kept yet
    else:
        top_v = tl.full([BLOCK_M, KP], float("-inf"), tl.float32)
        top_i = tl.full([BLOCK_M, KP], 1073741824, tl.int32)
    while kb0 < nb_hi:
        blk = kb0 + offs_n
        b_ok = blk < NB
        cnt = tl.load(cnt_ptr + b * NB + blk, mask=b_ok, other=1)
        s_t = tl.load(
            sums_ptr + b * stride_sb + hkv * stride_sh + blk[None, :] * stride_st + offs_d[:, None],
            mask=b_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        m_t = s_t / tl.maximum(cnt, 1).to(tl.float32)[None, :]
        if PRECISION == 1:
            sc = tl.dot(qs.to(tl.bfloat16), m_t.to(tl.bfloat16))
        elif PRECISION == 2:
            sc = tl.dot(qs, m_t, input_precision="tf32x3")
        else:
            sc = tl.dot(qs, m_t, input_precision="ieee")
        vis = b_ok[None, :] & (tl.load(lfv_base + blk, mask=b_ok, other=Nk)[None, :] <= hz[:, None])
        if HAS_WINDOW:
            vis = vis & (blk[None, :] >= first_blk[:, None])
        forced = (blk[None, :] == cur[:, None]) | (blk[None, :] == prev[:, None]) | (blk[None, :] == sink[:, None])
        key = tl.where(sc != sc, -3.0e38, tl.minimum(tl.maximum(sc, -3.0e38), 3.0e38))
        key = tl.where(forced & vis, float("inf"), key)
        if MERGE != 0:
            packed = tl.where(vis, _packed_keys(key, blk), -9223372036854775807)
            # the row's TOPK-th best kept key (the slots past TOPK hold none)
            kth = tl.min(tl.where(offs_k[None, :] < TOPK, top, 9223372036854775807), axis=1)
            if tl.sum(tl.sum((packed > kth[:, None]).to(tl.int32), axis=1), axis=0) > 0:
                if MERGE == 1:
                    top = _merge_top_k_bitonic(top, packed, KP, BLOCK_M)
                else:
                    top = _merge_top_k_packed(top, packed, offs_k, TOPK, KP, BLOCK_M)
        else:
            key = tl.where(vis, key, float("-inf"))
            kth = tl.min(top_v, axis=1)
            if tl.sum(tl.sum((key > kth[:, None]).to(tl.int32), axis=1), axis=0) > 0:
                top_v, top_i = _merge_top_k(top_v, top_i, key, blk, offs_k, TOPK, KP, BLOCK_M)
        kb0 += BLOCK_N
    if MERGE != 0:
        # the kept keys are sorted descending: the first TOPK are the row's choice
        kept = (top != -9223372036854775807) & (offs_k[None, :] < TOPK)
        top_i = tl.where(kept, 0x7FFFFFFF - (top & 0xFFFFFFFF).to(tl.int32), 1073741824)
    ids = tl.sort(top_i, dim=1)
    ids = tl.where(ids == 1073741824, -1, ids)
    tl.store(
        out_ptr + b * stride_ob + hkv * stride_oh + rows[:, None] * stride_on + offs_k[None, :],
        ids,
        mask=row_ok[:, None] & (offs_k[None, :] < TOPK),
    )


def _merge_code(top_k: int) -> int:
    merge = _SELECT_LAUNCH["merge"]
    if merge == "bitonic" and _p2(top_k, 2) > 64:
        merge = "rounds"
    return _MERGES[merge]


@triton_op("sparseflow::bsa_select_fwd", mutates_args={})
def _bsa_select_fwd(
    q: torch.Tensor,
    sums: torch.Tensor,
    cnt: torch.Tensor,
    lfv: torch.Tensor,
    n_k: int,
    scale: float,
    is_causal: bool,
    block_size: int,
    top_k: int,
    force_sink: bool,
    force_previous: bool,
    precision: str,
    sliding_window: int = BSAConfig.sliding_window,
    chunk_size: int = BSAConfig.chunk_size,
) -> torch.Tensor:
    b, hq, n_q, d = q.shape
    hkv, nb = sums.shape[1], sums.shape[2]
    out = torch.empty(b, hkv, n_q, top_k, dtype=torch.int32, device=q.device)
    if n_q == 0:
        return out
    block_m, num_warps = _SELECT_LAUNCH["block_m"], _SELECT_LAUNCH["num_warps"]
    if num_warps is None:  # (H200: IEEE dots at K <= 8 are fastest on 8 warps, tensor-core ones on 4)
        num_warps = 8 if top_k <= 8 and precision == "ieee" else 4
    wrap_triton(_bsa_select_kernel)[(triton.cdiv(n_q, block_m), b * hkv)](
        q,
        sums,
        cnt,
        lfv,
        out,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        sums.stride(0),
        sums.stride(1),
        sums.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        n_q,
        n_k,
        nb,
        hkv,
        scale,
        sliding_window,
        chunk_size,
        IS_CAUSAL=is_causal,
        HAS_WINDOW=bool(sliding_window or chunk_size),
        FORCE_SINK=force_sink,
        FORCE_PREV=force_previous,
        G=hq // hkv,
        D=d,
        DP=_p2(d),
        C=block_size,
        TOPK=top_k,
        KP=_p2(top_k, 2),
        BLOCK_M=block_m,
        BLOCK_N=_SELECT_LAUNCH["block_n"],
        PRECISION=_PRECISION_CODES[precision],
        MERGE=_merge_code(top_k),
        num_warps=num_warps,
    )
    return out


@_bsa_select_fwd.register_fake
def _(
    q, sums, cnt, lfv, n_k, scale, is_causal, block_size, top_k, force_sink, force_previous, precision,
    sliding_window=BSAConfig.sliding_window, chunk_size=BSAConfig.chunk_size,
):  # fmt: skip
    return q.new_empty(q.shape[0], sums.shape[1], q.shape[2], top_k, dtype=torch.int32)


def bsa_select(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    key_padding_mask: Optional[torch.Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    block_size: int = BSAConfig.block_size,
    top_k: int = BSAConfig.top_k,
    force_sink: bool = BSAConfig.force_sink,
    force_previous: bool = BSAConfig.force_previous,
    precision: str = "tf32x3",
    index_dtype: torch.dtype = torch.long,
    sliding_window: int = BSAConfig.sliding_window,
    chunk_size: int = BSAConfig.chunk_size,
) -> torch.Tensor:
    """The reference's ``bsa_select`` contract in Triton: ``[B, Hkv, Nq, top_k]`` int64
    (``index_dtype=torch.int32``: the kernel's own ids, what the attention kernel reads); a local
    window as the reference's."""
    check_index_dtype(index_dtype)
    check_window(sliding_window, chunk_size, is_causal)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"the Triton BSA selector takes fp16, bf16 or fp32 q/k, got {q.dtype}")
    b, hq, n_q, d = q.shape
    n_k = k.shape[2]
    top_k = selection_width(top_k, n_k, block_size)
    if n_k == 0 or b == 0:
        return torch.full((b, k.shape[1], n_q, top_k), -1, dtype=index_dtype, device=q.device)
    sc = 1.0 / math.sqrt(d) if scale is None else float(scale)
    with torch.no_grad():
        kpm = None if key_padding_mask is None else key_padding_mask.to(device=q.device, dtype=torch.int8).contiguous()
        sums, cnt, lfv = leaf_sums(k.detach(), kpm, int(block_size))
        idx = _bsa_select_fwd(
            q.detach(),
            sums,
            cnt,
            lfv,
            n_k,
            sc,
            bool(is_causal),
            int(block_size),
            int(top_k),
            bool(force_sink),
            bool(force_previous),
            "ieee" if interpreting() else precision,  # the interpreter's dots are numpy's fp32
            int(sliding_window),
            int(chunk_size),
        )
    return idx.to(index_dtype)
