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


def test_sliding_window_narrower_than_the_sequence_is_proven_only_on_request():
    # a caller that does not ask for windows (it reads only causal/key_padding) gets None
    ids, am = _inputs()
    masks = _dynamo_masks(_model("mistral", sliding_window=4), input_ids=ids, attention_mask=am)
    assert masks and all(prove_mask(m) is None for m in masks)
    for m in masks:
        proof = prove_mask(m, windows=True)
        assert proof.causal and proof.sliding_window == 4 and proof.chunk_size == 0
        assert proof.key_padding is not None


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
    from sparseflow.passes import RewriteOptions, rewrite_graph

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
    from sparseflow.passes import SDPA_TARGETS

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
    from sparseflow.passes import RewriteOptions, rewrite_graph

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


def test_sliding_window_mask_becomes_the_ops_window():
    from sparseflow import PBSConfig

    n = 40
    ids = torch.randint(0, 50, (1, n), generator=torch.Generator().manual_seed(4))
    am = torch.ones(1, n, dtype=torch.long)
    model = _model("mistral", num_hidden_layers=1, sliding_window=8)
    gm, entries, _ = _rewritten_graph(
        model, PBSConfig(block_size=16, segment_size=32, threshold=1.0), input_ids=ids, attention_mask=am
    )
    # the window goes into the op's config (PBS at threshold 1 would skip nothing inside it: the dense
    # method's exact window runs, registry.windowed)
    assert entries and all("sliding window 8" in e.mask for e in entries)
    assert all(e.method == "dense" and e.config["sliding_window"] == 8 for e in entries)


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


# --------------------------------------------------------------------------- local windows
#
# Every proof below is checked against the mask tensor the graph really computes: the nodes that
# build the mask are evaluated and compared element-wise with the mask the proof describes.


def _materialise(proof: MaskProof, batch: int, nq: int, nk: int, key_padding=None) -> torch.Tensor:
    """The ``[B, 1, Nq, Nk]`` bool mask ``proof`` states (the project's window contract)."""
    q, kv = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
    mask = torch.ones(nq, nk, dtype=torch.bool)
    if proof.causal:
        mask &= kv <= q
    if proof.sliding_window:
        mask &= kv > q - proof.sliding_window
    if proof.chunk_size:
        mask &= kv // proof.chunk_size == q // proof.chunk_size
    mask = mask.expand(batch, 1, nq, nk)
    if proof.key_padding is not None:
        mask = mask & (key_padding != 0)[:, None, None, :]
    return mask


