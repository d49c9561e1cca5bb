"""sparseflow.attention remembers the plan of an eager call (dense SDPA with its reason, or the
sparse backend) per call signature, so that a repeat skips validation and planning, and runs an
eager sparse call without gradient without the op's dispatcher; neither may change what a call
computes or records."""

import pytest
import torch
import torch.nn.functional as F

import sparseflow
from sparseflow import PBSConfig
from sparseflow.autobackend import default_chooser


def _qkv(n, d=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(n)
    return (
        torch.randn(1, 4, n, d, generator=g, dtype=dtype),
        torch.randn(1, 2, n, d, generator=g, dtype=dtype),
        torch.randn(1, 2, n, d, generator=g, dtype=dtype),
    )


@pytest.fixture(autouse=True)
def _fresh_memo():
    default_chooser.planned_calls.clear()
    yield
    default_chooser.planned_calls.clear()


CFG = PBSConfig(block_size=16, segment_size=32, min_seq_len=64)


def test_repeated_dense_call_is_remembered_and_equals_sdpa():
    q, k, v = _qkv(32)  # 32 < min_seq_len: dense
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for _ in range(2):
        with sparseflow.capture() as cap:
            out = sparseflow.attention(q, k, v, config=CFG, backend="reference", tag="layer")
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        (rec,) = cap.calls
        assert (rec.sparse, rec.tag) == (False, "layer") and "min_seq_len" in rec.reason
    assert len(default_chooser.planned_calls) == 1


def test_longer_call_after_a_remembered_one_runs_sparse():
    sparseflow.attention(*_qkv(32), config=CFG, backend="reference")
    with sparseflow.capture() as cap:
        sparseflow.attention(*_qkv(128), config=CFG, backend="reference")
    assert cap.calls[-1].sparse


@pytest.mark.parametrize(
    "bad,match",
    [(dict(scale=-1.0), "scale"), (dict(backend="fast"), "backend")],
    ids=["negative-scale", "unknown-backend"],
)
def test_bad_input_after_a_remembered_call_still_raises(bad, match):
    q, k, v = _qkv(32)
    sparseflow.attention(q, k, v, config=CFG, backend="reference")
    kw = dict(config=CFG, backend="reference")
    kw.update(bad)
    with pytest.raises(ValueError, match=match):
        sparseflow.attention(q, k, v, **kw)


def test_mismatched_value_dtype_after_a_remembered_call_still_raises():
    q, k, v = _qkv(32)
    sparseflow.attention(q, k, v, config=CFG, backend="reference")
    with pytest.raises(TypeError, match="share a dtype"):
        sparseflow.attention(q, k, v.double(), config=CFG, backend="reference")


def test_clearing_the_chooser_forgets_the_memo():
    sparseflow.attention(*_qkv(32), config=CFG, backend="reference")
    assert default_chooser.planned_calls
    default_chooser.clear()
    assert not default_chooser.planned_calls


def test_equal_config_objects_do_not_share_an_entry():
    # keyed by identity and checked on a hit: an equal but distinct config plans afresh
    q, k, v = _qkv(32)
    sparseflow.attention(q, k, v, config=CFG, backend="reference")
    other = PBSConfig(block_size=16, segment_size=32, min_seq_len=64)
    sparseflow.attention(q, k, v, config=other, backend="reference")
    assert len(default_chooser.planned_calls) == 2


def test_masked_and_traced_calls_are_not_remembered():
    q, k, v = _qkv(32)
    mask = torch.ones(1, 1, 1, 32, dtype=torch.bool)
    sparseflow.attention(q, k, v, config=CFG, backend="reference", attn_mask=mask, is_causal=True)
    torch.compile(
        lambda a, b, c: sparseflow.attention(a, b, c, config=CFG, backend="reference"), backend="eager", fullgraph=True
    )(q, k, v)
    assert not default_chooser.planned_calls


def test_repeated_sparse_call_is_remembered_and_skips_the_dispatcher_without_gradient(monkeypatch):
    from sparseflow import op_validation, ops

    q, k, v = _qkv(128)
    want = sparseflow.attention(q, k, v, config=CFG, backend="reference", tuning=sparseflow.Tuning(pbs_tma=False))
    validated, dispatched = [], []
    real_validate, real_op_for = op_validation.validate_inputs, ops.op_for
    monkeypatch.setattr(op_validation, "validate_inputs", lambda *a: validated.append(a[0]) or real_validate(*a))
    monkeypatch.setattr(ops, "op_for", lambda m: dispatched.append(m) or real_op_for(m))
    for i in range(3):
        with sparseflow.capture() as cap:
            out = sparseflow.attention(q, k, v, config=CFG, backend="reference", tag="layer")
        torch.testing.assert_close(out, want, rtol=0, atol=0)
        (rec,) = cap.calls
        assert (rec.sparse, rec.tag, rec.backend) == (True, "layer", "reference") and rec.selection is not None
    assert validated == ["pbs"] and dispatched == [] and len(default_chooser.planned_calls) == 2  # with `want`
    # with gradient the op's autograd is needed: through the dispatcher, with the remembered plan
    qg = q.clone().requires_grad_(True)
    out = sparseflow.attention(qg, k, v, config=CFG, backend="reference")
    out.sum().backward()
    assert dispatched == ["pbs"] and validated.count("pbs") >= 1 and qg.grad is not None
    torch.testing.assert_close(out.detach(), want, rtol=0, atol=0)


# --------------------------------------------------------------------------- a caller's notes (``known``)


def _any_layout(q, k, v, known, scale=None, backend="reference"):
    return sparseflow.ops.attention_any_layout(
        q, k, v, config=CFG, is_causal=True, scale=scale, backend=backend, tag="layer", known=known
    )


def _no_planning(monkeypatch):
    def planned(*a, **k):
        raise AssertionError("a noted dense call was planned again")

    monkeypatch.setattr(sparseflow.ops, "_attention", planned)


def test_noted_dense_call_goes_to_sdpa_and_still_records(monkeypatch):
    q, k, v = _qkv(32)  # below min_seq_len: dense
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    known = {}
    torch.testing.assert_close(_any_layout(q, k, v, known), want, rtol=0, atol=0)
    ((_, reason),) = known.values()
    assert "min_seq_len" in reason
    _no_planning(monkeypatch)
    with sparseflow.capture() as cap:
        out = _any_layout(q, k, v, known)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    (rec,) = cap.calls
    assert (rec.sparse, rec.tag) == (False, "layer") and "min_seq_len" in rec.reason
    with sparseflow.recording.tallying({}) as tally:
        _any_layout(q, k, v, known)
    assert tally == {("layer", "pbs"): {reason: 1}}


class _CountingEnviron(dict):
    """os.environ's stand-in that counts the reads a call makes."""

    reads = 0

    def get(self, key, default=None):
        type(self).reads += 1
        return super().get(key, default)

    def __getitem__(self, key):
        type(self).reads += 1
        return super().__getitem__(key)

    def __contains__(self, key):
        type(self).reads += 1
        return super().__contains__(key)


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_noted_dense_call_reads_nothing_from_the_environment(monkeypatch, backend):
    # a decided call must cost what SDPA costs: an environment read was 1-4 us a layer
    import os

    q, k, v = _qkv(32)
    known = {}
    _any_layout(q, k, v, known, backend=backend)
    monkeypatch.setattr(os, "environ", _CountingEnviron(os.environ))
    _CountingEnviron.reads = 0
    _any_layout(q, k, v, known, backend=backend)
    assert _CountingEnviron.reads == 0


def test_noted_sparse_call_is_planned_through_the_memo_and_stays_sparse():
    q, k, v = _qkv(128)
    known = {}
    first = _any_layout(q, k, v, known)
    assert list(known.values())[0][1] is None  # noted as sparse
    with sparseflow.capture() as cap:
        again = _any_layout(q, k, v, known)
    assert cap.calls[-1].sparse
    torch.testing.assert_close(again, first, rtol=0, atol=0)


@pytest.mark.parametrize(
    "change",
    ["longer", "scale", "value-dtype", "is-causal-int", "chooser-cleared"],
)
def test_a_noted_dense_call_does_not_answer_another(monkeypatch, change):
    q, k, v = _qkv(32)
    known = {}
    _any_layout(q, k, v, known)
    if change == "longer":
        q, k, v = _qkv(128)
        with sparseflow.capture() as cap:
            _any_layout(q, k, v, known)
        assert cap.calls[-1].sparse
    elif change == "scale":
        with pytest.raises(ValueError, match="scale"):
            _any_layout(q, k, v, known, scale=-1.0)
    elif change == "is-causal-int":
        with pytest.raises(TypeError, match="is_causal"):
            sparseflow.ops.attention_any_layout(
                q, k, v, config=CFG, is_causal=1, scale=None, backend="reference", tag="layer", known=known
            )
    elif change == "value-dtype":
        with pytest.raises(TypeError, match="share a dtype"):
            _any_layout(q, k, v.double(), known)
    else:
        default_chooser.clear()
        calls = []
        real = sparseflow.ops._attention
        monkeypatch.setattr(sparseflow.ops, "_attention", lambda *a: calls.append(1) or real(*a))
        _any_layout(q, k, v, known)
        assert calls == [1]


def test_notes_are_not_read_or_written_under_compile():
    q, k, v = _qkv(32)
    known = {}
    fn = torch.compile(lambda q, k, v: _any_layout(q, k, v, known), backend="eager", fullgraph=True)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(fn(q, k, v), want)
    assert known == {}


def test_notes_are_bounded():
    known = {}
    for n in range(8, 8 + sparseflow.op_memo._KNOWN_LIMIT + 3):
        _any_layout(*_qkv(n), known)
    assert 0 < len(known) <= sparseflow.op_memo._KNOWN_LIMIT
