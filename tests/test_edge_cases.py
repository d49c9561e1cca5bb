"""Edge cases of the ops and the reference / Triton implementations that must never give a wrong
answer: double backward, strictness of PBS's causal proxy, NaN keys, a config of another method,
empty batches, huge top_k, fp64 on Triton.

Triton pieces run in the CPU interpreter (TRITON_INTERPRET=1, set before Triton is imported).
"""
import math
import os
import time

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import sparseflow  # noqa: E402
from sparseflow import ops  # noqa: E402
from sparseflow.config import BSAConfig, PBSConfig, PISAConfig  # noqa: E402

EXACT = {
    "pbs": PBSConfig(block_size=4, segment_size=8, threshold=1.0),
    "pisa": PISAConfig(block_size=4, top_k=100),
    "bsa": BSAConfig(block_size=4, top_k=100),
}


def _qkv(b=1, hq=2, hkv=1, n=16, d=4, dtype=torch.float64, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, n, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, n, d, generator=g, dtype=dtype)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def _sdpa(q, k, v):
    """Causal softmax attention in plain ops (SDPA's CPU flash backward is not differentiable)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    n = q.shape[2]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -math.inf)
    return torch.softmax(s, -1) @ v


# --------------------------------------------------------------------------- double backward


@pytest.mark.parametrize("method", sorted(EXACT))
def test_second_derivatives_match_sdpa_in_exact_mode(method):
    q, k, v = _qkv(requires_grad=True)
    w = torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(1))

    def hessian_vector(fn):
        out = fn(q, k, v)
        gq, gk, gv = torch.autograd.grad((out * w).sum(), (q, k, v), create_graph=True)
        # a scalar of the first derivatives, differentiated again
        return torch.autograd.grad((gq ** 2).sum() + (gk * gv).sum(), (q, k, v))

    ours = hessian_vector(lambda *t: sparseflow.attention(*t, config=EXACT[method], backend="reference"))
    ref = hessian_vector(_sdpa)
    for a, b in zip(ours, ref):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("method", sorted(EXACT))
def test_gradgradcheck_exact_mode(method):
    q, k, v = _qkv(hq=1, n=4, d=2, requires_grad=True)
    cfg = EXACT[method].replace(block_size=2, **({"segment_size": 4} if method == "pbs" else {}))

    def fn(q, k, v):
        return sparseflow.attention(q, k, v, config=cfg, backend="reference")

    assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=True)
    assert torch.autograd.gradgradcheck(fn, (q, k, v), fast_mode=True)


def test_double_backward_with_only_some_inputs_requiring_grad():
    q, k, v = _qkv()
    q.requires_grad_(True)
    out = sparseflow.attention(q, k, v, config=EXACT["pisa"], backend="reference")
    (gq,) = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
    (hq,) = torch.autograd.grad(gq.sum(), q)
    out_ref = _sdpa(q, k, v)
    (gq_ref,) = torch.autograd.grad(out_ref.pow(2).sum(), q, create_graph=True)
    (hq_ref,) = torch.autograd.grad(gq_ref.sum(), q)
    torch.testing.assert_close(hq, hq_ref)


# --------------------------------------------------------------------------- config of another method


@pytest.mark.parametrize("fn, wrong, expected", [
    (ops.pbs_attention, PISAConfig(), "PBSConfig"),
    (ops.pisa_attention, BSAConfig(), "PISAConfig"),
    (ops.bsa_attention, PBSConfig(), "BSAConfig"),
])
def test_method_function_rejects_another_methods_config(fn, wrong, expected):
    q, k, v = _qkv(dtype=torch.float32)
    with pytest.raises(TypeError, match=rf"config must be a {expected}.*got {type(wrong).__name__}"):
        fn(q, k, v, config=wrong)


# --------------------------------------------------------------------------- fp64 on Triton


@pytest.mark.parametrize("method", sorted(EXACT))
def test_triton_rejects_fp64_with_a_clear_type_error(method, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the dispatcher would accept the CPU tensors
    q, k, v = _qkv(n=64)
    with pytest.raises(TypeError, match=r"backend='triton'.*float64.*backend='reference'"):
        sparseflow.attention(q, k, v, config=EXACT[method], backend="triton")
    # the op itself (as the rewrite pass calls it) and its fake implementation say the same
    args = (q, k, v, None, True, None, *ops.op_args(EXACT[method]), "triton", "")
    with pytest.raises(TypeError, match="float64"):
        ops.op_for(method)(*args)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode, pytest.raises(TypeError, match="float64"):
        ops.op_for(method)(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))


def test_auto_never_measures_triton_for_fp64():
    assert "triton" not in ops._fast_backends("pbs", torch.device("cpu"), torch.float64)
