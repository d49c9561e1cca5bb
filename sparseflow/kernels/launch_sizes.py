"""Compile-time sizes of kernel launches taken from tensor sizes that may be symbolic.

Under ``torch.compile(dynamic=True)`` a sequence length reaches a ``triton_op`` as a ``SymInt``.
``triton.next_power_of_2`` of it is a symbolic bit-twiddling expression, and Inductor cannot
emit one as a ``tl.constexpr`` (the generated kernel names an unbound symbol). Rounding up by
comparisons instead yields a plain ``int`` and records guards on the length's range, so one
compiled graph serves every length of the same bucket and a longer one recompiles.
"""

from __future__ import annotations

__all__ = ["pow2_at_least"]


def pow2_at_least(x, floor: int = 1) -> int:
    """The smallest power of two ``>= max(x, floor)`` as an ``int`` (``x`` an int or SymInt)."""
    p = 1
    while p < floor:
        p *= 2
    while p < x:
        p *= 2
    return p
