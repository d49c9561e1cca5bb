"""PBS-Attn, ``backend="triton"``: same signature and result as ``reference.pbs_attention``.

Stages:

1. proxy key scores, 2. segmented permutation, 3. block selection -- on CUDA the Triton kernels
   of ``triton_select`` (identical selections to the reference in the CPU-interpreter tests and
   in ``benchmarks/pbs.py --part check`` on the H200, and 8.6x faster than the torch stages at
   8K: benchmarks/results/pbs_h200_total_2026-11-29.log); elsewhere (the interpreter) the
   reference's torch stages. ``Tuning(pbs_select="reference"|"triton")`` overrides;
4. attention -- the Triton kernel ``sparseflow::pbs_block_sparse_fwd`` (``triton_attention``).

K/V layout for the kernel (``Tuning.pbs_kv_layout`` = ``"permuted"`` | ``"gather"``):

* ``permuted``: one gather pass writes K/V in permuted order, one head per permutation head
  (``[B, Hp, N, D]``); under per-KV-head permutation that is Hkv heads, so K/V are never
  repeated; under per-query-head permutation each query head has its own key order, so the
  permuted copy has Hq heads. The kernel then streams contiguous tiles (TMA on Hopper).
* ``gather``: the kernel reads the original ``[B, Hkv, N, D]`` K/V rows through the
  permutation (no copy, no TMA).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple, Union

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...config import backend_config
from ...selection import Selection
from ...tuning import DEFAULT_TUNING, Tuning
from ...kernels._triton_env import interpreting
from . import reference as _ref
from .triton_attention import PAD_POS, block_mask_to_indices, key_positions, pbs_block_sparse_attention
from .config import PBSConfig
from .tail import apply_tail, tail_first_block
from .memory import check_selection_memory

__all__ = ["pbs_attention", "permute_kv", "permuted_layout", "pool_query_blocks", "kv_layout", "select_impl"]


def select_impl(device: Optional[torch.device] = None, tuning: Tuning = DEFAULT_TUNING) -> str:
    """``tuning.pbs_select`` resolved for ``device``: ``reference`` (the reference's torch stages
    1-3) or ``triton`` (``triton_select``: Triton proxy scoring, segment sort and the block
    selection that writes the attention's block lists -- for ``scoring="mean"`` one kernel, for
    ``"sampled_rows"`` and ``"antidiagonal"`` after ``triton_estimate``'s one-pass strided
    estimate). ``"auto"``: ``triton`` on CUDA, ``reference`` elsewhere."""
    if tuning.pbs_select != "auto":
        return tuning.pbs_select
    return "triton" if device is not None and device.type == "cuda" else "reference"


def kv_layout(tuning: Tuning = DEFAULT_TUNING) -> str:
    """The attention kernel's K/V layout, ``"permuted"`` or ``"gather"`` (see the module docstring)."""
    return tuning.pbs_kv_layout


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
def _gather_pool_kernel(
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
            first = _ref._first_valid(key_padding_mask, b, n, dev)
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
        valid = _ref._valid_positions(key_padding_mask, bsz, n, q.device)
        return _ref._query_block_means(q, valid, block_size)
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


def pbs_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    config: Optional[PBSConfig] = None,
    *,
    key_padding_mask: Optional[Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    return_selection: bool = False,
    tuning: Tuning = DEFAULT_TUNING,
    **fields,
) -> Union[Tensor, Tuple[Tensor, Selection]]:
    """PBS-Attn prefill with the Triton attention kernel. ``q: [B, Hq, N, D]``,
    ``k, v: [B, Hkv, N, D]`` (Nq == Nk); output ``[B, Hq, N, D]`` in ``q.dtype``. ``tuning``:
    the selection implementation, K/V layout and TMA use (:class:`sparseflow.Tuning`)."""
    cfg = backend_config(PBSConfig, config, fields)
    check_selection_memory(q, cfg.block_size)
    _check_inputs(q, k, v, cfg)
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.to(torch.bool)
    kernels = select_impl(q.device, tuning) == "triton"
    bs, n = cfg.block_size, q.shape[2]
    mask_segment = cfg.segment_size if cfg.permute else bs
    with torch.no_grad():
        perm = _permutation(q.detach(), k.detach(), cfg, key_padding_mask, scale, kernels)
        if kernels:
            out, block_mask = _fused_select_attention(
                q,
                k,
                v,
                perm,
                key_padding_mask=key_padding_mask,
                is_causal=is_causal,
                scale=scale,
                block_size=bs,
                segment_size=cfg.segment_size,
                threshold=cfg.threshold,
                force_sink=cfg.force_sink,
                mask_segment=mask_segment,
                want_mask=return_selection,
                scoring=cfg.scoring,
                antidiagonal_stride=cfg.antidiagonal_stride,
                tuning=tuning,
                dense_from=tail_first_block(n, bs, cfg.dense_tail_blocks),
            )
            return _finish(out, block_mask, perm, key_padding_mask, is_causal, bs, n, return_selection)
        block_mask = _ref.select_blocks(
            q.detach(),
            k.detach(),
            perm,
            key_padding_mask=key_padding_mask,
            is_causal=is_causal,
            scale=scale,
            block_size=bs,
            segment_size=cfg.segment_size,
            threshold=cfg.threshold,
            force_sink=cfg.force_sink,
            scoring=cfg.scoring,
            antidiagonal_stride=cfg.antidiagonal_stride,
        )
        out = attention_from_selection(
            q,
            k,
            v,
            perm,
            block_mask,
            key_padding_mask=key_padding_mask,
            is_causal=is_causal,
            scale=scale,
            block_size=bs,
            segment_size=mask_segment,
            layout=tuning.pbs_kv_layout,
            tma=tuning.pbs_tma,
        )
        out, block_mask = apply_tail(  # under no_grad like the sparse rows: this backend is forward-only
            out, block_mask, q, k, v, cfg, key_padding_mask=key_padding_mask, is_causal=is_causal, scale=scale
        )
    return _finish(out, block_mask, perm, key_padding_mask, is_causal, bs, n, return_selection)


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, cfg: PBSConfig) -> None:
    _, _, n, d = q.shape
    if cfg.gqa_permutation not in ("query_head", "kv_head"):
        raise ValueError(f"gqa_permutation must be 'query_head' or 'kv_head', got {cfg.gqa_permutation!r}")
    if k.shape[2] != n:
        raise ValueError(f"PBS needs Nq == Nk, got Nq={n}, Nk={k.shape[2]}")
    if v.shape[-1] != d:
        raise ValueError(f"the Triton PBS kernel needs v's head dim == q's ({d}), got {v.shape[-1]}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(
            f"the Triton PBS kernel takes float16, bfloat16 or float32 q/k/v, got {q.dtype}; "
            "float64 runs on backend='reference'"
        )


