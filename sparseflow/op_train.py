"""An eager sparse call that autograd will differentiate, selecting once per training step.

The op's autograd (:mod:`sparseflow.ops`) recomputes the forward in its backward, selection
included: a custom op's forward runs below autograd and hands the backward nothing but its
output. A plain eager call is not bound by that. Here the backend runs with autograd on inside
a Function's forward, and the backward differentiates that graph: the selection runs once, and
the attention's forward is not run again. Only for backends whose graph is small: the Triton
token-sparse kernels and FlexAttention save the output, its log-sum-exp and the block lists
(O(N) memory), where the reference's plain torch graph would hold the N x N scores, so the
reference keeps the op's recomputation. A second derivative (``create_graph=True``) goes
through ``double_grads``, the op's twice-differentiable recomputation, as it does through the op.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from .op_backends import grad_backend
from .op_execute import execute
from .op_plan import Plan

__all__ = ["keeps_graph", "kept_graph_call"]

DoubleGrads = Callable[[torch.Tensor, Tuple], Tuple[Optional[torch.Tensor], ...]]


def keeps_graph(method: str, plan: Plan, device: torch.device) -> bool:
    """Whether a sparse eager call under autograd (q, k or v requiring grad: a mask's gradient
    is none either way) runs through :func:`kept_graph_call`: its backend differentiates itself
    on ``device`` (the backward would not switch to another) and is not the reference."""
    return (
        plan.reason is None
        and plan.backend != "reference"
        and grad_backend(method, plan.backend, device) == plan.backend
    )


def kept_graph_call(method: str, plan: Plan, args: Tuple, contiguous: bool, double_grads: DoubleGrads):
    """``args`` (the op's, validated) run as ``plan`` says, differentiable in q, k and v, with the
    backend's own autograd graph kept for the backward (see the module's note)."""
    q, k, v = args[:3]

    def run(q_, k_, v_):
        return execute(
            method, plan, (q_, k_, v_) + tuple(args[3:]), record=True, for_grad=True, twice=False, contiguous=contiguous
        )

    rest = tuple(args[3:])
    return _KeptGraph.apply(run, lambda grad, q_, k_, v_: double_grads(grad, (q_, k_, v_) + rest), q, k, v)


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
        wanted = [t for t in ctx.inner if t.requires_grad]
        # retain_graph: a caller's retain_graph=True backward may come again; the kept graph goes
        # with this node either way
        got = iter(torch.autograd.grad(ctx.out, wanted, grad, retain_graph=True, allow_unused=True))
        return (None, None, *(next(got) if t.requires_grad else None for t in ctx.inner))
