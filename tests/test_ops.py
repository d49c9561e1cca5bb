"""Op contracts: registration, fake impls, opcheck, torch.compile(fullgraph), export, errors."""

import logging
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import sparseflow
import sparseflow.testing
from sparseflow import BSAConfig, DenseConfig, PBSConfig, PISAConfig
from sparseflow.ops import op_args, op_for

SMALL = {
    "dense": DenseConfig(),
    "pbs": PBSConfig(block_size=8, segment_size=16, threshold=0.8),
    "pisa": PISAConfig(block_size=8, top_k=4),
    "bsa": BSAConfig(block_size=8, top_k=4),
}
METHODS = list(SMALL)


def _qkv(b=2, hq=6, hkv=2, n=45, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, d, generator=g, dtype=torch.float32).to(dtype)
    k = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float32).to(dtype)
    v = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float32).to(dtype)
    return q, k, v


def _op_inputs(method, q, k, v, mask=None, causal=True):
    return (q, k, v, mask, causal, None, *op_args(SMALL[method]), "auto", "layer")


def test_import_is_light():
    code = "import sys, sparseflow; print('triton' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


@pytest.mark.parametrize("method", METHODS)
def test_schema_matches_config(method):
    schema = str(op_for(method)._schema)
    for name in SMALL[method].to_dict():
        if name not in ("method", "version"):
            assert f" {name}" in schema


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "padmask"])
def test_opcheck(method, masked):
    q, k, v = _qkv()
    mask = None
    causal = True
    if masked:
        mask = torch.ones(2, 45, dtype=torch.bool)
        mask[1, 40:] = False
        causal = False
        mask = mask[:, None, None, :] & torch.ones(45, 45, dtype=torch.bool).tril()
    torch.library.opcheck(op_for(method), _op_inputs(method, q, k, v, mask, causal))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("layout", ["contiguous", "tokens-major"])
