"""sparseflow.Tuning: launch options of the Triton backends, passed per call (no environment switches).

The kernels run in Triton's CPU interpreter here (TRITON_INTERPRET=1, set in conftest.py) on small
shapes; spies on the launch helpers observe the values that reach the kernels.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import re

import pytest
import torch

import sparseflow
from sparseflow import DenseConfig, PBSConfig, PISAConfig, Tuning
from sparseflow import op_backends, op_schema, ops

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or not op_backends.triton_usable(torch.device("cpu")),
    reason="needs triton and TRITON_INTERPRET=1 (or CUDA)",
)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = pathlib.Path(__file__).resolve().parents[1]
PBS_SMALL = PBSConfig(block_size=16, segment_size=32, threshold=0.8)
PISA_SMALL = PISAConfig(block_size=16, top_k=3)


def _qkv(n=64, hq=4, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, h, n, d, generator=g).to(DEV) for h in (hq, hkv, hkv))


# --------------------------------------------------------------------------- the dataclass


def test_defaults_are_the_former_environment_defaults():
    t = Tuning()
    assert (
        t.pbs_select,
        t.pbs_kv_layout,
        t.pbs_tma,
        t.pbs_moments_product,
        t.pisa_warps,
        t.pisa_leaf_bytes,
        t.pisa_scores,
    ) == (
        "auto",
        "permuted",
        True,
        "tf32",
        None,
        None,
        "fp32",
    )
    assert t == sparseflow.tuning.DEFAULT_TUNING and hash(t) == hash(Tuning())
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.pbs_tma = False


@pytest.mark.parametrize(
    "field,value,exc,words",
    [
        ("pbs_select", "cuda", ValueError, ["pbs_select", "'auto'", "'triton'", "'reference'"]),
        ("pbs_select", 1, TypeError, ["pbs_select", "str"]),
        ("pbs_kv_layout", "copy", ValueError, ["pbs_kv_layout", "'permuted'", "'gather'"]),
        ("pbs_tma", 0, TypeError, ["pbs_tma", "bool"]),
        ("pbs_tma", "0", TypeError, ["pbs_tma", "bool"]),
        ("pbs_moments_product", "bf16", ValueError, ["pbs_moments_product", "'tf32'", "'ieee'"]),
        ("cuda_graphs", 1, TypeError, ["cuda_graphs", "bool"]),
        ("cuda_graphs", None, TypeError, ["cuda_graphs", "bool"]),
        ("pdl", 1, TypeError, ["pdl", "bool"]),
        ("pisa_warps", 3, ValueError, ["pisa_warps", "[1, 2, 4, 8, 16, 32]"]),
        ("pisa_warps", 4.0, TypeError, ["pisa_warps", "int"]),
        ("pisa_warps", True, TypeError, ["pisa_warps", "int"]),
        ("pisa_leaf_bytes", 0, ValueError, ["pisa_leaf_bytes", ">= 1"]),
        ("pisa_leaf_bytes", "16K", TypeError, ["pisa_leaf_bytes", "int"]),
        ("pisa_scores", "fp16", ValueError, ["pisa_scores", "'fp32'", "'bf16'", "'tf32'"]),
        ("pisa_scores", None, TypeError, ["pisa_scores", "str"]),
    ],
)
def test_validation_names_the_field_and_what_works(field, value, exc, words):
    with pytest.raises(exc) as info:
        Tuning(**{field: value})
    msg = str(info.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg


def test_entry_points_refuse_a_non_tuning(plain_attention):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="tuning must be a sparseflow.Tuning"):
        sparseflow.attention(q, k, v, config=PBS_SMALL, tuning={"pbs_tma": False})
    with pytest.raises(TypeError, match="tuning must be a sparseflow.Tuning"):
        sparseflow.compile(plain_attention(), method="dense", inner_backend="eager", tuning="gather")


# --------------------------------------------------------------------------- carried by the ops


def test_schemas_carry_each_methods_tuning_fields():
    schema = {m: str(ops.op_for(m)._schema) for m in ("dense", "pbs", "pisa", "bsa")}
    assert (
        "str pbs_select, str pbs_kv_layout, bool pbs_tma, str pbs_moments_product, bool cuda_graphs, str backend"
        in schema["pbs"]
    )
    assert (
        "int? pisa_warps, int? pisa_leaf_bytes, str pisa_scores, bool cuda_graphs, bool pdl, str backend"
        in schema["pisa"]
    )
    assert (
        "float? scale, int sliding_window, int chunk_size, int block_size" in schema["bsa"]
        and "bool cuda_graphs, bool pdl, str backend" in schema["bsa"]
    )
    for m in ("dense", "bsa"):
        assert "pbs_" not in schema[m] and "pisa_" not in schema[m]
    # the dense op's windowed calls run Triton kernels, which an eager call may replay from a graph
    assert "int chunk_size, bool cuda_graphs, str backend" in schema["dense"]
    assert "pdl" not in schema["pbs"] and "pdl" not in schema["dense"]  # their kernels do not chain
    t = Tuning(pbs_kv_layout="gather", pisa_warps=2, cuda_graphs=False, pdl=True)
    assert ops.op_args(PBS_SMALL, t)[-5:] == ["auto", "gather", True, "tf32", False]
    assert ops.op_args(PISA_SMALL, t)[-5:] == [2, None, "fp32", False, True]
    assert ops.op_args(PBS_SMALL)[-5:] == ["auto", "permuted", True, "tf32", True]  # default: Tuning()


def test_compiled_graph_holds_the_tuning(plain_attention):
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    q, k, v = _qkv()
    t = Tuning(pbs_kv_layout="gather", pbs_tma=False, pbs_moments_product="ieee")
    f = torch.compile(
        lambda q, k, v: sparseflow.attention(q, k, v, config=PBS_SMALL, backend="reference", tuning=t),
        fullgraph=True,
        backend=keep,
    )
    torch.testing.assert_close(f(q, k, v), sparseflow.attention(q, k, v, config=PBS_SMALL, backend="reference"))
    calls = [n for gm in graphs for n in gm.graph.nodes if n.target is ops.op_for("pbs")]
    # cuda_graphs off in the traced call: the compiled graph is Inductor's to capture
    assert len(calls) == 1 and list(calls[0].args[-7:-2]) == ["auto", "gather", False, "ieee", False]


def _cuda_graphs_arg(method, args):
    """The ``cuda_graphs`` value of an op call's ``args`` (as the op receives them)."""
    first_tuning = 6 + len(op_schema.NAMES[method])
    return args[first_tuning + op_schema.TUNING_NAMES[method].index("cuda_graphs")]


