"""The method registry (sparseflow.methods): lookups, errors, the fields the core reads from every
spec, and a method registered from outside the package resolving through the core."""

import argparse
import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from sparseflow import calibrate, context_parallel, op_backends, op_plan, option_checks, ops
from sparseflow.config import METHODS, BSAConfig, DenseConfig, PBSConfig, PISAConfig
from sparseflow.methods import (
    Backend,
    MethodSpec,
    OnnxBody,
    names,
    names_with,
    register,
    sparse_names,
    spec_for,
    specs,
    unregister,
)
from sparseflow._tuning_base import MethodTuning, check_choice, choice_field
from sparseflow.methods.pbs.tuning import PBSTuning
from sparseflow.methods.registry import TOKEN_CHUNKS, load_target, or_list
from sparseflow.tuning import DEFAULT_TUNING, Tuning, fields_of


# --------------------------------------------------------------------------- lookups


@pytest.mark.parametrize("name, cls", list(METHODS.items()))
def test_lookup_by_name_config_and_type(name, cls):
    spec = spec_for(name)
    assert spec.name == name and spec.config_type is cls
    assert spec_for(cls()) is spec and spec_for(cls) is spec


def test_registry_holds_exactly_the_config_methods():
    assert names() == tuple(METHODS)
    assert names_with("sparse") == ("pbs", "pisa", "bsa")
    assert names_with("has_top_k") == ("pisa", "bsa")
    assert names_with("has_permute") == names_with("has_threshold") == ("pbs",)
    assert names_with("supports_decode") == ("pisa",)


def test_unknown_method_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown method 'nope'; known methods: \['dense', 'pbs', 'pisa', 'bsa'\]"):
        spec_for("nope")


def test_unregistered_config_type_and_wrong_type():
    @dataclass(frozen=True)
    class Stray(BSAConfig):
        method: ClassVar[str] = "stray"

    with pytest.raises(ValueError, match="config type Stray is not registered; registered: .*BSAConfig"):
        spec_for(Stray())
    with pytest.raises(TypeError, match="spec_for takes a method name, a config or a config class, got int"):
        spec_for(3)


def test_unknown_backend_names_the_available_ones():
    with pytest.raises(
        ValueError,
        match=r"backend='cuda' is not available for method 'pbs'; available: "
        r"\['flex', 'reference', 'triton', 'auto'\]",
    ):
        spec_for("pbs").backend("cuda")


def test_unknown_capability():
    with pytest.raises(ValueError, match="capability must be one of"):
        names_with("has_wings")


def test_or_list():
    assert or_list(["pbs"]) == "pbs" and or_list(["pbs", "pisa", "bsa"]) == "pbs, pisa or bsa"


# --------------------------------------------------------------------------- what the core reads


@pytest.mark.parametrize("spec", specs(), ids=lambda s: s.name)
def test_every_spec_has_what_the_core_needs(spec):
    assert ops.op_for(spec.name) is not None  # an op per registered method
    assert callable(context_parallel.strategy_of(spec.name))
    text = spec.onnx.mask_text()
    assert isinstance(text, str) and "allowed5" in text and "cfg_ok" in text
    # every option of the config has an ONNX body: the default config exports
    assert spec.onnx.refuse(spec.config_type()) == ""
    assert spec.dense_rule(spec.config_type(), 4096, 4096) == ""
    assert spec.exact_config(spec.config_type(), 512).exact or spec.has_top_k
    if not spec.sparse:  # the dense method's backends run windowed calls only
        assert all(b.windows for b in spec.backends.values()) and spec.decode is None
        return
    # the backward recomputes through the reference when a backend is not differentiable
    assert "reference" in spec.backends and spec.backends["reference"].differentiable == "always"
    for backend in spec.backends.values():
        module = backend.target.split(":")[0]
        assert importlib.util.find_spec(module) is not None, backend.target
    # calibration's density cost model: the selection costs a small share of a dense call
    assert 0.0 < spec.estimate_cost(spec.config_type()) < 0.2
    if spec.selection_densities is not None:
        assert callable(load_target(spec.selection_densities))
    assert callable(spec.backend("reference").load())
    if spec.decode is not None:
        assert spec.decode.backend in spec.backends and callable(spec.decode.load())


