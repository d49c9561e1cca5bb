"""The converted model's attention function resolves each module's plan entry once and serves
repeated dense calls from the op's memo without copying SDPA's output; anything that changes
what a call computes (the plan, a mask, the dtype, the length) must be planned afresh."""

import pytest
import torch

pytest.importorskip("transformers")

import sparseflow  # noqa: E402
import sparseflow.hf as sfhf  # noqa: E402
from sparseflow import PBSConfig  # noqa: E402
from sparseflow.autobackend import default_chooser  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

from conftest import make_tiny  # noqa: E402

CFG = PBSConfig(block_size=16, segment_size=32, min_seq_len=64)  # dense below 64 tokens
TAG = "model.layers.1.self_attn"


@pytest.fixture(autouse=True)
def _fresh_memo():
    default_chooser.planned_calls.clear()
    yield
    default_chooser.planned_calls.clear()


@pytest.fixture
def attn():
    """Layer 1's attention module of a tiny Llama converted to a PBS plan."""
    model = sfhf.apply_plan(make_tiny("llama"), sfhf.Plan(method="pbs", config=CFG, num_layers=2))
    return model.model.layers[1].self_attn


def _qkv(n, dtype=torch.float32):
    # the layout a Llama attention hands over: [B, N, H, D] memory viewed as [B, H, N, D]
    g = torch.Generator().manual_seed(n)
    q = torch.randn(1, n, 6, 16, generator=g, dtype=dtype).transpose(1, 2)
    k, v = (torch.randn(1, n, 2, 16, generator=g, dtype=dtype).transpose(1, 2) for _ in range(2))
    return q, k, v


def _both(module, q, k, v, mask=None):
    """(sparseflow's output, transformers' SDPA output, the calls recorded) of one attention call."""
    with sparseflow.capture() as cap:
        got, _ = sfhf.sparseflow_attention_forward(module, q, k, v, mask, scaling=module.scaling)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=module.scaling)
    return got, want, cap.calls


def test_repeated_dense_calls_equal_sdpa_and_report_dense_with_the_reason(attn):
    q, k, v = _qkv(32)
    for _ in range(3):
        got, want, calls = _both(attn, q, k, v)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert got.is_contiguous()
        (rec,) = calls
        assert (rec.sparse, rec.tag, rec.method) == (False, TAG, "pbs") and "min_seq_len=64" in rec.reason
    assert len(default_chooser.planned_calls) == 1
    # the module's entry noted the signature as dense: the repeats went to SDPA from it
    ((_, reason),) = sfhf._layer_of(attn).known.values()
    assert "min_seq_len=64" in reason


def test_a_dense_result_keeps_sdpas_layout_so_the_transpose_back_copies_nothing():
    q, k, v = _qkv(32)
    out = sparseflow.ops.attention_any_layout(q, k, v, config=CFG, is_causal=True, scale=None, backend="auto", tag="")
    torch.testing.assert_close(out, sparseflow.attention(q, k, v, config=CFG), rtol=0, atol=0)
    assert out.transpose(1, 2).is_contiguous()  # [B, N, H, D] memory, like the inputs


