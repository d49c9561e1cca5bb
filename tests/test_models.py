"""The rewrite on tiny random-initialised Hugging Face models (no downloads): every attention call
found and rewritten, dense/exact modes reproduce the original model, export with the GQA fold,
generate(), and the sparse methods end to end."""

from __future__ import annotations

import copy

import pytest
import torch

import sparseflow
from sparseflow import BSAConfig, PBSConfig, PISAConfig

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

ARCHS = ["llama", "qwen2", "mistral", "gpt2", "bert"]
DECODERS = ["llama", "qwen2", "mistral", "gpt2"]

# exact modes at block 16 (N=200: 13 blocks, so top_k=64 covers every visible block)
EXACT = {
    "pbs": PBSConfig(threshold=1.0, block_size=16, segment_size=32),
    "pisa": PISAConfig(block_size=16, top_k=64),
    "bsa": BSAConfig(block_size=16, top_k=64),
}
SPARSE = {
    "pbs": PBSConfig(threshold=0.5, block_size=16, segment_size=32),
    "pisa": PISAConfig(block_size=16, top_k=4),
    "bsa": BSAConfig(block_size=16, top_k=4),
}


def _ids(n, batch=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 128, (batch, n), generator=g)


def _out(o):
    return o.logits if hasattr(o, "logits") else o.last_hidden_state


def _attn_tags(arch, layers):
    return {
        "llama": [f"model.layers.{i}.self_attn" for i in range(layers)],
        "qwen2": [f"model.layers.{i}.self_attn" for i in range(layers)],
        "mistral": [f"model.layers.{i}.self_attn" for i in range(layers)],
        "gpt2": [f"transformer.h.{i}.attn" for i in range(layers)],
        "bert": [f"encoder.layer.{i}.attention.self" for i in range(layers)],
    }[arch]


def _padded_mask(batch, n, pad):
    am = torch.ones(batch, n, dtype=torch.long)
    if batch > 1:
        am[1, :pad] = 0  # left padding (decoders) / any padding (encoder)
    return am


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "padded"])
def test_dense_rewrite_reproduces_model(tiny, arch, masked):
    layers = 3 if arch == "llama" else 2
    model = tiny(arch, layers=layers)
    ids = _ids(23, batch=2)
    kw = {"attention_mask": _padded_mask(2, 23, 5)} if masked else {}
    with torch.no_grad():
        want = _out(model(ids, **kw))
    sparseflow.compile(model, method="dense", inner_backend="aot_eager")
    res = sparseflow.inspect(model, ids, **kw)
    got = _out(res.output)
    if masked and arch != "bert":
        keep = kw["attention_mask"].bool()  # padded query rows are garbage in the original too
        got, want = got[keep], want[keep]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    rep = res.report
    assert rep.num_rewritten == layers and rep.num_skipped == 0, str(rep)
    assert rep.tags() == _attn_tags(arch, layers)
    assert [e.layer for e in rep.entries] == list(range(layers))
    assert [c.tag for c in res.calls] == _attn_tags(arch, layers)
    if arch in ("llama", "qwen2", "mistral"):
        # native GQA reaches the op: 2 KV heads, either via enable_gqa or by folding repeat_kv
        assert all(c.k_shape[1] == 2 and c.q_shape[1] == 6 for c in res.calls)
        assert all(e.gqa in ("enable_gqa", "folded repeat x3") for e in rep.entries)


def test_skip_layers_and_filter_fn_on_llama(tiny):
    model = tiny("llama", layers=3)
    ids = _ids(30)
    with torch.no_grad():
        want = model(ids).logits
    sparseflow.compile(
        model, method="dense", skip_layers=(0,), filter_fn=lambda tag: "layers.2" not in tag, inner_backend="eager"
    )
    res = sparseflow.inspect(model, ids)
    torch.testing.assert_close(res.output.logits, want, atol=1e-6, rtol=1e-6)
    rep = res.report
    assert [e.tag for e in rep.rewritten] == ["model.layers.1.self_attn"]
    skipped = {e.tag: e.reason for e in rep.skipped}
    assert "skip_layers" in skipped["model.layers.0.self_attn"]
    assert "filter_fn" in skipped["model.layers.2.self_attn"]
    assert [c.tag for c in res.calls] == ["model.layers.1.self_attn"]
    assert "model.layers.2.self_attn" in str(rep)


