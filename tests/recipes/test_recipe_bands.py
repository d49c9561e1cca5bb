"""Recipes with settings for longer prompts (``Recipe.longer``): checked, saved and read back, and
picked by a call's key count in ``sparseflow.compile`` (a guard on a symbolic length), in a
converted model's plan (``Plan.longer``) and in ``sparseflow convert``."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

import sparseflow
from sparseflow.config import PBSConfig
from sparseflow.hf import Plan
from sparseflow.recipes import Recipe, RecipeError, load_recipe

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "results")

BAND = 96  # where the tests' band for longer prompts starts (keys)


def _recipe(threshold: float, name: str, **kw) -> Recipe:
    """A recipe for conftest's tiny Llama (2 layers, head dim 16)."""
    return Recipe(
        name=name,
        description=f"threshold {threshold}",
        model_types=("llama",),
        configs={"pbs": PBSConfig(block_size=16, segment_size=32, threshold=threshold)},
        head_dim=16,
        **kw,
    )


SHORT = _recipe(1.0, "short", dense_layers=(0,))
LONG = _recipe(0.3, "long", layer_overrides={"pbs": {0: {"threshold": 0.5}}})
BANDED = _recipe(1.0, "banded", dense_layers=(0,), longer=((BAND, LONG),))


def test_for_tokens_picks_the_last_band_reached():
    three = _recipe(1.0, "three", longer=((BAND, LONG), (4 * BAND, _recipe(0.2, "longest"))))
    assert [three.for_tokens(n, "pbs").name for n in (1, BAND - 1, BAND, 4 * BAND - 1, 4 * BAND, 10**6)] == [
        "three",
        "three",
        "long",
        "long",
        "longest",
        "longest",
    ]
    assert SHORT.for_tokens(10**6, "pbs") is SHORT
    built = _recipe(1.0, "three").with_longer(BAND, LONG).with_longer(4 * BAND, three.longer[1][1])
    assert built == three
    with pytest.raises(RecipeError, match=r"increasing integers > 384, got 96"):
        built.with_longer(BAND, LONG)


@pytest.mark.parametrize(
    "longer, match",
    [
        (((0, LONG),), r"increasing integers > 0, got 0"),
        (((BAND, LONG), (BAND, LONG)), rf"increasing integers > {BAND}, got {BAND}"),
        (((True, LONG),), r"increasing integers > 0, got True"),
        (((BAND, "long"),), r"longer\[96\] must be a Recipe, got 'long'"),
        (((BAND,),), r"longer must hold \(tokens, Recipe\) pairs"),
        (((BAND, BANDED),), r"longer\[96\] has bands of its own"),
    ],
)
def test_bad_bands_are_refused(longer, match):
    with pytest.raises(RecipeError, match=match):
        _recipe(1.0, "bad", longer=longer)


def test_a_band_covers_some_of_the_methods_of_the_same_family():
    from sparseflow.config import BSAConfig

    bsa = BSAConfig(block_size=16, top_k=4)
    two = Recipe(
        name="two", description="", model_types=("llama",), configs={"pbs": PBSConfig(block_size=16), "bsa": bsa}
    )
    with pytest.raises(RecipeError, match=r"must cover some of the methods \['pbs'\].*it has \['bsa', 'pbs'\]"):
        _recipe(1.0, "x", longer=((BAND, two),))
    other = Recipe(name="q", description="", model_types=("qwen2",), configs=LONG.configs)
    with pytest.raises(RecipeError, match=r"model types \['llama'\]; it has \['pbs'\] and \['qwen2'\]"):
        _recipe(1.0, "x", longer=((BAND, other),))
    # a band without settings for a method leaves it on the shorter prompts' settings
    banded = dataclasses.replace(two, longer=((BAND, LONG),))
    assert banded.bands_for("bsa") == () and banded.for_tokens(10**6, "bsa") is banded
    assert banded.plan("bsa").longer == () and banded.plan("pbs").longer[0][1].config.threshold == 0.3


