"""Programmatic dependent launch (PDL, Hopper and later) for chains of short kernels.

A kernel launched with ``launch_pdl=True`` may be scheduled while the kernel before it in the
stream is still finishing its last programs; it must not touch memory until that kernel has
completed. Every kernel that takes a ``PDL`` flag therefore starts with :func:`pdl_start`: it lets
the next kernel of the chain be scheduled (``griddepcontrol.launch_dependents``) and then waits
for the previous one (``griddepcontrol.wait``), before its first load or store. What the chain
saves is the launch and set-up gap between kernels, which short latency-bound kernels pay at
every boundary. Imported lazily; this module imports Triton.
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._triton_env import interpreting

__all__ = ["pdl_start", "pdl_launch", "device_supports"]

_log = logging.getLogger("sparseflow")


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """The first statement of a kernel that may be launched with PDL (nothing when ``PDL`` is off)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@functools.lru_cache(maxsize=None)
def _capability_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def device_supports(t: torch.Tensor) -> bool:
    """Whether kernels on ``t``'s device may chain: compiled (not interpreted) CUDA of compute
    capability 9 or more."""
    return t.is_cuda and not interpreting() and _capability_major(t.device.index or 0) >= 9


def pdl_launch(t: torch.Tensor, wanted: bool) -> dict:
    """The launch arguments of a PDL-capable kernel working on ``t``'s device: ``PDL`` and
    ``launch_pdl``, on when ``wanted`` and :func:`device_supports` (else the plain launch).
    Traced by ``torch.compile`` the launch is plain (logged once): Inductor launches a user
    kernel through its own launcher, which has not been checked with the launch attribute."""
    on = bool(wanted) and device_supports(t)
    if on and torch.compiler.is_compiling():
        _note_plain_under_compile()
        on = False
    return {"PDL": on, "launch_pdl": on}


@functools.lru_cache(maxsize=1)
def _note_plain_under_compile() -> None:
    _log.info("sparseflow: Tuning(pdl=True) launches plainly inside torch.compile (eager calls and CUDA graphs chain)")