def _permutation(qd: Tensor, kd: Tensor, cfg: PBSConfig, key_padding_mask, scale, kernels: bool) -> Tensor:
    """The key permutation ``[B, Hp, N]`` (identity without ``cfg.permute``), by the Triton
    selection kernels (``kernels``) or the reference."""
    bsz, hq, n = qd.shape[:3]
    if not cfg.permute:
        hp = hq if cfg.gqa_permutation == "query_head" else kd.shape[1]
        return torch.arange(n, device=qd.device).expand(bsz, hp, n).clone()
    if kernels:
        from . import triton_select as _sel

        score_fn, perm_fn = _sel.key_scores, _sel.segment_permutation
    else:
        score_fn, perm_fn = _ref.key_scores, _ref.segment_permutation
    scores = score_fn(
        qd,
        kd,
        key_padding_mask=key_padding_mask,
        scale=scale,
        block_size=cfg.block_size,
        segment_size=cfg.segment_size,
        causal_proxy=cfg.causal_proxy,
        gqa_permutation=cfg.gqa_permutation,
        proxy_blocks=cfg.proxy_blocks,
    )
    return perm_fn(scores, segment_size=cfg.segment_size, key_padding_mask=key_padding_mask)


def _fused_select_attention(
    q,
    k,
    v,
    perm,
    *,
    key_padding_mask,
    is_causal,
    scale,
    block_size,
    segment_size,
    threshold,
    force_sink,
    mask_segment,
    want_mask,
    scoring=PBSConfig.scoring,
    antidiagonal_stride=PBSConfig.antidiagonal_stride,
    tuning: Tuning = DEFAULT_TUNING,
    dense_from: Optional[int] = None,
):
    """Stages 2-4 on the Triton kernels: ``(out, block mask or None)``. Query blocks from
    ``dense_from`` on (the dense tail) keep every visible key block, so the attention kernel
    computes their rows exactly, in the same launch as the sparse ones."""
    from .triton_select import select_block_lists

    has_pad = key_padding_mask is not None and not bool(key_padding_mask.all())
    kpm = key_padding_mask if has_pad else None
    gather = kv_layout(tuning) == "gather"
    # the strided estimates stream the permuted keys: written even when the attention gathers
    strided = scoring != "mean" and float(threshold) < 1.0
    # one launch: permuted K/V (unless the kernel gathers), pooled key blocks, positions, sink
    lay = permuted_layout(
        k,
        None if gather else v,
        perm,
        key_padding_mask=kpm,
        block_size=block_size,
        write_kv=strided or not gather,
        pool=True,
        positions=True,
        sink=force_sink,
    )
    kv_num, kv_full, kv_idx, block_mask = select_block_lists(
        q,
        lay.k,
        perm,
        key_padding_mask=kpm,
        is_causal=is_causal,
        scale=scale,
        block_size=block_size,
        segment_size=segment_size,
        threshold=threshold,
        force_sink=force_sink,
        mask_segment=mask_segment,
        return_block_mask=want_mask,
        layout=lay,
        scoring=scoring,
        antidiagonal_stride=antidiagonal_stride,
        padding_checked=True,
        dense_from=dense_from,
    )
    kk, vv = (k, v) if gather else (lay.k, lay.v)
    out = pbs_block_sparse_attention(
        q,
        kk,
        vv,
        lay.kpos,
        kv_num,
        kv_full,
        kv_idx,
        scale=scale,
        block_size=block_size,
        is_causal=is_causal,
        has_padding=has_pad,
        gather=gather,
        tma=tuning.pbs_tma,
    )
    return out, block_mask