def test_refuses_second_compile_on_llama(tiny):
    model = sparseflow.compile(tiny("llama"), method="dense", inner_backend="eager")
    with pytest.raises(RuntimeError, match="already transformed"):
        sparseflow.compile(model, method="pbs")
    assert model._sparseflow_config["method"] == "dense"


# --------------------------------------------------------------------------- export


@pytest.mark.parametrize("batch", [1, 2])
def test_export_llama_folds_gqa_and_passes_mask(tiny, batch):
    model = tiny("llama", layers=2)
    ids = _ids(40, batch=batch)
    kw = {"use_cache": False}
    if batch == 2:
        kw["attention_mask"] = _padded_mask(2, 40, 6)
    with torch.no_grad():
        want = model(ids, **kw).logits
    ep = sparseflow.export(model, (ids,), kw, method="dense")
    assert isinstance(ep, torch.export.ExportedProgram)
    rep = sparseflow.report(ep)
    assert rep.num_rewritten == 2 and rep.num_skipped == 0, str(rep)
    for e in rep.entries:
        assert e.graph == "export" and e.target == "aten.scaled_dot_product_attention"
        # the in-graph mask is proven causal (+ padding) and replaced by is_causal (+ [B, 1, 1, Nk])
        want_mask = "causal + key padding" if batch == 2 else "causal (proven"
        assert e.gqa == "folded repeat x3" and e.mask.startswith(want_mask) and "proven" in e.mask
    ops = [n for n in ep.graph_module.graph.nodes if n.op == "call_function" and "sparseflow" in str(n.target)]
    assert len(ops) == 2
    for n in ops:
        q, k, v = (a.meta["val"] for a in n.args[:3])
        assert q.shape[1] == 6 and k.shape[1] == 2 and v.shape[1] == 2  # the un-repeated K/V
        assert n.args[4] is True
        if batch == 2:
            mask = n.args[3].meta["val"]
            assert mask.dtype == torch.bool and tuple(mask.shape) == (2, 1, 1, 40)
        else:
            assert n.args[3] is None
        assert n.args[-1] in ("model.layers.0.self_attn", "model.layers.1.self_attn")
    assert not [n for n in ep.graph_module.graph.nodes if "scaled_dot_product" in str(n.target)]
    with torch.no_grad():
        got = ep.module()(ids, **kw).logits
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    # the op recognised the causal mask at run time: inspect records it ran (dense here)
    res = sparseflow.inspect(ep, ids, **kw)
    assert [c.k_shape[1] for c in res.calls] == [2, 2]


def test_export_llama_sparse_recognises_causal_mask(tiny):
    model = tiny("llama", layers=2)
    ids = _ids(200)
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
    ep = sparseflow.export(model, (ids,), {"use_cache": False}, method="pbs", config=EXACT["pbs"])
    res = sparseflow.inspect(ep, ids, use_cache=False)
    assert len(res.calls) == 2 and all(c.sparse for c in res.calls), str(res)
    torch.testing.assert_close(res.output.logits, want, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- generate


def test_generate_dense_llama(tiny):
    model = tiny("llama", layers=2)
    ref = copy.deepcopy(model)
    ids = _ids(20)
    want = ref.generate(ids, max_new_tokens=6, do_sample=False)
    sparseflow.compile(model, method="dense", inner_backend="eager")
    with sparseflow.capture() as cap:
        got = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, want)
    rep = sparseflow.report(model)
    assert rep.num_rewritten == 2 and rep.num_skipped == 0, str(rep)
    assert len(cap.calls) == 2 * 6  # prefill + 5 decode steps, 2 layers each
    assert {c.tag for c in cap.calls} == {"model.layers.0.self_attn", "model.layers.1.self_attn"}


def test_generate_pbs_llama_prefill_sparse_decode_dense(tiny):
    model = tiny("llama", layers=2)
    ref = copy.deepcopy(model)
    ids = _ids(96)
    want = ref.generate(ids, max_new_tokens=4, do_sample=False)
    sparseflow.compile(model, method="pbs", config=EXACT["pbs"], inner_backend="eager")
    with sparseflow.capture() as cap:
        got = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want)  # exact mode: same greedy tokens
    prefill = [c for c in cap.calls if c.q_shape[2] == 96]
    decode = [c for c in cap.calls if c.q_shape[2] == 1]
    assert len(prefill) == 2 and all(c.sparse for c in prefill), [c.reason for c in prefill]
    assert len(decode) == 2 * 3 and not any(c.sparse for c in decode)
    assert all("Nq=1" in c.reason for c in decode), {c.reason for c in decode}


