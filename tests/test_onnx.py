"""ONNX export (issue 7): one ``sparseflow``-domain node per attention layer, run by onnxruntime
through the model-local function bodies, equal to the PyTorch rewritten model.

Error metric everywhere: max |onnx - torch| / max |torch| over the logits (fp32).
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

import sparseflow

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
pytest.importorskip("transformers")

from sparseflow.onnx_export import DOMAIN, NODE_TYPES, OnnxExportError, export_onnx  # noqa: E402

TOL = 1e-3
LAYERS = 2
BSA = sparseflow.BSAConfig(block_size=16, top_k=4)  # 200 tokens = 13 blocks: really sparse
# tiny-model configs where the selection really drops blocks at N >= 200 (density < 1 is asserted)
SPARSE = {
    "bsa": BSA,
    "pbs": sparseflow.PBSConfig(block_size=16, segment_size=32, threshold=0.6),
    "pisa": sparseflow.PISAConfig(block_size=16, top_k=4),
}


def _session(proto):
    # as many threads as torch has here (tests/conftest.py shares the cores between test workers)
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    return ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _rel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32)
    return float((a - b).abs().max() / b.abs().max())


def _torch_logits(program, ids, attention_mask=None):
    """The PyTorch rewritten model (the ExportedProgram export_onnx converted, same method and
    config, dynamic length) on ``ids``."""
    kw = {"use_cache": False}
    if attention_mask is not None:
        kw["attention_mask"] = attention_mask
    with torch.no_grad():
        return program.module()(ids, **kw).logits


def _onnx_logits(sess, ids, attention_mask=None):
    feed = {"input_ids": ids.numpy()}
    if attention_mask is not None:
        feed["attention_mask"] = attention_mask.numpy()
    return torch.from_numpy(sess.run(None, feed)[0])


@pytest.fixture(scope="module")
def llama():
    import conftest

    return conftest.make_tiny("llama", layers=LAYERS)


_CACHE = {}


def _exported(model, key, **kw):
    if key not in _CACHE:
        ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(1))
        t0 = time.perf_counter()
        proto, program = export_onnx(
            model, (ids,), None, example_kwargs={"use_cache": False}, return_program=True, **kw
        )
        _CACHE[key] = (proto, _session(proto), program, time.perf_counter() - t0)
    return _CACHE[key]


def _ids(n, seed=0, batch=1):
    return torch.randint(0, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("n", [64, 200, 333])
def test_dense_matches_torch_dynamic_length(llama, n):
    proto, sess, program, _ = _exported(llama, "dense", method="dense")
    ids = _ids(n, seed=n)
    err = _rel(_onnx_logits(sess, ids), _torch_logits(program, ids))
    print(f"dense N={n}: max rel err {err:.2e}")
    assert err <= TOL


@pytest.mark.parametrize("method", ["bsa", "pbs", "pisa"])
@pytest.mark.parametrize("n", [64, 200, 333])
def test_sparse_methods_match_torch_dynamic_length(llama, method, n):
    """One export (64-token example) per method, run at other lengths: the onnxruntime output
    equals the PyTorch rewritten model where the selection really is sparse (density < 1, and the
    result far from dense), so the body reproduces the selection, not just dense attention."""
    proto, sess, program, _ = _exported(llama, method, method=method, config=SPARSE[method])
    ids = _ids(n, seed=n)
    with sparseflow.capture() as cap:
        ref = _torch_logits(program, ids)
    density = cap.mean_density()
    assert len(cap.calls) == LAYERS and not cap.fallbacks()
    err = _rel(_onnx_logits(sess, ids), ref)
    print(f"{method} N={n}: max rel err {err:.2e}, density {density:.3f}")
    assert err <= TOL
    if n >= 200:  # the selection really drops blocks: far from dense, yet ONNX matches it
        assert density < 0.9
        with torch.no_grad():
            dense = llama(ids, use_cache=False).logits
        assert _rel(ref, dense) > 10 * TOL


@pytest.mark.parametrize("method", ["bsa", "pbs", "pisa"])
def test_batch_with_key_padding(llama, method):
    """Batch of 2, row 1 right-padded: the HF 4-D mask folds into the node's key padding input
    (PBS then builds its segments on the row's effective length, as the op does)."""
    cfg = SPARSE[method]
    ids = _ids(150, seed=3, batch=2)
    am = torch.ones(2, 150, dtype=torch.long)
    am[1, 120:] = 0
    proto, program = export_onnx(
        llama,
        (ids,),
        None,
        method=method,
        config=cfg,
        return_program=True,
        example_kwargs={"attention_mask": am, "use_cache": False},
    )
    sess = _session(proto)
    assert [i.name for i in sess.get_inputs()] == ["input_ids", "attention_mask"]
    for n, pad in ((150, 30), (97, 20)):
        ids = _ids(n, seed=n, batch=2)
        am = torch.ones(2, n, dtype=torch.long)
        am[1, n - pad :] = 0
        got = _onnx_logits(sess, ids, am)
        ref = _torch_logits(program, ids, am)
        valid = am.bool()
        err = _rel(got[valid], ref[valid])
        print(f"{method} padded N={n}: max rel err {err:.2e}")
        assert err <= TOL


@pytest.mark.parametrize(
    "method,config,dynamic",
    [
        ("pbs", sparseflow.PBSConfig(block_size=16, segment_size=32, threshold=1.0), True),
        ("bsa", sparseflow.BSAConfig(block_size=16, top_k=64), True),
        ("pisa", sparseflow.PISAConfig(block_size=16, top_k=8), True),
    ],
)
def test_exact_modes_match_dense(llama, method, config, dynamic):
    n = 100  # 7 blocks of 16: every top_k above covers them all
    ids = _ids(n, seed=5)
    proto, program = export_onnx(
        llama,
        (ids,),
        None,
        method=method,
        config=config,
        return_program=True,
        example_kwargs={"use_cache": False},
        dynamic_seq=dynamic,
    )
    got = _onnx_logits(_session(proto), ids)
    with torch.no_grad():
        dense = llama(ids, use_cache=False).logits
    err_dense = _rel(got, dense)
    err_torch = _rel(got, _torch_logits(program, ids))
    print(f"{method} exact: rel err vs dense {err_dense:.2e}, vs torch op {err_torch:.2e}")
    assert err_dense <= TOL and err_torch <= TOL


# --------------------------------------------------------------------------- graph structure


@pytest.mark.parametrize("method", ["dense", "bsa", "pbs", "pisa"])
def test_one_sparseflow_node_per_layer_with_config_attributes(llama, method):
    cfg = SPARSE.get(method, sparseflow.DenseConfig())
    proto, _, program, _ = _exported(llama, method, method=method, config=SPARSE.get(method))
    # native GQA reaches the op: K/V with the model's 2 KV heads, never repeated to 6
    ops = [
        n for n in program.graph.nodes if n.op == "call_function" and getattr(n.target, "namespace", "") == "sparseflow"
    ]
    assert len(ops) == LAYERS
    assert all(n.args[0].meta["val"].shape[1] == 6 and n.args[1].meta["val"].shape[1] == 2 for n in ops)
    nodes = [n for n in proto.graph.node if n.domain == DOMAIN]
    assert len(nodes) == LAYERS
    assert all(n.op_type == NODE_TYPES[method] for n in nodes)
    # nothing else computes attention: no decomposed softmax in the main graph
    assert not any(n.op_type in ("Softmax", "Attention") for n in proto.graph.node)
    for node in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs["is_causal"] == 1
        assert attrs["scale"] == pytest.approx(1 / 16**0.5)
        for name, value in cfg.to_dict().items():
            if name in ("method", "version"):
                continue
            if isinstance(value, float):  # ONNX FLOAT attributes are fp32, as the op compares them
                assert attrs[name] == pytest.approx(value, rel=1e-7), name
            elif isinstance(value, str):  # STRING attributes come back as bytes
                assert attrs[name] == value.encode(), name
            else:
                assert attrs[name] == (int(value) if isinstance(value, bool) else value), name
        assert len(node.input) == 4
    fn_names = {(f.domain, f.name) for f in proto.functions}
    assert (DOMAIN, NODE_TYPES[method]) in fn_names
    assert any(o.domain == DOMAIN for o in proto.opset_import)
    assert onnx.defs.has(NODE_TYPES[method], DOMAIN)  # registered schema
    onnx.checker.check_model(proto)
    # the dynamic sequence dimension is symbolic in the file
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    assert dims[1].dim_param and not dims[1].dim_value
    # config travels in the metadata too
    meta = {p.key: p.value for p in proto.metadata_props}
    assert sparseflow.config_from_dict(meta["sparseflow_config"]) == cfg


@pytest.mark.parametrize("method", ["pbs", "pisa"])
def test_stripped_bodies_leave_bindable_nodes(llama, method):
    """The docs/onnx.md recipe for kernel runtimes: drop the bodies of the bound op types. The file
    still checks (registered schemas), and onnxruntime, which has no kernel for the node, refuses
    it by name -- the nodes are the only attention in the graph, nothing else computes it."""
    proto, _, _, _ = _exported(llama, method, method=method, config=SPARSE[method])
    stripped = onnx.ModelProto()
    stripped.CopyFrom(proto)
    keep = [f for f in stripped.functions if not (f.domain == DOMAIN and f.name == NODE_TYPES[method])]
    del stripped.functions[:]
    stripped.functions.extend(keep)
    onnx.checker.check_model(stripped)
    with pytest.raises(Exception, match=NODE_TYPES[method]):
        _session(stripped)


# --------------------------------------------------------------------------- refusals


class _OddAttention(torch.nn.Module):
    """One SDPA call the sparse ops cannot take as a sparse node: a sliding-window mask (not
    causal / key padding) or a value head dim different from the query's (the op runs dense)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.qk = torch.nn.Linear(32, 64)
        self.v = torch.nn.Linear(32, 48 if kind == "value_dim" else 32)

    def forward(self, x):
        b, n, _ = x.shape
        q, k = self.qk(x).view(b, n, 2, 2, 16).unbind(2)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v(x).view(b, n, 2, -1).transpose(1, 2)
        if self.kind == "window":
            i = torch.arange(n, device=x.device)
            mask = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 8)
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return o.transpose(1, 2).reshape(b, n, -1)


@pytest.mark.parametrize(
    "kind,method,match",
    [("window", "bsa", "cannot take"), ("window", "pisa", "cannot take"), ("value_dim", "pbs", "value head dim 24")],
)
def test_unsupported_fails_at_export_time(tmp_path, kind, method, match):
    """Calls the nodes cannot reproduce are refused before anything is written, naming the call."""
    path = tmp_path / "m.onnx"
    x = torch.randn(1, 40, 32, generator=torch.Generator().manual_seed(0))
    cfg = (
        sparseflow.default_config(method).replace(block_size=8)
        if method != "pbs"
        else sparseflow.PBSConfig(block_size=8, segment_size=16)
    )
    with pytest.raises(OnnxExportError, match=match) as info:
        export_onnx(_OddAttention(kind).eval(), (x,), path, method=method, config=cfg)
    assert "<root>" in str(info.value)
    assert not path.exists()
    assert not list(tmp_path.iterdir())  # no partial or temporary file either


def test_pbs_proxy_blocks_above_one_is_refused_at_export_time(tmp_path):
    """The PBSAttention body implements the single proxy only: proxy_blocks > 1 is refused,
    naming the option, before anything is written; proxy_blocks=1 (the default) exports."""
    path = tmp_path / "m.onnx"
    x = torch.randn(1, 40, 32, generator=torch.Generator().manual_seed(0))
    model = _OddAttention("causal").eval()
    cfg = sparseflow.PBSConfig(block_size=8, segment_size=16, proxy_blocks=3)
    with pytest.raises(OnnxExportError, match="proxy_blocks") as info:
        export_onnx(model, (x,), path, method="pbs", config=cfg)
    assert "<root>" in str(info.value)
    assert not path.exists() and not list(tmp_path.iterdir())
    export_onnx(model, (x,), path, method="pbs", config=cfg.replace(proxy_blocks=1))
    assert path.exists()


def test_mask_analysis_intercepts_only_its_own_context(monkeypatch):
    """The export's mask analysis answers the op calls of its own run only: an op called from
    another thread meanwhile runs its real implementation (and is recorded by capture())."""
    import threading

    import sparseflow.onnx_export as onnx_export

    recorded = []

    def op_call_in_another_thread():
        q = torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(0))
        cfg = sparseflow.PBSConfig(block_size=16, segment_size=32, min_seq_len=0)
        with sparseflow.capture() as cap:
            sparseflow.attention(q, q, q, config=cfg, backend="reference")
        recorded.append([(c.method, c.sparse) for c in cap.calls])

    real_analyse = onnx_export.analyse_mask
    started = []

    def analyse_and_call_elsewhere(*a, **kw):
        if not started:
            started.append(True)
            t = threading.Thread(target=op_call_in_another_thread)
            t.start()
            t.join(timeout=60)
        return real_analyse(*a, **kw)

    monkeypatch.setattr(onnx_export, "analyse_mask", analyse_and_call_elsewhere)
    x = torch.randn(1, 40, 32, generator=torch.Generator().manual_seed(0))
    export_onnx(_OddAttention("causal").eval(), (x,), None, method="dense", check=False)
    assert recorded == [[("pbs", True)]]


def test_bad_arguments_fail_clearly(llama):
    with pytest.raises(TypeError, match="example_inputs must be a tuple"):
        export_onnx(llama, _ids(64), None, method="dense")
    with pytest.raises(ValueError, match="method must be one of"):
        export_onnx(llama, (_ids(64),), None, method="nope")


def test_import_sparseflow_does_not_import_onnx():
    code = (
        "import sys, sparseflow; assert callable(sparseflow.export_onnx); "
        "bad = [m for m in ('onnx', 'onnxscript', 'onnxruntime') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- single node, op level


def _single_node_model(method, attrs, dtype=onnx.TensorProto.FLOAT):
    from sparseflow.onnx_export import DOMAIN_VERSION, OPSET, function_protos, register_schemas

    register_schemas()
    h = onnx.helper
    node = h.make_node(NODE_TYPES[method], ["q", "k", "v", "kpm"], ["out"], domain=DOMAIN, **attrs)
    inputs = [h.make_tensor_value_info(n, dtype, [None] * 4) for n in ("q", "k", "v")]
    inputs.append(h.make_tensor_value_info("kpm", onnx.TensorProto.BOOL, [None] * 2))
    graph = h.make_graph([node], "one_node", inputs, [h.make_tensor_value_info("out", dtype, [None] * 4)])
    model = h.make_model(
        graph,
        functions=[function_protos()[method]],
        opset_imports=[h.make_opsetid("", OPSET), h.make_opsetid(DOMAIN, DOMAIN_VERSION)],
    )
    onnx.checker.check_model(model, full_check=True)  # attributes against the registered schemas
    return _session(model)


@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("n", [37, 96])
def test_bsa_node_matches_op(is_causal, ties, n):
    """One BSAAttention node vs sparseflow.ops.bsa_attention: GQA group 3, padding, non-causal,
    exactly tied block scores (every key equal: ties must go to the lower block index)."""
    g = torch.Generator().manual_seed(n)
    b, hkv, grp, d = 2, 2, 3, 8
    q = torch.randn(b, hkv * grp, n, d, generator=g)
    k = torch.randn(b, hkv, n, d, generator=g)
    if ties:  # small integers: block sums and means are exact, so the scores tie exactly
        k = torch.randint(-3, 4, (b, hkv, 1, d), generator=g).float().expand(b, hkv, n, d).contiguous()
    v = torch.randn(b, hkv, n, d, generator=g)
    kpm = torch.ones(b, n, dtype=torch.bool)
    kpm[1, n - 5 :] = False
    kpm[1, 3] = False
    cfg = sparseflow.BSAConfig(block_size=8, top_k=5)
    ref = sparseflow.bsa_attention(q, k, v, config=cfg, attn_mask=kpm[:, None, None, :], is_causal=is_causal, scale=0.3)
    attrs = dict(
        is_causal=int(is_causal), scale=0.3, block_size=8, top_k=5, force_sink=1, force_previous=1, min_seq_len=0
    )
    sess = _single_node_model("bsa", attrs)
    got = sess.run(None, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "kpm": kpm.numpy()})[0]
    err = _rel(got, ref)
    assert err <= 1e-5, err


def _node_inputs(n, ties, seed):
    """GQA group 3, batch row 1 padded at the end and at position 3; with ``ties`` every key is the
    same small-integer vector, so every score ties exactly (ties must go to the lower index)."""
    g = torch.Generator().manual_seed(seed)
    b, hkv, grp, d = 2, 2, 3, 8
    q = torch.randn(b, hkv * grp, n, d, generator=g)
    k = torch.randn(b, hkv, n, d, generator=g)
    if ties:
        k = torch.randint(-3, 4, (b, hkv, 1, d), generator=g).float().expand(b, hkv, n, d).contiguous()
    v = torch.randn(b, hkv, n, d, generator=g)
    kpm = torch.ones(b, n, dtype=torch.bool)
    kpm[1, n - 5 :] = False
    kpm[1, 3] = False
    return q, k, v, kpm


def _node_attrs(cfg, is_causal, scale):
    from sparseflow.op_schema import FIELDS

    attrs = dict(is_causal=int(is_causal), scale=scale)
    for name, kind in FIELDS[cfg.method]:
        val = getattr(cfg, name)
        attrs[name] = int(val) if kind is bool else val
    return attrs


def _node_vs_op(cfg, n, is_causal, ties, seed=0):
    """(max rel error of one node vs the op, the op's density on the same inputs)."""
    q, k, v, kpm = _node_inputs(n, ties, seed)
    with sparseflow.capture() as cap:
        ref = sparseflow.attention(q, k, v, config=cfg, attn_mask=kpm[:, None, None, :], is_causal=is_causal, scale=0.3)
    (call,) = cap.calls
    assert call.sparse, call.reason
    sess = _single_node_model(cfg.method, _node_attrs(cfg, is_causal, 0.3))
    got = sess.run(None, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "kpm": kpm.numpy()})[0]
    return _rel(got, ref), call.density


PBS_NODE_CONFIGS = [
    sparseflow.PBSConfig(block_size=8, segment_size=16, threshold=0.5),
    sparseflow.PBSConfig(block_size=8, segment_size=32, threshold=0.6, gqa_permutation="kv_head"),
    sparseflow.PBSConfig(block_size=8, segment_size=16, threshold=0.7, causal_proxy=True, force_sink=False),
    sparseflow.PBSConfig(block_size=8, segment_size=16, threshold=0.7, permute=False),
    sparseflow.PBSConfig(block_size=8, segment_size=16, threshold=0.6, scoring="antidiagonal", antidiagonal_stride=4),
    sparseflow.PBSConfig(
        block_size=8,
        segment_size=32,
        threshold=0.7,
        scoring="antidiagonal",
        antidiagonal_stride=2,
        gqa_permutation="kv_head",
        causal_proxy=True,
    ),
]
PISA_NODE_CONFIGS = [
    sparseflow.PISAConfig(block_size=8, top_k=4),
    sparseflow.PISAConfig(block_size=4, top_k=5, branching=3, score="mean"),
    sparseflow.PISAConfig(block_size=8, top_k=3, score="mean_var", force_previous=False),
    sparseflow.PISAConfig(block_size=8, top_k=4, branching=4, force_sink=False),
    sparseflow.PISAConfig(block_size=4, top_k=4, beam=2, score="mean_var"),
]


@pytest.mark.parametrize("cfg", PBS_NODE_CONFIGS + PISA_NODE_CONFIGS, ids=lambda c: c.to_json())
@pytest.mark.parametrize("is_causal", [True, False])
def test_sparse_node_matches_op(cfg, is_causal):
    """One PBSAttention / PISAAttention node vs the sparseflow op (reference backend) at N=100,
    where both really select (density < 1): equal outputs mean equal selections. Covers GQA,
    padding, non-causal, every scoring/permutation option the bodies implement."""
    err, density = _node_vs_op(cfg, 100, is_causal, ties=False, seed=1)
    print(f"{cfg.method} causal={is_causal}: rel err {err:.2e}, density {density:.3f}")
    assert density < 0.95
    assert err <= 1e-5, err


@pytest.mark.parametrize("cfg", [PBS_NODE_CONFIGS[0], PISA_NODE_CONFIGS[0]], ids=["pbs", "pisa"])
@pytest.mark.parametrize("n", [37, 96])
def test_sparse_node_ties_and_odd_lengths(cfg, n):
    """Exactly tied scores (ties to the lower index, as the references' stable sorts) and lengths
    that leave a partial block / tail segment."""
    for ties in (False, True):
        err, _ = _node_vs_op(cfg, n, True, ties=ties, seed=n)
        assert err <= 1e-5, (ties, err)


@pytest.mark.parametrize(
    "method,bad",
    [
        ("pbs", {"scoring": "max"}),
        ("pbs", {"gqa_permutation": "per_token"}),
        ("pbs", {"proxy_blocks": 2}),
        ("pisa", {"score": "max"}),
        ("pisa", {"branching": 1}),
        ("pisa", {"beam": 0}),
    ],
)
def test_body_outputs_nan_for_settings_it_does_not_implement(method, bad):
    """A node written by hand (or by another tool) with a setting the body lacks: the fallback
    returns NaN, never an attention computed some other way."""
    cfg = PBS_NODE_CONFIGS[0] if method == "pbs" else PISA_NODE_CONFIGS[0]
    q, k, v, kpm = _node_inputs(40, False, 0)
    attrs = {**_node_attrs(cfg, True, 0.3), **bad}
    got = _single_node_model(method, attrs).run(
        None, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "kpm": kpm.numpy()}
    )[0]
    assert torch.isnan(torch.from_numpy(got)).all()
    attrs = _node_attrs(cfg, True, 0.3)  # and the same node with a supported setting is finite
    got = _single_node_model(method, attrs).run(
        None, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "kpm": kpm.numpy()}
    )[0]
    assert torch.isfinite(torch.from_numpy(got)).all()