def _dense_answer(seen):
    def answer(method, args):
        seen.append(_cuda_graphs_arg(method, args))
        q, k, v, _, is_causal, scale = args[:6]
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=is_causal, scale=scale, enable_gqa=True
        ).contiguous()

    return answer


@pytest.mark.parametrize("mode,replays", [(None, True), ("default", True), ("reduce-overhead", False)])
def test_compiled_model_calls_replay_op_level_graphs_unless_inductor_captures(plain_attention, mode, replays):
    # under Inductor's CUDA graphs an op keeps no CUDA graph of its own (whose static inputs would
    # stay in the memory pool of Inductor's graphs); a graph nothing captures keeps the tuning's
    model = plain_attention()
    sparseflow.compile(model, method="pbs", config=PBS_SMALL, backend="reference", mode=mode, tuning=Tuning())
    seen = []
    with ops.intercepting(_dense_answer(seen)):
        model(torch.randn(1, 64, 48))
    assert seen and all(s is replays for s in seen)


def test_a_compiled_model_keeps_cuda_graphs_off_when_the_tuning_says_so(plain_attention):
    model = plain_attention()
    sparseflow.compile(model, method="pbs", config=PBS_SMALL, backend="reference", tuning=Tuning(cuda_graphs=False))
    seen = []
    with ops.intercepting(_dense_answer(seen)):
        model(torch.randn(1, 64, 48))
    assert seen and not any(seen)


