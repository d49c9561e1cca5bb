"""Permuted block-sparse flash-attention forward (PBS-Attn step 4: attention over the selected blocks) in Triton.

Imported lazily (only when ``backend="triton"`` is asked for): this module imports Triton.

Layout (the contract of ``sparseflow::pbs_block_sparse_fwd``):

* ``q``: ``[B, Hq, N, D]`` queries in their original order.
* ``k``, ``v``: ``[B, Hkv', N, D]``. Either the *permuted* keys/values (``gather=False``; then
  ``Hkv'`` is the number of permutation heads ``Hp``, i.e. Hq for per-query-head permutation or
  Hkv for per-KV-head permutation) or the *original* keys/values (``gather=True``; then
  ``Hkv' = Hkv`` and the kernel reads permuted slot ``j`` from row ``kpos[j]``). A query head
  ``h`` reads K/V head ``h // (Hq // Hkv')``: GQA is native, K/V are never repeated.
* ``kpos``: ``[B, Hp, N]`` int32, the original position of the key in permuted slot ``j``, or
  ``PAD_POS`` (int32 max) for a padded key. Query head ``h`` reads permutation head
  ``h // (Hq // Hp)``. A key is visible to query ``i`` iff ``kpos <= i`` (causal) or
  ``kpos < N`` (non-causal): padding, causality inside the diagonal segment, and the ragged
  last block are all one comparison. A local window (``sliding_window`` / ``chunk_size``, causal
  only) adds its lower bound to that comparison: ``lo(i) <= kpos``.
* ``kv_num``, ``kv_full``: ``[B, Hq, nQB]`` int32; ``kv_idx``: ``[B, Hq, nQB, L]`` int32.
  Query block ``qb`` attends permuted key blocks ``kv_idx[..., :kv_num]``; the first ``kv_full``
  of them need no element mask (every key strictly before the query block's segment, no
  padding and, under a window, every key the block's segment can hold at or after the window's
  lower bound of the query block's last row), the rest are masked element-wise through ``kpos``. ``block_mask_to_indices`` builds
  these from a ``[B, Hq, nQB, nKB]`` bool block mask.

Softmax is online in fp32 (exp2 with the scale folded in); fp32 inputs use IEEE fp32 dots.
Rows that see no key are written as 0. Any head dim works (padded to a power of two inside the
kernel), any N, any block size (blocks smaller than 16 run on masked 16-wide tiles).
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

import torch

from .config import PBSConfig
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton
from ...kernels.launch_sizes import pow2_at_least
from ...kernels.token_blocks import check_window, window_lower_bounds
from ...kernels.token_sparse_triton import _window_lo

from ...kernels._triton_env import interpreting

__all__ = [
    "PAD_POS",
    "block_mask_to_indices",
    "key_positions",
    "pbs_block_sparse_attention",
]

PAD_POS = 2**31 - 1


# --------------------------------------------------------------------------- kernel


@triton.jit
def _tile(  # noqa: C901, PLR0912, PLR0915
    acc,
    l_i,
    m_i,
    q,
    offs_m,
    win_lo,
    kb,
    sub_n,
    k_base,
    v_base,
    kpos_base,
    desc_k,
    desc_v,
    desc_row0,
    stride_kn,
    stride_vn,
    N,
    qk_scale,
    offs_d,
    d_ok,
    SPARSE_BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    EVEN_N: tl.constexpr,
    MASK: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    GATHER: tl.constexpr,
    USE_TMA: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
):
    start = kb * SPARSE_BLOCK + sub_n * BLOCK_N
    in_blk = sub_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = kb * SPARSE_BLOCK + in_blk
    if GATHER or MASK:
        kp_ok = offs_n < N
        if not EVEN_N:
            kp_ok = kp_ok & (in_blk < SPARSE_BLOCK)
        kp = tl.load(kpos_base + offs_n, mask=kp_ok, other=2147483647)
    # ---- K
    if USE_TMA:
        k = desc_k.load([desc_row0 + start, 0])
    elif GATHER:
        src = tl.minimum(kp, N - 1)
        if EVEN_D:
            k = tl.load(k_base + src[:, None] * stride_kn + offs_d[None, :])
        else:
            k = tl.load(k_base + src[:, None] * stride_kn + offs_d[None, :], mask=d_ok[None, :], other=0.0)
    else:
        if MASK:
            n_ok = offs_n < N
            k = tl.load(
                k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0
            )
        elif EVEN_D:
            k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :])
        else:
            k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=d_ok[None, :], other=0.0)
    if INTERP:
        # the CPU interpreter mis-multiplies bf16 operands: compute the same products in fp32
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    elif IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if MASK:
        if IS_CAUSAL:
            vis = kp[None, :] <= offs_m[:, None]
            if WINDOW:  # (a padded key's PAD_POS fails the causal side)
                vis = vis & (kp[None, :] >= win_lo[:, None])
        else:
            vis = kp[None, :] < N
        s = tl.where(vis, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        m_use = m_new
        p = tl.math.exp2(s * qk_scale - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    # ---- V
    if USE_TMA:
        v = desc_v.load([desc_row0 + start, 0])
    elif GATHER:
        if EVEN_D:
            v = tl.load(v_base + src[:, None] * stride_vn + offs_d[None, :])
        else:
            v = tl.load(v_base + src[:, None] * stride_vn + offs_d[None, :], mask=d_ok[None, :], other=0.0)
    else:
        if MASK:
            v = tl.load(
                v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0
            )
        elif EVEN_D:
            v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :])
        else:
            v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :], mask=d_ok[None, :], other=0.0)
    if MASK:
        # a padded slot's value out of the product (probability 0 times a NaN value is NaN)
        v = tl.where((kp != 2147483647)[:, None], v, 0.0)
    if INTERP:
        pr = p
        if v.dtype == tl.bfloat16:
            # the interpreter truncates fp32 -> bf16 (its round-to-nearest drops the carry into the
            # exponent); the GPU rounds to nearest even: do that on the bits
            bits = p.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            pr = bits.to(tl.float32, bitcast=True)
        acc = tl.dot(pr.to(v.dtype).to(tl.float32), v.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        acc = tl.dot(p, v, acc, input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def _pbs_fwd_kernel(  # noqa: PLR0915
    Q,
    K,
    V,
    KPOS,
    KV_NUM,
    KV_FULL,
    KV_IDX,
    OUT,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_ob,
    stride_oh,
    stride_on,
    stride_pb,
    stride_ph,
    stride_cb,
    stride_ch,
    stride_ib,
    stride_ih,
    stride_iq,
    H,
    N,
    NQB,
    qk_scale,
    HKV,
    N_BUCKET,
    SLIDING,
    CHUNK,
    KV_GROUP: tl.constexpr,
    P_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPARSE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    MASK_ALL: tl.constexpr,
    GATHER: tl.constexpr,
    USE_TMA: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
):
    # Inductor types a Python float argument fp64 (Triton's JIT: fp32): keep the math in fp32 either way
    qk_scale = tl.cast(qk_scale, tl.float32)
    SUB_M: tl.constexpr = (SPARSE_BLOCK + BLOCK_M - 1) // BLOCK_M
    SUB_N: tl.constexpr = (SPARSE_BLOCK + BLOCK_N - 1) // BLOCK_N
    EVEN_M: tl.constexpr = SPARSE_BLOCK % BLOCK_M == 0
    EVEN_N: tl.constexpr = SPARSE_BLOCK % BLOCK_N == 0
    # a tile wider than the rest of its sparse block reaches into the next block, which need not
    # be selected: then even the "full" tiles take the element mask (slots past the block hide)
    MASK_FULL: tl.constexpr = MASK_ALL | (SPARSE_BLOCK % BLOCK_N != 0)
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    if HEADS_FIRST:  # grid (B*H, tiles): every head's heaviest tile is issued before any lighter one
        bh = tl.program_id(0)
        pid = tl.program_id(1)
    else:
        pid = tl.program_id(0)
        bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    # heaviest query tiles (latest) first, to shorten the causal tail
    tile = NQB * SUB_M - 1 - pid
    qb = tile // SUB_M
    sub_m = tile % SUB_M
    kvh = h // KV_GROUP
    ph = h // P_GROUP

    in_qblk = sub_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_m = qb * SPARSE_BLOCK + in_qblk
    row_ok = offs_m < N
    if not EVEN_M:
        row_ok = row_ok & (in_qblk < SPARSE_BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    win_lo = _window_lo(offs_m, SLIDING, CHUNK, WINDOW)  # each row's first key under its window

    b64 = b.to(tl.int64)
    q_base = Q + b64 * stride_qb + h.to(tl.int64) * stride_qh
    k_base = K + b64 * stride_kb + kvh.to(tl.int64) * stride_kh
    v_base = V + b64 * stride_vb + kvh.to(tl.int64) * stride_vh
    kpos_base = KPOS + b64 * stride_pb + ph.to(tl.int64) * stride_ph
    q = tl.load(q_base + offs_m[:, None] * stride_qn + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    if USE_TMA:
        rows = (tl.num_programs(0) if HEADS_FIRST else tl.num_programs(1)) // H * HKV * N
        desc_k = tl.make_tensor_descriptor(
            K, shape=[rows, HEAD_DIM], strides=[stride_kn, 1], block_shape=[BLOCK_N, BLOCK_D]
        )
        desc_v = tl.make_tensor_descriptor(
            V, shape=[rows, HEAD_DIM], strides=[stride_vn, 1], block_shape=[BLOCK_N, BLOCK_D]
        )
        desc_row0 = (b * HKV + kvh) * N
    else:
        desc_k = K
        desc_v = V
        desc_row0 = 0

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    cnt_off = b64 * stride_cb + h.to(tl.int64) * stride_ch + qb
    n_tot = tl.load(KV_NUM + cnt_off)
    n_full = tl.load(KV_FULL + cnt_off)
    idx_base = KV_IDX + b64 * stride_ib + h.to(tl.int64) * stride_ih + qb.to(tl.int64) * stride_iq

    # First the blocks wholly before the query's segment (no padding): no element mask; then the
    # diagonal segment (element mask by original position), the ragged last block, padding.
    # (Helpers are one call deep so Inductor's copy of the kernel source holds all of them.)
    hi_full = n_full * SUB_N
    hi_all = n_tot * SUB_N
    if INTERP:
        # The CPU interpreter cannot take a loaded scalar as a range bound with NumPy >= 2.3 (it
        # calls int() on a 1-element array); while loops evaluate the same tiles.
        t = hi_full * 0
        while t < hi_full:
            acc, l_i, m_i = _tile(
                acc,
                l_i,
                m_i,
                q,
                offs_m,
                win_lo,
                tl.load(idx_base + t // SUB_N),
                t % SUB_N,
                k_base,
                v_base,
                kpos_base,
                desc_k,
                desc_v,
                desc_row0,
                stride_kn,
                stride_vn,
                N,
                qk_scale,
                offs_d,
                d_ok,
                SPARSE_BLOCK,
                BLOCK_N,
                BLOCK_D,
                EVEN_D,
                EVEN_N,
                MASK_FULL,
                IS_CAUSAL,
                WINDOW,
                GATHER,
                USE_TMA,
                IEEE,
                INTERP,
            )
            t += 1
        while t < hi_all:
            acc, l_i, m_i = _tile(
                acc,
                l_i,
                m_i,
                q,
                offs_m,
                win_lo,
                tl.load(idx_base + t // SUB_N),
                t % SUB_N,
                k_base,
                v_base,
                kpos_base,
                desc_k,
                desc_v,
                desc_row0,
                stride_kn,
                stride_vn,
                N,
                qk_scale,
                offs_d,
                d_ok,
                SPARSE_BLOCK,
                BLOCK_N,
                BLOCK_D,
                EVEN_D,
                EVEN_N,
                True,
                IS_CAUSAL,
                WINDOW,
                GATHER,
                USE_TMA,
                IEEE,
                INTERP,
            )
            t += 1
    else:
        for t in range(0, hi_full):
            kb = tl.load(idx_base + t // SUB_N)
            acc, l_i, m_i = _tile(
                acc,
                l_i,
                m_i,
                q,
                offs_m,
                win_lo,
                kb,
                t % SUB_N,
                k_base,
                v_base,
                kpos_base,
                desc_k,
                desc_v,
                desc_row0,
                stride_kn,
                stride_vn,
                N,
                qk_scale,
                offs_d,
                d_ok,
                SPARSE_BLOCK,
                BLOCK_N,
                BLOCK_D,
                EVEN_D,
                EVEN_N,
                MASK_FULL,
                IS_CAUSAL,
                WINDOW,
                GATHER,
                USE_TMA,
                IEEE,
                INTERP,
            )
        for t in range(hi_full, hi_all):
            kb = tl.load(idx_base + t // SUB_N)
            acc, l_i, m_i = _tile(
                acc,
                l_i,
                m_i,
                q,
                offs_m,
                win_lo,
                kb,
                t % SUB_N,
                k_base,
                v_base,
                kpos_base,
                desc_k,
                desc_v,
                desc_row0,
                stride_kn,
                stride_vn,
                N,
                qk_scale,
                offs_d,
                d_ok,
                SPARSE_BLOCK,
                BLOCK_N,
                BLOCK_D,
                EVEN_D,
                EVEN_N,
                True,
                IS_CAUSAL,
                WINDOW,
                GATHER,
                USE_TMA,
                IEEE,
                INTERP,
            )

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    o_base = OUT + b64 * stride_ob + h.to(tl.int64) * stride_oh
    if INTERP and OUT.dtype.element_ty == tl.bfloat16:
        obits = out.to(tl.uint32, bitcast=True)
        obits = (obits + 0x7FFF + ((obits >> 16) & 1)) & 0xFFFF0000
        out = obits.to(tl.float32, bitcast=True)
    tl.store(
        o_base + offs_m[:, None] * stride_on + offs_d[None, :],
        out.to(OUT.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def _configs():
    if interpreting():
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
    # (BLOCK_M, BLOCK_N, num_warps, num_stages): the autotuner's candidates, as timed on an H200
    # (bf16, D=128, Hq=32/Hkv=8, 100% density): 128x64 on 4 warps is the fastest at 8K and 32K;
    # 128x128 on 8 warps comes next; 4 warps on 128x128 and 64-row tiles are far behind.
    # tl.range(warp_specialize=True) (Triton 3.6) does not compile for 128x64/4 warps on sm_90 and
    # is slower for 128x128/8 warps, so it is not used. At D=64 (Hq=9/Hkv=3, SmolLM2) 128x128 on 4
    # warps is the fastest, 3-4% ahead of 128x64 at 8K and 32K; _prune keeps it to D <= 64.
    table = [
        (128, 64, 4, 2),
        (128, 64, 4, 3),
        (128, 128, 8, 2),
        (128, 128, 8, 3),
        (128, 128, 4, 2),
        (128, 128, 4, 3),
        (64, 64, 4, 3),
        (32, 32, 4, 2),
        (16, 16, 4, 2),
    ]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=st) for m, n, w, st in table]


def _prune(configs, named_args, **kwargs):
    sb = kwargs.get("SPARSE_BLOCK", named_args.get("SPARSE_BLOCK"))
    d = kwargs.get("BLOCK_D", named_args.get("BLOCK_D"))
    tma = kwargs.get("USE_TMA", named_args.get("USE_TMA"))
    fitting = [c for c in configs if c.kwargs["BLOCK_M"] <= max(sb, 16) and c.kwargs["BLOCK_N"] <= max(sb, 16)]
    if tma:
        fitting = [c for c in fitting if sb % c.kwargs["BLOCK_N"] == 0]
    if d is not None and d > 64:  # registers: a 128x128 tile needs 8 warps past D=64
        fitting = [
            c for c in fitting if not (c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] >= 128 * 128 and c.num_warps < 8)
        ]
    if d is not None and d > 128:  # registers: keep tiles small for very large head dims
        fitting = [
            c for c in fitting if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 64 or c.kwargs["BLOCK_N"] <= 32
        ] or fitting
    if not fitting:
        fitting = [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=4, num_stages=1)]
    # keep the largest fitting tiles only (smaller ones are for small sparse blocks)
    best = max(c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] for c in fitting)
    return [c for c in fitting if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] * 4 >= best]


_pbs_fwd_autotuned = triton.autotune(
    configs=_configs(),
    key=[
        "N_BUCKET",
        "HEAD_DIM",
        "SPARSE_BLOCK",
        "IS_CAUSAL",
        "WINDOW",
        "MASK_ALL",
        "GATHER",
        "USE_TMA",
        "KV_GROUP",
        "P_GROUP",
        "HEADS_FIRST",
    ],
    prune_configs_by={"early_config_prune": _prune},
    # the timings go to Triton's on-disk cache (per GPU, Triton version and key), so a second
    # process skips the benchmarking that makes a first call at a new length take seconds
    cache_results=True,
)(_pbs_fwd_kernel)

# Fixed-config launches (benchmarks compare configurations side by side with these).
_FIXED_CONFIG: Optional[dict] = None
# launch order of the forward's programs: True issues every (batch, head)'s heaviest (latest)
# query tile first; False issues one head's tiles after another's; None picks per call
# (:func:`heads_first`). A benchmark switch.
HEADS_FIRST: Optional[bool] = None
# Heads first keeps the GPU full from the first wave but has every head's K/V in flight at once;
# head by head lets one head's tiles share its K/V in L2. On an H200 (50 MB L2; the PBS op,
# benchmarks/pbs_tail.py --orders) heads first is the faster order with K/V of 19 and 75 MB
# (SmolLM2 at 8K and 32K) and the slower with 537 MB (a Llama-8B shape at 32K); at 134 MB (that
# shape at 8K) neither order wins consistently, hence the cut at twice the L2.
HEADS_FIRST_MAX_L2_MULTIPLE = 2.0


def heads_first(k: torch.Tensor, v: torch.Tensor) -> bool:
    """The launch order for K/V ``k``/``v`` as the kernel reads them: heads first while their
    bytes are at most :data:`HEADS_FIRST_MAX_L2_MULTIPLE` x the GPU's L2 (:data:`HEADS_FIRST`
    overrides; off the GPU, head by head)."""
    if HEADS_FIRST is not None:
        return bool(HEADS_FIRST)
    if not k.is_cuda:
        return False
    return heads_first_fits((k.numel() + v.numel()) * k.element_size(), _l2_bytes(k.device.index))


def heads_first_fits(kv_bytes: int, l2_bytes: int) -> bool:
    return kv_bytes <= HEADS_FIRST_MAX_L2_MULTIPLE * l2_bytes


@functools.lru_cache(maxsize=None)
def _l2_bytes(index: Optional[int]) -> int:
    dev = torch.device("cuda", torch.cuda.current_device() if index is None else index)
    return int(getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 0))


def set_fixed_config(cfg: Optional[dict]) -> None:
    """Bypass the autotuner: ``{"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}`` or None."""
    global _FIXED_CONFIG
    _FIXED_CONFIG = cfg


# --------------------------------------------------------------------------- host side


_ALLOCATOR_SET = False


def _ensure_allocator():
    global _ALLOCATOR_SET
    if _ALLOCATOR_SET:
        return

    def alloc(size: int, alignment: int, stream):
        return torch.empty(size, device="cuda", dtype=torch.int8)

    triton.set_allocator(alloc)
    _ALLOCATOR_SET = True


def _tma_ok(q, k, v, gather: bool, allowed: bool = True) -> bool:
    if not allowed or gather or interpreting() or not q.is_cuda:
        return False
    if torch.cuda.get_device_capability(q.device)[0] < 9:
        return False
    d = int(k.shape[-1])
    for t in (k, v):
        # storage_offset (not data_ptr) so the check also runs on fake tensors while tracing;
        # allocations themselves are 256-byte aligned
        if not t.is_contiguous() or (int(t.storage_offset()) * t.element_size()) % 16 or (d * t.element_size()) % 16:
            return False
    return True


def _alloc_out(q: torch.Tensor) -> torch.Tensor:
    # one place to allocate the output, so tests can poison it (every row must be written)
    return torch.empty_like(q)


@triton_op("sparseflow::pbs_block_sparse_fwd", mutates_args={})
def pbs_block_sparse_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kpos: torch.Tensor,
    kv_num: torch.Tensor,
    kv_full: torch.Tensor,
    kv_idx: torch.Tensor,
    scale: float,
    block_size: int,
    is_causal: bool,
    has_padding: bool,
    gather: bool,
    allow_tma: bool = True,
    sliding_window: int = PBSConfig.sliding_window,
    chunk_size: int = PBSConfig.chunk_size,
) -> torch.Tensor:
    b, hq, n, d = (int(x) for x in q.shape)
    hkv = int(k.shape[1])
    out = _alloc_out(q)
    nqb = int(kv_num.shape[2])
    use_tma = _tma_ok(q, k, v, gather, allow_tma)
    if use_tma:
        _ensure_allocator()
    ptrs = (q, k, v, kpos, kv_num, kv_full, kv_idx, out)
    qkvo_strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3])
    index_strides = (*kpos.stride()[:2], *kv_num.stride()[:2], *kv_idx.stride()[:3])
    window = (int(sliding_window), int(chunk_size))
    args = (
        *ptrs,
        *qkvo_strides,
        *index_strides,
        hq,
        n,
        nqb,
        scale * 1.4426950408889634,
        hkv,
        pow2_at_least(n),
        *window,
    )
    meta = dict(
        KV_GROUP=hq // hkv,
        P_GROUP=hq // int(kpos.shape[1]),
        HEAD_DIM=d,
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        SPARSE_BLOCK=block_size,
        IS_CAUSAL=is_causal,
        WINDOW=window != (0, 0),
        MASK_ALL=bool(has_padding),
        GATHER=gather,
        USE_TMA=use_tma,
        IEEE=q.dtype == torch.float32,
        INTERP=interpreting(),
    )
    _launch_fwd(args, meta, nqb, block_size, b * hq, heads_first(k, v))
    return out


