"""The rewrite pass on small hand-written modules: what it finds, folds, rewrites and skips,
and the public API's argument checking. Model-level checks are in test_models.py."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sparseflow
from sparseflow import BSAConfig, DenseConfig, PBSConfig, PISAConfig
from sparseflow.passes import RewriteOptions, layer_index, match_repeat_kv, normalize_module_path, rewrite_graph

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

OP_NAMESPACE = "sparseflow"


def _op_nodes(gm):
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and isinstance(n.target, torch._ops.OpOverload)
        and n.target.namespace == OP_NAMESPACE
    ]


def _sdpa_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and "scaled_dot_product" in str(n.target)]


def _val(node):
    return node.meta.get("val", node.meta.get("example_value"))


# --------------------------------------------------------------------------- modules


class RepeatKV(nn.Module):
    """K/V repeated to every query head before SDPA, in one of several spellings."""

    def __init__(self, style: str, n_rep: int = 3):
        super().__init__()
        self.style, self.n_rep = style, n_rep

    def _repeat(self, x):
        b, h, n, d = x.shape
        r = self.n_rep
        if self.style == "hf":
            return x[:, :, None, :, :].expand(b, h, r, n, d).reshape(b, h * r, n, d)
        if self.style == "unsqueeze_view":
            return x.unsqueeze(2).expand(b, h, r, n, d).contiguous().view(b, h * r, n, d)
        if self.style == "repeat_interleave":
            return torch.repeat_interleave(x, r, dim=1)
        if self.style == "tile":  # x.repeat: head i uses kv head i % h — NOT GQA, must not fold
            return x.repeat(1, r, 1, 1)
        raise ValueError(self.style)

    def forward(self, q, k, v, mask=None):
        k, v = self._repeat(k), self._repeat(v)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _qkv(b=2, hq=6, hkv=2, n=24, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, hq, n, d, generator=g).to(dtype),
        torch.randn(b, hkv, n, d, generator=g).to(dtype),
        torch.randn(b, hkv, n, d, generator=g).to(dtype),
    )


class SDPACall(nn.Module):
    """One SDPA call with fixed keyword arguments."""

    def __init__(self, **kw):
        super().__init__()
        self.kw = kw

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, **self.kw)


class Wrap(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *a, **kw):
        return self.inner(*a, **kw)


# --------------------------------------------------------------------------- tags


@pytest.mark.parametrize(
    "path, tag",
    [
        ("L['self'].model.layers.3.self_attn", "model.layers.3.self_attn"),
        ("L['args'][0].model.layers.0.self_attn", "model.layers.0.self_attn"),
        ("L['model'].transformer.h.1.attn", "transformer.h.1.attn"),
        ("L['self']._modules['layers']._modules['2'].attn", "layers.2.attn"),
        ("L['self'].layers[4].attn", "layers.4.attn"),
        ("model.layers.1.self_attn", "model.layers.1.self_attn"),
        ("L['self']", ""),
        ("", ""),
    ],
)
def test_normalize_module_path(path, tag):
    assert normalize_module_path(path) == tag


@pytest.mark.parametrize(
    "tag, layer",
    [
        ("model.layers.3.self_attn", 3),
        ("transformer.h.0.attn", 0),
        ("encoder.layer.11.attention.self", 11),
        ("blocks.2", 2),
        ("enc.self_attn", None),
        ("", None),
        ("model.layers2.attn", None),
    ],
)
def test_layer_index(tag, layer):
    assert layer_index(tag) == layer


# --------------------------------------------------------------------------- plain module


def test_plain_module_dense_is_exact(plain_attention):
    model = plain_attention(layers=3)
    x = torch.randn(2, 37, 48)
    with torch.no_grad():
        want = model(x)
    twin = copy.deepcopy(model)
    assert sparseflow.compile(twin, method="dense", inner_backend="aot_eager") is twin
    res = sparseflow.inspect(twin, x)
    torch.testing.assert_close(res.output, want, atol=1e-6, rtol=1e-6)
    rep = sparseflow.report(twin)
    assert rep.num_rewritten == 3 and rep.num_skipped == 0
    assert rep.tags() == ["blocks.0", "blocks.1", "blocks.2"]
    assert [e.layer for e in rep.entries] == [0, 1, 2]
    assert all(e.gqa == "enable_gqa" and e.k_shape[1] == 2 for e in rep.entries)
    assert len(res.calls) == 3 and all(c.tag.startswith("blocks.") for c in res.calls)
    text = str(res)
    assert "blocks.1" in text and "rewritten" in text and "density" in text


def test_plain_module_inductor(plain_attention):
    model = plain_attention(layers=2)
    x = torch.randn(1, 40, 48)
    with torch.no_grad():
        want = model(x)
    sparseflow.compile(model, method="dense", inner_backend="inductor")
    with torch.no_grad():
        got = model(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert sparseflow.report(model).num_rewritten == 2


def test_training_gradients_flow(plain_attention):
    model = plain_attention(layers=2).train()
    twin = copy.deepcopy(model)
    x = torch.randn(2, 20, 48)
    model(x).square().sum().backward()
    sparseflow.compile(twin, method="dense", inner_backend="aot_eager")
    twin(x).square().sum().backward()
    assert sparseflow.report(twin).num_rewritten == 2
    for (name, p), p2 in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p2.grad, p.grad, atol=1e-5, rtol=1e-5, msg=name)


def test_fullgraph_and_dynamic_are_passed(plain_attention):
    model = plain_attention(layers=1)
    sparseflow.compile(model, method="dense", inner_backend="eager", fullgraph=True, dynamic=True)
    with torch.no_grad():
        model(torch.randn(1, 10, 48))
        model(torch.randn(1, 17, 48))
    rep = sparseflow.report(model)
    assert rep.graphs == 1  # dynamic=True: one graph for both lengths
    assert any(not isinstance(s, int) for s in rep.entries[0].q_shape)  # symbolic length


# --------------------------------------------------------------------------- GQA fold


@pytest.mark.parametrize("style", ["hf", "unsqueeze_view", "repeat_interleave"])
@pytest.mark.parametrize("graph", ["export", "dynamo"])
def test_gqa_fold(style, graph):
    q, k, v = _qkv()
    mod = RepeatKV(style)
    with torch.no_grad():
        want = mod(q, k, v)
    if graph == "export":
        ep = sparseflow.export(mod, (q, k, v), method="dense")
        gm = ep.graph_module
        got = ep.module()(q, k, v)
        rep = sparseflow.report(ep)
    else:  # the Dynamo graph is not reachable from outside: check the report and the op's inputs
        sparseflow.compile(mod, method="dense", inner_backend="eager")
        with torch.no_grad(), sparseflow.capture() as cap:
            got = mod(q, k, v)
        rep = sparseflow.report(mod)
        gm = None
        assert [c.k_shape for c in cap.calls] == [(2, 2, 24, 16)]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    (entry,) = rep.entries
    assert entry.rewritten and entry.gqa == "folded repeat x3", str(rep)
    assert entry.k_shape == (2, 2, 24, 16) and entry.v_shape == (2, 2, 24, 16)
    if gm is not None:
        (op,) = _op_nodes(gm)
        assert _val(op.args[1]).shape[1] == 2 and _val(op.args[2]).shape[1] == 2
        assert not _sdpa_nodes(gm)
        # the repeat is gone from the graph
        assert not [n for n in gm.graph.nodes if "expand" in str(n.target) or "repeat_interleave" in str(n.target)]


def test_tile_repeat_is_not_folded():
    q, k, v = _qkv()
    mod = RepeatKV("tile")
    want = mod(q, k, v)
    ep = sparseflow.export(mod, (q, k, v), method="dense")
    (entry,) = sparseflow.report(ep).entries
    assert entry.rewritten and entry.gqa == "" and entry.k_shape[1] == 6
    torch.testing.assert_close(ep.module()(q, k, v), want, atol=1e-6, rtol=1e-6)


def test_match_repeat_kv_rejects_other_shapes():
    q, k, v = _qkv()
    ep = torch.export.export(RepeatKV("hf"), (q, k, v)).run_decompositions({})
    (sdpa,) = _sdpa_nodes(ep.graph_module)
    m = match_repeat_kv(sdpa.args[1])
    assert m is not None and m.n_rep == 3 and _val(m.base).shape == (2, 2, 24, 16)
    assert match_repeat_kv(sdpa.args[0]) is None  # q is not a repeat
    assert match_repeat_kv(None) is None


def test_fold_with_mask_export():
    q, k, v = _qkv(n=30)
    mask = torch.ones(30, 30, dtype=torch.bool).tril()[None, None].expand(2, 1, 30, 30).clone()
    mask[1, :, :, :5] = False  # key padding on the second sequence
    mask[1, :, :5, 0] = True  # (avoid fully masked rows, which SDPA turns into NaN)
    mod = RepeatKV("hf")
    want = mod(q, k, v, mask)
    ep = sparseflow.export(mod, (q, k, v, mask), method="dense")
    (entry,) = sparseflow.report(ep).entries
    assert entry.gqa == "folded repeat x3" and "runtime-recognised" in entry.mask
    torch.testing.assert_close(ep.module()(q, k, v, mask), want, atol=1e-6, rtol=1e-6)


# --------------------------------------------------------------------------- export variants


class FlashCPU(nn.Module):
    def __init__(self, use_lse=False):
        super().__init__()
        self.use_lse = use_lse

    def forward(self, q, k, v):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
        return (out, lse) if self.use_lse else out


def test_backend_variant_rewritten_when_only_output0_used():
    q, k, v = _qkv(hkv=6)
    want = FlashCPU()(q, k, v)
    ep = sparseflow.export(FlashCPU(), (q, k, v), method="dense")
    (entry,) = sparseflow.report(ep).entries
    assert entry.rewritten and entry.target == "aten._scaled_dot_product_flash_attention_for_cpu"
    assert len(_op_nodes(ep.graph_module)) == 1
    torch.testing.assert_close(ep.module()(q, k, v), want, atol=1e-6, rtol=1e-6)


def test_backend_variant_skipped_when_logsumexp_used(caplog):
    q, k, v = _qkv(hkv=6)
    with caplog.at_level(logging.INFO, logger="sparseflow"):
        ep = sparseflow.export(FlashCPU(use_lse=True), (q, k, v), method="dense")
    (entry,) = sparseflow.report(ep).entries
    assert not entry.rewritten and "output[0]" in entry.reason
    assert any("output[0]" in r.getMessage() for r in caplog.records)
    assert not _op_nodes(ep.graph_module)


# --------------------------------------------------------------------------- skips


@pytest.mark.parametrize(
    "make, shape, dtype, reason",
    [
        (lambda: SDPACall(is_causal=True), (2, 24, 16), torch.float32, "3-D"),
        (lambda: SDPACall(is_causal=True), (2, 6, 24, 16), torch.float64, "dtype"),
        (lambda: SDPACall(is_causal=True, dropout_p=0.1), (2, 6, 24, 16), torch.float32, "dropout_p=0.1"),
    ],
    ids=["3d", "float64", "dropout"],
)
def test_skips_with_reason(make, shape, dtype, reason, caplog):
    torch.manual_seed(0)
    q, k, v = (torch.randn(*shape, dtype=dtype) for _ in range(3))
    mod = Wrap(make())
    sparseflow.compile(mod, method="dense", inner_backend="eager")
    with caplog.at_level(logging.INFO, logger="sparseflow"):
        mod(q, k, v)
    rep = sparseflow.report(mod)
    (entry,) = rep.entries
    assert not entry.rewritten and reason in entry.reason, str(rep)
    assert entry.tag == "inner"
    assert any(reason in r.getMessage() and "inner" in r.getMessage() for r in caplog.records)


def test_head_mismatch_without_enable_gqa_is_skipped():
    q, k, v = _qkv()
    ep = torch.export.export(SDPACall(is_causal=True, enable_gqa=True), (q, k, v)).run_decompositions({})
    (node,) = _sdpa_nodes(ep.graph_module)
    node.kwargs = {**node.kwargs, "enable_gqa": False}
    entries = rewrite_graph(ep.graph_module, RewriteOptions(DenseConfig()), graph_kind="export")
    (entry,) = entries
    assert not entry.rewritten and "without enable_gqa" in entry.reason
    assert len(_sdpa_nodes(ep.graph_module)) == 1


def test_float_mask_is_passed_to_the_op():
    q, k, v = _qkv(hkv=6)
    causal = torch.zeros(24, 24).masked_fill(~torch.ones(24, 24, dtype=torch.bool).tril(), float("-inf"))

    class M(nn.Module):
        def forward(self, q, k, v, m):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

    want = M()(q, k, v, causal)
    ep = sparseflow.export(M(), (q, k, v, causal), method="dense")
    (entry,) = sparseflow.report(ep).entries
    assert entry.rewritten and entry.mask.startswith("float32")
    torch.testing.assert_close(ep.module()(q, k, v, causal), want, atol=1e-6, rtol=1e-6)


# --------------------------------------------------------------------------- per-layer control


def test_skip_layers_filter_fn_and_layer_configs(plain_attention, caplog):
    model = plain_attention(layers=4)
    x = torch.randn(1, 64, 48)
    with torch.no_grad():
        want = model(x)
    sparseflow.compile(
        model,
        method="dense",
        skip_layers=[0],
        filter_fn=lambda tag: tag != "blocks.3",
        layer_configs={1: None, 2: PISAConfig(block_size=16, top_k=64)},
        inner_backend="eager",
    )
    with caplog.at_level(logging.INFO, logger="sparseflow"):
        res = sparseflow.inspect(model, x)
    torch.testing.assert_close(res.output, want, atol=1e-5, rtol=1e-5)
    rep = res.report
    by_tag = {e.tag: e for e in rep.entries}
    assert "skip_layers" in by_tag["blocks.0"].reason
    assert "layer_configs[1] is None" in by_tag["blocks.1"].reason
    assert by_tag["blocks.2"].rewritten and by_tag["blocks.2"].method == "pisa"
    assert by_tag["blocks.2"].config["top_k"] == 64
    assert "filter_fn" in by_tag["blocks.3"].reason
    assert rep.num_rewritten == 1 and rep.num_skipped == 3
    assert [c.tag for c in res.calls] == ["blocks.2"]
    logged = " ".join(r.getMessage() for r in caplog.records)
    for tag in ("blocks.0", "blocks.1", "blocks.3"):
        assert tag in logged
    text = str(rep)
    assert "skip_layers" in text and "filter_fn" in text


def test_report_dedupes_recompiles(plain_attention):
    model = plain_attention(layers=2)
    sparseflow.compile(model, method="dense", inner_backend="eager", dynamic=False)
    with torch.no_grad():
        for n in (10, 11, 12, 10):
            model(torch.randn(1, n, 48))
    rep = sparseflow.report(model)
    assert rep.graphs == 3
    assert len(rep.entries) == 2 and all(e.graphs == 3 for e in rep.entries)
    assert rep.counts() == {"calls": 2, "rewritten": 2, "skipped": 0, "graphs": 3}
    d = rep.to_dict()
    assert d["method"] == "dense" and len(d["entries"]) == 2


def test_report_is_empty_before_first_call(plain_attention):
    model = sparseflow.compile(plain_attention(layers=1), method="dense", inner_backend="eager")
    rep = sparseflow.report(model)
    assert rep.entries == [] and "no attention calls seen yet" in str(rep)


# --------------------------------------------------------------------------- nn.MultiheadAttention


class MHAUser(nn.Module):
    def __init__(self, batch_first=True):
        super().__init__()
        torch.manual_seed(0)
        self.attn = nn.MultiheadAttention(32, 4, batch_first=batch_first)

    def forward(self, x, **kw):
        return self.attn(x, x, x, need_weights=False, **kw)[0]


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("masks", ["none", "causal", "padding"])
def test_multihead_attention(grad, masks):
    model = MHAUser().eval()
    x = torch.randn(2, 12, 32)
    kw = {}
    if masks == "causal":
        kw = dict(attn_mask=nn.Transformer.generate_square_subsequent_mask(12), is_causal=True)
    elif masks == "padding":
        pad = torch.zeros(2, 12, dtype=torch.bool)
        pad[1, 9:] = True
        kw = dict(key_padding_mask=pad)
    with torch.no_grad():
        want = model(x, **kw)
    sparseflow.compile(model, method="dense", inner_backend="aot_eager")
    with torch.set_grad_enabled(grad):
        got = model(x, **kw)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    (entry,) = sparseflow.report(model).entries
    assert entry.rewritten and entry.tag == "attn" and entry.target == "F.multi_head_attention_forward"
    with sparseflow.capture() as cap, torch.no_grad():
        model(x, **kw)
    assert [c.tag for c in cap.calls] == ["attn"]
    assert cap.calls[0].q_shape == (2, 4, 12, 8)


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_export(batch_first):
    model = MHAUser(batch_first=batch_first).eval()
    x = torch.randn(2, 12, 32) if batch_first else torch.randn(12, 2, 32)
    with torch.no_grad():
        want = model(x)
    ep = sparseflow.export(model, (x,), method="dense")
    (entry,) = sparseflow.report(ep).entries
    assert entry.rewritten and entry.tag == "attn" and entry.target == "aten.scaled_dot_product_attention"
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(x), want, atol=1e-6, rtol=1e-6)


def test_bare_multihead_attention_and_need_weights():
    mha = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    x = torch.randn(2, 12, 32)
    with torch.no_grad():
        want = mha(x, x, x, need_weights=False)[0]
    sparseflow.compile(mha, method="dense", inner_backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(mha(x, x, x, need_weights=False)[0], want, atol=1e-6, rtol=1e-6)
        mha(x, x, x)  # need_weights=True (the default): explicit weights, no SDPA
    rep = sparseflow.report(mha)
    assert [e.rewritten for e in rep.entries] == [True, False]
    assert "need_weights=True" in rep.entries[1].reason


def test_transformer_encoder_layer_fast_path_is_reported():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True).eval()
    x = torch.randn(2, 12, 32)
    with torch.no_grad():
        want = layer(x)
    twin = copy.deepcopy(layer)
    sparseflow.compile(twin, method="dense", inner_backend="eager")
    with torch.no_grad():  # eval + no_grad: the fused fast path, SDPA invisible
        torch.testing.assert_close(twin(x), want, atol=1e-6, rtol=1e-6)
    (entry,) = sparseflow.report(twin).entries
    assert not entry.rewritten and "fast path" in entry.reason and "set_fastpath_enabled" in entry.reason
    # with gradients enabled the layer runs F.multi_head_attention_forward, which is rewritten
    torch.testing.assert_close(twin(x), want, atol=1e-5, rtol=1e-5)
    rewritten = [e for e in sparseflow.report(twin).entries if e.rewritten]
    assert [e.tag for e in rewritten] == ["self_attn"]


def test_transformer_encoder_layer_with_fastpath_disabled():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True).eval()
    x = torch.randn(2, 12, 32)
    with torch.no_grad():
        want = layer(x)
    sparseflow.compile(layer, method="dense", inner_backend="eager")
    old = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad():
            got = layer(x)
    finally:
        torch.backends.mha.set_fastpath_enabled(old)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert [e.tag for e in sparseflow.report(layer).rewritten] == ["self_attn"]


# --------------------------------------------------------------------------- API checks


def test_inspect_requires_compiled_model(plain_attention):
    with pytest.raises(TypeError, match="sparseflow.compile"):
        sparseflow.inspect(plain_attention(), torch.randn(1, 4, 48))
    with pytest.raises(TypeError, match="sparseflow.compile"):
        sparseflow.report(plain_attention())


def test_refuses_to_transform_twice(plain_attention):
    model = sparseflow.compile(plain_attention(layers=1), method="dense", inner_backend="eager")
    assert model._sparseflow_config["method"] == "dense"
    assert model._sparseflow_config["config"] == DenseConfig().to_dict()
    with pytest.raises(RuntimeError, match="already transformed"):
        sparseflow.compile(model, method="dense")
    parent = Wrap(model)
    with pytest.raises(RuntimeError, match="submodule 'inner'"):
        sparseflow.compile(parent, method="dense")
    # a deep copy drops the compiled call (Module pickling does), so it is plain again (its call
    # only warns, at the first call, that the compilation was lost)
    twin = copy.deepcopy(model)
    assert twin._compiled_call_impl is not model._compiled_call_impl
    sparseflow.compile(twin, method="dense", inner_backend="eager")


def test_refuses_already_torch_compiled(plain_attention):
    model = plain_attention(layers=1)
    with pytest.raises(TypeError, match="_orig_mod"):
        sparseflow.compile(torch.compile(model), method="dense")
    model.compile(backend="eager")
    with pytest.raises(RuntimeError, match="already has torch.compile"):
        sparseflow.compile(model, method="dense")


def test_export_refuses_transformed_program():
    q, k, v = _qkv(hkv=6)
    ep = sparseflow.export(SDPACall(is_causal=True), (q, k, v), method="dense")
    with pytest.raises(RuntimeError, match="already transformed"):
        sparseflow.export(ep.module(), (q, k, v), method="dense")


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(method="sparse"), ValueError, "method"),
        (dict(method=3), TypeError, "method"),
        (dict(method="pbs", config=PISAConfig()), ValueError, "config"),
        (dict(method="pisa", config={"top_k": 4}), TypeError, "config"),
        (dict(method="pbs", backend="cuda"), ValueError, "backend"),
        (dict(method="dense", backend="reference"), ValueError, "backend"),
        (dict(method="dense", inner_backend="tvm"), ValueError, "inner_backend"),
        (dict(method="dense", skip_layers="0"), TypeError, "skip_layers"),
        (dict(method="dense", skip_layers=[-1]), ValueError, "skip_layers"),
        (dict(method="dense", skip_layers=[1.0]), TypeError, "skip_layers"),
        (dict(method="dense", layer_configs=[None]), TypeError, "layer_configs"),
        (dict(method="dense", layer_configs={"1": None}), TypeError, "layer_configs"),
        (dict(method="dense", layer_configs={1: "pbs"}), TypeError, r"layer_configs\[1\]"),
        (dict(method="dense", skip_layers=[1], layer_configs={1: PBSConfig()}), ValueError, "skip_layers"),
        (dict(method="dense", filter_fn="layers.0"), TypeError, "filter_fn"),
        (dict(method="dense", dynamic="yes"), TypeError, "dynamic"),
        (dict(method="dense", fullgraph=1), TypeError, "fullgraph"),
    ],
)
def test_compile_bad_arguments(plain_attention, kwargs, exc, match):
    model = plain_attention(layers=1)
    with pytest.raises(exc, match=match):
        sparseflow.compile(model, **kwargs)
    assert model._compiled_call_impl is None and not hasattr(model, "_sparseflow_config")


def test_compile_bad_model():
    with pytest.raises(TypeError, match="model"):
        sparseflow.compile(lambda x: x, method="dense")


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda m, a: sparseflow.export(m, list(a), method="dense"), TypeError, "args"),
        (lambda m, a: sparseflow.export(m, a, [], method="dense"), TypeError, "kwargs"),
        (lambda m, a: sparseflow.export(m, a, method="pbs", config=BSAConfig()), ValueError, "config"),
        (lambda m, a: sparseflow.export(m, a, method="bsa", backend="nope"), ValueError, "backend"),
        (lambda m, a: sparseflow.export(m, a), TypeError, "method"),
    ],
)
def test_export_bad_arguments(call, exc, match):
    q, k, v = _qkv(hkv=6)
    with pytest.raises(exc, match=match):
        call(SDPACall(is_causal=True), (q, k, v))


def test_config_method_pairing_accepted(plain_attention):
    for method, cfg in (("pbs", PBSConfig(block_size=16, segment_size=32)), ("bsa", BSAConfig(block_size=16))):
        model = sparseflow.compile(plain_attention(layers=1), method=method, config=cfg, inner_backend="eager")
        assert model._sparseflow_config["config"] == cfg.to_dict()


def test_mode_reaches_inductor(plain_attention, monkeypatch):
    # torch.compile's mode becomes Inductor's settings for the rewritten graph (CUDA graphs for
    # "reduce-overhead"); recorded instead of compiled, so the test stays fast
    import torch._inductor.compile_fx as cfx

    seen = []

    def fake_compile_fx(gm, example_inputs, config_patches=None):
        seen.append(config_patches)
        return gm.forward

    monkeypatch.setattr(cfx, "compile_fx", fake_compile_fx)
    model = plain_attention(layers=1)
    sparseflow.compile(model, method="dense", mode="reduce-overhead")
    with torch.no_grad():
        model(torch.randn(1, 10, 48))
    assert seen and seen[0].get("triton.cudagraphs") is True
    assert sparseflow.report(model).num_rewritten == 1


@pytest.mark.parametrize(
    "kwargs,match",
    [(dict(mode="fast"), "mode must be"), (dict(mode="reduce-overhead", inner_backend="eager"), "inner_backend")],
    ids=["unknown-mode", "mode-without-inductor"],
)
def test_mode_bad_values(plain_attention, kwargs, match):
    with pytest.raises(ValueError, match=match):
        sparseflow.compile(plain_attention(layers=1), method="dense", **kwargs)


def test_capture_refused_under_cuda_graphs(plain_attention):
    # replays of a CUDA graph skip the ops' Python: a capture() would come back silently empty
    model = sparseflow.compile(plain_attention(layers=1), method="dense", mode="reduce-overhead")
    with sparseflow.capture(), pytest.raises(RuntimeError, match="mode='reduce-overhead'"):
        model(torch.randn(1, 10, 48))