# --------------------------------------------------------------------------- the real checkpoint


@pytest.mark.slow
def test_smollm2_every_method_onnx_matches_torch_at_1k_tokens():
    """SmolLM2-135M-Instruct (9 query heads, 3 KV heads, 30 layers) with BSA, PBS and PISA at their
    defaults on alternating layers -- one export (256-token example, dynamic length) checks all
    three node types on the real checkpoint -- run by onnxruntime at 1024 tokens of real text
    against the PyTorch rewritten model. Every method must really select (density < 1)."""
    from sparseflow.checkpoints import SMOLLM2_PACKAGE_HINT, load_smollm2, real_tokens, smollm2_gguf

    if smollm2_gguf() is None:
        pytest.skip(f"SmolLM2 GGUF not installed ({SMOLLM2_PACKAGE_HINT})")
    model, tok = load_smollm2()
    ids = real_tokens(tok, 1024)
    cycle = ["bsa", "pbs", "pisa"]
    n_layers = model.config.num_hidden_layers
    per_layer = {i: sparseflow.default_config(cycle[i % 3]) for i in range(n_layers)}
    t0 = time.perf_counter()
    proto, program = export_onnx(
        model,
        (ids[:, :256],),
        None,
        method="bsa",
        layer_configs=per_layer,
        example_kwargs={"use_cache": False},
        return_program=True,
    )
    export_s = time.perf_counter() - t0
    nodes = [n.op_type for n in proto.graph.node if n.domain == DOMAIN]
    assert nodes == [NODE_TYPES[cycle[i % 3]] for i in range(n_layers)]
    t0 = time.perf_counter()
    got = _onnx_logits(_session(proto), ids)
    run_s = time.perf_counter() - t0
    with sparseflow.capture() as cap:
        ref = _torch_logits(program, ids)
    assert not cap.fallbacks() and len(cap.calls) == n_layers
    density = {m: sum(c.density for c in cap.calls if c.method == m) / (n_layers // 3) for m in cycle}
    err = _rel(got, ref)
    print(
        f"\nSmolLM2 bsa/pbs/pisa N=1024: export {export_s:.1f} s, onnxruntime {run_s:.1f} s, "
        f"max rel err {err:.2e}, density {density}"
    )
    assert err <= TOL
    assert all(d < 0.95 for d in density.values()), density  # every method really sparse at 1K tokens


# --------------------------------------------------------------------------- command line


@pytest.fixture(scope="module")
def llama_folder(llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_llama_onnx")
    llama.save_pretrained(folder)
    return folder


def test_cli_export_onnx_writes_the_same_model(llama, llama_folder, tmp_path, capsys):
    """``sparseflow export-onnx FOLDER --method pisa --config ...`` writes a file computing what
    export_onnx computes for the same model and config (checked at a length other than --tokens)."""
    import json

    from sparseflow.cli import main

    out = tmp_path / "tiny.onnx"
    cfg = SPARSE["pisa"]
    rc = main(
        [
            "export-onnx",
            str(llama_folder),
            "--method",
            "pisa",
            "--config",
            json.dumps(cfg.to_dict()),
            "--tokens",
            "48",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    assert f"2 {NODE_TYPES['pisa']}" in capsys.readouterr().out
    proto = onnx.load(str(out))
    assert [n.op_type for n in proto.graph.node if n.domain == DOMAIN] == [NODE_TYPES["pisa"]] * LAYERS
    ids = _ids(200, seed=9)
    _, api_sess, _, _ = _exported(llama, "pisa", method="pisa", config=cfg)
    err = _rel(_onnx_logits(_session(proto), ids), _onnx_logits(api_sess, ids))
    assert err <= 1e-5, err


def test_cli_export_onnx_errors(llama_folder, tmp_path, capsys):
    from sparseflow.cli import main

    out = tmp_path / "x.onnx"
    assert main(["export-onnx", str(llama_folder), "--out", str(out)]) == 2
    assert "pass --method" in capsys.readouterr().err
    bad = '{"block_size": 16, "segment_size": 24}'
    assert (
        main(
            ["export-onnx", str(llama_folder), "--method", "pbs", "--config", bad, "--tokens", "64", "--out", str(out)]
        )
        == 2
    )
    assert "segment_size must be a multiple of block_size" in capsys.readouterr().err
    assert not out.exists()


def test_plain_module_native_gqa(plain_attention):
    """A user module calling F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)."""
    model = plain_attention(dim=48, heads=6, kv_heads=2, layers=2).eval()
    cfg = sparseflow.BSAConfig(block_size=8, top_k=3)
    x = torch.randn(1, 40, 48, generator=torch.Generator().manual_seed(0))
    proto, program = export_onnx(model, (x,), None, method="bsa", config=cfg, return_program=True)
    assert sum(n.op_type == "BSAAttention" for n in proto.graph.node) == 2
    sess = _session(proto)
    for n in (40, 71):
        x = torch.randn(1, n, 48, generator=torch.Generator().manual_seed(n))
        got = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
        with torch.no_grad():
            ref = program.module()(x)
        err = _rel(got, ref)
        assert err <= TOL, err


def test_dense_node_half_precision():
    """fp16 q/k/v: the body computes in fp32 and returns fp16, like the op."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 6, 50, 16, generator=g).half()
    k = torch.randn(1, 2, 50, 16, generator=g).half()
    v = torch.randn(1, 2, 50, 16, generator=g).half()
    kpm = torch.ones(1, 50, dtype=torch.bool)
    sess = _single_node_model("dense", dict(is_causal=1, scale=0.25), dtype=onnx.TensorProto.FLOAT16)
    got = sess.run(None, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "kpm": kpm.numpy()})[0]
    assert got.dtype.name == "float16"
    ref = sparseflow.dense_attention(q.float(), k.float(), v.float(), is_causal=True, scale=0.25)
    assert _rel(got, ref) <= 1e-3


# --------------------------------------------------------------------------- local windows


@pytest.mark.parametrize("window", [(5, 0), (16, 0), (0, 8)])
@pytest.mark.parametrize("n", [37, 64])
def test_dense_window_node_matches_op(n, window):
    """A DenseAttention node with a sliding or chunked window (and key padding) computes what the
    op's exact window computes, which differs from plain causal attention."""
    cfg = sparseflow.DenseConfig(sliding_window=window[0], chunk_size=window[1])
    err, _ = _node_vs_op(cfg, n, is_causal=True, ties=False)
    assert err < 1e-5
    q, k, v, kpm = _node_inputs(n, False, 0)
    causal = sparseflow.attention(
        q, k, v, config=sparseflow.DenseConfig(), attn_mask=kpm[:, None, None, :], is_causal=True, scale=0.3
    )
    windowed = sparseflow.attention(q, k, v, config=cfg, attn_mask=kpm[:, None, None, :], is_causal=True, scale=0.3)
    assert _rel(windowed, causal) > 1e-2  # the window matters on these inputs


def test_window_attributes_are_optional():
    """A node without the window attributes (a file written before windows were exported, or a
    runtime's own node) has no window: it is plain causal attention."""
    attrs = _node_attrs(sparseflow.DenseConfig(), True, 0.3)
    del attrs["sliding_window"], attrs["chunk_size"]
    q, k, v, kpm = _node_inputs(40, False, 0)
    got = _single_node_model("dense", attrs).run(
        None, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "kpm": kpm.numpy()}
    )[0]
    ref = sparseflow.attention(
        q, k, v, config=sparseflow.DenseConfig(), attn_mask=kpm[:, None, None, :], is_causal=True, scale=0.3
    )
    assert _rel(got, ref) < 1e-5


def test_attributes_added_after_a_nodes_first_files_are_optional():
    """PBS's ``moments_sd`` came after PBSAttention files were written: a node without it passes
    the checker against the registered schema (full check) and computes what the op computes."""
    cfg = sparseflow.PBSConfig(block_size=8, segment_size=16, threshold=0.9)
    attrs = _node_attrs(cfg, True, 0.3)
    assert "moments_sd" in attrs
    del attrs["moments_sd"]
    sess = _single_node_model("pbs", attrs)
    q, k, v, kpm = _node_inputs(40, False, 0)
    got = sess.run(None, {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "kpm": kpm.numpy()})[0]
    ref = sparseflow.attention(q, k, v, config=cfg, attn_mask=kpm[:, None, None, :], is_causal=True, scale=0.3)
    assert _rel(got, ref) < 1e-5


def test_sparse_method_with_a_window_is_refused(tmp_path, monkeypatch):
    """A sparse method chooses its blocks inside the window; a node body that does not
    (``OnnxBody.windows`` off, as a method registered without it) would choose them over all keys
    and only then cut them to the window: refused, naming the node, the window and the way that
    exports. Every built-in body chooses inside the window; a BSA body marked otherwise stands in."""
    import dataclasses

    import sparseflow.onnx_export as onnx_export

    cfg = sparseflow.BSAConfig(block_size=8, sliding_window=16)
    spec = sparseflow.methods.spec_for(cfg)
    unwindowed = dataclasses.replace(spec, onnx=dataclasses.replace(spec.onnx, windows=False))
    spec_for = sparseflow.methods.spec_for
    monkeypatch.setattr(onnx_export, "spec_for", lambda m: unwindowed if m == "bsa" else spec_for(m))

    class Windowed(torch.nn.Module):
        def forward(self, q, k, v):
            return sparseflow.attention(q, k, v, config=cfg, is_causal=True)

    q = torch.randn(1, 2, 40, 16)
    node = spec.onnx.node_type
    with pytest.raises(
        OnnxExportError, match=rf"{node} does not choose its blocks inside a local window.*sliding_window=16.*'dense'"
    ):
        export_onnx(Windowed().eval(), (q, q, q), tmp_path / "m.onnx", method=cfg.method)
    assert not list(tmp_path.iterdir())


def test_gemma3_windows_export_and_match(tmp_path):
    """A Gemma 3 model (sliding-window and global layers) exports: its sliding layers are nodes
    carrying their window, and onnxruntime computes the rewritten model's logits at another length."""
    import conftest

    model = conftest.make_family("gemma3_text", layers=2)
    ids = _ids(64, seed=1)
    proto, program = export_onnx(
        model, (ids,), None, example_kwargs={"use_cache": False}, return_program=True, method="dense"
    )
    windows = sorted(
        onnx.helper.get_attribute_value(a)
        for n in proto.graph.node
        if n.domain == DOMAIN
        for a in n.attribute
        if a.name == "sliding_window"
    )
    assert windows == [0, conftest.WINDOW]  # conftest's alternating sliding / global layers
    x = _ids(100, seed=2)
    got = _session(proto).run(None, {proto.graph.input[0].name: x.numpy()})[0]
    ref = _torch_logits(program, x)
    assert _rel(got, ref) < 1e-4
    with torch.no_grad():
        plain = model(x, use_cache=False).logits
    assert _rel(got, plain) < 1e-4


# A window the selection must choose inside: it spans more blocks than the top-K keeps, and the
# lengths reach past it, so choosing over all keys and cutting to the window would differ.
# (config, lengths)
WINDOWED_NODES = {
    "bsa-sliding-40": (sparseflow.BSAConfig(block_size=8, top_k=3, sliding_window=40), (61, 100)),
    "bsa-sliding-23-nosink": (sparseflow.BSAConfig(block_size=4, top_k=3, force_sink=False, sliding_window=23), (50,)),
    "bsa-chunk-32": (sparseflow.BSAConfig(block_size=4, top_k=3, chunk_size=32), (61, 100)),
    "bsa-chunk-48-noprev": (sparseflow.BSAConfig(block_size=4, top_k=4, force_previous=False, chunk_size=48), (90,)),
    "pisa-sliding-29": (sparseflow.PISAConfig(block_size=4, top_k=3, sliding_window=29), (61, 100)),
    "pisa-chunk-32-mean-g3": (
        sparseflow.PISAConfig(block_size=4, top_k=4, branching=3, score="mean", chunk_size=32),
        (61, 100),
    ),
    "pisa-sliding-40-mean_var-beam2": (
        sparseflow.PISAConfig(block_size=4, top_k=3, score="mean_var", beam=2, sliding_window=40),
        (100,),
    ),
    "pbs-sliding-30": (
        sparseflow.PBSConfig(block_size=4, segment_size=16, threshold=0.6, sliding_window=30),
        (61, 100),
    ),
    "pbs-chunk-32-kv_head": (
        sparseflow.PBSConfig(block_size=4, segment_size=16, threshold=0.7, chunk_size=32, gqa_permutation="kv_head"),
        (61, 100),
    ),
    "pbs-sliding-37-antidiagonal-causal_proxy": (
        sparseflow.PBSConfig(
            block_size=4,
            segment_size=16,
            threshold=0.6,
            scoring="antidiagonal",
            antidiagonal_stride=2,
            causal_proxy=True,
            sliding_window=37,
        ),
        (100,),
    ),
    "pbs-sliding-23-nopermute-nosink": (
        sparseflow.PBSConfig(
            block_size=4, segment_size=16, threshold=0.6, permute=False, force_sink=False, sliding_window=23
        ),
        (61,),
    ),
    "pisa-sliding-23-noprev": (
        sparseflow.PISAConfig(block_size=4, top_k=3, force_previous=False, sliding_window=23),
        (61,),
    ),
}


def _attention_over(q, k, v, keys, scale):
    """Softmax attention of each query over the keys ``keys [B, Hq, Nq, Nk]`` says it attends (GQA
    by repetition); a query attending nothing outputs 0."""
    g = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(g, 1) for t in (k, v))
    logits = (q @ kk.transpose(-1, -2) * scale).masked_fill(~keys, float("-inf"))
    probs = torch.softmax(logits, -1).nan_to_num(0.0)
    return probs @ vv


@pytest.mark.parametrize("case", WINDOWED_NODES.values(), ids=WINDOWED_NODES.keys())
def test_windowed_sparse_node_matches_op(case):
    """A sparse node with a local window chooses its blocks inside each query's window as the op
    (reference backend) does: equal outputs, and equal selections read off the node itself (with
    the identity as values, a query's output row is its attention probabilities, nonzero exactly on
    the keys it attends). GQA group 3, a padded batch row. The op's selection differs, on these
    inputs, from the one made over all keys and then cut to the window, so a body choosing over
    all keys fails here."""
    from sparseflow.selection import visible_key_mask

    cfg, lengths = case
    unwindowed = cfg.replace(sliding_window=0, chunk_size=0)
    sess = _single_node_model(cfg.method, _node_attrs(cfg, True, 0.3))
    for n in lengths:
        q, k, v, kpm = _node_inputs(n, False, seed=n)
        b, hq, hkv = q.shape[0], q.shape[1], k.shape[1]
        with sparseflow.capture() as cap:
            ref = sparseflow.attention(q, k, v, config=cfg, attn_mask=kpm[:, None, None, :], scale=0.3)
            sparseflow.attention(q, k, v, config=unwindowed, attn_mask=kpm[:, None, None, :], scale=0.3)
        call, call_all = cap.calls
        assert call.sparse and call_all.sparse, (call.reason, call_all.reason)
        feed = {"q": q.numpy(), "k": k.numpy(), "v": v.numpy(), "kpm": kpm.numpy()}
        err = _rel(sess.run(None, feed)[0], ref)
        assert err <= 1e-5, (n, err)
        keys = call.selection.key_mask(hq)
        eye = torch.eye(n).expand(b, hkv, n, n).contiguous()
        probs = torch.from_numpy(sess.run(None, {**feed, "v": eye.numpy()})[0])
        assert torch.equal(probs > 0, keys), n
        window = dict(sliding_window=cfg.sliding_window, chunk_size=cfg.chunk_size)
        cut = call_all.selection.key_mask(hq) & visible_key_mask(n, n, is_causal=True, batch=b, **window)[:, None]
        assert _rel(_attention_over(q, k, v, cut, 0.3), ref) > 1e-2, "the window must change the choice"
        print(f"{cfg.method} {window} N={n}: rel err {err:.2e}, density {call.density:.3f}")


# method: a config whose top-K is narrower than the blocks conftest.WINDOW spans, so the
# windowed layers run the method inside their window (not the exact window)
WINDOWED_MODELS = {
    "bsa": sparseflow.BSAConfig(block_size=4, top_k=3),
    "pisa": sparseflow.PISAConfig(block_size=4, top_k=3),
    "pbs": sparseflow.PBSConfig(block_size=4, segment_size=8, threshold=0.6),
}


@pytest.mark.parametrize("method", WINDOWED_MODELS)
def test_windowed_model_sparse_nodes_match_torch(method):
    """A Gemma 3 model (a sliding-window and a global layer) exports with a sparse method: the
    sliding layer is a sparse node carrying its window, and onnxruntime computes the rewritten
    model's logits at the exported length and another one, with a right-padded batch row."""
    import conftest

    model = conftest.make_family("gemma3_text", layers=2)
    ids = _ids(64, seed=1, batch=2)
    am = torch.ones(2, 64, dtype=torch.long)
    am[1, 50:] = 0
    proto, program = export_onnx(
        model,
        (ids,),
        None,
        method=method,
        config=WINDOWED_MODELS[method],
        return_program=True,
        example_kwargs={"attention_mask": am, "use_cache": False},
    )
    nodes = [n for n in proto.graph.node if n.domain == DOMAIN]
    assert [n.op_type for n in nodes] == [NODE_TYPES[method]] * 2
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in nodes]
    assert sorted(a["sliding_window"] for a in attrs) == [0, conftest.WINDOW]
    sess = _session(proto)
    for n, pad in ((64, 14), (150, 40)):
        ids = _ids(n, seed=n, batch=2)
        am = torch.ones(2, n, dtype=torch.long)
        am[1, n - pad :] = 0
        with sparseflow.capture() as cap:
            ref = _torch_logits(program, ids, am)
        (windowed,) = [c for c in cap.calls if c.selection is not None and c.selection.sliding_window]
        assert windowed.sparse and windowed.density < 0.9
        valid = am.bool()
        err = _rel(_onnx_logits(sess, ids, am)[valid], ref[valid])
        print(f"gemma3 {method} N={n}: max rel err {err:.2e}, windowed density {windowed.density:.3f}")
        assert err <= TOL


class _WindowedOp(torch.nn.Module):
    """One op call with a local window in its config and a key-padding mask (native GQA)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg

    def forward(self, q, k, v, kpm):
        return sparseflow.attention(q, k, v, config=self.cfg, attn_mask=kpm[:, None, None, :], scale=0.3)


@pytest.mark.parametrize(
    "case",
    [
        "bsa-sliding-40",
        "bsa-chunk-32",
        "pisa-sliding-29",
        "pisa-chunk-32-mean-g3",
        "pbs-sliding-30",
        "pbs-chunk-32-kv_head",
    ],
)
def test_windowed_op_call_exports_with_dynamic_length(case):
    """An op call carrying a sliding or chunked window, exported once (64 tokens, dynamic length):
    the file computes the op at 64 tokens and at the other lengths of the case, GQA and padding."""
    cfg, lengths = WINDOWED_NODES[case]
    seq = torch.export.Dim("seq", min=2, max=4096)
    q, k, v, kpm = _node_inputs(64, False, seed=0)
    shapes = {"q": {2: seq}, "k": {2: seq}, "v": {2: seq}, "kpm": {1: seq}}
    proto = export_onnx(_WindowedOp(cfg).eval(), (q, k, v, kpm), None, method=cfg.method, dynamic_shapes=shapes)
    (node,) = [n for n in proto.graph.node if n.domain == DOMAIN]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert (attrs["sliding_window"], attrs["chunk_size"]) == (cfg.sliding_window, cfg.chunk_size)
    sess = _session(proto)
    for n in (64,) + lengths:
        q, k, v, kpm = _node_inputs(n, False, seed=n)
        ref = sparseflow.attention(q, k, v, config=cfg, attn_mask=kpm[:, None, None, :], scale=0.3)
        got = sess.run(None, dict(zip((i.name for i in sess.get_inputs()), (t.numpy() for t in (q, k, v, kpm)))))[0]
        err = _rel(got, ref)
        assert err <= 1e-5, (n, err)