def test_op_output_is_tokens_major(method, layout):
    """The op returns ``[B, H, N, D]`` in ``[B, N, H, D]`` memory, as SDPA's flash and cuDNN
    kernels do, whatever q's layout, so that a model's ``transpose(1, 2).contiguous()`` after it
    copies nothing; its fake implementation says the same strides."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v = _qkv()
    if layout == "tokens-major":
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    args = _op_inputs(method, q, k, v)
    out = op_for(method)(*args)
    assert out.transpose(1, 2).is_contiguous() and not out.is_contiguous(), out.stride()
    with FakeTensorMode() as mode:
        fake = op_for(method)(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    assert fake.shape == out.shape and fake.stride() == out.stride()
    torch.testing.assert_close(out, sparseflow.attention(q, k, v, config=SMALL[method]))


@pytest.mark.parametrize("method", METHODS)
def test_opcheck_with_grad(method):
    q, k, v = _qkv(b=1, n=33)
    q.requires_grad_()
    k.requires_grad_()
    v.requires_grad_()
    torch.library.opcheck(op_for(method), _op_inputs(method, q, k, v))


@pytest.mark.parametrize("method", METHODS)
def test_compile_fullgraph_matches_eager(method):
    q, k, v = _qkv()
    cfg = SMALL[method]

    def f(q, k, v):
        return sparseflow.attention(q, k, v, config=cfg) * 2.0

    eager = f(q, k, v)
    compiled = torch.compile(f, fullgraph=True, backend="inductor")(q, k, v)
    torch.testing.assert_close(compiled, eager)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", [m for m in METHODS if m != "dense"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_cuda_compile_fullgraph_triton_backend(method, dtype):
    # Inductor compiles the Triton kernels behind the ops itself (it passes Python floats to them
    # as fp64, which the kernels must accept): compiled output == eager output
    q, k, v = (t.to("cuda", dtype) for t in _qkv(n=301, d=64))
    cfg = {
        "pbs": PBSConfig(block_size=16, segment_size=32, threshold=0.8),
        "pisa": PISAConfig(block_size=16, top_k=4),
        "bsa": BSAConfig(block_size=16, top_k=4),
    }[method]

    def f(q, k, v):
        return sparseflow.attention(q, k, v, config=cfg, backend="triton") * 2.0

    eager = f(q, k, v)
    compiled = torch.compile(f, fullgraph=True)(q, k, v)
    assert not compiled.isnan().any()
    torch.testing.assert_close(compiled, eager)


@pytest.mark.parametrize("method", METHODS)
def test_export_roundtrip(method):
    cfg = SMALL[method]

    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return sparseflow.attention(q, k, v, config=cfg)

    q, k, v = _qkv(b=1)
    ep = torch.export.export(M(), (q, k, v))
    targets = {n.target for n in ep.graph.nodes if n.op == "call_function"}
    assert op_for(method) in targets
    torch.testing.assert_close(ep.module()(q, k, v), M()(q, k, v))


def test_dense_op_is_sdpa_bitwise():
    q, k, v = _qkv()
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(sparseflow.dense_attention(q, k, v), ref)


@pytest.mark.parametrize("method", METHODS)
def test_backward_flows(method):
    q, k, v = _qkv(b=1, n=40, dtype=torch.float64)
    for t in (q, k, v):
        t.requires_grad_()
    out = sparseflow.attention(q, k, v, config=SMALL[method])
    out.square().sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda q, k, v: (q[0], k, v), "q must be 4-D"),
        (lambda q, k, v: (q, k.to(torch.int32), v), "k must be float16"),
        (lambda q, k, v: (q, k.half(), v), "share a dtype"),
        (lambda q, k, v: (q[:, :5], k, v), r"query heads \(5\) must be a multiple of key/value heads \(2\)"),
        (lambda q, k, v: (q, k, v[:, :, :-1]), "k and v must agree"),
        (lambda q, k, v: (q[..., :8], k, v), "head dims must match"),
        (lambda q, k, v: (q, k[:1], v[:1]), "batch sizes"),
    ],
    ids=["rank", "dtype-int", "dtype-mixed", "heads-not-divisible", "kv-length", "head-dim", "batch"],
)
@pytest.mark.parametrize("method", METHODS)
def test_bad_inputs_raise_clear_errors(method, mutate, match):
    q, k, v = mutate(*_qkv())
    with pytest.raises((ValueError, TypeError), match=match):
        sparseflow.attention(q, k, v, config=SMALL[method])


def test_bad_scale_and_backend_and_config():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="scale"):
        sparseflow.pbs_attention(q, k, v, scale=-1.0)
    with pytest.raises(ValueError, match="backend must be one of"):
        sparseflow.pbs_attention(q, k, v, backend="cuda")
    with pytest.raises(TypeError, match="config must be one of"):
        sparseflow.attention(q, k, v, config={"method": "pbs"})
    with pytest.raises(TypeError, match="is_causal"):
        sparseflow.pbs_attention(q, k, v, is_causal=1)


@pytest.mark.parametrize(
    "cls, kwargs, match",
    [
        (PBSConfig, {"block_size": 0}, "block_size must be >= 1"),
        (PBSConfig, {"block_size": 64, "segment_size": 96}, "segment_size must be a multiple of block_size=64"),
        (PBSConfig, {"threshold": 0.0}, r"threshold must be in \(0, 1\]"),
        (PBSConfig, {"threshold": 1.5}, r"threshold must be in \(0, 1\]"),
        (PBSConfig, {"threshold": "0.9"}, "threshold must be a float"),
        (PBSConfig, {"gqa_permutation": "group"}, "gqa_permutation must be one of"),
        (PBSConfig, {"scoring": "max"}, "scoring must be one of"),
        (PBSConfig, {"scoring": "antidiagonal", "antidiagonal_stride": 7}, "antidiagonal_stride must divide"),
        (PISAConfig, {"top_k": 2}, r"top_k must be >= the number of forced blocks \(3"),
        (PISAConfig, {"branching": 1}, "branching must be >= 2"),
        (PISAConfig, {"score": "max"}, "score must be one of"),
        (BSAConfig, {"top_k": 1, "force_previous": False}, r"top_k must be >= the number of forced blocks \(2"),
        (BSAConfig, {"block_size": 16.0}, "block_size must be an int"),
    ],
    ids=lambda x: x if isinstance(x, str) and len(x) < 20 else None,
)
def test_config_validation(cls, kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        cls(**kwargs)


@pytest.mark.parametrize("cfg", list(SMALL.values()), ids=METHODS)
def test_config_roundtrip(cfg):
    assert sparseflow.config_from_dict(cfg.to_json()) == cfg
    assert sparseflow.config_from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="version must be"):
        sparseflow.config_from_dict({**cfg.to_dict(), "version": 99})
    with pytest.raises(ValueError, match="unknown fields"):
        sparseflow.config_from_dict({**cfg.to_dict(), "bogus": 1})
    with pytest.raises(dataclasses_frozen_error()):
        cfg.__setattr__("min_seq_len", 3)


def dataclasses_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


# ----------------------------------------------------------------------------- fallbacks


def test_pbs_decode_step_falls_back_dense_and_logs(caplog):
    q, k, v = _qkv(n=40)
    q1 = q[:, :, -1:]
    with caplog.at_level(logging.INFO, logger="sparseflow"), sparseflow.capture() as cap:
        out = sparseflow.pbs_attention(q1, k, v, is_causal=False, config=SMALL["pbs"], tag="dec")
    ref = F.scaled_dot_product_attention(q1, k, v, enable_gqa=True)
    assert torch.equal(out, ref)
    assert not cap.calls[0].sparse and "prefill" in cap.calls[0].reason
    assert any("runs dense" in r.message for r in caplog.records)


@pytest.mark.parametrize("method", ["pbs", "pisa", "bsa"])
def test_float_bias_mask_falls_back_dense(method):
    q, k, v = _qkv()
    bias = torch.randn(1, 1, 45, 45)
    with sparseflow.capture() as cap:
        out = sparseflow.attention(q, k, v, config=SMALL[method], attn_mask=bias, is_causal=False)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True))
    assert "values other than 0/-inf" in cap.calls[0].reason


@pytest.mark.parametrize("method", ["pbs", "pisa", "bsa"])
def test_short_sequence_below_min_seq_len_is_dense(method):
    q, k, v = _qkv(n=30)
    cfg = SMALL[method].replace(min_seq_len=64)
    with sparseflow.capture() as cap:
        out = sparseflow.attention(q, k, v, config=cfg)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    assert "min_seq_len=64" in cap.calls[0].reason


@pytest.mark.parametrize("method", ["pbs", "pisa", "bsa"])
def test_causal_mask_is_recognised_as_causal(method):
    q, k, v = _qkv()
    mask = torch.ones(45, 45, dtype=torch.bool).tril()[None, None].expand(2, 1, 45, 45)
    a = sparseflow.attention(q, k, v, config=SMALL[method], attn_mask=mask, is_causal=False)
    b = sparseflow.attention(q, k, v, config=SMALL[method], is_causal=True)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    with sparseflow.capture() as cap:
        sparseflow.attention(q, k, v, config=SMALL[method], attn_mask=mask, is_causal=False)
    assert cap.calls[0].sparse


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_key_padding_mask_with_either_causality(method, causal):
    """Key padding as the SDPA form [B, 1, 1, Nk] bool combines with is_causal (the op intersects
    a mask with causality, as SDPA's CPU kernel does)."""
    q, k, v = _qkv()
    kpm = torch.ones(2, 45, dtype=torch.bool)
    kpm[1, 30:] = False
    out = sparseflow.attention(
        q,
        k,
        v,
        config=sparseflow.testing.exact_config(method, 45, SMALL[method]),
        attn_mask=kpm[:, None, None, :],
        is_causal=causal,
    )
    full = kpm[:, None, None, :] & (torch.ones(45, 45, dtype=torch.bool).tril() if causal else True)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=full, enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_auto_backend_chooser_measures_once_per_bucket_and_honours_override(monkeypatch):
    from sparseflow.autobackend import ENV_OVERRIDE, BackendChooser

    chooser = BackendChooser(reps=1)
    calls = []

    def run(name):
        calls.append(name)
        n = 600 if name == "flex" else 10
        return torch.ones(n, n).matmul(torch.ones(n, n)).sum()

    q = torch.zeros(1, 4, 1000, 16)
    key = chooser.key("pisa", q, q[:, :2], ())
    assert chooser.choose(key, ["triton", "flex"], run) == "triton"
    n_calls = len(calls)
    assert chooser.choose(key, ["triton", "flex"], run) == "triton" and len(calls) == n_calls  # cached
    assert chooser.timings[key]["flex"] > chooser.timings[key]["triton"]
    other = chooser.key("pisa", torch.zeros(1, 4, 2000, 16), q[:, :2], ())
    assert other != key  # another length bucket is measured on its own
    monkeypatch.setenv(ENV_OVERRIDE, "flex")
    assert chooser.choose(key, ["triton", "flex"], run) == "flex"
    monkeypatch.setenv(ENV_OVERRIDE, "cuda-graphs")
    with pytest.raises(ValueError, match=ENV_OVERRIDE):
        chooser.choose(key, ["triton", "flex"], run)


def test_auto_runs_dense_when_measured_faster_and_says_so(monkeypatch):
    # CPU stand-in for the CUDA path: auto measures the (slow) reference against dense SDPA
    import sparseflow.op_backends as op_backends
    from sparseflow.autobackend import default_chooser

    monkeypatch.setattr(
        op_backends,
        "resolve_backend",
        lambda method, backend, device, dtype=None: "measure" if backend == "auto" else backend,
    )
    monkeypatch.setattr(op_backends, "fast_backends", lambda method, device, dtype=None: ["reference"])
    default_chooser.clear()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 300, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(1, 2, 300, 16, generator=g) for _ in range(2))
    try:
        with sparseflow.capture() as cap:
            out = sparseflow.attention(q, k, v, config=PISAConfig(block_size=16, top_k=3), backend="auto")
        rec = cap.calls[-1]
        assert rec.backend == "sdpa" and not rec.sparse and "measured faster than pisa" in rec.reason
        ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
        torch.testing.assert_close(out, ref)
        # the backward recomputes with the forward's choice (dense), not a sparse backend
        (g_out,) = torch.autograd.grad(out.sum(), q)
        (g_ref,) = torch.autograd.grad(ref.sum(), q)
        torch.testing.assert_close(g_out, g_ref)
    finally:
        default_chooser.clear()