def test_a_banded_recipe_file_reads_back_equal(tmp_path):
    path = BANDED.save(tmp_path / "banded.json")
    data = json.loads(path.read_text())
    assert [b["tokens"] for b in data["longer"]] == [BAND] and data["longer"][0]["recipe"]["name"] == "long"
    assert "longer" not in SHORT.to_dict()  # files without bands keep their old form
    back = load_recipe(path)
    assert back == BANDED and back.for_tokens(BAND, "pbs").configs["pbs"].threshold == 0.3


@pytest.mark.parametrize(
    "longer, match",
    [
        ({"tokens": BAND}, r"longer must be a list"),
        ([{"tokens": BAND}], r"longer\[0\] must be an object \{\"tokens\": int, \"recipe\""),
        ([{"tokens": -1, "recipe": {}}], r"longer\[0\].tokens must be a positive integer, got -1"),
        ([{"tokens": BAND, "recipe": {"name": "long"}}], r"longer\[0\]: model_types must be a non-empty list"),
    ],
)
def test_bad_band_files_name_the_field(tmp_path, longer, match):
    data = {**BANDED.to_dict(), "longer": longer}
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(RecipeError, match=match):
        load_recipe(path)


# --------------------------------------------------------------------------- the user paths


def _save(tmp_path, recipe: Recipe) -> str:
    return str(recipe.save(tmp_path / f"{recipe.name}.json"))


def _forward(model, n: int):
    ids = torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(n))
    with torch.no_grad():
        return model(ids, use_cache=False).logits


@pytest.mark.usefixtures("fresh_dynamo")
def test_compile_runs_each_length_with_its_band(tiny, tmp_path):
    banded = sparseflow.compile(tiny("llama"), method="pbs", inner_backend="eager", recipe=_save(tmp_path, BANDED))
    short = sparseflow.compile(tiny("llama"), method="pbs", inner_backend="eager", recipe=_save(tmp_path, SHORT))
    long = sparseflow.compile(tiny("llama"), method="pbs", inner_backend="eager", recipe=_save(tmp_path, LONG))
    # 32 then 48 tokens: Dynamo's second length makes it symbolic; 160 then crosses the band's
    # start, and 64 comes back below it (the guard the band's choice added sends it to the first graph)
    for n in (32, 48, 160, 64):
        want = long if n >= BAND else short
        other = short if n >= BAND else long
        got = _forward(banded, n)
        assert torch.equal(got, _forward(want, n)), n
        assert not torch.equal(got, _forward(other, n)), n  # the two bands differ at this length
    rep = sparseflow.report(banded)
    noted = [e for e in rep.entries if f"the recipe's settings for {BAND} keys or more" in e.notes]
    assert {e.layer for e in noted} == {0, 1}  # the band has no dense layer: both layers rewritten
    assert all(e.config["threshold"] == (0.5 if e.layer == 0 else 0.3) for e in noted)
    marker = getattr(banded, "_sparseflow_config")
    assert marker["longer"][BAND]["config"]["threshold"] == 0.3 and marker["layer_configs"] == {0: None}


def test_user_settings_win_in_every_band(tiny, tmp_path):
    user = PBSConfig(block_size=16, segment_size=32, threshold=0.9)
    model = sparseflow.compile(
        tiny("llama"),
        method="pbs",
        config=user,
        inner_backend="eager",
        recipe=_save(tmp_path, BANDED),
        layer_configs={1: None},
    )
    marker = getattr(model, "_sparseflow_config")
    band = marker["longer"][BAND]
    assert marker["config"] == user.to_dict() and band["config"] == user.to_dict()
    assert band["layer_configs"] == {0: user.replace(threshold=0.5).to_dict(), 1: None}


