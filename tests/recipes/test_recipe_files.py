"""Recipe files (Recipe.save / load_recipe / from_dict), resolve_recipe, and ``recipe=`` in
sparseflow.compile / sparseflow.export and the ``convert`` / ``eval`` / ``export-onnx`` commands."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

import sparseflow
from sparseflow.config import BSAConfig, PBSConfig
from sparseflow.recipes import RECIPE_FORMAT, Recipe, RecipeError, get_recipe, list_recipes, load_recipe, resolve_recipe
from sparseflow.recipes.smollm2 import PERMUTED_LAYERS

SMOLLM2_LAYERS = 30


def _tiny_recipe(**overrides) -> dict:
    """A recipe file's data fitting conftest's tiny Llama (2 layers, head dim 16)."""
    data = {
        "format": RECIPE_FORMAT,
        "name": "tiny",
        "description": "for the tests' tiny Llama",
        "model_types": ["llama"],
        "configs": {
            "pbs": {"method": "pbs", "block_size": 16, "segment_size": 32, "threshold": 1.0},
            "pisa": {"block_size": 16, "top_k": 64},
        },
        "dense_layers": [0],
        "head_dim": 16,
        "layer_overrides": {"pbs": {"1": {"threshold": 0.99}}},
    }
    data.update(overrides)
    return data


def _write(path: Path, data) -> Path:
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


@pytest.fixture
def tiny_recipe_file(tmp_path) -> Path:
    return _write(tmp_path / "tiny.json", _tiny_recipe())


def _smollm2_like():
    """A tiny random Llama whose config passes the smollm2 recipe's checks (llama, head dim 64,
    30 layers so that every layer the recipe names exists)."""
    tf = pytest.importorskip("transformers")
    cfg = tf.LlamaConfig(
        num_hidden_layers=SMOLLM2_LAYERS,
        hidden_size=64,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=64,
        intermediate_size=32,
        vocab_size=64,
        max_position_embeddings=256,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(cfg).eval()


def _marker(model) -> dict:
    return model._sparseflow_config


# --------------------------------------------------------------------------- the file format


@pytest.mark.parametrize("name", list_recipes())
def test_every_shipped_recipe_round_trips(name, tmp_path):
    r = get_recipe(name)
    assert Recipe.from_dict(r.to_dict()) == r
    path = r.save(tmp_path / f"{name}.json")
    data = json.loads(path.read_text())
    assert data["format"] == RECIPE_FORMAT and data["head_dim"] == r.head_dim
    back = load_recipe(path)
    assert back == r and back.layer_overrides == r.layer_overrides and back.head_dim == r.head_dim
    assert back.label == str(path) and r.label == name
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{name}.json"]  # no temporary file left


def test_save_is_atomic(tmp_path, monkeypatch):
    path = get_recipe("smollm2").save(tmp_path / "r.json")
    before = path.read_text()

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        get_recipe("smollm2-code").save(path)
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


@pytest.mark.parametrize(
    "data, needle",
    [
        ("{not json", "is not valid JSON: "),
        ([1, 2], "a recipe must be a JSON object, got list"),
        (_tiny_recipe(format=2), "format must be 1"),
        (_tiny_recipe(colour="red"), "unknown fields ['colour']"),
        (_tiny_recipe(name=""), "name must be a non-empty string"),
        (_tiny_recipe(model_types="llama"), "model_types must be a non-empty list"),
        (_tiny_recipe(configs={}), "configs must be an object"),
        (_tiny_recipe(configs={"pbs": {"threshold": 2.0}}), "configs.pbs: threshold must be in"),
        (_tiny_recipe(configs={"pbs": {"method": "bsa"}}), "configs.pbs has method 'bsa'"),
        (_tiny_recipe(configs={"pbs": {"colour": 1}}), "configs.pbs: unknown fields for PBSConfig"),
        (_tiny_recipe(configs={"dense": {}}), "unknown method 'dense'"),
        (_tiny_recipe(dense_layers=[-1]), "dense_layers must be a list of non-negative layer indices"),
        (_tiny_recipe(dense_layers=[True]), "dense_layers must be a list of non-negative layer indices"),
        (_tiny_recipe(head_dim=0), "head_dim must be a positive integer or null"),
        (_tiny_recipe(num_layers="2"), "num_layers must be a positive integer or null"),
        (
            _tiny_recipe(layer_overrides={"pbs": {"x": {}}}),
            "layer_overrides.pbs keys must be non-negative layer indices",
        ),
        (_tiny_recipe(layer_overrides={"pbs": {"1": {"colour": 1}}}), "layer_overrides['pbs'][1]"),
        (_tiny_recipe(layer_overrides={"pbs": {"0": {"threshold": 0.9}}}), "layer 0 is dense and has layer_overrides"),
        (_tiny_recipe(layer_overrides={"bsa": {"1": {}}}), "layer_overrides for 'bsa', which has no config"),
        (_tiny_recipe(measured=[1]), "measured must be an object"),
    ],
)
def test_malformed_recipe_file_names_the_file_and_field(tmp_path, data, needle):
    path = _write(tmp_path / "bad.json", data)
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    msg = str(info.value)
    assert msg.startswith(f"recipe file {str(path)!r}"), msg
    assert needle in msg and "\n" not in msg, msg


def test_missing_file_and_folder(tmp_path):
    with pytest.raises(RecipeError, match=r"recipe file '.*nope\.json' does not exist"):
        load_recipe(tmp_path / "nope.json")
    with pytest.raises(RecipeError, match="is a folder"):
        load_recipe(tmp_path)


# --------------------------------------------------------------------------- resolve_recipe


def test_resolve_names_paths_and_none(tiny_recipe_file):
    assert resolve_recipe(None) is None
    assert resolve_recipe("smollm2") is get_recipe("smollm2")
    for spec in (str(tiny_recipe_file), tiny_recipe_file):
        r = resolve_recipe(spec)
        assert r.name == "tiny" and r.label == str(tiny_recipe_file) and r.dense_layers == (0,)
    with pytest.raises(RecipeError, match=r"unknown recipe 'llama9'.*or pass the path of a recipe \.json file"):
        resolve_recipe("llama9")
    with pytest.raises(RecipeError, match="recipe file 'missing.json' does not exist"):
        resolve_recipe("missing.json")
    with pytest.raises(TypeError, match="recipe must be a recipe name"):
        resolve_recipe(3)


def test_resolve_auto(tiny, caplog):
    cfg = _smollm2_like().config
    with caplog.at_level(logging.INFO, logger="sparseflow"):
        r = resolve_recipe("auto", cfg)
    # smollm2 and smollm2-code share their model checks: the first by name is taken, and said
    assert r is get_recipe("smollm2")
    assert "recipes ['smollm2', 'smollm2-code'] fit the model; using 'smollm2'" in caplog.text
    assert resolve_recipe(" AUTO ", cfg) is r
    assert resolve_recipe("auto", tiny("llama").config) is None  # head dim 16
    assert resolve_recipe("auto", tiny("gpt2").config) is None
    assert resolve_recipe("auto", None) is None


def test_auto_needs_every_layer_the_recipe_names(tiny):
    # a Llama with head dim 64 but fewer layers than the recipe's per-layer choices name is not SmolLM2
    tf = pytest.importorskip("transformers")
    cfg = tf.LlamaConfig(num_hidden_layers=4, hidden_size=64, num_attention_heads=1, head_dim=64)
    assert resolve_recipe("auto", cfg) is None
    with pytest.raises(RecipeError, match=r"layer_overrides\['pbs'\] name layers \[4, 5"):
        get_recipe("smollm2").check_model(cfg)


# --------------------------------------------------------------------------- compile / export


def test_compile_auto_applies_the_matching_recipe(caplog):
    model = _smollm2_like()
    with caplog.at_level(logging.INFO, logger="sparseflow"):
        sparseflow.compile(model, method="pbs", inner_backend="eager")
    assert "recipe 'smollm2' applied: pbs" in caplog.text
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 16)), use_cache=False)
    rep = sparseflow.report(model)
    assert rep.recipe == "smollm2" and rep.to_dict()["recipe"] == "smollm2"
    assert str(rep).startswith("sparseflow rewrite report: method=pbs backend=auto recipe=smollm2 - ")
    by_layer = {e.layer: e for e in rep.entries}
    assert sorted(by_layer) == list(range(SMOLLM2_LAYERS))
    assert not by_layer[0].rewritten and "layer_configs[0] is None" in by_layer[0].reason
    recipe_cfg = get_recipe("smollm2").config_for("pbs")
    assert rep.config == recipe_cfg.to_dict()
    for i in range(1, SMOLLM2_LAYERS):
        want = recipe_cfg.replace(permute=i in PERMUTED_LAYERS).to_dict()
        assert by_layer[i].rewritten and by_layer[i].config == want, i
    assert by_layer[2].config["permute"] is False and by_layer[1].config["permute"] is True


def test_compile_recipe_none_opts_out():
    model = sparseflow.compile(_smollm2_like(), method="pbs", inner_backend="eager", recipe=None)
    marker = _marker(model)
    assert marker["recipe"] is None and marker["layer_configs"] == {} and marker["skip_layers"] == []
    assert marker["config"] == PBSConfig().to_dict()
    rep = sparseflow.report(model)
    assert rep.recipe is None and "recipe=none" in str(rep)


def test_compile_user_config_and_layers_win_over_the_recipe():
    user = PBSConfig(threshold=0.9, scoring="antidiagonal")
    model = sparseflow.compile(_smollm2_like(), method="pbs", config=user, inner_backend="eager")
    marker = _marker(model)
    assert marker["recipe"] == "smollm2" and marker["config"] == user.to_dict()
    assert marker["layer_configs"][0] is None  # the recipe's dense layer
    assert marker["layer_configs"][1] == user.replace(permute=True).to_dict()  # its override on the user's base
    assert 2 not in marker["layer_configs"]

    bsa = BSAConfig(block_size=16, top_k=4)
    model = sparseflow.compile(
        _smollm2_like(), method="pbs", inner_backend="eager", skip_layers=iter([3]), layer_configs={0: bsa, 1: None}
    )
    marker = _marker(model)
    assert marker["skip_layers"] == [3] and 3 not in marker["layer_configs"]
    assert marker["layer_configs"][0] == bsa.to_dict() and marker["layer_configs"][1] is None
    assert marker["layer_configs"][4]["permute"] is True  # layers the user did not name keep the recipe's


def test_explicit_recipe_lacking_the_method_or_not_fitting_raises(tmp_path, tiny):
    path = _write(tmp_path / "pbs_only.json", _tiny_recipe(configs={"pbs": _tiny_recipe()["configs"]["pbs"]}))
    with pytest.raises(ValueError, match=rf"recipe '{path}' has no 'bsa' settings; it covers \['pbs'\]"):
        sparseflow.compile(tiny("llama"), method="bsa", recipe=str(path))
    with pytest.raises(ValueError, match="recipe 'smollm2' has no 'dense' settings"):
        sparseflow.compile(tiny("llama"), method="dense", recipe="smollm2")
    with pytest.raises(RecipeError, match="expects head_dim=64, but the model has 16"):
        sparseflow.compile(tiny("llama"), method="pbs", recipe="smollm2")
    with pytest.raises(RecipeError, match="unknown recipe 'nope'"):
        sparseflow.compile(tiny("llama"), method="pbs", recipe="nope")


def test_auto_skips_a_recipe_lacking_the_method_and_logs_no_match(tiny, caplog):
    with caplog.at_level(logging.INFO, logger="sparseflow"):
        model = sparseflow.compile(_smollm2_like(), method="dense", inner_backend="eager")
    assert _marker(model)["recipe"] is None
    assert "'smollm2' fits the model but has no 'dense' settings" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sparseflow"):
        model = sparseflow.compile(tiny("llama"), method="pbs", inner_backend="eager")
    assert _marker(model)["recipe"] is None and _marker(model)["layer_configs"] == {}
    assert "recipe='auto': no shipped recipe fits this model" in caplog.text


def test_export_with_a_recipe_file(tiny, tiny_recipe_file):
    ids = torch.randint(0, 128, (1, 64))
    ep = sparseflow.export(tiny("llama"), (ids,), {"use_cache": False}, method="pbs", recipe=str(tiny_recipe_file))
    rep = sparseflow.report(ep)
    assert rep.recipe == str(tiny_recipe_file) and rep.to_dict()["recipe"] == str(tiny_recipe_file)
    by_layer = {e.layer: e for e in rep.entries}
    assert not by_layer[0].rewritten and by_layer[1].config["threshold"] == 0.99
    assert rep.config["block_size"] == 16


# --------------------------------------------------------------------------- command line


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """conftest's tiny Llama (2 layers, head dim 16) saved with a character tokenizer."""
    pytest.importorskip("transformers")
    import conftest
    from test_convert import _char_tokenizer

    folder = tmp_path_factory.mktemp("tiny_llama_recipe")
    conftest.make_tiny("llama", layers=2).save_pretrained(folder)
    _char_tokenizer().save_pretrained(folder)
    return folder


