"""What plain eager attention calls remember between calls, so a repeat skips the work its first
call did: the plan per call signature (in the default chooser, which ``clear()`` empties), and
in a caller's own ``known`` dict (``sparseflow.ops.attention_any_layout``) which signatures run
dense and the in-place CUDA graph its last sparse call replayed.

A caller's repeat of a sparse call that replayed an in-place CUDA graph (a model's layer,
forward after forward) replays it again from what the call matches alone: the same tensors'
addresses, layouts and flags, on the same stream, in the same mode. Everything the full path
decides from is in that match or checked per call, so the result is the full path's; the full
path's own checks cost a replayed call more host time than its kernels' launch.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from . import autobackend as _autobackend
from . import graph_replay as _graph_replay
from . import recording as _capture
from .op_execute import INTERCEPTOR
from .op_plan import Plan
from .op_replay import TOKENS_MAJOR, needs_autograd
from .op_schema import CACHE_LIMIT

__all__ = [
    "LAST_REPLAY",
    "LastReplay",
    "plain_eager",
    "call_signature",
    "plan_memo_key",
    "memoized_plan",
    "remember_plan",
    "note_known",
    "replay_site",
    "replay_again",
]

LAST_REPLAY = object()  # the key of a caller's LastReplay in its ``known`` dict

_KNOWN_LIMIT = 64  # signatures per caller (decode steps grow the key length: each is new)


class LastReplay(NamedTuple):
    site: Tuple  # replay_site of the call
    handle: "_graph_replay.ReplayHandle"


def plain_eager(q, k, v, attn_mask) -> bool:
    """True for plain tensors run eagerly: no compiler, fake or proxy tensors, dispatch or
    function modes, functorch transforms or autocast, all of which must see the op itself."""
    tensor = torch.Tensor
    return (
        type(q) is tensor
        and type(k) is tensor
        and type(v) is tensor
        and (attn_mask is None or type(attn_mask) is tensor)
        and not torch.compiler.is_compiling()
        and not torch._C._len_torch_dispatch_stack()
        and not torch._C._is_torch_function_mode_enabled()
        and not torch._C._are_functorch_transforms_active()
        and not torch._C._is_any_autocast_enabled()
    )


# --------------------------------------------------------------------------- plans per call signature


def call_signature(q, k, v, is_causal, scale, backend) -> Tuple:
    """What a call's plan depends on besides the config, tuning, backend and tag (cf.
    :func:`plan_memo_key`)."""
    return (
        is_causal,
        scale,
        q.shape,
        k.shape,
        v.shape,
        q.dtype,
        k.dtype,
        v.dtype,
        q.device,
        k.device,
        v.device,
    )


def plan_memo_key(config, tuning, q, k, v, is_causal, scale, backend, tag):
    """The key under which a plain eager call without a mask or context parallelism remembers
    its plan, or None when an argument cannot be part of a key (those calls plan afresh).
    Every input the validation and the plan read is in it; the config and tuning by identity
    (the memo keeps them alive and checks them on a hit)."""
    if type(tag) is not str or not (scale is None or type(scale) in (int, float)):
        return None
    return _memo_of(config, tuning, backend, tag, call_signature(q, k, v, is_causal, scale, backend))


def _memo_of(config, tuning, backend, tag, sig: Tuple) -> Tuple:
    return (id(config), id(tuning), backend, tag) + sig


def memoized_plan(memo, config, tuning) -> Optional[Plan]:
    """The plan remembered under ``memo`` for this very config and tuning, or None."""
    hit = _autobackend.default_chooser.planned_calls.get(memo)
    if hit is not None and hit[0] is config and hit[1] is tuning:
        return hit[2]
    return None


def remember_plan(memo, config, tuning, plan: Plan) -> None:
    planned = _autobackend.default_chooser.planned_calls
    if len(planned) >= CACHE_LIMIT:
        planned.clear()
    planned[memo] = (config, tuning, plan)


# --------------------------------------------------------------------------- a caller's notes


def note_known(known, sig, config, tuning, backend, tag) -> None:
    """Note in ``known`` the dense reason (None: sparse) of the plan the call just remembered
    (under :func:`plan_memo_key`, which is ``sig`` behind the caller's fixed arguments)."""
    memo = None if type(tag) is not str else _memo_of(config, tuning, backend, tag, sig)
    plan = None if memo is None else memoized_plan(memo, config, tuning)
    if plan is None:
        return
    if len(known) >= _KNOWN_LIMIT:
        known.clear()
    known[sig] = (_autobackend.default_chooser.generation, plan.reason)


def replay_site(q, k, v, is_causal, scale, backend) -> Tuple:
    """Everything a plain eager sparse call's path to its graph depends on besides the caller's
    fixed config, tuning, backend and tag: the plan's signature (:func:`call_signature`), the
    inputs' addresses and strides, the stream and the chooser's generation."""
    stream = torch._C._cuda_getCurrentRawStream(q.device.index) if q.is_cuda else None
    return call_signature(q, k, v, is_causal, scale, backend) + (
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        q.stride(),
        k.stride(),
        v.stride(),
        stream,
        _autobackend.default_chooser.generation,
    )


def replay_again(last: LastReplay, q, k, v, is_causal, scale, backend) -> Optional[torch.Tensor]:
    """The output of ``last``'s graph when this call is its repeat and may replay (see
    op_replay.replayable; what the key of op_replay.replayed_impl holds is in the site), else None."""
    if replay_site(q, k, v, is_causal, scale, backend) != last.site:
        return None
    if needs_autograd(q, k, v, None) or INTERCEPTOR.get() is not None or _capture.active_capture() is not None:
        return None
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    return _graph_replay.default_replays.replay_handle(last.handle, TOKENS_MAJOR)