def test_plan_bands_round_trip_and_old_plans_still_read():
    plan = BANDED.plan("pbs")
    assert plan.for_keys(BAND - 1) is plan and plan.for_keys(BAND).config.threshold == 0.3
    data = plan.to_dict()
    assert data["format"] == 2 and data["longer"][0]["tokens"] == BAND
    back = Plan.from_dict(json.loads(json.dumps(data)))
    assert back == plan and back.for_keys(BAND).layer_configs[0].threshold == 0.5
    old = SHORT.plan("pbs").to_dict()
    assert old["format"] == 1 and "longer" not in old and Plan.from_dict(old) == SHORT.plan("pbs")
    with pytest.raises(ValueError, match=r"\"longer\" must be a list"):
        Plan.from_dict({**data, "longer": [{"tokens": BAND}]})
    with pytest.raises(ValueError, match=r"must share the plan's method, backend and layer count"):
        Plan(method="pbs", config=plan.config, longer=((BAND, Plan(method="pbs", config=plan.config, backend="flex")),))


@pytest.mark.parametrize(
    "longer, match",
    [
        (lambda p: ((0, p),), r"Plan.longer's token counts must be increasing integers > 0, got 0"),
        (lambda p: ((BAND, p), (BAND, p)), rf"increasing integers > {BAND}, got {BAND}"),
        (lambda p: ((BAND, "plan"),), r"Plan.longer\[96\] must be a Plan, got 'plan'"),
        (lambda p: ((BAND,),), r"Plan.longer must hold \(tokens, Plan\) pairs"),
        (lambda p: ((BAND, BANDED.plan("pbs")),), r"Plan.longer\[96\] has bands of its own"),
    ],
)
def test_bad_plan_bands_are_refused(longer, match):
    plan = SHORT.plan("pbs")
    with pytest.raises(ValueError, match=match):
        Plan(method="pbs", config=plan.config, longer=longer(plan))


def test_a_converted_model_runs_each_length_with_its_band(tiny):
    from sparseflow.hf import apply_plan

    banded = apply_plan(tiny("llama"), BANDED.plan("pbs"))
    short = apply_plan(tiny("llama"), SHORT.plan("pbs"))
    long = apply_plan(tiny("llama"), LONG.plan("pbs"))
    for n in (48, BAND - 1, BAND, 160):
        want, other = (long, short) if n >= BAND else (short, long)
        got = _forward(banded, n)
        assert torch.equal(got, _forward(want, n)), n
        assert not torch.equal(got, _forward(other, n)), n


def test_convert_writes_the_bands_with_the_users_changes(tiny, tmp_path):
    from sparseflow.convert import build_plan

    config = tiny("llama").config
    plan = build_plan(config, "pbs", recipe=_save(tmp_path, BANDED), config={"segment_size": 64})
    assert plan.config.segment_size == 64 and plan.dense_layers == (0,)
    ((tokens, band),) = plan.longer
    assert tokens == BAND and band.config.threshold == 0.3 and band.config.segment_size == 64
    assert band.dense_layers == () and band.layer_configs[0].threshold == 0.5
    made_dense = build_plan(config, "pbs", recipe=_save(tmp_path, BANDED), dense_layers="1")
    assert made_dense.dense_layers == (1,) and made_dense.longer[0][1].dense_layers == (1,)


def test_recipes_command_lists_a_recipes_bands(monkeypatch, capsys):
    import sys
    import types

    from sparseflow import recipes
    from sparseflow.cli import main

    module = types.ModuleType("banded_recipe_for_test")
    module.RECIPE = BANDED
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(recipes, "RECIPE_MODULES", {"banded": module.__name__})
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out.splitlines()
    band = out.index(f"    from {BAND} keys (long): dense layers []")
    assert out[0].startswith("banded: threshold 1.0") and '"threshold": 0.3' in out[band + 1]


def test_compile_of_a_method_no_band_covers_keeps_one_setting(tiny, tmp_path):
    from sparseflow.config import BSAConfig

    two = Recipe(
        name="two",
        description="",
        model_types=("llama",),
        configs={"pbs": PBSConfig(block_size=16, segment_size=32), "bsa": BSAConfig(block_size=16, top_k=4)},
        head_dim=16,
        longer=((BAND, LONG),),
    )
    path = _save(tmp_path, two)
    bsa = sparseflow.compile(tiny("llama"), method="bsa", inner_backend="eager", recipe=path)
    pbs = sparseflow.compile(tiny("llama"), method="pbs", inner_backend="eager", recipe=path)
    assert getattr(bsa, "_sparseflow_config")["longer"] == {}
    assert list(getattr(pbs, "_sparseflow_config")["longer"]) == [BAND]


