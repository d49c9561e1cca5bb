"""PBS's block-level working set, checked before a call allocates it.

The selection holds block scores for every (query block, key block) pair of every query head:
``B * Hq * (N / block_size)**2`` fp32 entries, a few times over (logits, probabilities, their
sort). With a tiny ``block_size`` at long lengths that is quadratic in N (``block_size=1`` at
16K: 1 GiB a head and tensor), so a call whose estimate exceeds the memory its device has free
is refused with the numbers, instead of dying in the allocator.
"""

from __future__ import annotations

import os

import torch

__all__ = ["check_selection_memory", "selection_bytes"]

_COPIES = 3  # block logits, their softmax and the sorted copy live together in the selection


def selection_bytes(batch: int, heads: int, n: int, block_size: int) -> int:
    blocks = -(-n // block_size)
    return _COPIES * 4 * batch * heads * blocks * blocks


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # no such counter here: nothing to check against
        return -1


def check_selection_memory(q: torch.Tensor, block_size: int) -> None:
    """A ValueError naming ``block_size`` and N when the selection's working set would not fit
    in the device's free memory (meta tensors and unknown free memory pass)."""
    if q.is_meta:
        return
    b, hq, n = q.shape[0], q.shape[1], q.shape[2]
    need = selection_bytes(b, hq, n, block_size)
    free = _free_bytes(q.device)
    if 0 <= free < need:
        raise ValueError(
            f"PBS with block_size={block_size} at N={n} needs about {need / 2**30:.1f} GiB for its block scores "
            f"(B={b} x Hq={hq} x {-(-n // block_size)}^2 blocks), more than the {free / 2**30:.1f} GiB free on "
            f"{q.device}; use a larger block_size (the default is 128)"
        )
