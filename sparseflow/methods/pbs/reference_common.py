"""What the stages of PBS's plain-PyTorch reference share: each batch row's effective length,
valid and first valid positions, the block count, the permutation padded to whole blocks and
which of its slots hold a real key, which permutation a query head reads, and the softmax
helpers. The Triton stages read the same rows through these functions.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

__all__ = [
    "softmax_scale",
    "num_blocks",
    "safe_softmax",
    "effective_lengths",
    "first_valid",
    "padded_permutation",
    "valid_positions",
    "slot_validity",
    "permutation_head_of",
]


def softmax_scale(scale: Optional[float], d: int) -> float:
    """``scale``, or ``1 / sqrt(d)`` when it is None (SDPA's default)."""
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


def num_blocks(n: int, block_size: int) -> int:
    """``ceil(n / block_size)``: the last block may be partial."""
    return -(-n // block_size)


def safe_softmax(x: Tensor, dim: int = -1) -> Tensor:
    """Softmax that returns zeros (not NaN) for a slice whose entries are all -inf."""
    empty = torch.isneginf(x.amax(dim=dim, keepdim=True))
    return torch.softmax(x, dim=dim).masked_fill(empty, 0.0)


def effective_lengths(key_padding_mask: Optional[Tensor], batch: int, n: int, device=None) -> Tensor:
    """``[B]`` int64: ``1 + last valid position`` per row (``N`` without a mask, 0 if all padded)."""
    if key_padding_mask is None:
        return torch.full((batch,), n, dtype=torch.int64, device=device)
    pos = torch.arange(1, n + 1, device=key_padding_mask.device)
    return torch.where(key_padding_mask.bool(), pos, torch.zeros_like(pos)).amax(dim=-1)


def first_valid(key_padding_mask: Optional[Tensor], batch: int, n: int, device) -> Tensor:
    """``[B]`` int64: first valid position per row, -1 for an all-padded row."""
    if key_padding_mask is None:
        return torch.zeros(batch, dtype=torch.int64, device=device)
    kpm = key_padding_mask.bool()
    first = kpm.to(torch.int8).argmax(dim=-1)
    return torch.where(kpm.any(dim=-1), first, torch.full_like(first, -1))


def padded_permutation(permutation: Tensor, n_blocks: int, block_size: int) -> Tensor:
    """``[B, Hp, nB*bs]``: the permutation with -1 in the slots past N (partial last block)."""
    b, hp, n = permutation.shape
    total = n_blocks * block_size
    if total == n:
        return permutation.contiguous()
    pad = permutation.new_full((b, hp, total - n), -1)
    return torch.cat([permutation, pad], dim=-1)


def valid_positions(key_padding_mask: Optional[Tensor], batch: int, n: int, device) -> Tensor:
    """``[B, N]`` bool: the positions that are not padding (all of them without a mask)."""
    if key_padding_mask is None:
        return torch.ones(batch, n, dtype=torch.bool, device=device)
    return key_padding_mask.bool()


def slot_validity(permutation: Tensor, key_padding_mask: Optional[Tensor], n_blocks: int, block_size: int) -> Tensor:
    """``[B, Hp, nB*bs]`` bool: the permuted slot holds a real (in range, not padded) key."""
    bsz, hp, n = permutation.shape
    perm_p = padded_permutation(permutation, n_blocks, block_size)
    ok = perm_p >= 0
    if key_padding_mask is not None:
        kpm_ext = torch.cat([key_padding_mask.bool(), key_padding_mask.new_zeros(bsz, 1).bool()], dim=-1)
        idx = torch.where(ok, perm_p, torch.full_like(perm_p, n))
        ok = ok & torch.gather(kpm_ext[:, None, :].expand(bsz, hp, n + 1), 2, idx)
    return ok


def permutation_head_of(hq: int, hp: int) -> Tensor:
    """``[Hq]`` int64: the permutation head each query head reads (``Hp`` divides ``Hq``)."""
    return torch.arange(hq) // (hq // hp)