@pytest.mark.parametrize("name", ["pbs", "pisa", "bsa"])
@pytest.mark.parametrize("window", [0, 80])
def test_a_methods_selection_is_the_one_its_reference_attention_reports(name, window):
    # the registry's selection (what sparseflow.eval measures) against the reference's return_selection,
    # with padding and a local window; a small block so several are skipped
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, 200, 16, generator=g) for h in (4, 2, 2))
    pad = torch.ones(2, 200, dtype=torch.bool)
    pad[1, 170:] = False
    spec = spec_for(name)
    fields = {"pbs": dict(segment_size=32, threshold=0.7, dense_tail_blocks=1)}.get(name, dict(top_k=3))
    cfg = spec.config_type(block_size=16, sliding_window=window, **fields)
    call = dict(key_padding_mask=pad, is_causal=True, scale=0.3)
    got = spec.select(q, k, cfg, **call)
    _, want = spec.backend("reference").load()(q, k, v, cfg, return_selection=True, **call)
    assert got.method == want.method == name and got.sliding_window == window
    assert torch.equal(got.key_mask(4), want.key_mask(4))
    assert torch.equal(got.density, want.density) and float(got.density.mean()) < 0.95
    with pytest.raises(ValueError, match="'dense' selects no blocks"):
        spec_for("dense").select(q, k, spec_for("dense").config_type())


def test_selection_tolerance_checks_come_from_the_registry():
    from sparseflow.testing import check_pisa_selection, check_selection_tolerance

    assert [n for n in ("pbs", "pisa", "bsa") if spec_for(n).selection_check] == ["pisa"]
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 2, 40, 8, generator=g), torch.randn(1, 1, 40, 8, generator=g)
    with pytest.raises(ValueError, match="'bsa' states no selection tolerance"):
        check_selection_tolerance("bsa", q, k)
    trace = load_target("sparseflow.methods.pisa.tolerance_check:walk_trace")(q, k, block_size=4, top_k=3)
    fields = dict(block_size=4, top_k=3, delta=0.0)
    assert (
        check_pisa_selection(q, k, trace, **fields).ok and check_selection_tolerance("pisa", q, k, trace, **fields).ok
    )
    trace[0][..., -1, 0] = trace[0][..., -1, 1]  # a node kept twice
    with pytest.raises(AssertionError, match="pisa selection breaks the"):
        check_selection_tolerance("pisa", q, k, trace, **fields)


def test_context_parallel_strategies_come_from_the_registry():
    # the core's own strategy unless the method names one in its folder
    assert context_parallel.strategy_of("bsa") is context_parallel.strategy_of("pisa")
    pbs = context_parallel.strategy_of("pbs")
    assert pbs.__module__ == "sparseflow.methods.pbs.context_parallel"
    assert spec_for("pisa").context_parallel == TOKEN_CHUNKS
    with pytest.raises(ValueError, match="context_parallel"):
        dataclasses.replace(spec_for("bsa"), context_parallel="shared_rows")


def test_top_k_exact_config_covers_every_block():
    cfg = spec_for("pisa").exact_config(PISAConfig(block_size=64, top_k=4), 1000)
    assert cfg.top_k == 16  # ceil(1000 / 64)
    assert spec_for("pbs").exact_config(PBSConfig(threshold=0.5), 1000).threshold == 1.0
    assert spec_for("dense").exact_config(DenseConfig(), 1000) == DenseConfig()


def test_pbs_dense_rule_and_onnx_refusals():
    rule = spec_for("pbs").dense_rule
    assert "prefill method (Nq=1, Nk=512" in rule(PBSConfig(), 1, 512)
    assert "sequence length 128 < segment_size=256" in rule(PBSConfig(), 128, 128)
    refuse = spec_for("pbs").onnx.refuse
    assert "implements scoring 'mean' and 'antidiagonal', got scoring='sampled_rows'" in refuse(
        PBSConfig(scoring="sampled_rows")
    )
    assert "does not implement the config field(s) ['proxy_blocks']" in refuse(PBSConfig(proxy_blocks=2))


def test_onnx_refuses_a_field_its_body_does_not_list():
    body = dataclasses.replace(spec_for("pisa").onnx, fields=spec_for("pisa").onnx.fields - {"beam"})
    assert "does not implement the config field(s) ['beam']" in body.refuse(PISAConfig())


