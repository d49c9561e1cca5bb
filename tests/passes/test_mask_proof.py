"""The mask prover reads HF models' in-graph mask construction (Dynamo and export graphs)."""

import operator

import pytest
import torch
import torch.fx as fx

from sparseflow.passes.mask_proof import MaskProof, prove_mask

transformers = pytest.importorskip("transformers")

_TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    vocab_size=50,
    attn_implementation="sdpa",
)


def _model(kind: str, **overrides):
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    cfg_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
    }[kind]
    torch.manual_seed(0)
    return model_cls(cfg_cls(**{**_TINY, **overrides})).eval()


def _sdpa_masks(gm: fx.GraphModule):
    out = []
    for n in gm.graph.nodes:
        if "scaled_dot_product" in str(n.target):
            mask = n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None)
            out.append(mask)
    return out


def _dynamo_masks(model, **kwargs):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend)(**kwargs)
    return [m for gm in graphs for m in _sdpa_masks(gm)]


def _export_masks(model, ids, **kwargs):
    ep = torch.export.export(model, (ids,), {"use_cache": False, **kwargs}).run_decompositions({})
    return _sdpa_masks(ep.graph_module)


def _inputs():
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    am = torch.ones(2, 8, dtype=torch.long)
    am[1, :3] = 0
    return ids, am


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("graph", ["dynamo", "export"])
def test_padded_causal_mask_is_proven(kind, graph):
    ids, am = _inputs()
    model = _model(kind)
    masks = (
        _dynamo_masks(model, input_ids=ids, attention_mask=am)
        if graph == "dynamo"
        else _export_masks(model, ids, attention_mask=am)
    )
    assert masks and all(isinstance(m, fx.Node) for m in masks)
    for m in masks:
        proof = prove_mask(m)
        assert isinstance(proof, MaskProof) and proof.causal
        assert proof.key_padding is not None and proof.key_padding.op == "placeholder"


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_unpadded_mask_is_causal_without_padding(kind):
    # transformers versions that build the mask under Dynamo without an attention_mask (5.17
    # does; newer ones pass is_causal instead): when a mask is there it is exactly causal
    ids, _ = _inputs()
    for m in _dynamo_masks(_model(kind), input_ids=ids):
        if m is not None:
            assert prove_mask(m) == MaskProof(causal=True, key_padding=None)


def test_sliding_window_narrower_than_the_sequence_is_not_proven():
    ids, am = _inputs()
    masks = _dynamo_masks(_model("mistral", sliding_window=4), input_ids=ids, attention_mask=am)
    assert masks and all(prove_mask(m) is None for m in masks)


def _graph(build):
    g = fx.Graph()
    src = g.placeholder("attention_mask")
    mask = build(g, src)
    g.output(mask)
    return mask


def _positions(g, n, at, offset=0):
    idx = [None] * 4
    idx[at] = slice(None)
    pos = g.call_function(torch.arange, (n,))
    if offset:
        pos = g.call_function(operator.add, (pos, offset))
    return g.call_function(operator.getitem, (pos, tuple(idx)))


@pytest.mark.parametrize(
    "q_off,kv_off,proven", [(0, 0, True), (1, 0, False), (0, 1, False), (2, 2, True)], ids=lambda x: str(x)
)
def test_causal_needs_equal_offsets(q_off, kv_off, proven):
    def build(g, src):
        q = _positions(g, 8, 2, q_off)
        kv = _positions(g, 8, 3, kv_off)
        return g.call_function(operator.le, (kv, q))

    assert (prove_mask(_graph(build)) is not None) == proven


def test_reversed_comparison_and_unknown_ops():
    def ge(g, src):
        return g.call_function(operator.ge, (_positions(g, 8, 2), _positions(g, 8, 3)))

    assert prove_mask(_graph(ge)) == MaskProof(causal=True, key_padding=None)

    def swapped_axes(g, src):  # q <= kv: anti-causal
        return g.call_function(operator.le, (_positions(g, 8, 2), _positions(g, 8, 3)))

    assert prove_mask(_graph(swapped_axes)) is None

    def or_(g, src):
        c = g.call_function(operator.le, (_positions(g, 8, 3), _positions(g, 8, 2)))
        return g.call_function(operator.or_, (c, c))

    assert prove_mask(_graph(or_)) is None

    def raw_placeholder(g, src):
        return src

    assert prove_mask(_graph(raw_placeholder)) is None


def test_padding_with_shifted_keys_is_not_proven():
    def build(g, src):
        bsrc = g.call_method("to", (src,), {"dtype": torch.bool})
        b = _positions(g, 2, 0)
        kv = _positions(g, 8, 3, 1)
        return g.call_function(operator.getitem, (bsrc, (b, kv)))

    assert prove_mask(_graph(build)) is None


# --------------------------------------------------------------------------- through the rewrite


def _rewritten_graph(model, config, layer_configs=None, **kwargs):
    """Capture the model's Dynamo graph, rewrite it, and run the rewritten graph eagerly."""
    from sparseflow.passes.sdpa_rewrite import RewriteOptions, rewrite_graph

    seen = {}
    options = RewriteOptions(config=config, backend="reference", layer_configs=layer_configs or {})

    def backend(gm, example_inputs):
        seen["entries"] = rewrite_graph(gm, options)
        seen["gm"] = gm
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(model, backend=backend)(**kwargs).logits
    return seen["gm"], seen["entries"], out


