"""Running a planned op call: dense SDPA with its reason, one generate() step through the
method's decode cache, or the sparse backend (replayed from a CUDA graph when it may be), and
the call's record in the active capture. Also the context-local interceptor that answers op
calls instead of running them (:func:`intercepting`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Iterator, Optional, Tuple

import torch

from . import decode_state as _decode_state
from . import methods as _methods
from . import recording as _capture
from .op_backends import call_impl, grad_backend
from .op_plan import Plan
from .op_replay import TOKENS_MAJOR, replayed_or_launched
from .op_windows import dense_sdpa

__all__ = ["OpInterceptor", "INTERCEPTOR", "intercepting", "execute", "tokens_major", "tokens_major_empty"]

# An analysis that needs the arguments of every op call but not the sparse result (the ONNX
# export reads the mask each call receives) answers the calls itself inside ``intercepting``.
# A ContextVar, not a swapped module attribute: other threads and contexts keep running the ops.
OpInterceptor = Callable[[str, Tuple], torch.Tensor]

INTERCEPTOR: contextvars.ContextVar[Optional[OpInterceptor]] = contextvars.ContextVar(
    "sparseflow_interceptor", default=None
)


@contextlib.contextmanager
def intercepting(fn: OpInterceptor) -> Iterator[None]:
    """Within the block, every sparseflow op call in this context returns ``fn(method, args)``
    (``args`` as the op received them, the tag last) instead of running its implementation."""
    token = INTERCEPTOR.set(fn)
    try:
        yield
    finally:
        INTERCEPTOR.reset(token)


def execute(
    method: str, plan: Plan, args: Tuple, *, record: bool, for_grad: bool, twice: bool, contiguous: bool = True
) -> torch.Tensor:
    """Run ``args`` (validated) as ``plan`` says: dense SDPA with its reason, a decode step, or the
    sparse backend; record the call in the active capture. ``contiguous=False``: the result may
    come in ``[B, N, H, D]`` memory order (SDPA's flash and cuDNN kernels write it so; a replay's
    copy lands there for free), for a caller that transposes it back to that order."""
    q, k, v, attn_mask, is_causal, scale = args[:6]
    tag = args[-1]
    cap = _capture.active_capture() if record else None
    if plan.reason is not None:
        out = dense_sdpa(method, tag, plan.reason, q, k, v, attn_mask, is_causal, scale, cap, plan.window)
        return out.contiguous() if contiguous else out
    mask, chosen = plan.mask, plan.backend
    if for_grad:
        chosen = "reference" if twice else grad_backend(method, chosen, q.device)
    want_sel = cap is not None and cap.keep_selections
    decode = _decode_of(method, chosen, q, k, v, mask)
    if decode is not None:
        state, step = decode
        if record:
            _capture.note_call(method, tag, True)
        out, sel = step(state, tag, plan.entry.cfg, plan.entry.tuning, q, k, v, scale, cap is not None)
        _record_sparse(cap, tag, method, chosen, q, k, sel, want_sel)
        return out.contiguous()
    if cap is None and not for_grad:
        layout = None if contiguous else TOKENS_MAJOR
        out, sel = replayed_or_launched(method, chosen, plan.entry, q, k, v, mask, scale, layout), None
    else:
        result = call_impl(method, chosen, plan.entry, q, k, v, mask, scale, cap is not None)
        out, sel = result if isinstance(result, tuple) else (result, None)
    _record_sparse(cap, tag, method, chosen, q, k, sel, want_sel)
    if record:
        _capture.note_call(method, tag, True)
    return out.contiguous() if contiguous else out


def _decode_of(method: str, chosen: str, q, k, v, mask) -> Optional[Tuple[Any, Callable]]:
    """(the model's decode state, the method's decode step) when this call is one generate()
    step the method's cache serves: one query over cached keys, no padding, no gradient."""
    if q.shape[2] != 1 or k.shape[2] <= 1:  # a prefill: the common case, decided first
        return None
    decode = _methods.spec_for(method).decode
    if decode is None or chosen != decode.backend:
        return None
    if mask.key_padding_mask is not None:
        return None
    state = _decode_state.current()
    if state is None or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        return None
    return state, decode.load()


def _record_sparse(cap, tag: str, method: str, chosen: str, q, k, sel, want_sel: bool) -> None:
    if cap is not None:
        kept = sel if (sel is None or want_sel) else _strip(sel)
        cap.calls.append(_capture.CallRecord(tag, method, chosen, True, "", tuple(q.shape), tuple(k.shape), kept))


def _strip(sel):
    # keep the density, drop the (large) block tensors
    return dataclasses.replace(sel, block_mask=None, permutation=None, block_indices=None, key_padding_mask=None)


def tokens_major(out: torch.Tensor) -> torch.Tensor:
    """``out`` (``[B, H, N, D]``) in ``[B, N, H, D]`` memory order, the op's output layout: what
    SDPA's flash and cuDNN kernels return, so that the model's ``transpose(1, 2)`` back to tokens
    and heads is free. A result already laid out so is returned as it is, others are copied."""
    if out.transpose(1, 2).is_contiguous():
        return out
    return tokens_major_empty(out, out.shape[-1]).copy_(out)


def tokens_major_empty(like: torch.Tensor, head_dim: int) -> torch.Tensor:
    """An uninitialised ``[B, H, N, head_dim]`` tensor like ``like`` (``[B, H, N, *]``), laid out
    ``[B, N, H, head_dim]`` in memory (see :func:`tokens_major`)."""
    b, h, n = like.shape[:3]
    return like.new_empty(b, n, h, head_dim).transpose(1, 2)