def _evaluate(node: fx.Node, feeds: dict):
    """The value of ``node``, running only the nodes it depends on; a placeholder's value is
    ``feeds[name]`` (a KeyError names a placeholder the test did not expect)."""
    needed, pending = set(), [node]
    while pending:
        n = pending.pop()
        if n not in needed:
            needed.add(n)
            pending.extend(n.all_input_nodes)
    env = {}
    for n in node.graph.nodes:  # topological order
        if n not in needed:
            continue
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
        if n.op == "placeholder":
            env[n] = feeds[n.name]
        elif n.op == "call_function":
            env[n] = n.target(*args, **kwargs)
        elif n.op == "call_method":
            env[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
        else:
            raise AssertionError(f"unexpected {n.op} {n.target} in the mask")
    return env[node]


def _assert_exact(mask: fx.Node, proof: MaskProof, feeds: dict) -> None:
    """The proof describes the graph's mask exactly (every batch row, query and key)."""
    real = _evaluate(mask, feeds)
    while real.dim() < 4:
        real = real[None]
    padding = _evaluate(proof.key_padding, feeds) if proof.key_padding is not None else None
    batch = padding.shape[0] if padding is not None else real.shape[0]
    want = _materialise(proof, batch, real.shape[-2], real.shape[-1], padding)
    torch.testing.assert_close(real.expand_as(want), want)


def _causal(g, n=8):
    return g.call_function(operator.le, (_positions(g, n, 3), _positions(g, n, 2)))


def _and(g, *masks):
    out = masks[0]
    for m in masks[1:]:
        out = g.call_function(operator.and_, (out, m))
    return out


def _window_graph(op, kv_off, q_off, flip=False, n=8):
    """``causal & (kv + kv_off <op> q + q_off)`` (``flip``: written ``q + q_off <op'> kv + kv_off``)."""

    def build(g, src):
        kv, q = _positions(g, n, 3, kv_off), _positions(g, n, 2, q_off)
        flipped = {
            operator.lt: operator.gt,
            operator.gt: operator.lt,
            operator.le: operator.ge,
            operator.ge: operator.le,
        }
        window = g.call_function(flipped[op], (q, kv)) if flip else g.call_function(op, (kv, q))
        return _and(g, _causal(g, n), window)

    return _graph(build)


@pytest.mark.parametrize(
    "op,kv_off,q_off,window",
    [
        (operator.gt, 0, -4, 4),  # transformers' kv > q - W
        (operator.gt, 0, -3, 3),  # kv > q - W + 1: one key fewer
        (operator.ge, 0, -4, 5),  # kv >= q - W: one key more
        (operator.gt, 4, 0, 4),  # kv + W > q
        (operator.ge, 0, 0, 1),  # kv >= q: the diagonal only
        (operator.gt, 0, 0, None),  # kv > q with causality: no key at all
    ],
)
@pytest.mark.parametrize("flip", [False, True], ids=["kv_first", "q_first"])
def test_window_offsets_give_their_exact_width(op, kv_off, q_off, window, flip):
    mask = _window_graph(op, kv_off, q_off, flip)
    proof = prove_mask(mask, windows=True)
    if window is None:
        assert proof is None
        return
    assert proof == MaskProof(causal=True, key_padding=None, sliding_window=window)
    _assert_exact(mask, proof, {})


def test_every_proven_band_is_exact_and_every_window_is_proven():
    # every comparison and offset of a lower bound beside causality: what is proven equals the
    # real mask, and a mask that is a sliding window (or plain causal) is proven
    n, proven = 8, 0
    for op in (operator.lt, operator.le, operator.gt, operator.ge):
        for kv_off in range(-3, 4):
            for q_off in range(-10, 4):
                for flip in (False, True):
                    mask = _window_graph(op, kv_off, q_off, flip, n)
                    real = _evaluate(mask, {})
                    proof = prove_mask(mask, windows=True)
                    if proof is not None:
                        proven += 1
                        _assert_exact(mask, proof, {})
                    bands = [MaskProof(True, None, w) for w in range(0, n + 1)]
                    if any(torch.equal(real.expand(1, 1, n, n), _materialise(b, 1, n, n)) for b in bands):
                        assert proof is not None, (op, kv_off, q_off, flip)
    assert proven > 50


def test_windows_are_opt_in():
    # a caller that reads only causal/key_padding must not take a window for plain causality
    mask = _window_graph(operator.gt, 0, -4)
    assert prove_mask(mask) is None
    assert prove_mask(_graph(lambda g, src: _causal(g))) == MaskProof(causal=True, key_padding=None)


def test_window_wider_than_the_static_sequence_is_plain_causal():
    mask = _window_graph(operator.gt, 0, -16)
    assert prove_mask(mask, windows=True) == prove_mask(mask) == MaskProof(causal=True, key_padding=None)
    _assert_exact(mask, prove_mask(mask), {})


def _q_minus(g, w, n=8):
    return g.call_function(operator.sub, (_positions(g, n, 2), w))


def test_windows_not_proven():
    def alone(g, src):  # no causality: a window alone is not proven
        return g.call_function(operator.gt, (_positions(g, 8, 3), _q_minus(g, 4)))

    def with_unknown(g, src):  # window & something unknown
        window = g.call_function(operator.gt, (_positions(g, 8, 3), _q_minus(g, 4)))
        odd = g.call_function(operator.ne, (_positions(g, 8, 3), 3))
        return _and(g, _causal(g), window, odd)

    def symbolic_width(g, src):  # W from a graph input (a SymInt or a tensor)
        w = g.placeholder("w")
        return _and(g, _causal(g), g.call_function(operator.gt, (_positions(g, 8, 3), _q_minus(g, w))))

    def tensor_width(g, src):
        w = g.call_function(torch.sum, (src,))
        return _and(g, _causal(g), g.call_function(operator.gt, (_positions(g, 8, 3), _q_minus(g, w))))

    def upper_bound_only(g, src):  # kv <= q - 2: a shifted causal, no window
        return g.call_function(operator.le, (_positions(g, 8, 3), _q_minus(g, 2)))

    for build in (alone, with_unknown, symbolic_width, tensor_width, upper_bound_only):
        assert prove_mask(_graph(build), windows=True) is None, build.__name__


def test_window_width_from_a_traced_constant():
    # W as cache_position[4] (a 0-d tensor of the graph) is a constant like a Python int
    def build(g, src):
        w = g.call_function(operator.getitem, (g.call_function(torch.arange, (0, 8)), 4))
        return _and(g, _causal(g), g.call_function(operator.gt, (_positions(g, 8, 3), _q_minus(g, w))))

    mask = _graph(build)
    assert prove_mask(mask, windows=True) == MaskProof(True, None, sliding_window=4)
    _assert_exact(mask, prove_mask(mask, windows=True), {})


def test_two_windows_keep_the_narrower():
    def build(g, src):
        kv = _positions(g, 8, 3)
        wide = g.call_function(operator.gt, (kv, _q_minus(g, 5)))
        narrow = g.call_function(operator.gt, (kv, _q_minus(g, 3)))
        return _and(g, wide, _causal(g), narrow)

    mask = _graph(build)
    assert prove_mask(mask, windows=True) == MaskProof(True, None, sliding_window=3)
    _assert_exact(mask, prove_mask(mask, windows=True), {})


def _chunk_graph(size=4, kv_off=0, q_off=0, compare=operator.eq, causal=True, divide=None, n=10):
    """``(kv + kv_off) // size <compare> (q + q_off) // size`` (``& causal``)."""
    divide = divide or (lambda g, x: g.call_function(operator.floordiv, (x, size)))

    def build(g, src):
        kv = divide(g, _positions(g, n, 3, kv_off))
        q = divide(g, _positions(g, n, 2, q_off))
        same = g.call_function(compare, (kv, q))
        return _and(g, _causal(g, n), same) if causal else same

    return _graph(build)


@pytest.mark.parametrize(
    "kwargs,chunk",
    [
        ({}, 4),
        ({"size": 3}, 3),  # the sequence (10) is no multiple of the chunk
        ({"kv_off": 8, "q_off": 8}, 4),  # an offset the size divides moves no boundary
        ({"kv_off": 2, "q_off": 2}, None),  # one it does not divide shifts the chunks
        ({"kv_off": 4, "q_off": 0}, None),  # chunks of different positions
        ({"compare": operator.ne}, None),
        ({"causal": False}, None),  # chunks without causality
        ({"divide": lambda g, x: g.call_function(torch.div, (x, 4), {"rounding_mode": "floor"})}, 4),
        ({"divide": lambda g, x: g.call_method("__floordiv__", (x, 4))}, 4),
        ({"divide": lambda g, x: g.call_function(torch.ops.aten.floor_divide.default, (x, 4))}, 4),
        ({"divide": lambda g, x: g.call_function(torch.div, (x, 4), {"rounding_mode": "trunc"})}, None),
        ({"divide": lambda g, x: g.call_function(torch.div, (x, 4))}, None),  # true division
        ({"divide": lambda g, x: g.call_function(operator.floordiv, (x, g.placeholder("c")))}, None),
    ],
    ids=lambda x: str(x) if not isinstance(x, dict) else ",".join(sorted(x)) or "plain",
)
def test_chunks(kwargs, chunk):
    mask = _chunk_graph(**kwargs)
    proof = prove_mask(mask, windows=True)
    if chunk is None:
        assert proof is None
        return
    assert proof == MaskProof(causal=True, key_padding=None, chunk_size=chunk)
    _assert_exact(mask, proof, {})


def test_two_chunk_sizes_are_not_proven():
    def build(g, src):
        kv, q = _positions(g, 8, 3), _positions(g, 8, 2)
        c2 = g.call_function(
            operator.eq, (g.call_function(operator.floordiv, (kv, 2)), g.call_function(operator.floordiv, (q, 2)))
        )
        c3 = g.call_function(
            operator.eq, (g.call_function(operator.floordiv, (kv, 3)), g.call_function(operator.floordiv, (q, 3)))
        )
        return _and(g, _causal(g), c2, c3)

    assert prove_mask(_graph(build), windows=True) is None


def _left_padding_chunks(g, left_padding, n=10, size=4):
    """Llama 4's chunks: ``(kv - lp[b]) // C == (q - lp[b]) // C`` with ``lp`` a ``[B]`` tensor."""
    b = _positions(g, 2, 0)
    kv = g.call_function(operator.sub, (_positions(g, n, 3), g.call_function(operator.getitem, (left_padding, b))))
    q = g.call_function(operator.sub, (_positions(g, n, 2), g.call_function(operator.getitem, (left_padding, b))))
    div = [g.call_function(operator.floordiv, (x, size)) for x in (kv, q)]
    return _and(g, g.call_function(operator.eq, tuple(div)), _causal(g, n))


def test_chunks_with_zero_left_padding_are_proven():
    mask = _graph(lambda g, src: _left_padding_chunks(g, g.call_function(torch.zeros, (2,), {"dtype": torch.int64})))
    proof = prove_mask(mask, windows=True)
    assert proof == MaskProof(causal=True, key_padding=None, chunk_size=4)
    _assert_exact(mask, proof, {})


@pytest.mark.parametrize("zeros_kwargs", [{}, {"dtype": torch.float32}, {"dtype": torch.bool}])
def test_chunks_with_other_left_padding_are_not_proven(zeros_kwargs):
    # float or bool zeros, and a left padding read from the graph's input (per-row chunk starts)
    assert (
        prove_mask(
            _graph(lambda g, src: _left_padding_chunks(g, g.call_function(torch.zeros, (2,), zeros_kwargs))),
            windows=True,
        )
        is None
    )
    assert prove_mask(_graph(lambda g, src: _left_padding_chunks(g, src)), windows=True) is None


def test_a_constant_of_higher_rank_keeps_positions_apart():
    # arange(8) - zeros(2)[b] with b a 4-D batch position is 4-D: placing it with [None, None, :, None]
    # is not the query axis, so nothing is proven
    def build(g, src):
        lp = g.call_function(torch.zeros, (2,), {"dtype": torch.int64})
        pos = g.call_function(
            operator.sub,
            (g.call_function(torch.arange, (8,)), g.call_function(operator.getitem, (lp, _positions(g, 2, 0)))),
        )
        q = g.call_function(operator.getitem, (pos, (None, None, slice(None), None)))
        return g.call_function(operator.le, (_positions(g, 8, 3), q))

    assert prove_mask(_graph(build), windows=True) is None


def test_window_and_key_padding():
    def build(g, src):
        padding = g.call_function(
            operator.getitem,
            (g.call_method("to", (src,), {"dtype": torch.bool}), (_positions(g, 2, 0), _positions(g, 8, 3))),
        )
        window = g.call_function(operator.gt, (_positions(g, 8, 3), _q_minus(g, 3)))
        return _and(g, _causal(g), window, padding)

    mask = _graph(build)
    proof = prove_mask(mask, windows=True)
    assert proof.causal and proof.sliding_window == 3 and proof.key_padding is not None
    am = torch.ones(2, 8, dtype=torch.long)
    am[1, :3] = 0
    am[0, -2:] = 0
    _assert_exact(mask, proof, {"attention_mask": am})


# --------------------------------------------------------------------------- real local-window models


_SEQ, _WINDOW = 20, 8


def _local_model(family: str):
    """(a tiny random model, each layer's attention: "sliding", "chunked" or "full")."""
    import transformers as tf

    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=64,
        attn_implementation="sdpa",
    )
    sliding_full = ["sliding_attention", "full_attention"]
    builds = {
        "mistral": lambda: (
            tf.MistralForCausalLM(tf.MistralConfig(num_hidden_layers=2, sliding_window=_WINDOW, **common)),
            ["sliding", "sliding"],
        ),
        "qwen2": lambda: (
            tf.Qwen2ForCausalLM(
                tf.Qwen2Config(
                    num_hidden_layers=2, use_sliding_window=True, sliding_window=_WINDOW, max_window_layers=1, **common
                )
            ),
            ["full", "sliding"],
        ),
        "gemma3": lambda: (
            tf.Gemma3ForCausalLM(
                tf.Gemma3TextConfig(num_hidden_layers=3, sliding_window=_WINDOW, sliding_window_pattern=3, **common)
            ),
            ["sliding", "sliding", "full"],
        ),
        "cohere2": lambda: (
            tf.Cohere2ForCausalLM(
                tf.Cohere2Config(num_hidden_layers=2, sliding_window=_WINDOW, layer_types=sliding_full, **common)
            ),
            ["sliding", "full"],
        ),
        "llama4": lambda: (
            tf.Llama4ForCausalLM(
                tf.Llama4TextConfig(
                    num_hidden_layers=2,
                    attention_chunk_size=_WINDOW,
                    no_rope_layers=[1, 0],  # layer 0 uses RoPE: chunked; layer 1 global
                    moe_layers=[],
                    intermediate_size_mlp=128,
                    **common,
                )
            ),
            ["chunked", "full"],
        ),
    }
    torch.manual_seed(0)
    model, kinds = builds[family]()
    return model.eval(), kinds


