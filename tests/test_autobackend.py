"""backend="auto" dispatch cost: decisions, configs and plans are made once per key; a call
decided dense is plain SDPA with the op's log, tally and record."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import sparseflow
import sparseflow.autobackend as autobackend
import sparseflow.op_backends as op_backends
import sparseflow.op_schema as op_schema
import sparseflow.op_validation as op_validation
import sparseflow.ops as ops
import sparseflow.recording as recording
from sparseflow import BSAConfig, PBSConfig, PISAConfig
from sparseflow.autobackend import BackendChooser, default_chooser
from sparseflow.ops import op_args, op_for

CFG = PISAConfig(block_size=16, top_k=3)
TIMES = {"reference": 2.0, "sdpa": 1.0}  # ms: dense measures faster
REASON = "measured faster than pisa here: dense SDPA 1.000 ms vs reference 2.000 ms (backend='auto' on cpu)"


def _qkv(n=64, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, n, 16, generator=g, requires_grad=requires_grad)
    k, v = (torch.randn(1, 2, n, 16, generator=g, requires_grad=requires_grad) for _ in range(2))
    return q, k, v


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


@pytest.fixture
def measured(monkeypatch):
    """CPU stand-in for the CUDA path: auto "measures" the reference against SDPA with fixed
    timings, and counts how often the chooser and the device-name lookup are consulted."""
    counts = {"choose": 0, "time": 0, "device_name": 0}
    monkeypatch.setattr(
        op_backends,
        "resolve_backend",
        lambda method, backend, device, dtype=None: "measure" if backend == "auto" else backend,
    )
    monkeypatch.setattr(op_backends, "fast_backends", lambda method, device, dtype=None: ["reference"])
    real_decide, real_name = BackendChooser.decide, autobackend._device_name

    def decide(self, *a, **kw):
        counts["choose"] += 1
        return real_decide(self, *a, **kw)

    def time_(self, run, name):
        counts["time"] += 1
        return TIMES[name]

    def device_name(device):
        counts["device_name"] += 1
        return real_name(device)

    monkeypatch.setattr(BackendChooser, "decide", decide)
    monkeypatch.setattr(BackendChooser, "_time", time_)
    monkeypatch.setattr(autobackend, "_device_name", device_name)
    default_chooser.clear()
    yield counts
    default_chooser.clear()


def test_auto_decides_once_per_key(measured):
    q, k, v = _qkv(300)
    for _ in range(4):
        sparseflow.attention(q, k, v, config=CFG, backend="auto")
    assert measured == {"choose": 1, "time": 2, "device_name": 1}
    q2, k2, v2 = _qkv(310)  # same length bucket: the same decision
    sparseflow.attention(q2, k2, v2, config=CFG, backend="auto")
    assert measured["choose"] == 1
    sparseflow.attention(q, k, v, config=CFG.replace(top_k=4), backend="auto")  # another config
    assert measured["choose"] == 2
    q3, k3, v3 = _qkv(600)  # another length bucket
    sparseflow.attention(q3, k3, v3, config=CFG, backend="auto")
    assert measured["choose"] == 3
    default_chooser.clear()  # clearing the chooser forgets the decisions too
    sparseflow.attention(q, k, v, config=CFG, backend="auto")
    assert measured["choose"] == 4


def test_direct_op_calls_share_the_decision(measured):
    q, k, v = _qkv(300)
    args = (q, k, v, None, True, None, *op_args(CFG), "auto", "")
    for _ in range(3):
        op_for("pisa")(*args)
    assert measured["choose"] == 1 and measured["device_name"] == 1


def _recorded(fn):
    tally = {}
    with sparseflow.capture() as cap, recording.tallying(tally):
        out = fn()
    return out, cap.calls, tally


def _record_op_entries(monkeypatch):
    """The methods of every call that enters the op's implementation (``ops._run``), in order."""
    entered = []
    real_run = ops._run
    monkeypatch.setattr(ops, "_run", lambda method, args, **kw: entered.append(method) or real_run(method, args, **kw))
    return entered


def test_decided_dense_is_sdpa_without_the_op_and_records_what_the_op_records(measured, monkeypatch):
    q, k, v = _qkv(300)
    op_out, op_calls, op_tally = _recorded(
        lambda: op_for("pisa")(q, k, v, None, True, None, *op_args(CFG), "auto", "layers.0")
    )
    entered = _record_op_entries(monkeypatch)
    out, calls, tally = _recorded(lambda: sparseflow.attention(q, k, v, config=CFG, backend="auto", tag="layers.0"))
    assert entered == []  # the decided-dense call never entered the op
    assert torch.equal(out, _sdpa(q, k, v)) and torch.equal(out, op_out) and out.is_contiguous()
    assert calls == op_calls and calls[0].reason == REASON and calls[0].backend == "sdpa" and not calls[0].sparse
    assert tally == op_tally == {("layers.0", "pisa"): {REASON: 1}}


def test_decided_dense_gradients_are_sdpa_gradients(measured):
    q, k, v = _qkv(300, requires_grad=True)
    out = sparseflow.attention(q, k, v, config=CFG, backend="auto")
    ref = _sdpa(q, k, v)
    grads = torch.autograd.grad((out * out).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * ref).sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=0, atol=0)


