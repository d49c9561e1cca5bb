"""The checks an attention call's arguments pass before anything runs: tensors, mask, scale and
backend (on real and on fake tensors, so errors surface at trace time), a backend's dtypes, and
the config and flag types of the Python entry points."""

from __future__ import annotations

import math

import torch

from . import methods as _methods
from .config import BACKENDS, default_instance
from .masks import check_mask

__all__ = ["TRITON_DTYPES", "validate_inputs", "check_backend_dtype", "check_call_types", "method_config"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # fp64: oracles, gradcheck

# The Triton kernels compute in fp32 from 16/32-bit inputs; fp64 (oracles, gradcheck) runs on the reference.
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_CONFIG_TYPES = tuple(s.config_type for s in _methods.specs())  # the methods that have an op


def validate_inputs(method: str, q, k, v, attn_mask, scale, backend: str, tag: str) -> None:
    """Checks every call makes, on real and on fake tensors (so errors surface at trace time)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    _check_together(q, k, v)
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
        if attn_mask.device != q.device:
            raise ValueError(f"attn_mask must be on {q.device}, got {attn_mask.device}")
        check_mask(attn_mask, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), q.dtype)
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite float or None, got {scale!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")


def _check_tensor(name: str, t) -> None:
    """One of q, k, v on its own: a 4-D floating tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name} must be 4-D [batch, heads, seq, head_dim], got shape {tuple(t.shape)}")
    if t.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")


def _check_together(q, k, v) -> None:
    """q, k and v against each other: one dtype and device, matching batch, heads and lengths."""
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share a dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    qs, ks, vs = q.shape, k.shape, v.shape  # every call pays for these checks: read each shape once
    if not (qs[0] == ks[0] == vs[0]):
        raise ValueError(f"batch sizes of q, k, v must match, got {qs[0]}, {ks[0]}, {vs[0]}")
    if ks[:3] != vs[:3]:
        raise ValueError(f"k and v must agree in batch, heads and length, got k={tuple(ks)}, v={tuple(vs)}")
    if qs[-1] != ks[-1]:
        raise ValueError(f"q and k head dims must match, got q={qs[-1]}, k={ks[-1]}")
    if qs[1] == 0 or ks[1] == 0:
        # (SDPA returns an empty tensor here; a headless attention layer is a bug upstream)
        raise ValueError(f"q and k/v need at least one head, got q={tuple(qs)}, k={tuple(ks)}")
    if qs[1] % ks[1]:
        raise ValueError(f"query heads ({qs[1]}) must be a multiple of key/value heads ({ks[1]})")


def check_backend_dtype(method: str, backend: str, dtype: torch.dtype) -> None:
    """TypeError when an explicitly chosen backend cannot take ``dtype`` (before any kernel compiles)."""
    if backend == "triton" and _methods.spec_for(method).sparse and dtype not in TRITON_DTYPES:
        raise TypeError(
            f"backend='triton' ({method}) takes float16, bfloat16 or float32 q/k/v, got {dtype}; "
            "use backend='reference' (or 'auto') for float64"
        )


def check_call_types(config, is_causal) -> None:
    if not isinstance(config, _CONFIG_TYPES):
        raise TypeError(f"config must be one of {[c.__name__ for c in _CONFIG_TYPES]}, got {type(config).__name__}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")


def method_config(config, cls):
    """``config`` (default ``cls()``) after checking it is a ``cls``: a method's function never
    runs another method's config."""
    if config is None:
        return default_instance(cls)
    if not isinstance(config, cls):
        raise TypeError(
            f"config must be a {cls.__name__} (or None), got {type(config).__name__}; "
            "use sparseflow.ops.attention(config=...) to run any method"
        )
    return config
