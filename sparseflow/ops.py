"""The ``sparseflow::*_attention`` custom ops (fake implementations, autograd) and the Python
entry points that call them.

Torch-only and registered at import; Triton and FlexAttention backends are imported lazily the
first time they are asked for. One op per method, whose schema is derived from the method's
config dataclass, so a config field and an op argument can never drift apart:

    sparseflow::<method>_attention(Tensor q, Tensor k, Tensor v, Tensor? attn_mask,
        bool is_causal, float? scale, <config fields...>, <tuning fields...>, str backend, str tag) -> Tensor

The tuning fields are the method's fields of :class:`sparseflow.Tuning` (launch options of the
Triton backends; none for dense and BSA), carried the same way so they are read per call.

``tag`` names the module the call came from (the rewrite pass fills it) so reports and logged
fallbacks say which layer they are about. The Python entry points ``pbs_attention`` etc. below
take a config object instead of loose arguments.

A call passes through these modules, each with one job: :mod:`~sparseflow.op_schema` (the
argument lists and the configs they describe), :mod:`~sparseflow.op_validation`,
:mod:`~sparseflow.op_plan` (dense with a reason, or which sparse backend; ``backend="auto"`` in
:mod:`~sparseflow.autobackend`), :mod:`~sparseflow.op_execute` (dense SDPA from
:mod:`~sparseflow.op_windows`, a decode step, or the backend of :mod:`~sparseflow.op_backends`,
replayed through :mod:`~sparseflow.op_replay` when it may be), and :mod:`~sparseflow.op_memo`
(what repeated eager calls skip).
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import autobackend as _autobackend
from . import context_parallel as _cp
from . import methods as _methods
from . import op_validation as _validation
from . import recording as _capture
from .config import AttentionConfig, BSAConfig, DenseConfig, PBSConfig, PISAConfig
from .op_execute import INTERCEPTOR, execute, intercepting, tokens_major, tokens_major_empty
from .op_memo import (
    LAST_REPLAY,
    LastReplay,
    call_signature,
    memoized_plan,
    note_known,
    plain_eager,
    plan_memo_key,
    remember_plan,
    replay_again,
    replay_site,
)
from .op_plan import PREPARED, Plan, checked_plan, plan_call, prepared_plan
from .op_replay import REPLAY_NOTE, needs_autograd
from .op_train import keeps_graph, kept_graph_call
from .op_schema import IMPLEMENTATIONS, add_method_tables, config_call, op_args, op_for, schema
from .op_validation import check_call_types, method_config
from .op_windows import dense_sdpa
from .tuning import DEFAULT_TUNING, Tuning, check_tuning

__all__ = [
    "attention",
    "dense_attention",
    "pbs_attention",
    "pisa_attention",
    "bsa_attention",
    "op_for",
    "op_args",
    "intercepting",
    "IMPLEMENTATIONS",
]


# --------------------------------------------------------------------------- registration


def _run(
    method: str,
    args: Tuple,
    *,
    record: bool = True,
    for_grad: bool = False,
    twice: bool = False,
    contiguous: bool = True,
) -> torch.Tensor:
    """The real implementation behind every op: analyse, fall back or dispatch, record.
    ``for_grad``: the backward's recomputation (same choice as the forward, through a
    differentiable backend); ``twice``: through the reference, whose plain torch ops autograd
    differentiates twice (double backward; the kernels' backward passes are not differentiable).
    ``contiguous=False``: the result may come in either memory order (see ``execute``)."""
    interceptor = INTERCEPTOR.get()
    if interceptor is not None:
        return interceptor(method, args)
    plan = prepared_plan(method, args) or checked_plan(method, args)
    return execute(method, plan, args, record=record, for_grad=for_grad, twice=twice, contiguous=contiguous)


def _define(method: str) -> None:
    name = f"sparseflow::{method}_attention"
    bwd_name = f"sparseflow::{method}_attention_backward"
    torch.library.define(name, schema(method))
    torch.library.define(
        bwd_name,
        schema(method)
        .replace("(Tensor q", "(Tensor grad_out, Tensor q")
        .replace("-> Tensor", "-> (Tensor, Tensor, Tensor)"),
    )

    @torch.library.impl(name, "CompositeExplicitAutograd")
    def _impl(*args):
        return tokens_major(_run(method, args, contiguous=False))

    @torch.library.register_fake(name)
    def _fake(*args):
        q, k, v, attn_mask, is_causal, scale = args[:6]
        _validation.validate_inputs(method, q, k, v, attn_mask, scale, args[-2], args[-1])
        _validation.check_backend_dtype(method, args[-2], q.dtype)
        return tokens_major_empty(q, v.shape[-1])

    @torch.library.impl(bwd_name, "CompositeExplicitAutograd")
    def _bwd_impl(grad_out, *args):
        # Recompute the forward with autograd on: the selection is made without gradient by the
        # implementation itself, so gradients flow through the attention over selected keys only.
        q, k, v = (t.detach().requires_grad_(True) for t in args[:3])
        # Recompute with the forward's choice (dense, or sparse through that backend when it is
        # differentiable, else through the reference, which selects exactly the same blocks).
        with torch.enable_grad(), _capture.suspended():
            out = _run(method, (q, k, v) + tuple(args[3:]), record=False, for_grad=True)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out, allow_unused=True)
        zeros = lambda t, g: torch.zeros_like(t) if g is None else g.contiguous()  # noqa: E731
        return zeros(q, dq), zeros(k, dk), zeros(v, dv)

    @torch.library.register_fake(bwd_name)
    def _bwd_fake(grad_out, *args):
        q, k, v = args[:3]
        # the real backward returns contiguous gradients; so must the fake (not empty_like's strides)
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    bwd_op = getattr(torch.ops.sparseflow, f"{method}_attention_backward").default

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:3], *([inputs[3]] if inputs[3] is not None else []))
        ctx.has_mask = inputs[3] is not None
        ctx.rest = inputs[4:]

    def backward(ctx, grad):
        saved = ctx.saved_tensors
        q, k, v = saved[:3]
        mask = saved[3] if ctx.has_mask else None
        if torch.is_grad_enabled():
            # create_graph=True: the gradient must itself be differentiable, which the backward
            # op (an opaque kernel) is not; recompute through a twice-differentiable path instead
            grads = _differentiable_grads(method, grad, (q, k, v, mask) + tuple(ctx.rest))
        else:
            grads = bwd_op(grad, q, k, v, mask, *ctx.rest)
        return tuple(grads) + (None,) * (3 + len(ctx.rest))

    torch.library.register_autograd(name, backward, setup_context=setup_context)


def _differentiable_grads(method: str, grad: torch.Tensor, args: Tuple) -> Tuple[Optional[torch.Tensor], ...]:
    """(dq, dk, dv) as differentiable functions of the inputs and of ``grad`` (double backward):
    the forward is recomputed with the same choice through plain torch ops (the reference or
    SDPA; the selection carries no gradient), then differentiated with ``create_graph``."""
    q, k, v = args[:3]
    with _capture.suspended():
        out = _run(method, args, record=False, for_grad=True, twice=True)
    wanted = [i for i, t in enumerate((q, k, v)) if t.requires_grad]
    grads: List[Optional[torch.Tensor]] = [None, None, None]
    if out.requires_grad and wanted:
        got = torch.autograd.grad(out, [args[i] for i in wanted], grad, create_graph=True, allow_unused=True)
        for i, g in zip(wanted, got):
            grads[i] = g
    return tuple(grads)


def _prepare(spec) -> None:
    """A registered method's op: defined on its registration (or here, for the methods registered
    before this module), once per process; a later registration of the same name must bring the
    same schema."""
    add_method_tables(spec.name)
    try:
        defined = getattr(torch.ops.sparseflow, f"{spec.name}_attention")
    except AttributeError:
        defined = None
    if defined is None:
        _define(spec.name)
    elif str(defined.default._schema).split("(", 1)[1] != schema(spec.name).split("(", 1)[1]:
        raise ValueError(
            f"method {spec.name!r}: its op sparseflow::{spec.name}_attention is already defined in this process "
            "with other arguments (a config with other fields); register it under another name"
        )


_methods.registry.on_register(_prepare)


# --------------------------------------------------------------------------- public functions


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    config: AttentionConfig,
    attn_mask: Optional[torch.Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    backend: str = "auto",
    tag: str = "",
    context_parallel: Any = None,
    tuning: Optional[Tuning] = None,
) -> torch.Tensor:
    """Sparse attention with the method of ``config`` (PBSConfig, PISAConfig, BSAConfig or
    DenseConfig). ``q: [B, Hq, Nq, D]``, ``k, v: [B, Hkv, Nk, D]`` with Hq a multiple of Hkv.
    ``attn_mask``: None or any SDPA mask, with SDPA's meaning (a 2-D mask is ``[Nq, Nk]``); key
    padding is ``kpm[:, None, None, :]`` (``[B, 1, 1, Nk]`` bool, True = valid), and with
    ``is_causal=True`` a mask is intersected with causality. Causal / key-padding masks run
    sparse; others run dense, logged (see :mod:`sparseflow.masks`).
    ``context_parallel``: a 1-D DeviceMesh, a ProcessGroup or a :class:`sparseflow.ContextParallel`
    (its ``sharding``): q, k, v are then this rank's sequence shards and the result is the output
    of this rank's queries (see :mod:`sparseflow.context_parallel`).
    ``tuning``: launch options of the Triton backends (:class:`sparseflow.Tuning`; None: the
    defaults)."""
    tuning = check_tuning(tuning)
    check_call_types(config, is_causal)
    return _attention(q, k, v, config, attn_mask, is_causal, scale, backend, tag, context_parallel, tuning, True)


def attention_any_layout(
    q,
    k,
    v,
    *,
    config,
    is_causal: bool,
    scale,
    backend: str,
    tag: str,
    tuning: Tuning = DEFAULT_TUNING,
    known: Optional[Dict[Tuple, Tuple[int, Optional[str]]]] = None,
) -> torch.Tensor:
    """:func:`attention` without a mask or context parallelism, for a caller that lays the
    result out itself (``sparseflow.hf``): a dense call returns SDPA's own layout, which for q/k/v
    viewed from ``[B, N, H, D]`` memory is that memory, and a replayed sparse call returns
    ``[B, N, H, D]`` memory, so transposing back to it copies nothing.

    ``known``: a dict the caller keeps for one (config, tuning, backend, tag) -- the same four on
    every call that passes it -- where plain eager calls note whether their signature runs dense
    SDPA, so a repeat of a dense call goes to SDPA from its signature alone (a converted layer
    that ``auto`` keeps dense then costs about what transformers' own SDPA function does)."""
    sig = None
    sparse_known = False
    plain_args = type(is_causal) is bool and (scale is None or type(scale) in (int, float))
    if known is not None and plain_args and plain_eager(q, k, v, None):
        last = known.get(LAST_REPLAY)
        if last is not None:
            out = replay_again(last, q, k, v, is_causal, scale, backend)
            if out is not None:
                _capture.note_call(config.method, tag, True)
                return out
        sig = call_signature(q, k, v, is_causal, scale, backend)
        hit = known.get(sig)
        if hit is not None and hit[0] == _autobackend.default_chooser.generation:
            if hit[1] is not None:
                scale = None if scale is None else float(scale)
                return dense_sdpa(
                    config.method,
                    tag,
                    hit[1],
                    q,
                    k,
                    v,
                    None,
                    is_causal,
                    scale,
                    _capture.active_capture(),
                    (config.sliding_window, config.chunk_size),
                )
            sig, sparse_known = None, True  # known to run sparse: nothing to learn
    check_call_types(config, is_causal)
    if sparse_known:
        return _attention_noting_replay(known, q, k, v, config, is_causal, scale, backend, tag, tuning)
    out = _attention(q, k, v, config, None, is_causal, scale, backend, tag, None, tuning, False)
    if sig is not None:
        note_known(known, sig, config, tuning, backend, tag)
    return out


def _attention_noting_replay(known, q, k, v, config, is_causal, scale, backend, tag, tuning) -> torch.Tensor:
    """A call known to run sparse, the full way; the in-place graph that served it (if one did)
    becomes the caller's last replay."""
    note: List = []
    token = REPLAY_NOTE.set(note)
    try:
        out = _attention(q, k, v, config, None, is_causal, scale, backend, tag, None, tuning, False)
    finally:
        REPLAY_NOTE.reset(token)
    if len(note) == 1 and q.shape[2] > 1:  # a one-query call may be a decode step another time
        known[LAST_REPLAY] = LastReplay(replay_site(q, k, v, is_causal, scale, backend), note[-1])
    else:
        known.pop(LAST_REPLAY, None)
    return out


def _attention(q, k, v, config, attn_mask, is_causal, scale, backend, tag, context_parallel, tuning, contiguous):
    """:func:`attention` after its type checks (``tuning`` a Tuning); ``contiguous``: a contiguous
    result (else it may come in ``[B, N, H, D]`` memory order, as SDPA's and the op's do)."""
    if q.is_meta:  # shape inference (a model built on the meta device): SDPA's meta output
        _validation.validate_inputs(config.method, q, k, v, attn_mask, scale, backend, tag)
        return _meta_output(q, v)
    eager = plain_eager(q, k, v, attn_mask)
    memo = (
        plan_memo_key(config, tuning, q, k, v, is_causal, scale, backend, tag)
        if eager and attn_mask is None and context_parallel is None
        else None
    )
    plan = None if memo is None else memoized_plan(memo, config, tuning)
    if plan is not None and plan.reason is not None:
        # the same call signature was validated and planned to dense SDPA before
        out = dense_sdpa(
            config.method,
            tag,
            plan.reason,
            q,
            k,
            v,
            None,
            is_causal,
            None if scale is None else float(scale),
            _capture.active_capture(),
            plan.window,
        )
        return out.contiguous() if contiguous else out
    method = config.method
    if plan is None:
        _validation.validate_inputs(method, q, k, v, attn_mask, scale, backend, tag)
        _validation.check_backend_dtype(method, backend, q.dtype)
    scale = None if scale is None else float(scale)
    if context_parallel is not None:
        return _cp.attention(
            q,
            k,
            v,
            config=config,
            context_parallel=context_parallel,
            attn_mask=attn_mask,
            is_causal=is_causal,
            scale=scale,
            backend=backend,
            tag=tag,
            tuning=tuning,
        )
    if not eager:
        # traced, transformed or intercepted calls see exactly the op (op_args stays traceable)
        if torch.compiler.is_compiling():
            tuning = tuning.traced()
        return op_for(method)(q, k, v, attn_mask, is_causal, scale, *op_args(config, tuning), backend, tag)
    # a remembered plan holds the entry config_call would give (the memo checked config and tuning)
    values, entry = (plan.entry.values, plan.entry) if plan is not None else config_call(config, tuning)
    args = (q, k, v, attn_mask, is_causal, scale) + values + (backend, tag)
    return _eager_call(config, tuning, memo, args, entry, contiguous, plan)


def _meta_output(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The op's output for meta inputs: ``[B, Hq, Nq, Dv]``, contiguous, in q's dtype (no values
    to select from, so no method or backend runs; what SDPA answers for meta inputs)."""
    return q.new_empty(q.shape[0], q.shape[1], q.shape[2], v.shape[-1])


def _eager_call(config, tuning, memo, args, entry, contiguous: bool, plan: Optional[Plan] = None) -> torch.Tensor:
    """A plain eager call with validated ``args`` (the op's arguments): planned here (unless
    ``plan`` was remembered under ``memo``; a new plan is remembered there), run dense directly
    when the plan says so (made contiguous when asked), run sparse directly when nothing needs
    the op's autograd, else through the op."""
    method = config.method
    q, k, v, attn_mask, is_causal, scale = args[:6]
    tag = args[-1]
    if plan is None:
        plan = plan_call(method, args, entry)
        if memo is not None:
            remember_plan(memo, config, tuning, plan)
    if plan.reason is not None and not _needs_op(q, k, v, attn_mask):
        # exactly what the op computes and records for this plan, without the dispatcher's cost
        cap = _capture.active_capture()
        out = dense_sdpa(method, tag, plan.reason, q, k, v, attn_mask, is_causal, scale, cap, plan.window)
        return out.contiguous() if contiguous else out
    if plan.reason is None and INTERCEPTOR.get() is None:
        if not needs_autograd(q, k, v, attn_mask):
            # what the op's implementation runs for this plan, without the dispatcher's cost
            return execute(method, plan, args, record=True, for_grad=False, twice=False, contiguous=contiguous)
        if (q.requires_grad or k.requires_grad or v.requires_grad) and keeps_graph(method, plan, q.device):
            # the backward differentiates this call's own graph: no second selection, no second forward
            double = functools.partial(_differentiable_grads, method)
            return kept_graph_call(method, plan, args, contiguous, double)
    token = PREPARED.set((method, args, plan))
    try:
        return op_for(method)(*args)
    finally:
        PREPARED.reset(token)


def _needs_op(q, k, v, attn_mask) -> bool:
    # the op's autograd backward keeps a mask that requires grad out of the gradient; SDPA would not
    return attn_mask is not None and attn_mask.requires_grad


def dense_attention(q, k, v, *, attn_mask=None, is_causal=True, scale=None, tag: str = ""):
    return attention(q, k, v, config=DenseConfig(), attn_mask=attn_mask, is_causal=is_causal, scale=scale, tag=tag)


def pbs_attention(q, k, v, *, config: Optional[PBSConfig] = None, **kw):
    return attention(q, k, v, config=method_config(config, PBSConfig), **kw)


def pisa_attention(q, k, v, *, config: Optional[PISAConfig] = None, **kw):
    return attention(q, k, v, config=method_config(config, PISAConfig), **kw)


def bsa_attention(q, k, v, *, config: Optional[BSAConfig] = None, **kw):
    return attention(q, k, v, config=method_config(config, BSAConfig), **kw)