def _sdpa_calls(gm: fx.GraphModule):
    """(attn_mask, is_causal) of every SDPA call, in graph order."""
    out = []
    for n in gm.graph.nodes:
        if "scaled_dot_product" in str(n.target):
            mask = n.kwargs.get("attn_mask", n.args[3] if len(n.args) > 3 else None)
            out.append((mask, n.kwargs.get("is_causal", n.args[5] if len(n.args) > 5 else False)))
    return out


def _local_inputs(padded: bool):
    ids = torch.randint(0, 64, (2, _SEQ), generator=torch.Generator().manual_seed(7))
    if not padded:
        return ids, None
    am = torch.ones(2, _SEQ, dtype=torch.long)
    am[1, :3] = 0  # left padding
    am[0, -2:] = 0  # right padding
    return ids, am


def _calls(model, graph: str, ids, am):
    kwargs = {} if am is None else {"attention_mask": am}
    if graph == "export":
        ep = torch.export.export(model, (ids,), {"use_cache": False, **kwargs}).run_decompositions({})
        return _sdpa_calls(ep.graph_module)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend)(input_ids=ids, **kwargs)
    return [c for gm in graphs for c in _sdpa_calls(gm)]


def _expected(kind: str, padded: bool):
    """The proof each kind of layer gets (None: not provable), key padding aside."""
    if kind == "chunked" and padded:
        return None  # chunks start at each row's first token: not the op's chunks
    return (True, padded, _WINDOW if kind == "sliding" else 0, _WINDOW if kind == "chunked" else 0)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("graph", ["dynamo", "export"])
