"""Which implementation of a method runs a call, and how it is called: an explicit backend
checked against the device, the fast candidates ``backend="auto"`` may measure, the backend a
backward recomputes through, and the implementation's call with the config, mask and tuning."""

from __future__ import annotations

import functools
import importlib.util
from typing import Callable, List, Optional

import torch

from . import methods as _methods
from .kernels._triton_env import interpreting
from .op_schema import ConfigEntry
from .op_validation import TRITON_DTYPES

__all__ = [
    "DENSE_CHOICE",
    "triton_installed",
    "triton_usable",
    "resolve_backend",
    "fast_backends",
    "grad_backend",
    "load",
    "call_impl",
]

DENSE_CHOICE = "sdpa"  # what the auto chooser calls dense attention among its candidates

_FAST_BACKENDS = ("triton", "flex")  # the candidates backend='auto' measures, in this order


@functools.lru_cache(maxsize=None)
def triton_installed() -> bool:
    # an installation does not change within a process; find_spec costs microseconds per call
    return importlib.util.find_spec("triton") is not None


def triton_usable(device: torch.device) -> bool:
    if device.type != "cuda" and not interpreting():
        return False
    return triton_installed()


def resolve_backend(method: str, backend: str, device: torch.device, dtype: Optional[torch.dtype] = None) -> str:
    """The concrete backend for a call; ``auto`` here is the static part of the choice (reference
    off CUDA, else ``"measure"``: the plan times the fast backends on the call, see autobackend)."""
    if backend == "auto":
        if device.type == "cuda" and fast_backends(method, device, dtype):
            return "measure"
        return "reference"
    _methods.spec_for(method).backend(backend)  # ValueError naming the available ones
    if backend == "triton" and not triton_usable(device):
        raise ValueError(
            f"backend='triton' needs CUDA tensors (got {device}) and an installed triton; "
            "on the CPU use backend='reference' or 'flex' (or TRITON_INTERPRET=1 for kernel tests)"
        )
    return backend


def fast_backends(method: str, device: torch.device, dtype: Optional[torch.dtype] = None) -> List[str]:
    fast = [b for b in _FAST_BACKENDS if b in _methods.spec_for(method).backends]
    return [b for b in fast if b != "triton" or (triton_usable(device) and dtype in (None,) + TRITON_DTYPES)]


def grad_backend(method: str, backend: str, device: torch.device) -> str:
    """The backend the backward recomputes through: the forward's when autograd can
    differentiate it on ``device``, else the reference (which selects the same blocks)."""
    impl = _methods.spec_for(method).backends.get(backend)
    return backend if impl is not None and impl.differentiable_on(device.type) else "reference"


def load(method: str, backend: str) -> Callable:
    return _methods.spec_for(method).backend(backend).load()


def call_impl(method: str, backend: str, entry: ConfigEntry, q, k, v, mask, scale, return_selection: bool):
    """One implementation's call: the config object, the mask analysis's form of the mask (a
    MaskAnalysis or a MaskView), and the tuning for an implementation that declares it takes one (``Backend.tuned``)."""
    spec = _methods.spec_for(method).backend(backend)
    impl = spec.load()
    extra = {"tuning": entry.tuning} if spec.tuned else {}
    cfg = entry.cfg
    if (mask.sliding_window, mask.chunk_size) != (cfg.sliding_window, cfg.chunk_size):
        cfg = cfg.replace(sliding_window=mask.sliding_window, chunk_size=mask.chunk_size)  # a mask's window
    return impl(
        q,
        k,
        v,
        cfg,
        key_padding_mask=mask.key_padding_mask,
        is_causal=mask.is_causal,
        scale=scale,
        return_selection=return_selection,
        **extra,
    )