# --------------------------------------------------------------------------- sparse methods


@pytest.mark.parametrize("method", ["pbs", "pisa", "bsa"])
def test_exact_mode_matches_original_llama(tiny, method):
    model = tiny("llama", layers=2)
    ids = _ids(200)
    with torch.no_grad():
        want = model(ids).logits
    sparseflow.compile(model, method=method, config=EXACT[method], inner_backend="eager")
    res = sparseflow.inspect(model, ids)
    assert len(res.calls) == 2 and all(c.sparse for c in res.calls), str(res)
    assert all(abs(c.density - 1.0) < 1e-6 for c in res.calls)
    torch.testing.assert_close(res.output.logits, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["pbs", "pisa", "bsa"])
def test_sparse_mode_reduces_density_llama(tiny, method):
    model = tiny("llama", layers=2)
    ids = _ids(200)
    with torch.no_grad():
        want = model(ids).logits
    sparseflow.compile(model, method=method, config=SPARSE[method], inner_backend="eager")
    res = sparseflow.inspect(model, ids)
    assert len(res.calls) == 2 and all(c.sparse for c in res.calls), str(res)
    assert res.mean_density() < 1.0
    assert torch.isfinite(res.output.logits).all()
    assert res.output.logits.shape == want.shape
    assert "sparse" in str(res)


def test_per_layer_methods_llama(tiny):
    model = tiny("llama", layers=3)
    ids = _ids(200)
    with torch.no_grad():
        want = model(ids).logits
    sparseflow.compile(
        model, method="pbs", config=EXACT["pbs"], layer_configs={0: None, 2: EXACT["pisa"]}, inner_backend="eager"
    )
    res = sparseflow.inspect(model, ids)
    torch.testing.assert_close(res.output.logits, want, atol=1e-5, rtol=1e-5)
    assert [(c.tag, c.method) for c in res.calls] == [
        ("model.layers.1.self_attn", "pbs"),
        ("model.layers.2.self_attn", "pisa"),
    ]
    assert "layer_configs[0] is None" in res.report.skipped[0].reason


@pytest.mark.parametrize("method", ["pbs", "pisa", "bsa"])
@pytest.mark.parametrize("arch", ARCHS)
def test_exact_mode_matches_original_every_arch(tiny, arch, method):
    """Property 6 on every architecture: the rewritten model in exact mode is the original model
    (BERT runs the non-causal paths, with key padding in the second batch row)."""
    model = tiny(arch, layers=2)
    ids = _ids(100, batch=2)
    am = _padded_mask(2, 100, pad=37)
    with torch.no_grad():
        want = _out(model(ids, attention_mask=am))
    sparseflow.compile(model, method=method, config=EXACT[method], inner_backend="eager")
    res = sparseflow.inspect(model, ids, attention_mask=am)
    assert res.report.num_rewritten == 2, str(res.report)
    assert all(c.sparse for c in res.calls), str(res)
    got = _out(res.output)
    valid = am.bool()  # padded positions' outputs are not meaningful in any implementation
    torch.testing.assert_close(got[valid], want[valid], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("method", ["pisa", "bsa"])
@pytest.mark.parametrize("arch", DECODERS)
def test_sparse_mode_is_causal_and_sparse(tiny, arch, method):
    """Changing tokens after position t changes no logit at or before t, while the model runs
    really sparse. Not PBS: its selection reads the prompt's last queries (the proxy) and pools
    each query block, so in a model a later token moves the selection of earlier ones; PBS is a
    prefill method over a known prompt. Its attention given a selection is causal, and with
    causal_proxy=True its op is causal in keys/values (tests/test_properties.py)."""
    cfg = SPARSE[method]
    model = tiny(arch, layers=2)
    sparseflow.compile(model, method=method, config=cfg, inner_backend="eager")
    ids = _ids(180)
    t = 121
    ids2 = ids.clone()
    ids2[:, t + 1 :] = _ids(180 - t - 1, seed=7)
    a = sparseflow.inspect(model, ids)
    b = sparseflow.inspect(model, ids2)
    assert all(c.sparse for c in a.calls + b.calls)
    assert a.mean_density() < 0.9, a.mean_density()
    torch.testing.assert_close(a.output.logits[:, : t + 1], b.output.logits[:, : t + 1], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(a.output.logits[:, t + 1 :], b.output.logits[:, t + 1 :])