def test_a_traced_windowed_dense_call_replays_no_op_level_graph():
    # the dense op's windowed calls launch Triton kernels too: traced by torch.compile they must
    # leave the graph to Inductor, as the sparse methods' calls do (an eager call may replay)
    q, k, v = _qkv()
    cfg = DenseConfig(sliding_window=16)
    seen = []
    f = torch.compile(lambda q, k, v: sparseflow.attention(q, k, v, config=cfg), fullgraph=True, backend="eager")
    with ops.intercepting(_dense_answer(seen)):
        f(q, k, v)
        sparseflow.attention(q, k, v, config=cfg)
    assert seen == [False, True]


def test_exported_program_keeps_the_tuning(plain_attention):
    # an exported program runs eagerly: its calls may replay their own graphs
    ep = sparseflow.export(plain_attention(), (torch.randn(1, 64, 48),), method="pbs", config=PBS_SMALL)
    calls = [n for n in ep.graph.nodes if n.op == "call_function" and "sparseflow" in str(n.target)]
    assert calls and all(_cuda_graphs_arg("pbs", n.args) is True for n in calls)


def test_rewrite_pass_carries_the_tuning(plain_attention):
    model = plain_attention()
    t = Tuning(pbs_kv_layout="gather")
    sparseflow.compile(
        model, method="pbs", config=PBS_SMALL, backend="reference", inner_backend="eager", fullgraph=True, tuning=t
    )
    model(torch.randn(1, 64, 48))
    assert model._sparseflow_config["tuning"] == t.to_dict()


# --------------------------------------------------------------------------- reaching the kernels


def _spy_pbs(monkeypatch):
    """Records (gather, TMA allowed) per attention launch and which selection ran."""
    from sparseflow.methods.pbs import triton_attention as TA
    from sparseflow.methods.pbs import triton_impl as TI
    from sparseflow.methods.pbs import triton_select as S

    seen = {"launch": [], "select": []}
    real_tma, real_lists, real_blocks = TA._tma_ok, S.select_block_lists, TI.select_blocks

    def tma_ok(q, k, v, gather, allowed=True):
        seen["launch"].append((gather, allowed))
        return real_tma(q, k, v, gather, allowed)

    def lists(*a, **kw):
        seen["select"].append("triton")
        return real_lists(*a, **kw)

    def blocks(*a, **kw):
        seen["select"].append("reference")
        return real_blocks(*a, **kw)

    monkeypatch.setattr(TA, "_tma_ok", tma_ok)
    monkeypatch.setattr(S, "select_block_lists", lists)
    monkeypatch.setattr(TI, "select_blocks", blocks)  # the name the backend's torch selection calls
    return seen


@needs_triton
@pytest.mark.parametrize(
    "tuning,select,launch",
    [
        (Tuning(), "reference" if DEV == "cpu" else "triton", (False, True)),
        (Tuning(pbs_select="triton", pbs_kv_layout="gather", pbs_tma=False), "triton", (True, False)),
        (Tuning(pbs_select="reference", pbs_tma=False), "reference", (False, False)),
    ],
    ids=["defaults", "triton-gather-notma", "reference-permuted-notma"],
)
def test_pbs_tuning_reaches_the_kernel(monkeypatch, tuning, select, launch):
    seen = _spy_pbs(monkeypatch)
    q, k, v = _qkv()
    ref = sparseflow.attention(q, k, v, config=PBS_SMALL, backend="reference")
    seen["select"].clear()
    out = sparseflow.attention(q, k, v, config=PBS_SMALL, backend="triton", tuning=tuning)
    assert seen["select"] == [select]
    assert seen["launch"] == [launch]
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def _spy_pisa(monkeypatch):
    from sparseflow.methods.pisa import triton_select_per_token as per_token

    seen = []
    real = per_token._launch

    def launch(cw, warps=None, leaf_bytes=None):
        got = real(cw, warps, leaf_bytes)
        seen.append(got)
        return got

    monkeypatch.setattr(per_token, "_launch", launch)
    return seen


