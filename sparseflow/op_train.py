"""An eager sparse call that autograd will differentiate, selecting once per training step.

The op's autograd (:mod:`sparseflow.ops`) recomputes the forward in its backward, selection
included: a custom op's forward runs below autograd and hands the backward nothing but its
output. A plain eager call is not bound by that. Here the backend runs with autograd on inside
a Function's forward, and the backward differentiates that graph: the selection runs once, and
the attention's forward is not run again. Only for backends whose graph is compact
(``Backend.compact_graph``: the Triton token-sparse kernels save the output, its log-sum-exp and
the block lists, O(N) memory), where a plain torch reference's graph would hold the N x N
scores. A second derivative (``create_graph=True``) goes
through ``double_grads``, the op's twice-differentiable recomputation, as it does through the op.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from . import methods as _methods
from .op_execute import execute, tokens_major
from .op_plan import Plan

__all__ = ["keeps_graph", "kept_graph_call"]

DoubleGrads = Callable[[torch.Tensor, Tuple], Tuple[Optional[torch.Tensor], ...]]


def keeps_graph(method: str, plan: Plan, device: torch.device) -> bool:
    """Whether a sparse eager call under autograd (q, k or v requiring grad: a mask's gradient
    is none either way) runs through :func:`kept_graph_call`: its backend differentiates itself
    on ``device`` with a compact graph (``Backend.compact_graph``), and no saved-tensor hooks are
    active (activation checkpointing, offloading: they cannot see tensors kept on the Function's
    context, so the op's recomputation serves them)."""
    if plan.reason is not None or _saved_tensor_hooks_active():
        return False
    return _methods.spec_for(method).backend(plan.backend).keeps_graph_on(device.type)


def _saved_tensor_hooks_active() -> bool:
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None  # unknown: assume active, the op path is always right


def kept_graph_call(method: str, plan: Plan, args: Tuple, contiguous: bool, double_grads: DoubleGrads):
    """``args`` (the op's, validated) run as ``plan`` says, differentiable in q, k and v, with the
    backend's own autograd graph kept for the backward (see the module's note)."""
    q, k, v = args[:3]
    rest = tuple(args[3:])

    def run(q_, k_, v_):
        return execute(
            method, plan, (q_, k_, v_) + rest, record=True, for_grad=True, twice=False, contiguous=contiguous
        )

    def second_order(grad, q_, k_, v_):
        return double_grads(grad, (q_, k_, v_) + rest)

    out = _KeptGraph.apply(run, second_order, q, k, v)
    # contiguous=False: the op's layout, [B, N, H, D] memory, which the model's transpose back reads in place
    return out if contiguous else tokens_major(out)


class _KeptGraph(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, double_grads, q, k, v):
        inner = tuple(t.detach().requires_grad_(t.requires_grad) for t in (q, k, v))
        with torch.enable_grad():
            out = run(*inner)
        ctx.inner, ctx.out, ctx.double_grads = inner, out, double_grads
        ctx.save_for_backward(q, k, v)
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():
            # create_graph: the kernels' backward passes are not differentiable themselves
            q, k, v = ctx.saved_tensors
            return (None, None, *ctx.double_grads(grad, q, k, v))
        inner, out = ctx.inner, ctx.out
        keep = _backward_keeps_graph()
        if not keep:  # freed now, as autograd frees saved tensors, not when the outer graph goes
            ctx.inner = ctx.out = None
        wanted = [t for t in inner if t.requires_grad]
        got = iter(torch.autograd.grad(out, wanted, grad, retain_graph=keep, allow_unused=True))
        return (None, None, *(next(got) if t.requires_grad else None for t in inner))


def _backward_keeps_graph() -> bool:
    """Whether the running backward was asked to keep the graph (``retain_graph=True``)."""
    keeps = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if keeps is None else bool(keeps())
