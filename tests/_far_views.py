"""Tensors 2**31 elements or more into one CPU buffer, for the kernels' 64-bit offset tests.

The buffer is reserved but never written except where a test copies data or a kernel stores, so
only those pages are ever allocated. Every view starts at least ``FAR_START`` elements into it:
an offset that a 32-bit product wraps (2**31 and past, less than 2**32) lands before the views,
on zero pages inside the buffer, so the unfixed kernels read or write wrong but valid memory
(a wrong answer, not a crash).
"""

from __future__ import annotations

from typing import Sequence, Tuple

import pytest
import torch

FAR_START = 2**31

Spec = Tuple[Sequence[int], Sequence[int], int]  # (shape, strides, offset past FAR_START)


def far_views(specs: Sequence[Spec], dtype: torch.dtype, device: str):
    """One strided view per spec into a fresh buffer of ``dtype``, or a skip where the views
    cannot work (not the CPU, or that address space cannot be reserved)."""
    if device != "cpu":
        pytest.skip("the strided views rely on untouched CPU pages staying unallocated")
    end = max(off + sum((n - 1) * st for n, st in zip(shape, strides)) for shape, strides, off in specs)
    try:
        big = torch.empty(FAR_START + end + 1, dtype=dtype)
    except RuntimeError:
        pytest.skip(f"cannot reserve {FAR_START + end + 1} {dtype} elements of address space")
    return [big.as_strided(shape, strides, FAR_START + off) for shape, strides, off in specs]


def allocate_as(monkeypatch, shape: Sequence[int], dtype: torch.dtype, view: torch.Tensor) -> None:
    """``torch.empty(*shape, dtype=dtype, ...)`` returns ``view`` (a kernel's output, placed far
    with the strides it gets); every other allocation is the usual one."""
    empty = torch.empty

    def far_empty(*size, **kw):
        if tuple(size) == tuple(shape) and kw.get("dtype") == dtype:
            return view
        return empty(*size, **kw)

    monkeypatch.setattr(torch, "empty", far_empty)


def blinded(near: torch.Tensor, far: torch.Tensor) -> torch.Tensor:
    """A copy of ``near`` with zeros where ``far`` (its far copy) holds elements 2**31 or more
    past its first one: what an unfixed kernel reads there (zero pages before the views)."""
    offsets = torch.zeros(far.shape, dtype=torch.int64)
    for dim, (n, stride) in enumerate(zip(far.shape, far.stride())):
        shape = [1] * far.dim()
        shape[dim] = n
        offsets = offsets + (torch.arange(n) * stride).view(shape)
    return near.masked_fill(offsets >= 2**31, 0)