@needs_triton
def test_pisa_tuning_reaches_the_launch_per_call(monkeypatch):
    seen = _spy_pisa(monkeypatch)
    q, k, v = _qkv(n=40)  # five blocks of 8: the interpreter walks 40 tokens, not 64, per call
    cfg = PISA_SMALL.replace(block_size=8)
    # candidate width 16 (K=3, branching 2): the defaults are 1 warp and 16 KB chunks
    sparseflow.attention(q, k, v, config=cfg, backend="triton")
    sparseflow.attention(q, k, v, config=cfg, backend="triton", tuning=Tuning(pisa_warps=2, pisa_leaf_bytes=4096))
    sparseflow.attention(q, k, v, config=cfg, backend="triton", tuning=Tuning(pisa_warps=8))
    assert seen == [(1, 16384), (2, 4096), (8, 16384)]


@needs_triton
def test_pisa_decode_takes_the_tuning(monkeypatch):
    from sparseflow.methods.pisa.pyramid_cache import PyramidCache

    seen = _spy_pisa(monkeypatch)
    q, k, v = _qkv(n=50)
    cache = PyramidCache(k, capacity=64, block_size=16)
    cache.select(q[:, :, -1:], k, top_k=3, tuning=Tuning(pisa_warps=4, pisa_leaf_bytes=2048))
    assert seen == [(4, 2048)]


def test_default_launch_settings_unchanged():
    pytest.importorskip("triton")
    from sparseflow.methods.pbs import triton_impl as TI
    from sparseflow.methods.pisa import triton_select_per_token as per_token

    assert per_token._launch(16) == (1, 16384) and per_token._launch(32) == (4, 65536)
    assert TI.select_impl(torch.device("cpu")) == "reference"
    assert TI.select_impl(torch.device("cuda")) == "triton"
    assert TI.select_impl(torch.device("cuda"), Tuning(pbs_select="reference")) == "reference"
    assert TI.kv_layout() == "permuted"


# --------------------------------------------------------------------------- no environment switches


def test_no_tuning_environment_variable_is_read():
    pattern = re.compile(r"SPARSEFLOW_(PBS|PISA)_")
    files = [p for d in ("sparseflow", "benchmarks", "tests") for p in (ROOT / d).rglob("*.py")]
    hits = [str(p.relative_to(ROOT)) for p in files if p.name != "test_tuning.py" and pattern.search(p.read_text())]
    assert hits == []
    assert len(files) > 50  # the search looked at the code base


# --------------------------------------------------------------------------- context parallel


def test_context_parallel_receives_the_tuning(monkeypatch):
    from sparseflow import context_parallel as cpm

    got = {}
    monkeypatch.setattr(cpm, "attention", lambda *a, **kw: got.update(kw) or a[0])
    q, k, v = _qkv()
    t = Tuning(pbs_kv_layout="gather")
    sparseflow.attention(q, k, v, config=PBS_SMALL, context_parallel="group", tuning=t)
    assert got["tuning"] is t


@needs_triton
def test_context_parallel_pbs_selection_follows_the_tuning():
    from sparseflow.methods.pbs import context_parallel as cpm

    q = _qkv()[0]
    assert cpm._pbs_kernels(q, Tuning(pbs_select="triton"))
    assert not cpm._pbs_kernels(q, Tuning(pbs_select="reference"))
    assert cpm._pbs_kernels(q) == (DEV == "cuda")  # the default: Triton on CUDA only


def test_from_dict_inverts_to_dict_and_names_unknown_fields():
    t = Tuning(pbs_kv_layout="gather", cuda_graphs=False)
    assert Tuning.from_dict(t.to_dict()) == t
    with pytest.raises(ValueError, match=r"tuning has unknown fields \['warps'\]"):
        Tuning.from_dict({"warps": 4})
    with pytest.raises(TypeError, match="tuning must be a dict, got str"):
        Tuning.from_dict("gather")
