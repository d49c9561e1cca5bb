"""A method registered from outside the package reaches everything a built-in one does: its op,
the rewrite pass, the CLI's method lists and the property suite. The registry is the only door:
registering a spec is all it takes (issue 50).

The toy is BSA's full scan under another name (its config a BSA config with another ``method``),
so each of its results has a built-in one to equal.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

import sparseflow
from sparseflow import BSAConfig, ops
from sparseflow.methods import Backend, MethodSpec, OnnxBody, names, register, unregister
from sparseflow.methods.registry import BenchPart
from sparseflow.methods.topk import TOPK_ONNX_FIELDS
from sparseflow.testing import assert_rewrite_equivalent
from sparseflow.testing.pytest_plugin import _registered_methods


@dataclass(frozen=True)
class ToyConfig(BSAConfig):
    method: ClassVar[str] = "toy"


SPEC = MethodSpec(
    name="toy",
    config_type=ToyConfig,
    backends={"reference": Backend("sparseflow.methods.bsa.reference:bsa_attention", differentiable="always")},
    onnx=OnnxBody(node_type="ToyAttention", mask="sparseflow.methods.bsa.onnx:MASK", fields=TOPK_ONNX_FIELDS),
    has_top_k=True,
    estimate_cost=lambda cfg: 0.01,
    # a part of its own, and a timing beside BSA's in PISA's part (one shape: one dense baseline)
    bench=BenchPart("toy.py", checks=(ToyConfig(block_size=32, top_k=4),), timings=((ToyConfig(), (4096, 32, 2, 64)),)),
)
SMALL = dict(block_size=16, top_k=3)


@pytest.fixture(scope="module")
def toy():
    register(SPEC)
    try:
        yield SPEC
    finally:
        unregister("toy")


def _qkv(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, h, n, 16, generator=g) for h in (4, 2, 2))


def test_the_op(toy):
    q, k, v = _qkv()
    assert ops.op_for("toy")._schema.name == "sparseflow::toy_attention"
    got = sparseflow.attention(q, k, v, config=ToyConfig(**SMALL), backend="reference")
    want = sparseflow.attention(q, k, v, config=BSAConfig(**SMALL), backend="reference")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    with sparseflow.capture() as cap:
        sparseflow.attention(q, k, v, config=ToyConfig(**SMALL), backend="reference")
    assert [(c.method, c.sparse) for c in cap.calls] == [("toy", True)]


def test_the_rewrite(toy, plain_attention):
    x = torch.randn(1, 64, 48)
    base = plain_attention()
    toyed, bsa = copy.deepcopy(base), copy.deepcopy(base)
    sparseflow.compile(toyed, method="toy", config=ToyConfig(**SMALL), backend="reference")
    sparseflow.compile(bsa, method="bsa", config=BSAConfig(**SMALL), backend="reference")
    with torch.no_grad():
        torch.testing.assert_close(toyed(x), bsa(x))
    report = sparseflow.report(toyed)
    assert {e.method for e in report.entries if e.rewritten} == {"toy"}


def test_the_cli_lists(toy):
    from sparseflow.cli import build_parser

    for argv in (
        ["convert", "model", "--method", "toy", "--out", "out"],
        ["calibrate", "model", "--method", "toy", "--kl-budget", "0.01", "--out", "plan.json"],
        ["export-onnx", "model", "--method", "toy", "--out", "m.onnx"],
    ):
        assert build_parser().parse_args(argv).method == "toy"


def test_the_property_suite(toy, plain_attention):
    assert "toy" in _registered_methods() and "toy" in names()
    assert_rewrite_equivalent(plain_attention(), (torch.randn(1, 64, 48),), method="toy")


def test_the_bench_parts(toy, tmp_path):
    from sparseflow import bench

    checks, timings = bench.parts()["toy.py"]
    assert [c.method for c in checks] == ["toy"] and [(list(m), s.n) for m, s in timings] == [(["toy"], 4096)]
    result = bench.run_part("toy.py", tmp_path / "toy.json", device="cpu", backend="reference", reps=1, max_n=96)
    assert result["ok"] and [r["method"] for r in result["check"]] == ["toy", "toy"]
    # the built-in parts are unchanged by it
    assert [c.method for c in bench.parts()["pisa.py"][0]] == ["pisa", "bsa"]


def test_a_second_method_of_the_same_name_must_bring_the_same_op(toy):
    @dataclass(frozen=True)
    class OtherToy(sparseflow.PISAConfig):  # other fields: another op schema
        method: ClassVar[str] = "toy2"

    register(MethodSpec(**{**_spec_fields(), "name": "toy2", "config_type": ToyConfig2}))
    unregister("toy2")
    with pytest.raises(ValueError, match="sparseflow::toy2_attention is already defined in this process"):
        register(MethodSpec(**{**_spec_fields(), "name": "toy2", "config_type": OtherToy}))
    assert "toy2" not in names()  # the refused registration left nothing behind


@dataclass(frozen=True)
class ToyConfig2(BSAConfig):
    method: ClassVar[str] = "toy2"


def _spec_fields():
    return dict(backends=SPEC.backends, onnx=SPEC.onnx, has_top_k=True, estimate_cost=SPEC.estimate_cost)


def test_a_bench_part_is_checked_when_made():
    with pytest.raises(ValueError, match="BenchPart.script"):
        BenchPart("toy", checks=(ToyConfig(),))
    with pytest.raises(TypeError, match="AttentionConfig"):
        BenchPart("toy.py", checks=({"top_k": 4},))
    with pytest.raises(ValueError, match=r"\(n, hq, hkv, d\)"):
        BenchPart("toy.py", timings=((ToyConfig(), (4096, 32, 2)),))
    with pytest.raises(TypeError, match="bench must be a BenchPart"):
        MethodSpec(**{**_spec_fields(), "name": "toy", "config_type": ToyConfig, "bench": "toy.py"})
