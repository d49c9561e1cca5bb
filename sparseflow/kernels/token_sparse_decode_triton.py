"""Split-K ("flash-decoding") attention over per-token selected key blocks, for decoding: one or
a few query rows. The forward-only counterpart of ``token_sparse_triton`` for that case.

Imported lazily; this module imports Triton.

Contract: ``token_sparse_attention``'s (``block_indices [B, Hkv, Nq, K]``, ``-1`` = unused, in any
slot; the ``G`` query heads of a KV head share its blocks; query ``i`` sits at key position
``i + Nk - Nq`` and sees key ``j`` iff ``j``'s block is selected, ``j < Nk``, the key is valid and,
causally, ``j <= p_i``; a query that sees no key outputs 0). A block id listed twice counts twice,
as in ``attend_selected_blocks``.

Why a second kernel: at decode time ``token_sparse_fwd`` runs one program per (batch, query head)
that walks its ``K`` blocks one after another -- a few dozen programs on a GPU of a hundred SMs,
latency-bound. Here the grid is (batch * KV heads * query rows, splits): each program attends
with all ``G`` query heads of its KV head (``G`` rows of one dot, so each key block is loaded once
for the group) to one contiguous slice of the row's ``K`` slots and writes its unnormalised fp32
output, row max and sum of exponentials; a second kernel merges the splits exactly
(log-sum-exp). Not differentiable: training and prefill use ``token_sparse_attention``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from ._triton_env import interpreting
from .launch_sizes import sm_count
from .token_sparse_triton import last_dim_contiguous, online_softmax_step

__all__ = ["token_sparse_decode", "token_sparse_decode_fwd", "decode_splits", "DECODE_ROWS"]

DECODE_ROWS = 8  # the most query rows the callers send here (prefill tiles rows instead)
_LOG2E = 1.4426950408889634
_KEYS_PER_ITER = 128  # keys one loop step loads (several small blocks at once: more loads in flight)
_DEFAULT_PROGRAMS = 128  # the split target without a CUDA device to ask (interpreter, compile check)


def _p2(x: int, lo: int = 1) -> int:
    return max(lo, triton.next_power_of_2(int(x)))


def decode_splits(groups: int, n_slots: int, device: Optional[torch.device] = None) -> int:
    """How many splits of ``n_slots`` selected blocks the ``groups`` (batch * KV heads * query
    rows) get: about one program per SM in all, every split non-empty."""
    if n_slots <= 0:
        return 1
    target = _DEFAULT_PROGRAMS
    if device is not None and torch.device(device).type == "cuda":
        target = sm_count(torch.device(device))
    per = -(-n_slots // max(1, -(-target // max(1, groups))))
    return -(-n_slots // per)


# --------------------------------------------------------------------------- kernels


@triton.jit
def _visible_keys(
    sel_row, kpm_ptr, b, slot, hi, c, Nk, hz, C: tl.constexpr, HAS_KPM: tl.constexpr, IS_CAUSAL: tl.constexpr
):
    """Key positions of the slots ``slot`` (one lane per key) and which of them this row sees: a
    hidden or unheld key is never loaded, so a NaN in its slot cannot reach a product."""
    kb = tl.load(sel_row + slot, mask=slot < hi, other=-1)
    kpos = kb.to(tl.int64) * C + c  # 64-bit: times a row stride, a position can pass 2**31 elements
    ok = (kb >= 0) & (c < C) & (kpos < Nk)
    if IS_CAUSAL:
        ok = ok & (kpos <= hz)
    if HAS_KPM:
        ok = ok & (tl.load(kpm_ptr + b * Nk + kpos, mask=ok, other=0) != 0)
    return kpos, ok


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    sel_ptr,
    kpm_ptr,
    acc_ptr,
    m_ptr,
    l_ptr,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_sb,
    stride_sh,
    stride_sn,
    Nq,
    Nk,
    HKV,
    qk_scale,
    G: tl.constexpr,
    MP: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    C: tl.constexpr,
    CP: tl.constexpr,
    TOPK: tl.constexpr,
    PER: tl.constexpr,
    NB: tl.constexpr,
    HAS_KPM: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    IEEE: tl.constexpr,
):
    # Inductor types a Python float argument fp64 (Triton's JIT: fp32): keep the math in fp32 either way
    qk_scale = tl.cast(qk_scale, tl.float32)
    grp = tl.program_id(0)  # (b, hkv, query row)
    split = tl.program_id(1)
    n_split = tl.num_programs(1)
    i = grp % Nq
    bh = (grp // Nq).to(tl.int64)  # 64-bit offsets: batch x head strides pass 2**31 elements at long contexts
    b = bh // HKV
    hkv = bh % HKV
    hz = i + Nk - Nq
    offs_g = tl.arange(0, MP)
    offs_d = tl.arange(0, DP)
    offs_t = tl.arange(0, NB * CP)  # NB blocks side by side, CP lanes each
    c = offs_t % CP
    g_ok = offs_g < G
    d_ok = offs_d < D
    heads = hkv * G + offs_g
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + i * stride_qn + offs_d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    sel_row = sel_ptr + b * stride_sb + hkv * stride_sh + i * stride_sn
    k_base = k_ptr + b * stride_kb + hkv * stride_kh
    v_base = v_ptr + b * stride_vb + hkv * stride_vh
    m_i = tl.full([MP], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([MP], dtype=tl.float32)
    acc = tl.zeros([MP, DP], dtype=tl.float32)
    j = split * PER
    hi = tl.minimum(j + PER, TOPK)
    while j < hi:
        kpos, ok = _visible_keys(sel_row, kpm_ptr, b, j + offs_t // CP, hi, c, Nk, hz, C, HAS_KPM, IS_CAUSAL)
        k_t = tl.load(k_base + kpos[None, :] * stride_kn + offs_d[:, None], mask=ok[None, :] & d_ok[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q.to(tl.float32), k_t.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k_t)
        s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
        vt = tl.load(v_base + kpos[:, None] * stride_vn + offs_d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        acc, l_i, m_i = online_softmax_step(acc, l_i, m_i, s, vt, IEEE)
        j += NB
    # partials [groups, splits, G, (DP)]: this split's rows side by side
    part = (grp * n_split + split) * G + offs_g
    tl.store(acc_ptr + part[:, None] * DP + offs_d[None, :], acc, mask=g_ok[:, None])
    tl.store(m_ptr + part, m_i, mask=g_ok)
    tl.store(l_ptr + part, l_i, mask=g_ok)


@triton.jit
def _decode_combine_kernel(
    acc_ptr,
    m_ptr,
    l_ptr,
    o_ptr,
    flag_ptr,
    stride_ob,
    stride_oh,
    stride_on,
    Nq,
    HKV,
    S,
    G: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    SP: tl.constexpr,
    HAS_FLAG: tl.constexpr,
):
    """One program per (b, KV head, query row, query head of the group): the exact log-sum-exp
    merge of its splits (NaN everywhere while ``flag_ptr[0]`` is set)."""
    grp = tl.program_id(0)
    g = tl.program_id(1)
    i = grp % Nq
    bh = grp // Nq
    b = bh // HKV
    h = (bh % HKV) * G + g
    offs_s = tl.arange(0, SP)
    offs_d = tl.arange(0, DP)
    s_ok = offs_s < S
    part = (grp * S + offs_s) * G + g
    m = tl.load(m_ptr + part, mask=s_ok, other=float("-inf"))
    l_s = tl.load(l_ptr + part, mask=s_ok, other=0.0)
    acc = tl.load(acc_ptr + part[:, None] * DP + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    m_all = tl.max(m, axis=0)
    w = tl.exp2(m - tl.where(m_all == float("-inf"), 0.0, m_all))  # an empty split: exp2(-inf) = 0
    total = tl.sum(l_s * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    if HAS_FLAG:
        out = tl.where(tl.load(flag_ptr) != 0, float("nan"), out)
    tl.store(
        o_ptr + b * stride_ob + h * stride_oh + i * stride_on + offs_d, out.to(o_ptr.dtype.element_ty), mask=offs_d < D
    )


# --------------------------------------------------------------------------- op


def _split_meta(q, k, block_size, top_k, splits):
    """The split kernel's constexprs: ``PER`` slots per split, ``NB`` blocks per loop step."""
    g, d = q.shape[1] // k.shape[1], q.shape[-1]
    cp = _p2(block_size, 16)  # a dot's N is at least 16 on the GPU (the interpreter takes any)
    per = max(1, -(-top_k // splits))
    nb = 1
    while nb * 2 <= per and nb * 2 * cp <= _KEYS_PER_ITER:
        nb *= 2
    ieee = q.dtype == torch.float32 or interpreting()  # the interpreter's 16-bit dot is unreliable
    return dict(G=g, MP=_p2(g, 16), D=d, DP=_p2(d, 16), C=block_size, CP=cp, TOPK=top_k, PER=per, NB=nb, IEEE=ieee)


@triton_op("sparseflow::token_sparse_decode_fwd", mutates_args={})
def token_sparse_decode_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sel: torch.Tensor,
    kpm: Optional[torch.Tensor],
    nan_flag: Optional[torch.Tensor],
    scale: float,
    block_size: int,
    is_causal: bool,
    splits: int,
) -> torch.Tensor:
    """``[B, Hq, Nq, D]`` in q's dtype; ``kpm`` int8 ``[B, Nk]`` (nonzero = a valid key) or None;
    ``nan_flag`` uint8 ``[1]`` (nonzero: the whole output NaN) or None. Last dims contiguous."""
    b, hq, n_q, d = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    out = torch.empty_like(q)
    if b == 0 or n_q == 0:
        return out
    meta = _split_meta(q, k, block_size, sel.shape[-1], splits)
    groups, g, dp = b * hkv * n_q, meta["G"], meta["DP"]
    acc = torch.empty(groups, splits, g, dp, dtype=torch.float32, device=q.device)
    m = torch.empty(groups, splits, g, dtype=torch.float32, device=q.device)
    l_s = torch.empty_like(m)
    wrap_triton(_decode_split_kernel)[(groups, splits)](
        q,
        k,
        v,
        sel,
        kpm if kpm is not None else sel,
        acc,
        m,
        l_s,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        sel.stride(0),
        sel.stride(1),
        sel.stride(2),
        n_q,
        n_k,
        hkv,
        scale * _LOG2E,
        HAS_KPM=kpm is not None,
        IS_CAUSAL=is_causal,
        num_warps=4,
        num_stages=2,
        **meta,
    )
    wrap_triton(_decode_combine_kernel)[(groups, g)](
        acc,
        m,
        l_s,
        out,
        nan_flag if nan_flag is not None else m,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        n_q,
        hkv,
        splits,
        G=g,
        D=d,
        DP=dp,
        SP=_p2(splits),
        HAS_FLAG=nan_flag is not None,
        num_warps=4,
    )
    return out


@token_sparse_decode_fwd.register_fake
def _(q, k, v, sel, kpm, nan_flag, scale, block_size, is_causal, splits):
    return torch.empty_like(q)


def _check_inputs(q, k, v, block_indices, key_padding_mask, block_size, splits) -> None:
    b, hq, n_q, d = q.shape
    if v.shape[-1] != d:
        raise ValueError(f"the split-K decode kernel needs v's head dim == q's ({d}), got {v.shape[-1]}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(
            f"the split-K decode kernel takes q, k, v of one dtype of fp16 / bf16 / fp32, got "
            f"{q.dtype}, {k.dtype}, {v.dtype}"
        )
    if hq % k.shape[1]:
        raise ValueError(f"q's heads must be a multiple of the {k.shape[1]} KV heads, got {hq}")
    if tuple(block_indices.shape[:3]) != (b, k.shape[1], n_q):
        raise ValueError(
            f"block_indices must be [{b}, {k.shape[1]}, {n_q}, K] (batch, KV heads, query rows, "
            f"blocks), got {list(block_indices.shape)}"
        )
    if key_padding_mask is not None and tuple(key_padding_mask.shape) != (b, k.shape[2]):
        raise ValueError(
            f"key_padding_mask must be [{b}, {k.shape[2]}] (batch, keys; True = a valid key), got "
            f"{list(key_padding_mask.shape)}"
        )
    if int(block_size) < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size}")
    if splits is not None and int(splits) < 1:
        raise ValueError(f"splits must be a positive int or None (chosen for the device), got {splits}")


def token_sparse_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_indices: torch.Tensor,
    *,
    key_padding_mask: Optional[torch.Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    block_size: int,
    splits: Optional[int] = None,
) -> torch.Tensor:
    """``token_sparse_attention``'s contract and result for a few query rows (forward only), split
    over the selected blocks (``splits``: how many slices of the ``K`` slots; None = one program
    per SM in all)."""
    _check_inputs(q, k, v, block_indices, key_padding_mask, block_size, splits)
    b, hq, n_q, d = q.shape
    kk = block_indices.shape[-1]
    if b == 0 or n_q == 0 or k.shape[2] == 0 or kk == 0:  # nothing to attend: 0, as a row seeing no key
        return q.new_zeros(b, hq, n_q, d)
    sc = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if splits is None:
        splits = decode_splits(b * k.shape[1] * n_q, kk, q.device)
    sel = block_indices.to(device=q.device, dtype=torch.int32)
    kpm = None if key_padding_mask is None else key_padding_mask.to(device=q.device, dtype=torch.int8).contiguous()
    q, k, v, sel = (last_dim_contiguous(t) for t in (q, k, v, sel))
    return token_sparse_decode_fwd(q, k, v, sel, kpm, None, sc, int(block_size), bool(is_causal), min(int(splits), kk))