def test_auto_forced_backend_is_typed_taken_without_measuring_and_reported(monkeypatch):
    import sparseflow.op_backends as op_backends
    from sparseflow.autobackend import BackendChooser, default_chooser

    with pytest.raises(TypeError, match="forced backend"):
        BackendChooser(forced=3)
    with pytest.raises(TypeError, match="forced backend"):
        BackendChooser().force("")
    monkeypatch.setattr(
        op_backends,
        "resolve_backend",
        lambda method, backend, device, dtype=None: "measure" if backend == "auto" else backend,
    )
    monkeypatch.setattr(op_backends, "fast_backends", lambda method, device, dtype=None: ["reference"])
    q, k, v = (torch.randn(1, h, 300, 16) for h in (4, 2, 2))
    cfg = PISAConfig(block_size=16, top_k=3)

    def backend_and_reason():
        with sparseflow.capture() as cap:
            sparseflow.attention(q, k, v, config=cfg, backend="auto")
        return cap.calls[-1].backend, cap.calls[-1].reason

    try:
        default_chooser.force("sdpa")
        backend, reason = backend_and_reason()
        assert backend == "sdpa" and "forced by BackendChooser.force" in reason
        assert not default_chooser.timings  # nothing was measured
        default_chooser.force("reference")  # forgets the decision made under the other force
        assert backend_and_reason()[0] == "reference"
        default_chooser.force("cuda-graphs")
        with pytest.raises(ValueError, match="BackendChooser.force must be one of"):
            backend_and_reason()
        default_chooser.force(None)  # measures again
        backend_and_reason()
        assert default_chooser.timings
    finally:
        default_chooser.force(None)