def _one_line_error(capsys, command: str, *needles: str) -> None:
    err = capsys.readouterr().err.strip()
    errors = [line for line in err.splitlines() if "error" in line.lower()]  # progress lines may precede it
    assert len(errors) == 1 and "Traceback" not in err, err
    err = errors[0]
    assert err.startswith(f"sparseflow {command}: error: "), err
    for n in needles:
        assert n in err, err


def test_cli_convert_with_a_recipe_file(llama_folder, tiny_recipe_file, tmp_path):
    from sparseflow.cli import main

    out = tmp_path / "conv"
    assert (
        main(["convert", str(llama_folder), "--method", "pbs", "--recipe", str(tiny_recipe_file), "--out", str(out)])
        == 0
    )
    plan = json.loads((out / "config.json").read_text())["sparseflow"]
    assert plan["recipe"] == str(tiny_recipe_file) and plan["dense_layers"] == [0]
    assert plan["config"]["block_size"] == 16 and plan["layer_configs"]["1"]["threshold"] == 0.99


def test_cli_eval_with_a_recipe_file(llama_folder, tiny_recipe_file, tmp_path, capsys):
    from sparseflow.cli import main

    out = tmp_path / "eval.json"
    assert (
        main(
            [
                "eval",
                str(llama_folder),
                "--method",
                "pbs",
                "--recipe",
                str(tiny_recipe_file),
                "--tokens",
                "64",
                "--eval-positions",
                "16",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())["results"][0]
    assert result["plan"]["recipe"] == str(tiny_recipe_file) and result["plan"]["dense_layers"] == [0]
    assert result["density_per_layer"][0] == 1.0


def test_cli_export_onnx_with_a_recipe_file(llama_folder, tiny_recipe_file, tmp_path, capsys):
    pytest.importorskip("onnxscript")
    from sparseflow.cli import main

    out = tmp_path / "m.onnx"
    assert (
        main(
            [
                "export-onnx",
                str(llama_folder),
                "--method",
                "pbs",
                "--recipe",
                str(tiny_recipe_file),
                "--tokens",
                "48",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    # layer 0 (the recipe's dense layer) stays plain attention: one sparseflow node, layer 1's
    assert ": 1 PBSAttention node(s)," in printed, printed


@pytest.mark.parametrize("command", ["convert", "eval", "export-onnx"])
def test_cli_malformed_recipe_file_is_one_line_before_loading(command, llama_folder, tmp_path, capsys, monkeypatch):
    from sparseflow import convert as convert_mod
    from sparseflow.cli import main

    def refuse(*a, **k):
        raise AssertionError("the weights were loaded before the recipe was checked")

    monkeypatch.setattr(convert_mod, "load_source", refuse)
    bad = _write(tmp_path / "bad.json", _tiny_recipe(configs={"pbs": {"threshold": 2.0}}))
    out = {"convert": ["--out", str(tmp_path / "o")], "eval": [], "export-onnx": ["--out", str(tmp_path / "m.onnx")]}
    args = [command, str(llama_folder), "--method", "pbs", "--recipe", str(bad)] + out[command]
    assert main(args) == 2
    _one_line_error(capsys, command, str(bad), "configs.pbs: threshold must be in")
    assert (
        main([command, str(llama_folder), "--method", "pbs", "--recipe", str(tmp_path / "gone.json")] + out[command])
        == 2
    )
    _one_line_error(capsys, command, "gone.json' does not exist")
    assert not (tmp_path / "o").exists() and not (tmp_path / "m.onnx").exists()


def test_cli_recipe_without_method_is_an_error(llama_folder, tiny_recipe_file, capsys):
    from sparseflow.cli import main

    assert main(["eval", str(llama_folder), "--recipe", str(tiny_recipe_file)]) == 2
    _one_line_error(capsys, "eval", "applies to --method: pass --method too")