def test_implementations_view_is_read_only_and_live():
    assert ops.IMPLEMENTATIONS[("bsa", "reference")] == "sparseflow.methods.bsa.reference:bsa_attention"
    assert ("dense", "flex") in ops.IMPLEMENTATIONS and "pbs" not in ops.IMPLEMENTATIONS  # dense: window backends
    assert len(ops.IMPLEMENTATIONS) == sum(len(s.backends) for s in specs())
    with pytest.raises(TypeError):
        ops.IMPLEMENTATIONS[("bsa", "reference")] = "x:y"  # type: ignore[index]


def test_spec_backends_are_read_only():
    with pytest.raises(TypeError):
        spec_for("bsa").backends["cuda"] = Backend("a:b")  # type: ignore[index]


# --------------------------------------------------------------------------- registering


@dataclass(frozen=True)
class _FakeConfig(BSAConfig):
    method: ClassVar[str] = "fake"


def _fake_spec(**changes) -> MethodSpec:
    fields = dict(
        name="fake",
        config_type=_FakeConfig,
        backends={"reference": Backend("sparseflow.methods.bsa.reference:bsa_attention", differentiable="always")},
        onnx=OnnxBody(node_type="FakeAttention", mask="sparseflow.methods.bsa.onnx:MASK"),
        dense_rule=lambda cfg, n_q, n_k: "fake needs 64 keys" if n_k < 64 else "",
        has_top_k=True,
    )
    return MethodSpec(**{**fields, **changes})


@pytest.fixture
def fake_method():
    spec = register(_fake_spec())
    try:
        yield spec
    finally:
        unregister("fake")


def test_a_fourth_method_resolves_through_the_core(fake_method):
    # (its torch op is not defined: ops are defined at import for the methods sparseflow.methods registers)
    cfg = _FakeConfig(block_size=16, top_k=4)
    assert spec_for("fake") is fake_method and spec_for(cfg) is fake_method
    assert spec_for(BSAConfig()).name == "bsa"  # the subclass did not shadow its base
    assert ops.IMPLEMENTATIONS[("fake", "reference")] == fake_method.backends["reference"].target
    cpu = torch.device("cpu")
    assert op_backends.resolve_backend("fake", "reference", cpu) == "reference"
    with pytest.raises(ValueError, match=r"not available for method 'fake'; available: \['reference', 'auto'\]"):
        option_checks.check_backend("fake", "flex")
    assert op_plan.dense_reason("fake", cfg, 32, 32, True) == "fake needs 64 keys"
    assert op_backends.grad_backend("fake", "reference", cpu) == "reference"
    # it runs: the implementation the spec names, with the config's keyword arguments
    q, k, v = (torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    impl = op_backends.load("fake", "reference")
    kwargs = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "min_seq_len"}
    got = impl(q, k, v, key_padding_mask=None, is_causal=True, scale=None, return_selection=False, **kwargs)
    want = ops.bsa_attention(q, k, v, config=BSAConfig(block_size=16, top_k=4), backend="reference")
    torch.testing.assert_close(got, want)
    assert [c.key for c in calibrate.candidate_choices("fake", cfg, top_ks=(4, 8))] == ["top_k=4", "top_k=8"]
    assert calibrate.estimate_overhead(cfg) == 0.0  # no estimate_cost in its spec: nothing added


@dataclass(frozen=True)
class _TunedConfig(BSAConfig):
    method: ClassVar[str] = "tuned"


@dataclass(frozen=True)
class _TunedTuning(MethodTuning):
    method: ClassVar[str] = "tuned"

    knob: str = choice_field("a", "str")

    def __post_init__(self):
        check_choice(self.label("knob"), self.knob, ("a", "b"))


def test_a_method_brings_its_own_tuning_options():
    register(_fake_spec(name="tuned", config_type=_TunedConfig, tuning_type=_TunedTuning))
    try:
        t = Tuning(tuned_knob="b", pbs_select="triton")
        assert t.tuned_knob == "b" and t.of("tuned") == _TunedTuning(knob="b") and t.pbs_select == "triton"
        assert Tuning(tuned=_TunedTuning(knob="b"), pbs_select="triton") == t
        assert fields_of("tuned") == (("tuned_knob", "str"), ("cuda_graphs", "bool"))
        assert "str tuned_knob, bool cuda_graphs, str backend" in str(ops.op_for("tuned")._schema)
        assert DEFAULT_TUNING.tuned_knob == "a"  # a tuning made before the method came: its default
        assert Tuning.from_dict(t.to_dict()) == t
        with pytest.raises(ValueError, match=r"Tuning.tuned_knob must be one of \['a', 'b'\], got 'c'"):
            Tuning(tuned_knob="c")
    finally:
        unregister("tuned")
    with pytest.raises(TypeError, match="unexpected keyword argument 'tuned_knob'"):
        Tuning(tuned_knob="b")  # gone with its method
    with pytest.raises(TypeError, match="tuning_type must be a sparseflow.tuning.MethodTuning subclass"):
        _fake_spec(tuning_type=PBSTuning)  # another method's options