def _smollm2_config(layers=30, heads=9, kv=3):
    from transformers import LlamaConfig

    return LlamaConfig(
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv, hidden_size=heads * 64
    )


def test_smollm2_runs_the_plans_calibrated_at_32k_and_at_128k_from_those_lengths():
    from sparseflow.recipes import get_recipe, resolve_recipe
    from sparseflow.recipes.smollm2_bands import BAND_32K, BAND_128K

    rec = resolve_recipe("auto", _smollm2_config())
    assert rec is get_recipe("smollm2")
    plan = rec.plan("pbs", _smollm2_config())
    assert [t for t, _ in plan.longer] == [32768, 131072]
    assert [plan.for_keys(n).recipe for n in (8192, 32767, 32768, 131071, 131072, 262144)] == [
        "smollm2", "smollm2", "smollm2-32k", "smollm2-32k", "smollm2-128k", "smollm2-128k"
    ]  # fmt: skip
    band = plan.for_keys(32768)
    assert band.dense_layers == BAND_32K.dense_layers and band.config.scoring == "mean"
    assert band.layer_configs[3].scoring == "sampled_rows" and band.layer_configs[3].permute
    band = plan.for_keys(131072)
    assert band.dense_layers == BAND_128K.dense_layers and band.config.permute
    assert band.layer_configs[25].threshold == 0.9 and not band.layer_configs[25].permute
    assert plan.for_keys(8192).dense_layers == (0,) and plan.for_keys(8192).config.scoring == "sampled_rows"
    assert get_recipe("smollm2-code").longer == ()


def test_smollm2s_128k_band_is_the_plan_calibrated_on_the_gpu():
    from sparseflow.recipes.smollm2_bands import BAND_128K

    calibrated = load_recipe(os.path.join(RESULTS, "calibrate_smollm2_pbs_131072_b0.05_h100.json"))
    assert BAND_128K.configs == calibrated.configs
    assert BAND_128K.layer_overrides == calibrated.layer_overrides
    assert BAND_128K.dense_layers == calibrated.dense_layers
    for field in ("model_types", "num_layers", "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert getattr(BAND_128K, field) == getattr(calibrated, field), field


def test_a_band_made_for_another_model_of_the_family_is_dropped_with_a_warning(caplog):
    from sparseflow.recipes import get_recipe, resolve_recipe

    other = _smollm2_config(layers=32, heads=15, kv=5)  # SmolLM2-360M's shape
    rec = resolve_recipe("auto", other)
    assert rec is get_recipe("smollm2")  # the family's recipe still fits
    with caplog.at_level("WARNING", logger="sparseflow"):
        plan = rec.plan("pbs", other)
    assert "from 32768 tokens ('smollm2-32k') do not fit this model" in caplog.text
    assert "num_hidden_layers=30" in caplog.text
    assert "from 131072 tokens ('smollm2-128k') do not fit this model" in caplog.text
    assert plan.longer == ()  # both bands were calibrated on the 135M model
    assert plan.for_keys(262144).recipe == "smollm2"
    with pytest.raises(RecipeError, match="model types"):
        rec.fitted(type("Cfg", (), {"model_type": "qwen2"})())


def test_a_band_naming_layers_the_model_lacks_is_dropped_not_the_recipe(caplog):
    from sparseflow.recipes.smollm2_bands import BAND_32K

    family = Recipe(name="family", description="", model_types=("llama",), configs=BAND_32K.configs)
    banded = family.with_longer(32768, BAND_32K)  # the band names layers up to 28
    config = _smollm2_config(layers=24)
    with caplog.at_level("WARNING", logger="sparseflow"):
        assert banded.fitted(config).longer == ()
        assert banded.fitted_to_layers(24).longer == ()  # a model without a transformers config
    assert caplog.text.count("do not fit this model") == 2
    assert banded.fitted_to_layers(30) is banded
    with pytest.raises(RecipeError, match="dense layers"):
        dataclasses.replace(family, dense_layers=(25,)).fitted_to_layers(24)