def test_auto_reads_the_override_once_when_it_decides(monkeypatch):
    # the decision and its report come from one read of the override
    import sparseflow.op_backends as op_backends
    from sparseflow.autobackend import ENV_OVERRIDE, default_chooser

    monkeypatch.setattr(
        op_backends,
        "resolve_backend",
        lambda method, backend, device, dtype=None: "measure" if backend == "auto" else backend,
    )
    monkeypatch.setattr(op_backends, "fast_backends", lambda method, device, dtype=None: ["reference"])
    reads = []
    forcing = default_chooser.forcing
    monkeypatch.setattr(default_chooser, "forcing", lambda: reads.append(1) or forcing())
    monkeypatch.setenv(ENV_OVERRIDE, "sdpa")
    default_chooser.clear()
    q, k, v = (torch.randn(1, h, 300, 16) for h in (4, 2, 2))
    with sparseflow.capture() as cap:
        sparseflow.attention(q, k, v, config=PISAConfig(block_size=16, top_k=3), backend="auto")
    assert cap.calls[-1].backend == "sdpa" and f"forced by {ENV_OVERRIDE}" in cap.calls[-1].reason
    assert len(reads) == 1


def test_auto_backend_is_reference_on_cpu_and_recorded():
    q = torch.randn(1, 2, 300, 16)
    k = torch.randn(1, 1, 300, 16)
    with sparseflow.capture() as cap:
        sparseflow.attention(q, k, k, config=sparseflow.BSAConfig(block_size=16, top_k=3), backend="auto")
    assert cap.calls[-1].backend == "reference"