def _square_tensors(gm, n):
    return [
        node.name
        for node in gm.graph.nodes
        for val in [node.meta.get("example_value", node.meta.get("val"))]
        if isinstance(val, torch.Tensor) and val.dim() >= 2 and tuple(val.shape[-2:]) == (n, n)
    ]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_rewritten_graph_builds_no_square_mask_and_equals_dense(kind, padded):
    from sparseflow import PBSConfig

    n = 40
    ids = torch.randint(0, 50, (2, n), generator=torch.Generator().manual_seed(2))
    kwargs = {"input_ids": ids}
    if padded:
        am = torch.ones(2, n, dtype=torch.long)
        am[1, :5] = 0  # left padding
        am[0, -3:] = 0  # and right padding
        kwargs["attention_mask"] = am
    model = _model(kind, num_hidden_layers=2)
    with torch.no_grad():
        dense = model(**kwargs).logits
    exact = PBSConfig(block_size=16, segment_size=32, threshold=1.0)
    gm, entries, out = _rewritten_graph(model, exact, **kwargs)
    assert entries and all(e.rewritten for e in entries), [e.reason for e in entries]
    assert _square_tensors(gm, n) == []
    if padded:
        assert all("proven from the graph" in e.mask for e in entries)
        valid = kwargs["attention_mask"].bool()
        torch.testing.assert_close(out[valid], dense[valid], atol=2e-5, rtol=2e-5)
    else:
        torch.testing.assert_close(out, dense, atol=2e-5, rtol=2e-5)


def _sdpa_nodes(gm):
    from sparseflow.passes.sdpa_rewrite import SDPA_TARGETS

    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in SDPA_TARGETS]


def _sdpa_mask_and_causal(gm):
    (node,) = _sdpa_nodes(gm)
    mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
    return mask, node.kwargs.get("is_causal", node.args[5] if len(node.args) > 5 else False)