def _finish(out, block_mask, perm, key_padding_mask, is_causal, block_size, n, return_selection):
    if not return_selection:
        return out
    density = _ref.selection_density(
        block_mask, perm, key_padding_mask=key_padding_mask, is_causal=is_causal, block_size=block_size
    )
    sel = Selection(
        method="pbs",
        density=density,
        block_size=block_size,
        is_causal=is_causal,
        num_keys=n,
        block_mask=block_mask,
        permutation=perm,
        key_padding_mask=key_padding_mask,
    )
    return out, sel


def attention_from_selection(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    permutation: Tensor,
    block_mask: Tensor,
    *,
    key_padding_mask: Optional[Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    block_size: int = PBSConfig.block_size,
    segment_size: int = PBSConfig.segment_size,
    layout: Optional[str] = None,
    tma: bool = True,
) -> Tensor:
    """Step 4 alone: the Triton kernel over a given permutation ``[B, Hp, N]`` and block mask
    ``[B, Hq, nB, nB]`` (the reference's ``permuted_block_attention`` contract; forward only).
    ``layout`` (default ``Tuning().pbs_kv_layout``) and ``tma`` as in :class:`sparseflow.Tuning`."""
    layout = kv_layout() if layout is None else layout
    n = q.shape[2]
    has_pad = key_padding_mask is not None and not bool(key_padding_mask.all())
    kpos = key_positions(permutation, key_padding_mask if has_pad else None)
    kv_num, kv_full, kv_idx = block_mask_to_indices(
        block_mask,
        num_keys=n,
        block_size=block_size,
        segment_size=segment_size,
        is_causal=is_causal,
        has_padding=has_pad,
    )
    if layout == "gather":
        kk, vv, gather = k, v, True
    else:
        kk, vv, gather = permute_kv(k, permutation), permute_kv(v, permutation), False
    return pbs_block_sparse_attention(
        q,
        kk,
        vv,
        kpos,
        kv_num,
        kv_full,
        kv_idx,
        scale=scale,
        block_size=block_size,
        is_causal=is_causal,
        has_padding=has_pad,
        gather=gather,
        tma=tma,
    )