def test_a_dense_call_returns_sdpas_own_output_uncopied(attn, monkeypatch):
    sdpa, made = torch.nn.functional.scaled_dot_product_attention, []

    def kept_sdpa(*args, **kwargs):
        made.append(sdpa(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", kept_sdpa)
    q, k, v = _qkv(32)
    for _ in range(2):  # planned, then remembered
        got, _ = sfhf.sparseflow_attention_forward(attn, q, k, v, None, scaling=attn.scaling)
        assert got.data_ptr() == made[-1].data_ptr()


def test_module_keeps_its_resolved_layer_and_a_new_plan_replaces_it(attn):
    q, k, v = _qkv(32)
    _both(attn, q, k, v)
    kept = attn.__dict__[sfhf._LAYER_ATTR]
    _both(attn, q, k, v)
    assert attn.__dict__[sfhf._LAYER_ATTR] is kept and kept.tag == TAG and kept.cfg == CFG
    # a new plan (layer 1 dense) on the same config object: the layer re-resolves on its next call
    setattr(attn.config, sfhf.PLAN_KEY, sfhf.Plan(method="pbs", config=CFG, dense_layers=(1,)).to_dict())
    got, want, calls = _both(attn, q, k, v)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert calls[-1].method == "dense" and attn.__dict__[sfhf._LAYER_ATTR] is not kept


def test_a_lower_min_seq_len_in_a_new_plan_runs_sparse(attn):
    q, k, v = _qkv(64)
    setattr(
        attn.config,
        sfhf.PLAN_KEY,
        sfhf.Plan(method="pbs", config=PBSConfig(block_size=16, segment_size=32, min_seq_len=128)).to_dict(),
    )
    assert not _both(attn, q, k, v)[2][-1].sparse
    setattr(attn.config, sfhf.PLAN_KEY, sfhf.Plan(method="pbs", config=CFG).to_dict())
    assert _both(attn, q, k, v)[2][-1].sparse


def test_a_padding_mask_after_a_remembered_call_is_honoured(attn):
    q, k, v = _qkv(32)
    _both(attn, q, k, v)
    valid = torch.ones(1, 32, dtype=torch.bool)
    valid[:, :5] = False  # left padding
    mask = torch.tril(torch.ones(32, 32, dtype=torch.bool))[None, None] & valid[:, None, None, :]
    got, want, calls = _both(attn, q, k, v, mask)
    torch.testing.assert_close(got[:, 5:], want[:, 5:])
    unmasked, _, _ = _both(attn, q, k, v)
    assert not torch.allclose(got[:, 5:], unmasked[:, 5:])
    assert not calls[-1].sparse and "min_seq_len" in calls[-1].reason


def test_a_changed_dtype_or_length_is_planned_afresh(attn):
    _both(attn, *_qkv(32))
    got, want, calls = _both(attn, *_qkv(32, torch.float64))
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert len(default_chooser.planned_calls) == 2
    assert _both(attn, *_qkv(64))[2][-1].sparse  # now long enough for the plan


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_layer_resolved_eagerly_compiles_in_one_graph(attn):
    # the kept layer spares the trace plan_of's lock, which Dynamo cannot enter (a graph break)
    q, k, v = _qkv(32)
    want = _both(attn, q, k, v)[1]
    kept = vars(attn)[sfhf._LAYER_ATTR]
    fn = torch.compile(
        lambda a, b, c: sfhf.sparseflow_attention_forward(attn, a, b, c, None, scaling=attn.scaling)[0],
        backend="eager",
        fullgraph=True,
    )
    torch.testing.assert_close(fn(q, k, v), want)
    assert vars(attn)[sfhf._LAYER_ATTR] is kept


def test_a_plans_tuning_round_trips_and_reaches_the_op(attn, monkeypatch):
    tuning = sparseflow.Tuning(cuda_graphs=False, pbs_kv_layout="gather")
    plan = sfhf.Plan(method="pbs", config=CFG, tuning=tuning)
    assert sfhf.Plan.from_dict(plan.to_dict()).tuning == tuning
    old = plan.to_dict()
    del old["tuning"]  # a plan written before plans carried one
    assert sfhf.Plan.from_dict(old).tuning == sparseflow.Tuning()
    with pytest.raises(ValueError, match=r"unknown fields \['pbs_warp_count'\]"):
        sfhf.Plan.from_dict({**plan.to_dict(), "tuning": {"pbs_warp_count": 4}})
    with pytest.raises(TypeError, match="Plan.tuning must be a sparseflow.Tuning"):
        sfhf.Plan(method="pbs", config=CFG, tuning={"cuda_graphs": False})
    seen = []
    real = sparseflow.ops._attention
    monkeypatch.setattr(sparseflow.ops, "_attention", lambda *a: seen.append(a[10]) or real(*a))
    setattr(attn.config, sfhf.PLAN_KEY, plan.to_dict())
    q, k, v = _qkv(80)  # sparse at this length: min_seq_len is 64
    sfhf.sparseflow_attention_forward(attn, q, k, v, None, scaling=attn.scaling)
    assert seen == [tuning]
