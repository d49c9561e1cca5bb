"""Compile-time sizes of kernel launches taken from tensor sizes that may be symbolic.

Under ``torch.compile(dynamic=True)`` a sequence length reaches a ``triton_op`` as a ``SymInt``.
``triton.next_power_of_2`` of it is a symbolic bit-twiddling expression, and Inductor cannot
emit one as a ``tl.constexpr`` (the generated kernel names an unbound symbol). Rounding up by
comparisons instead yields a plain ``int`` and records guards on the length's range, so one
compiled graph serves every length of the same bucket and a longer one recompiles.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["pow2_at_least", "sm_count"]


def pow2_at_least(x, floor: int = 1) -> int:
    """The smallest power of two ``>= max(x, floor)`` as an ``int`` (``x`` an int or SymInt)."""
    p = 1
    while p < floor:
        p *= 2
    while p < x:
        p *= 2
    return p


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (its index, or the current device)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