@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma3", "cohere2", "llama4"])
def test_local_window_models(family, graph, padded):
    model, kinds = _local_model(family)
    ids, am = _local_inputs(padded)
    calls = _calls(model, graph, ids, am)
    assert len(calls) == len(kinds)
    feeds = {"attention_mask": am, "l_kwargs_attention_mask_": am}
    for (mask, is_causal), kind in zip(calls, kinds):
        if mask is None:  # Dynamo hands full layers without padding to SDPA's is_causal
            assert graph == "dynamo" and not padded and kind == "full" and is_causal is True
            continue
        proof = prove_mask(mask, windows=True)
        summary = (
            None
            if proof is None
            else (proof.causal, proof.key_padding is not None, proof.sliding_window, proof.chunk_size)
        )
        assert summary == _expected(kind, padded), kind
        if proof is not None:
            _assert_exact(mask, proof, feeds)
        else:  # the chunks the op would run differ from the model's on the left-padded row
            wrong = MaskProof(True, None, chunk_size=_WINDOW)
            real = _evaluate(mask, feeds)
            assert not torch.equal(real, _materialise(wrong, 2, _SEQ, _SEQ) & am.bool()[:, None, None, :])
        assert prove_mask(mask) == (None if kind != "full" else proof)  # off by default


@pytest.mark.parametrize("family,field", [("mistral", "sliding_window"), ("llama4", "chunk_size")])
def test_local_windows_with_symbolic_lengths(family, field):
    # dynamic=True: arange(s) of a symbolic length; the width is a constant all the same
    model, kinds = _local_model(family)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    ids, _ = _local_inputs(False)
    with torch.no_grad():
        torch.compile(model, backend=backend, dynamic=True)(input_ids=ids)
    ((gm,),) = [graphs]
    aranges = [n for n in gm.graph.nodes if n.target is torch.arange]
    assert any(isinstance(a, fx.Node) for n in aranges for a in n.args)
    masks = [m for m, _ in _sdpa_calls(gm) if m is not None]
    assert len(masks) == kinds.count("sliding") + kinds.count("chunked") > 0
    assert all(getattr(prove_mask(m, windows=True), field) == _WINDOW for m in masks)
