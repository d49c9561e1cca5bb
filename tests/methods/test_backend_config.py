"""Every backend takes the method's config object; keyword fields are the config's, validated by it."""

import importlib

import pytest
import torch

from sparseflow import BSAConfig, PBSConfig, PISAConfig
from sparseflow.methods import registry

CASES = [
    ("pbs", PBSConfig(block_size=16, segment_size=32)),
    ("pisa", PISAConfig(block_size=16, top_k=3)),
    ("bsa", BSAConfig(block_size=16, top_k=3)),
]


def _qkv():
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, h, 64, 16, generator=g) for h in (4, 2, 2))


def _reference(method):
    module, fn = registry.spec_for(method).backends["reference"].target.split(":")
    return getattr(importlib.import_module(module), fn)


@pytest.mark.parametrize("method,cfg", CASES, ids=[m for m, _ in CASES])
def test_config_object_and_keyword_fields_agree(method, cfg):
    impl = _reference(method)
    q, k, v = _qkv()
    by_config = impl(q, k, v, cfg)
    fields = {f: x for f, x in cfg.to_dict().items() if f not in ("method", "version", "min_seq_len")}
    by_fields = impl(q, k, v, **fields)
    torch.testing.assert_close(by_config, by_fields, rtol=0, atol=0)


@pytest.mark.parametrize("method,cfg", CASES, ids=[m for m, _ in CASES])
def test_keyword_fields_override_the_config(method, cfg):
    impl = _reference(method)
    q, k, v = _qkv()
    exact = registry.spec_for(method).exact(cfg, 64)
    changed = {f: getattr(exact, f) for f in ("threshold", "top_k") if hasattr(cfg, f)}
    torch.testing.assert_close(impl(q, k, v, cfg, **changed), impl(q, k, v, exact), rtol=0, atol=0)


def test_unknown_field_is_a_type_error_naming_it():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="top_k"):
        _reference("pbs")(q, k, v, top_k=4)


def test_wrong_config_type_is_a_type_error():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="PBSConfig"):
        _reference("pbs")(q, k, v, BSAConfig())


def test_field_values_are_validated_by_the_config():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="top_k"):
        _reference("bsa")(q, k, v, top_k=0)


def test_config_field_defaults_are_not_redeclared_in_the_method_folders():
    # a parameter named like a config field takes the config's default from the config class, not
    # from a copy of the literal (a function whose own default differs, e.g. an estimate that
    # defaults to the scoring it implements, is not a copy)
    import ast
    import dataclasses
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "sparseflow" / "methods"
    found = []
    for method, cls in (("pbs", PBSConfig), ("pisa", PISAConfig), ("bsa", BSAConfig)):
        fields = {f.name: f.default for f in dataclasses.fields(cls)}
        for path in (root / method).glob("*.py"):
            if path.name == "config.py":
                continue
            for fn in ast.walk(ast.parse(path.read_text())):
                if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                a = fn.args
                pos = a.posonlyargs + a.args
                pairs = list(zip(pos[len(pos) - len(a.defaults) :], a.defaults)) + list(
                    zip(a.kwonlyargs, a.kw_defaults)
                )
                found += [
                    f"{path.name}:{fn.name}({arg.arg}={ast.unparse(d)})"
                    for arg, d in pairs
                    if arg.arg in fields and isinstance(d, ast.Constant) and d.value == fields[arg.arg]
                ]
    assert not found, found