def test_structural_fallback_skips_the_op_and_matches_it(monkeypatch):
    # N < segment_size: PBS runs dense whatever the backend
    q, k, v = _qkv(32)
    cfg = PBSConfig(block_size=16, segment_size=64)
    op_out, op_calls, op_tally = _recorded(
        lambda: op_for("pbs")(q, k, v, None, True, None, *op_args(cfg), "reference", "l")
    )
    entered = _record_op_entries(monkeypatch)
    out, calls, tally = _recorded(lambda: sparseflow.pbs_attention(q, k, v, config=cfg, backend="reference", tag="l"))
    assert entered == [] and torch.equal(out, op_out) and calls == op_calls and tally == op_tally
    assert "segment_size=64" in calls[0].reason


def test_attention_validates_once_and_direct_op_calls_still_validate(monkeypatch):
    seen = []
    real = op_validation.validate_inputs
    monkeypatch.setattr(op_validation, "validate_inputs", lambda *a: seen.append(a[0]) or real(*a))
    for requires_grad in (False, True):  # through the op's autograd layer too
        seen.clear()
        q, k, v = _qkv(64, requires_grad=requires_grad)
        with sparseflow.capture() as cap:
            sparseflow.attention(q, k, v, config=BSAConfig(block_size=16, top_k=3), backend="reference")
        assert cap.calls[-1].sparse and seen == ["bsa"]  # entered the op, validated once
    q, k, v = (t.detach() for t in (q, k, v))
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        op_for("bsa")(
            q,
            k[:, :1].expand(1, 3, 64, 16),
            v[:, :1].expand(1, 3, 64, 16),
            None,
            True,
            None,
            *op_args(BSAConfig(block_size=16, top_k=3)),
            "reference",
            "",
        )


def test_fake_tensors_are_still_validated_at_trace_time():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(1, 4, 64, 16), torch.empty(1, 3, 64, 16)
        with pytest.raises(ValueError, match="multiple of key/value heads"):
            sparseflow.attention(q, k, k, config=CFG, backend="auto")
        out = sparseflow.dense_attention(
            torch.empty(1, 4, 64, 16), torch.empty(1, 2, 64, 16), torch.empty(1, 2, 64, 16)
        )
        assert out.shape == (1, 4, 64, 16)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_intercepted_calls_still_see_the_op():
    q, k, v = _qkv(32)
    with _Ops() as mode:
        sparseflow.dense_attention(q, k, v)
    assert any("sparseflow.dense_attention" in s for s in mode.seen)


def test_a_mask_that_requires_grad_keeps_the_op_and_gets_no_gradient():
    q, k, v = _qkv(32, requires_grad=True)
    mask = torch.randn(32, 32, requires_grad=True)  # neither causal nor padding: dense
    out = sparseflow.attention(q, k, v, config=CFG, attn_mask=mask, is_causal=False, backend="reference")
    out.sum().backward()
    assert mask.grad is None and q.grad is not None


def test_config_cache_returns_equal_configs_for_equal_arguments_only():
    values = tuple(op_args(PBSConfig(block_size=16, segment_size=64)))
    a, b = op_schema.config_entry("pbs", values), op_schema.config_entry("pbs", tuple(values))
    assert a is b and a.cfg == PBSConfig(block_size=16, segment_size=64)
    assert "min_seq_len" not in a.kwargs and a.kwargs["segment_size"] == 64
    other = op_schema.config_entry("pbs", tuple(op_args(PBSConfig(block_size=16, segment_size=128))))
    assert other.cfg != a.cfg and other.serial != a.serial
    # True == 1, yet the config's own type checks must still run for the int
    i = [n for n, _ in op_schema.FIELDS["pbs"]].index("force_sink")
    with pytest.raises(TypeError, match="force_sink must be a bool"):
        op_schema.config_entry("pbs", values[:i] + (1,) + values[i + 1 :])
    # an int threshold and a float one are one config, and the op's arguments are floats
    assert op_schema.config_call(PBSConfig(threshold=1))[0] == op_schema.config_call(PBSConfig(threshold=1.0))[0]


@pytest.mark.parametrize(
    ("sparse_ms", "chosen"),
    [(0.99, "sdpa"), (0.975, "sdpa"), (0.96, "triton"), (0.5, "triton"), (1.2, "sdpa")],
    ids=["1pct-faster", "2.5pct-faster", "4pct-faster", "2x-faster", "slower"],
)
def test_dense_gives_way_only_to_a_backend_beating_it_by_the_margin(monkeypatch, sparse_ms, chosen):
    times = {"triton": sparse_ms, "sdpa": 1.0}
    monkeypatch.setattr(BackendChooser, "_time", lambda self, run, name: times[name])
    chooser = BackendChooser()
    assert chooser.margin == 1.03
    assert chooser.choose(("k",), ["triton", "sdpa"], run=None, prefer="sdpa") == chosen
    assert BackendChooser().choose(("k",), ["triton", "sdpa"], run=None) == min(times, key=times.get)


def test_a_dense_choice_by_the_margin_says_so(monkeypatch):
    monkeypatch.setattr(
        op_backends,
        "resolve_backend",
        lambda method, backend, device, dtype=None: "measure" if backend == "auto" else backend,
    )
    monkeypatch.setattr(op_backends, "fast_backends", lambda method, device, dtype=None: ["reference"])
    monkeypatch.setattr(BackendChooser, "_time", lambda self, run, name: {"reference": 0.99, "sdpa": 1.0}[name])
    default_chooser.clear()
    try:
        q, k, v = _qkv(300)
        with sparseflow.capture() as cap:
            sparseflow.attention(q, k, v, config=CFG, backend="auto")
        assert cap.calls[-1].backend == "sdpa"
        assert "pisa measured less than 1.03x faster than dense here (dense is exact)" in cap.calls[-1].reason
    finally:
        default_chooser.clear()
