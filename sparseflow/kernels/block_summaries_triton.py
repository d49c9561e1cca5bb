"""Per-leaf-block key sums in Triton, shared by the PISA pyramid and the BSA selector.

Imported lazily; this module imports Triton. One program per (leaf block, batch x KV head) sums
the block's valid keys in fp32 and records the valid-key count and the first valid position
(``Nk`` when the block has none), the inputs of both methods' block summaries.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

__all__ = ["leaf_sums"]


@triton.jit
def _leaf_kernel(
    k_ptr,
    kpm_ptr,
    sums_ptr,
    cnt_ptr,
    fv_ptr,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_sb,
    stride_sh,
    stride_st,
    Nk,
    n_leaves,
    HKV,
    HAS_KPM: tl.constexpr,
    C: tl.constexpr,
    CP: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
):
    leaf = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # 64-bit offsets: batch x head strides pass 2**31 elements at long contexts
    b = bh // HKV
    h = bh % HKV
    offs_c = tl.arange(0, CP)
    offs_d = tl.arange(0, DP)
    pos = leaf * C + offs_c
    ok = (offs_c < C) & (pos < Nk)
    if HAS_KPM:
        ok = ok & (tl.load(kpm_ptr + b * Nk + pos, mask=ok, other=0) != 0)
    kt = tl.load(
        # 64-bit: a key position times its row stride can pass 2**31 elements
        k_ptr + b * stride_kb + h * stride_kh + pos.to(tl.int64)[:, None] * stride_kn + offs_d[None, :],
        mask=ok[:, None] & (offs_d[None, :] < D),
        other=0.0,
    ).to(tl.float32)
    s = tl.sum(kt, axis=0)
    row = sums_ptr + b * stride_sb + h * stride_sh + leaf.to(tl.int64) * stride_st  # 64-bit: leaf index x row stride
    tl.store(row + offs_d, s, mask=offs_d < D)
    if h == 0:
        tl.store(cnt_ptr + b * n_leaves + leaf, tl.sum(ok.to(tl.int32), axis=0))
        first = tl.min(tl.where(ok, pos, Nk), axis=0)
        tl.store(fv_ptr + b * n_leaves + leaf, first)


@triton_op("sparseflow::leaf_block_sums", mutates_args={})
def leaf_sums(
    k: torch.Tensor, kpm: Optional[torch.Tensor], block_size: int
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``k [B, Hkv, Nk, D]``, ``kpm [B, Nk]`` int8 or None -> (sums ``[B, Hkv, nB, D]`` fp32,
    valid counts ``[B, nB]`` int32, first valid positions ``[B, nB]`` int32)."""
    b, hkv, n_k, d = k.shape
    n_leaves = max(1, -(-n_k // block_size))
    sums = torch.empty(b, hkv, n_leaves, d, dtype=torch.float32, device=k.device)
    cnt = torch.empty(b, n_leaves, dtype=torch.int32, device=k.device)
    lfv = torch.empty(b, n_leaves, dtype=torch.int32, device=k.device)
    wrap_triton(_leaf_kernel)[(n_leaves, b * hkv)](
        k,
        kpm if kpm is not None else cnt,
        sums,
        cnt,
        lfv,
        k.stride(0),
        k.stride(1),
        k.stride(2),
        sums.stride(0),
        sums.stride(1),
        sums.stride(2),
        n_k,
        n_leaves,
        hkv,
        HAS_KPM=kpm is not None,
        C=block_size,
        CP=max(16, triton.next_power_of_2(block_size)),
        D=d,
        DP=max(16, triton.next_power_of_2(d)),
    )
    return sums, cnt, lfv


@leaf_sums.register_fake
def _(k, kpm, block_size):
    b, hkv, n_k, d = k.shape
    n = max(1, -(-n_k // block_size))
    return (
        k.new_empty(b, hkv, n, d, dtype=torch.float32),
        k.new_empty(b, n, dtype=torch.int32),
        k.new_empty(b, n, dtype=torch.int32),
    )