def test_unregister_leaves_nothing_behind(fake_method):
    unregister("fake")
    try:
        assert "fake" not in names() and ("fake", "reference") not in ops.IMPLEMENTATIONS
        with pytest.raises(ValueError, match="unknown method 'fake'"):
            spec_for("fake")
        with pytest.raises(ValueError, match="config type _FakeConfig is not registered"):
            spec_for(_FakeConfig())
    finally:
        register(fake_method)  # the fixture unregisters it


def test_register_refuses_taken_names_and_types(fake_method):
    with pytest.raises(ValueError, match="method 'fake' is already registered; unregister it first"):
        register(_fake_spec())
    with pytest.raises(ValueError, match="method 'bsa' is already registered"):
        register(spec_for("bsa"))
    with pytest.raises(TypeError, match="register takes a MethodSpec, got str"):
        register("fake")


@pytest.mark.parametrize(
    "changes, error, message",
    [
        (dict(name="fake method"), ValueError, "MethodSpec.name must be an identifier"),
        (dict(name="other"), ValueError, "config_type _FakeConfig.method is 'fake'; they must agree"),
        (dict(config_type=dict), TypeError, "config_type must be an AttentionConfig subclass"),
        (dict(backends={"reference": "a:b"}), TypeError, "backends must map backend names to Backend objects"),
        (dict(sparse=False), ValueError, r"a dense .sparse=False. method runs SDPA; its backends .windows=True. run"),
        (dict(context_parallel="ring"), ValueError, "context_parallel"),
        (dict(selection_densities="no_colon"), ValueError, "selection_densities must be a 'module:attribute' string"),
        (dict(selection="no_colon"), ValueError, "selection must be a 'module:attribute' string"),
        (dict(selection_check="no_colon"), ValueError, "selection_check must be a 'module:attribute' string"),
    ],
)
def test_spec_validation(changes, error, message):
    with pytest.raises(error, match=message):
        _fake_spec(**changes)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: Backend("no_colon"), "Backend.target must be a 'module:attribute' string"),
        (lambda: Backend("a:b", differentiable="sometimes"), "Backend.differentiable must be one of"),
        (lambda: OnnxBody(node_type="X", mask=":MASK"), "OnnxBody.mask must be a 'module:attribute' string"),
    ],
)
def test_part_validation(build, message):
    with pytest.raises(ValueError, match=message):
        build()


# --------------------------------------------------------------------------- the core's method lists


def _subcommand(name: str) -> argparse.ArgumentParser:
    from sparseflow.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices[name]


@pytest.mark.parametrize("command", ["bench", "demo"])
def test_cli_method_defaults_are_the_registrys(fake_method, command):
    # the parser is built after "fake" registered: its default and its help name it
    parser = _subcommand(command)
    assert "fake" in sparse_names()
    assert parser.parse_args([]).methods == list(sparse_names())
    assert ",".join(sparse_names()) in parser.format_help()


def test_bench_and_evaluation_default_to_the_sparse_methods():
    from conftest import make_tiny
    from sparseflow.bench import BenchShape, op_timings
    from sparseflow.eval.evaluate import evaluate_methods

    rows = op_timings([BenchShape(32, hq=2, hkv=1, d=8)], backends=["reference"], reps=1)
    assert [r["method"] for r in rows] == list(sparse_names())
    ids = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    results = evaluate_methods(make_tiny("llama", layers=1).eval(), ids, eval_positions=4, backend="reference")
    assert [r.method for r in results] == list(sparse_names())


def test_the_pytest_plugin_yields_every_registered_method(fake_method, sparseflow_methods):
    # (sparseflow_methods: the fixture of sparseflow.testing.pytest_plugin, loaded by its entry point)
    assert sparseflow_methods == list(names()) and "fake" in sparseflow_methods
