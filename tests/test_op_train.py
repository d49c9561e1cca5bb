"""An eager training call selects once: the backward differentiates the forward's own graph
(the Triton backends of the top-k methods, through Triton's interpreter on the CPU) and gives
the gradients the op's recomputing backward gives, first and second order."""

from __future__ import annotations

import importlib

import pytest
import torch

import sparseflow
from sparseflow.ops import op_args, op_for

DEV = "cuda" if torch.cuda.is_available() else "cpu"

CONFIGS = {
    "pisa": sparseflow.PISAConfig(block_size=8, top_k=4, min_seq_len=0),
    "bsa": sparseflow.BSAConfig(block_size=8, top_k=4, min_seq_len=0),
}


def _inputs(n=61, hq=4, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, n, d, generator=g).to(DEV) for h in (hq, hkv, hkv))
    return [t.requires_grad_(True) for t in (q, k, v)]


def _selector(method):
    """(module, attribute) of the selection function the method's Triton backend calls."""
    spec = sparseflow.methods.spec_for(method).backend("triton")
    module = importlib.import_module(spec.target.split(":")[0])
    names = [n for n in vars(module) if n.endswith("_select") and callable(getattr(module, n))]
    assert len(names) == 1, names
    return module, names[0]


def _counting_selections(monkeypatch, method):
    module, name = _selector(method)
    real = getattr(module, name)
    calls = []

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(module, name, counted)
    return calls


def _grads(out, inputs, w, **kw):
    return torch.autograd.grad((out * w).sum(), inputs, **kw)


@pytest.mark.parametrize("method", ["pisa", "bsa"])
def test_a_training_step_selects_once_and_matches_the_ops_gradients(method, monkeypatch):
    cfg = CONFIGS[method]
    calls = _counting_selections(monkeypatch, method)
    q, k, v = _inputs()
    out = sparseflow.attention(q, k, v, config=cfg, backend="triton")
    w = torch.randn_like(out)
    ours = _grads(out, (q, k, v), w)
    assert len(calls) == 1, "the backward must not select again"

    calls.clear()
    args = (q, k, v, None, True, None) + tuple(op_args(cfg, sparseflow.Tuning())) + ("triton", "")
    through_op = op_for(method)(*args)
    assert torch.equal(out, through_op)
    theirs = _grads(through_op, (q, k, v), w)
    assert len(calls) == 2  # the op's backward recomputes its forward, selection included
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)


def test_only_the_inputs_that_require_grad_get_one_and_second_derivatives_still_work():
    cfg = CONFIGS["pisa"]
    q, k, v = _inputs(n=33, seed=1)
    k.requires_grad_(False)
    out = sparseflow.attention(q, k, v, config=cfg, backend="triton")
    w = torch.randn_like(out)
    gq, gv = _grads(out, (q, v), w, create_graph=True)
    assert gq.requires_grad  # differentiable once more, through the op's recomputation
    (hq,) = torch.autograd.grad(gq.pow(2).sum(), q)

    args = (q, k, v, None, True, None) + tuple(op_args(cfg, sparseflow.Tuning())) + ("triton", "")
    gq_op, gv_op = _grads(op_for("pisa")(*args), (q, v), w, create_graph=True)
    (hq_op,) = torch.autograd.grad(gq_op.pow(2).sum(), q)
    torch.testing.assert_close(gq, gq_op, rtol=0, atol=1e-6)
    torch.testing.assert_close(gv, gv_op, rtol=0, atol=1e-6)
    torch.testing.assert_close(hq, hq_op, rtol=0, atol=1e-6)


def test_a_backward_retained_runs_twice_and_the_reference_keeps_recomputing(monkeypatch):
    cfg = CONFIGS["pisa"]
    q, k, v = _inputs(n=33, seed=2)
    out = sparseflow.attention(q, k, v, config=cfg, backend="triton")
    w = torch.randn_like(out)
    first = _grads(out, (q, k, v), w, retain_graph=True)
    assert out.grad_fn.out is not None  # kept for the backward asked for
    again = _grads(out, (q, k, v), w)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    assert out.grad_fn.out is None and out.grad_fn.inner is None  # freed by the last backward

    # the reference's graph would hold the N x N scores: it still goes through the op
    import sparseflow.op_train as op_train

    seen = []
    monkeypatch.setattr(op_train._KeptGraph, "apply", lambda *a: seen.append(a) or None)
    ref = sparseflow.attention(q, k, v, config=cfg, backend="reference")
    assert ref is not None and not seen


def test_under_activation_checkpointing_the_op_recomputes_and_the_gradients_are_the_same(monkeypatch):
    # non-reentrant checkpointing's saved-tensor hooks cannot see a graph kept on the Function's
    # context, so the call goes through the op there
    from torch.utils.checkpoint import checkpoint

    import sparseflow.op_train as op_train

    cfg = CONFIGS["pisa"]
    q, k, v = _inputs(n=33, seed=3)

    def layer(q, k, v):
        return sparseflow.attention(q, k, v, config=cfg, backend="triton").sin()

    w = torch.randn(1, 4, 33, 16).to(DEV)
    plain = _grads(layer(q, k, v), (q, k, v), w)
    kept = []
    real = op_train._KeptGraph.apply
    monkeypatch.setattr(op_train._KeptGraph, "apply", lambda *a: kept.append(1) or real(*a))
    checkpointed = _grads(checkpoint(layer, q, k, v, use_reentrant=False), (q, k, v), w)
    assert not kept
    for a, b in zip(plain, checkpointed):
        assert torch.equal(a, b)