def _launch_fwd(args, meta, nqb: int, block_size: int, rows: int, by_heads: bool) -> None:
    """The forward kernel over ``nqb`` sparse query blocks and ``rows`` (batch, head) pairs, in
    the :func:`heads_first` order ``by_heads``: with the fixed config when one is set
    (``set_fixed_config``), else autotuned."""
    fixed = _FIXED_CONFIG
    meta = dict(meta, HEADS_FIRST=by_heads)

    def tiles_and_rows(bm: int):
        tiles = nqb * triton.cdiv(block_size, bm)
        return (rows, tiles) if by_heads else (tiles, rows)

    if fixed is not None:
        bm = fixed["BLOCK_M"]

        def grid(meta_):
            return tiles_and_rows(bm)

        wrap_triton(_pbs_fwd_kernel)[grid](
            *args,
            **meta,
            BLOCK_M=bm,
            BLOCK_N=fixed["BLOCK_N"],
            num_warps=fixed["num_warps"],
            num_stages=fixed["num_stages"],
        )
    else:

        def grid(meta_):
            return tiles_and_rows(meta_["BLOCK_M"])

        wrap_triton(_pbs_fwd_autotuned)[grid](*args, **meta)


@pbs_block_sparse_fwd.register_fake
def _(
    q, k, v, kpos, kv_num, kv_full, kv_idx, scale, block_size, is_causal, has_padding, gather, allow_tma=True,
    sliding_window=PBSConfig.sliding_window, chunk_size=PBSConfig.chunk_size,
):  # fmt: skip
    torch._check(q.dim() == 4 and k.dim() == 4 and v.dim() == 4, lambda: "q, k, v must be 4-D")
    torch._check(
        kpos.dtype == torch.int32 and kv_num.dtype == torch.int32 and kv_idx.dtype == torch.int32,
        lambda: "kpos, kv_num, kv_full, kv_idx must be int32",
    )
    return torch.empty_like(q)