class _CausalMaskAttention(torch.nn.Module):
    """SDPA with the causal mask built in the graph, as transformers 5.17 does under Dynamo."""

    def forward(self, q, k, v):
        pos = torch.arange(q.shape[2])
        mask = pos[None, None, :, None] >= pos[None, None, None, :]
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_a_call_kept_as_sdpa_runs_causal_without_the_square_mask():
    # a call the options keep as SDPA (a recipe's dense layer) trades its proven causal mask for
    # is_causal=True: same result, and the [N, N] mask is no longer built
    from sparseflow import PBSConfig
    from sparseflow.passes.sdpa_rewrite import RewriteOptions, rewrite_graph

    n, seen = 40, {}
    options = RewriteOptions(config=PBSConfig(), backend="reference", filter_fn=lambda tag: False)

    def backend(gm, example_inputs):
        seen["entries"], seen["gm"] = rewrite_graph(gm, options), gm
        return gm.forward

    q, k, v = (torch.randn(1, 2, n, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    torch._dynamo.reset()
    out = torch.compile(_CausalMaskAttention(), backend=backend)(q, k, v)
    (entry,) = seen["entries"]
    assert not entry.rewritten and "filter_fn" in entry.reason and "proven from the graph" in entry.mask
    assert _sdpa_mask_and_causal(seen["gm"]) == (None, True)
    assert _square_tensors(seen["gm"], n) == []
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_padded_layer_kept_as_sdpa_keeps_its_mask(kind):
    # key padding cannot go to SDPA beside is_causal: the kept layer keeps the mask, and the
    # rewritten layer beside it still gets the padding
    from sparseflow import PBSConfig

    n = 40
    ids = torch.randint(0, 50, (2, n), generator=torch.Generator().manual_seed(6))
    am = torch.ones(2, n, dtype=torch.long)
    am[1, :5] = 0
    model = _model(kind, num_hidden_layers=2)
    with torch.no_grad():
        dense = model(input_ids=ids, attention_mask=am).logits
    exact = PBSConfig(block_size=16, segment_size=32, threshold=1.0)
    gm, entries, out = _rewritten_graph(model, exact, layer_configs={0: None}, input_ids=ids, attention_mask=am)
    kept, rewritten = entries
    assert not kept.rewritten and "SDPA kept" in kept.reason and rewritten.rewritten
    mask, is_causal = _sdpa_mask_and_causal(gm)
    assert mask is not None and is_causal is False
    torch.testing.assert_close(out[am.bool()], dense[am.bool()], atol=2e-5, rtol=2e-5)


def test_padding_changes_the_rewritten_result():
    # the padding travels to the op: the same tokens without the mask give other logits
    from sparseflow import PBSConfig

    n = 40
    ids = torch.randint(0, 50, (2, n), generator=torch.Generator().manual_seed(3))
    am = torch.ones(2, n, dtype=torch.long)
    am[1, :7] = 0
    exact = PBSConfig(block_size=16, segment_size=32, threshold=1.0)
    model = _model("llama", num_hidden_layers=2)
    _, _, with_pad = _rewritten_graph(model, exact, input_ids=ids, attention_mask=am)
    _, _, without = _rewritten_graph(model, exact, input_ids=ids)
    assert (with_pad[1, 7:] - without[1, 7:]).abs().max() > 1e-3
    torch.testing.assert_close(with_pad[0], without[0], atol=2e-5, rtol=2e-5)


def test_sliding_window_mask_is_kept():
    from sparseflow import PBSConfig

    n = 40
    ids = torch.randint(0, 50, (1, n), generator=torch.Generator().manual_seed(4))
    am = torch.ones(1, n, dtype=torch.long)
    model = _model("mistral", num_hidden_layers=1, sliding_window=8)
    gm, entries, _ = _rewritten_graph(
        model, PBSConfig(block_size=16, segment_size=32, threshold=1.0), input_ids=ids, attention_mask=am
    )
    assert all("proven" not in e.mask for e in entries)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_exported_program_builds_no_square_mask(padded):
    import sparseflow

    n = 40
    ids = torch.randint(0, 50, (2, n), generator=torch.Generator().manual_seed(5))
    kw = {"use_cache": False}
    if padded:
        am = torch.ones(2, n, dtype=torch.long)
        am[1, :6] = 0
        kw["attention_mask"] = am
    model = _model("qwen2", num_hidden_layers=2)
    with torch.no_grad():
        want = model(ids, **kw).logits
    ep = sparseflow.export(
        model,
        (ids,),
        kw,
        method="pbs",
        config=sparseflow.PBSConfig(block_size=16, segment_size=32, threshold=1.0),
        backend="reference",
    )
    assert _square_tensors(ep.graph_module, n) == []
    with torch.no_grad():
        got = ep.module()(ids, **kw).logits
    rows = kw["attention_mask"].bool() if padded else torch.ones(2, n, dtype=torch.bool)
    torch.testing.assert_close(got[rows], want[rows], atol=2e-5, rtol=2e-5)


def test_offsets_read_from_a_position_tensor():
    # q/kv offsets as cache_position[0] (a 0-d tensor, as some Dynamo versions keep it) still prove causality
    def build(g, src):
        cache = g.call_function(torch.arange, (0, 8))
        off = g.call_function(operator.getitem, (cache, 0))
        q = g.call_function(operator.add, (g.call_function(torch.arange, (8,)), off))
        kv = g.call_function(operator.add, (g.call_function(torch.arange, (8,)), off))
        qi = g.call_function(operator.getitem, (q, (None, None, slice(None), None)))
        ki = g.call_function(operator.getitem, (kv, (None, None, None, slice(None))))
        return g.call_function(operator.le, (ki, qi))

    assert prove_mask(_graph(build)) == MaskProof(causal=True, key_padding=None)

    def shifted(g, src):  # cache_position[1] on the queries only: not causal
        cache = g.call_function(torch.arange, (0, 8))
        q = g.call_function(
            operator.add, (g.call_function(torch.arange, (8,)), g.call_function(operator.getitem, (cache, 1)))
        )
        qi = g.call_function(operator.getitem, (q, (None, None, slice(None), None)))
        ki = g.call_function(operator.getitem, (g.call_function(torch.arange, (8,)), (None, None, None, slice(None))))
        return g.call_function(operator.le, (ki, qi))

    assert prove_mask(_graph(shifted)) is None


def _packed_sequence_mask(g, n, compare_method):
    """transformers' one-packed-sequence check as Dynamo on torch 2.11 records it on CUDA: the
    ids of ``cumsum(diff(position_ids) != 1)`` compared between query and key as a tensor method."""
    pos = g.call_method("unsqueeze", (g.call_function(operator.add, (g.call_function(torch.arange, (n,)), 0)), 0))
    first = g.call_function(operator.sub, (g.call_function(operator.getitem, (pos, (slice(None), slice(None, 1)))), 1))
    diff = g.call_function(torch.diff, (pos,), {"prepend": first, "dim": -1})
    ids = g.call_method("cumsum", (g.call_function(operator.ne, (diff, 1)), -1))
    b = _positions(g, 1, 0)
    q_ids = g.call_function(operator.getitem, (ids, (b, _positions(g, n, 2))))
    kv_ids = g.call_function(operator.getitem, (ids, (b, _positions(g, n, 3))))
    return g.call_method(compare_method, (q_ids, kv_ids))


@pytest.mark.parametrize("method,proven", [("__eq__", True), ("eq", True), ("__ne__", False), ("ne", False)])
def test_packed_sequence_check_as_tensor_methods(method, proven):
    def build(g, src):
        causal = g.call_function(operator.le, (_positions(g, 8, 3), _positions(g, 8, 2)))
        ones = g.call_method("new_ones", (causal, ()), {"dtype": torch.bool})
        both = g.call_method("__and__", (ones, causal))
        return g.call_function(operator.and_, (both, _packed_sequence_mask(g, 8, method)))

    expected = MaskProof(causal=True, key_padding=None) if proven else None
    assert prove_mask(_graph(build)) == expected
