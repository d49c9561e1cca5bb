"""PBS-Attn's permuted K/V layout: one Triton gather kernel that writes K (and V) in the
permutation's key order and, in the same pass, what the selection reads from it (each permuted
key block's mean over its valid keys, the slots' original positions, the sink block). Query block
means go through the same kernel with the identity order.

The selection (``triton_select``), the strided estimates (``triton_estimate``) and the backend
(``triton_impl``) all read this layout, so it sits below them. Imported lazily; imports Triton.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...kernels._triton_env import interpreting
from .estimate import query_block_means
from .reference_common import first_valid, valid_positions
from .config import PBSConfig
from .triton_attention import PAD_POS

__all__ = ["PermutedLayout", "permute_kv", "permute_kv_torch", "permuted_layout", "pool_query_blocks"]


def _use_kernels(t: Tensor) -> bool:
    """Triton kernels for tensors on CUDA, or anywhere under the CPU interpreter."""
    return t.is_cuda or interpreting()


@triton.jit
def _slot_rows(
    p_base, KPM, b64, blk, r0, N, BLOCK: tl.constexpr, ROWS: tl.constexpr, IDENTITY: tl.constexpr, HAS_PAD: tl.constexpr
):
    """(slots, in range, source rows, valid) of ``ROWS`` permuted slots from ``blk * BLOCK + r0``:
    the original row each slot holds and whether that row is a valid (unpadded) token."""
    slot = blk * BLOCK + r0 + tl.arange(0, ROWS)
    s_ok = slot < N
    if IDENTITY:
        src = slot.to(tl.int64)
    else:
        src = tl.load(p_base + slot, mask=s_ok, other=0).to(tl.int64)
    if HAS_PAD:
        valid = s_ok & (tl.load(KPM + b64 * N + src, mask=s_ok, other=0) != 0)
    else:
        valid = s_ok
    return slot, s_ok, src, valid


@triton.jit
def _gather_pool_kernel(  # noqa: C901, PLR0912, PLR0915
    X,
    Y,
    PERM,
    KPM,
    FIRST,
    XOUT,
    YOUT,
    POOLED,
    COUNT,
    KPOS,
    SINK,
    HP,
    HX,
    N,
    NB,
    stride_xb,
    stride_xh,
    stride_xn,
    stride_yb,
    stride_yh,
    stride_yn,
    stride_pb,
    stride_ph,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    IDENTITY: tl.constexpr,
    WRITE_X: tl.constexpr,
    WRITE_Y: tl.constexpr,
    POOL: tl.constexpr,
    FALLBACK_ALL: tl.constexpr,
    WRITE_POS: tl.constexpr,
    FIND_SINK: tl.constexpr,
    HAS_PAD: tl.constexpr,
    PAD_VALUE: tl.constexpr,
):
    """One program per (block of ``BLOCK`` permuted slots, batch * permutation head): copies the
    rows ``X[b, p // (HP // HX), PERM[b, p, slot]]`` (and ``Y``'s) to ``XOUT/YOUT[b, p, slot]``
    (contiguous ``[B, HP, N, D]``), and optionally writes the block's fp32 mean over its valid
    rows (``POOLED [B, HP, nB, D]``) with its valid-row count (``COUNT``), the original position
    per slot (``KPOS``, ``PAD_VALUE`` where padded) and the block holding the row's first valid
    token (``SINK [B, HP]``). 64-bit row addresses; rows are D contiguous values."""
    blk = tl.program_id(0)
    bp = tl.program_id(1)
    b = bp // HP
    p = bp % HP
    xh = p // (HP // HX)
    b64 = b.to(tl.int64)
    bp64 = bp.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    x_base = X + b64 * stride_xb + xh.to(tl.int64) * stride_xh
    y_base = Y + b64 * stride_yb + xh.to(tl.int64) * stride_yh
    p_base = PERM + b64 * stride_pb + p.to(tl.int64) * stride_ph
    if FIND_SINK:
        if HAS_PAD:
            first = tl.load(FIRST + b)  # -1: no valid token
        else:
            first = 0
    if POOL:
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        cnt = tl.sum(tl.zeros([ROWS], dtype=tl.int32), 0)
        use_all = cnt < 0
        if FALLBACK_ALL:
            if HAS_PAD:
                # a block without a valid position is pooled over all its in-range positions
                for r0 in tl.static_range(0, BLOCK, ROWS):
                    _, _, _, ok = _slot_rows(p_base, KPM, b64, blk, r0, N, BLOCK, ROWS, IDENTITY, HAS_PAD)
                    cnt += tl.sum(ok.to(tl.int32), 0)
                use_all = cnt == 0
                cnt = cnt * 0
    for r0 in tl.static_range(0, BLOCK, ROWS):
        slot, s_ok, src, valid = _slot_rows(p_base, KPM, b64, blk, r0, N, BLOCK, ROWS, IDENTITY, HAS_PAD)
        m2 = s_ok[:, None] & d_ok[None, :]
        out_rows = (bp64 * N + slot)[:, None] * HEAD_DIM + offs_d[None, :]
        x = tl.load(x_base + src[:, None] * stride_xn + offs_d[None, :], mask=m2, other=0.0)
        if WRITE_X:
            tl.store(XOUT + out_rows, x, mask=m2)
        if POOL:
            w = valid
            if FALLBACK_ALL:
                w = tl.where(use_all, s_ok, valid)
            acc += tl.sum(tl.where(w[:, None], x.to(tl.float32), 0.0), 0)
            cnt += tl.sum(w.to(tl.int32), 0)
        if WRITE_Y:
            y = tl.load(y_base + src[:, None] * stride_yn + offs_d[None, :], mask=m2, other=0.0)
            tl.store(YOUT + out_rows, y, mask=m2)
        if WRITE_POS:
            pos = tl.where(valid, src.to(tl.int32), PAD_VALUE)
            tl.store(KPOS + bp64 * N + slot, pos, mask=s_ok)
        if FIND_SINK:
            hit = s_ok & (src == first)
            tl.store(SINK + bp64 + slot * 0, blk + slot * 0, mask=hit)
    if POOL:
        mean = acc / tl.maximum(cnt, 1).to(tl.float32)
        tl.store(POOLED + (bp64 * NB + blk) * HEAD_DIM + offs_d, mean, mask=d_ok)
        tl.store(COUNT + bp64 * NB + blk, cnt)


class PermutedLayout(NamedTuple):
    """What :func:`permuted_layout` returns (``None`` for what was not asked for)."""

    k: Optional[Tensor]  # [B, Hp, N, D] permuted K
    v: Optional[Tensor]  # [B, Hp, N, D] permuted V
    kbar: Optional[Tensor]  # [B, Hp, nB, D] fp32 mean of each permuted key block over its valid keys
    kcount: Optional[Tensor]  # [B, Hp, nB] int32 valid keys per permuted block
    kpos: Optional[Tensor]  # [B, Hp, N] int32 original position per slot, PAD_POS where padded
    sink: Optional[Tensor]  # [B, Hp] int32 permuted block of the row's first valid token, -1 if none


def _launch_gather(
    x,
    y,
    permutation,
    *,
    key_padding_mask,
    block_size,
    write_x,
    write_y,
    pool,
    fallback_all,
    positions,
    sink,
    identity=False,
    hp=None,
):
    """One ``_gather_pool_kernel`` launch; returns ``(xo, yo, pooled, count, kpos, sink)``, None
    for each output not asked for."""
    b, hx, n, d = x.shape
    hp = permutation.shape[1] if hp is None else hp
    nb = -(-n // block_size)
    x, y, permutation = (None if t is None else _unit_last_stride(t) for t in (x, y, permutation))
    buffers = _gather_buffers(
        x,
        y,
        key_padding_mask,
        hp=hp,
        nb=nb,
        write_x=write_x,
        write_y=write_y,
        pool=pool,
        positions=positions,
        sink=sink,
    )
    yy = y if y is not None else x
    pp = permutation if permutation is not None else x
    perm_strides = pp.stride()[:2] if permutation is not None else (0, 0)
    block_d = triton.next_power_of_2(d)
    _gather_pool_kernel[(nb, b * hp)](
        x,
        yy,
        pp,
        *(t if t is not None else x for t in buffers),  # x stands in for the unused ones
        hp,
        hx,
        n,
        nb,
        *x.stride()[:3],
        *yy.stride()[:3],
        *perm_strides,
        HEAD_DIM=d,
        BLOCK_D=block_d,
        BLOCK=block_size,
        ROWS=_gather_rows(block_size, block_d),
        IDENTITY=identity,
        WRITE_X=write_x,
        WRITE_Y=write_y,
        POOL=pool,
        FALLBACK_ALL=fallback_all,
        WRITE_POS=positions,
        FIND_SINK=sink,
        HAS_PAD=key_padding_mask is not None,
        PAD_VALUE=PAD_POS,
        num_warps=4,
    )
    return buffers[2:]


def _unit_last_stride(t: Tensor) -> Tensor:
    # the kernel reads rows as D contiguous values
    return t if t.stride(-1) == 1 else t.contiguous()


def _gather_buffers(x, y, key_padding_mask, *, hp, nb, write_x, write_y, pool, positions, sink):
    """The gather kernel's pointer arguments after X, Y, PERM, in its order: ``(kpm, first, xo, yo,
    pooled, count, kpos, sink)``, None for those the launch does not use."""
    b, _, n, d = x.shape
    dev = x.device
    has_pad = key_padding_mask is not None
    xo = torch.empty(b, hp, n, d, dtype=x.dtype, device=dev) if write_x else None
    yo = torch.empty(b, hp, n, y.shape[-1], dtype=y.dtype, device=dev) if write_y else None
    pooled = torch.empty(b, hp, nb, d, dtype=torch.float32, device=dev) if pool else None
    count = torch.empty(b, hp, nb, dtype=torch.int32, device=dev) if pool else None
    kpos = torch.empty(b, hp, n, dtype=torch.int32, device=dev) if positions else None
    first = None
    sink_out = None
    if sink:
        if has_pad:
            first = first_valid(key_padding_mask, b, n, dev)
            sink_out = torch.full((b, hp), -1, dtype=torch.int32, device=dev)
        else:
            sink_out = torch.empty(b, hp, dtype=torch.int32, device=dev)  # every row has token 0
    kpm = key_padding_mask.to(torch.int8).contiguous() if has_pad else None
    return kpm, first, xo, yo, pooled, count, kpos, sink_out


def _gather_rows(block_size: int, block_d: int) -> int:
    """Rows per step of the gather kernel: a power of two dividing ``block_size``, at most 64 and
    at most 8192 values of ``block_d`` columns."""
    rows = max(1, min(block_size, 8192 // block_d, 64))
    rows = min(rows, triton.next_power_of_2(block_size))
    if block_size % rows:
        rows = 1 << ((block_size & -block_size).bit_length() - 1)  # largest power of two dividing bs
    return rows


def permuted_layout(
    k: Tensor,
    v: Optional[Tensor],
    permutation: Tensor,
    *,
    key_padding_mask: Optional[Tensor] = None,
    block_size: int = PBSConfig.block_size,
    write_kv: bool = True,
    pool: bool = True,
    positions: bool = True,
    sink: bool = True,
) -> PermutedLayout:
    """One Triton launch (CUDA, or the CPU interpreter) producing everything the selection and the
    attention kernel need from K/V and the permutation ``[B, Hp, N]``: the permuted K and V
    (``write_kv``; exactly ``permute_kv``'s tensors), the fp32 pooled permuted key blocks with
    their valid-key counts (``pool``; the reference's key-block means), the slots' original
    positions (``positions``; ``key_positions``'s tensor) and the sink block per permutation head
    (``sink``). ``key_padding_mask`` ``[B, N]`` bool, None when nothing is padded."""
    write_v = write_kv and v is not None
    if v is not None and v.shape[-1] != k.shape[-1]:
        vo = permute_kv(v, permutation) if write_v else None
        write_v = False
    else:
        vo = None
    kk, vv, kbar, kcnt, kpos, snk = _launch_gather(
        k,
        v if write_v else None,
        permutation,
        key_padding_mask=key_padding_mask,
        block_size=block_size,
        write_x=write_kv,
        write_y=write_v,
        pool=pool,
        fallback_all=False,
        positions=positions,
        sink=sink,
    )
    return PermutedLayout(kk, vv if vv is not None else vo, kbar, kcnt, kpos, snk)


def pool_query_blocks(q: Tensor, key_padding_mask: Optional[Tensor], block_size: int) -> Tensor:
    """fp32 ``[B, Hq, nB, D]`` query block means over the valid positions (all in-range positions
    for a block with none: the reference's rule), one Triton launch (torch on CPU)."""
    if not _use_kernels(q):
        bsz, _, n, _ = q.shape
        valid = valid_positions(key_padding_mask, bsz, n, q.device)
        return query_block_means(q, valid, block_size)
    return _launch_gather(
        q,
        None,
        None,
        key_padding_mask=key_padding_mask,
        block_size=block_size,
        write_x=False,
        write_y=False,
        pool=True,
        fallback_all=True,
        positions=False,
        sink=False,
        identity=True,
        hp=q.shape[1],
    )[2]


def permute_kv(x: Tensor, permutation: Tensor) -> Tensor:
    """``[B, Hkv, N, D]`` -> ``[B, Hp, N, D]`` with slot ``j`` of permutation head ``p`` holding
    row ``permutation[b, p, j]`` of KV head ``p // (Hp // Hkv)`` (no repeat first). On CUDA (or the
    interpreter) one Triton gather launch; elsewhere one torch ``index_select``."""
    b, hkv, n, d = x.shape
    hp = permutation.shape[1]
    if _use_kernels(x) and n > 0 and b * hp > 0:
        return _launch_gather(
            x,
            None,
            permutation,
            key_padding_mask=None,
            block_size=128,
            write_x=True,
            write_y=False,
            pool=False,
            fallback_all=False,
            positions=False,
            sink=False,
        )[0]
    return permute_kv_torch(x, permutation)


def permute_kv_torch(x: Tensor, permutation: Tensor) -> Tensor:
    """The torch path of :func:`permute_kv` (one ``index_select``)."""
    b, hkv, n, d = x.shape
    hp = permutation.shape[1]
    kv_of_p = torch.arange(hp, device=x.device) // (hp // hkv)  # [Hp]
    base = (torch.arange(b, device=x.device)[:, None] * hkv + kv_of_p[None, :]) * n  # [B, Hp]
    rows = (base[:, :, None] + permutation).reshape(-1)
    return x.reshape(b * hkv * n, d).index_select(0, rows).view(b, hp, n, d)