# --------------------------------------------------------------------------- helpers


def key_positions(permutation: torch.Tensor, key_padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[B, Hp, N]`` int32 original position per permuted slot, ``PAD_POS`` where padded."""
    kpos = permutation.to(torch.int32)
    if key_padding_mask is not None:
        valid = torch.gather(key_padding_mask.to(torch.bool)[:, None, :].expand(kpos.shape), 2, permutation.long())
        kpos = torch.where(valid, kpos, torch.full_like(kpos, PAD_POS))
    return kpos.contiguous()


def block_mask_to_indices(
    block_mask: torch.Tensor,
    *,
    num_keys: int,
    block_size: int,
    segment_size: int,
    is_causal: bool,
    has_padding: bool = False,
    sliding_window: int = PBSConfig.sliding_window,
    chunk_size: int = PBSConfig.chunk_size,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[B, H, nQB, nKB]`` bool -> ``(kv_num, kv_full, kv_idx)`` int32 (see module docstring).

    Blocks that need no element mask come first (ascending), then the rest (ascending). A block
    needs a mask when it lies in or after the query block's segment (causal: its keys' original
    positions may exceed a query's), when its segment starts before the local window's lower
    bound of the query block's last row (a key of it may lie before a row's window), when it is
    the ragged last block, or always under padding.
    ``segment_size`` only decides which blocks take the cheaper unmasked path: every mask is
    exact element-wise, so a smaller value (e.g. ``block_size`` when keys are unpermuted) is
    still correct."""
    bsz, h, nqb, nkb = block_mask.shape
    dev = block_mask.device
    kb = torch.arange(nkb, device=dev)
    needs = torch.zeros(nqb, nkb, dtype=torch.bool, device=dev)
    if is_causal:
        qstart = torch.arange(nqb, device=dev) * block_size
        seg_first_block = (qstart // segment_size) * segment_size // block_size
        needs |= kb[None, :] >= seg_first_block[:, None]
    if sliding_window or chunk_size:
        needs |= _window_cuts(nqb, nkb, num_keys, block_size, segment_size, sliding_window, chunk_size, dev)
    if num_keys % block_size:
        needs[:, nkb - 1] = True
    if has_padding:
        needs[:] = True
    sel = block_mask.to(torch.bool)
    key = torch.where(sel, kb + needs.to(kb.dtype) * nkb, kb + 2 * nkb)
    # key < 3*nkb; sort keys are unique per row, so the sort is a plain ascending sort
    sorted_key = torch.sort(key.to(torch.int32), dim=-1).values
    kv_idx = (sorted_key % nkb).to(torch.int32).contiguous()
    kv_num = sel.sum(-1, dtype=torch.int32).contiguous()
    kv_full = (sel & ~needs).sum(-1, dtype=torch.int32).contiguous()
    return kv_num, kv_full, kv_idx


def _window_cuts(nqb, nkb, num_keys, block_size, segment_size, sliding_window, chunk_size, device) -> torch.Tensor:
    """``[nQB, nKB]`` bool: a key of block ``J`` may lie before the window of a row of query block
    ``I`` -- the first key ``J``'s segment holds comes before the window's lower bound of ``I``'s
    last row (the highest bound of the block: the bound rises with the position)."""
    last_row = (torch.arange(1, nqb + 1, device=device) * block_size).clamp_max(num_keys) - 1
    lo = window_lower_bounds(last_row, sliding_window, chunk_size)
    seg_start = torch.arange(nkb, device=device) * block_size // segment_size * segment_size
    return seg_start[None, :] < lo[:, None]


def pbs_block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kpos: torch.Tensor,
    kv_num: torch.Tensor,
    kv_full: torch.Tensor,
    kv_idx: torch.Tensor,
    *,
    scale: Optional[float] = None,
    block_size: int,
    is_causal: bool = True,
    has_padding: bool = False,
    gather: bool = False,
    tma: bool = True,
    sliding_window: int = PBSConfig.sliding_window,
    chunk_size: int = PBSConfig.chunk_size,
) -> torch.Tensor:
    """Python entry to the op; checks the layout (see module docstring). ``tma=False`` keeps the
    kernel off TMA loads even where they would apply (``Tuning.pbs_tma``). ``sliding_window`` /
    ``chunk_size``: a local window's lower bound on every masked block's keys (causal only; the
    block lists must put every block a window can cut among the masked ones:
    :func:`block_mask_to_indices` with the same window does)."""
    check_window(sliding_window, chunk_size, is_causal)
    b, hq, n, d = q.shape
    if k.shape[0] != b or v.shape[:3] != k.shape[:3] or k.shape[2] != n or v.shape[-1] != d or k.shape[-1] != d:
        raise ValueError(
            f"k/v must be [B, H', N, D] matching q {tuple(q.shape)}, got {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if hq % k.shape[1] or hq % kpos.shape[1]:
        raise ValueError(
            f"query heads {hq} must be a multiple of K/V heads {k.shape[1]} and permutation heads {kpos.shape[1]}"
        )
    if not gather and k.shape[1] != kpos.shape[1]:
        raise ValueError("gather=False expects permuted K/V with one head per permutation head")
    nqb = -(-n // block_size)
    if kv_num.shape != (b, hq, nqb) or kv_full.shape != (b, hq, nqb) or kv_idx.shape[:3] != (b, hq, nqb):
        raise ValueError(f"kv_num/kv_full must be [B, Hq, nQB]={(b, hq, nqb)}, kv_idx [B, Hq, nQB, L]")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    if n == 0:
        return torch.empty_like(q)
    return pbs_block_sparse_fwd(
        q,
        k,
        v,
        kpos,
        kv_num,
        kv_full,
        kv_idx,
        scale,
        int(block_size),
        bool(is_causal),
        bool(has_padding),
        bool(gather),
        bool(tma),
        int(sliding_window),
        int(chunk_size),
    )
