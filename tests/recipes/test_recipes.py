"""Recipes (sparseflow.recipes) and the per-layer Plan they produce (sparseflow.hf.Plan)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import sparseflow
from sparseflow.config import BSAConfig, PBSConfig, PISAConfig
from sparseflow.recipes import Recipe, RecipeError, get_recipe, list_recipes


def _smollm2_config(**overrides):
    tf = pytest.importorskip("transformers")
    kw = dict(
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        hidden_size=576,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
    )
    kw.update(overrides)
    return tf.LlamaConfig(**kw)


def test_list_and_get():
    assert "smollm2" in list_recipes()
    r = get_recipe("smollm2")
    assert get_recipe(" SmolLM2 ") is r
    assert r.methods == ["bsa", "pbs", "pisa"]
    assert isinstance(r.config_for("pbs"), PBSConfig)
    assert isinstance(r.config_for("pisa"), PISAConfig)
    assert isinstance(r.config_for("bsa"), BSAConfig)
    d = r.to_dict()
    assert d["name"] == "smollm2" and set(d["configs"]) == {"pbs", "pisa", "bsa"}


def test_unknown_recipe_names_the_known_ones():
    with pytest.raises(
        RecipeError, match=r"unknown recipe 'llama9'; available recipes: \['gemma3', 'smollm2', 'smollm2-code'\]"
    ):
        get_recipe("llama9")
    with pytest.raises(TypeError, match="recipe name must be a str"):
        get_recipe(3)
    assert issubclass(RecipeError, ValueError)


def test_every_shipped_recipe_is_valid():
    for name in list_recipes():
        r = get_recipe(name)
        assert r.name == name and r.model_types and r.configs
        for method, cfg in r.configs.items():
            assert cfg.method == method
            assert not cfg.exact if method == "pbs" else True  # a recipe that computes dense is pointless
            assert sparseflow.config_from_dict(cfg.to_dict()) == cfg
        assert sorted(set(r.dense_layers)) == sorted(r.dense_layers)


def test_smollm2_recipe_fits_smollm2_and_builds_plans():
    r = get_recipe("smollm2")
    cfg = _smollm2_config()
    r.check_model(cfg)
    from sparseflow.hf import Plan

    for method in r.methods:
        plan = r.plan(method, cfg, source="x")
        assert plan.num_layers == 30 and plan.recipe == "smollm2" and plan.dense_layers == r.dense_layers
        for i in r.dense_layers:
            assert plan.config_for(i).method == "dense"
        sparse_layer = next(i for i in range(30) if i not in r.dense_layers)
        expected = r.config_for(method).replace(**r.layer_overrides.get(method, {}).get(sparse_layer, {}))
        assert plan.config_for(sparse_layer) == expected
        assert Plan.from_dict(plan.to_dict()) == plan


def test_recipe_rejects_other_models():
    r = get_recipe("smollm2")
    tf = pytest.importorskip("transformers")
    with pytest.raises(RecipeError, match=r"for model types \['llama'\], but the model is 'gpt2'"):
        r.check_model(tf.GPT2Config())
    with pytest.raises(RecipeError, match="expects head_dim=64, but the model has 16"):
        r.check_model(_smollm2_config(head_dim=16))
    with pytest.raises(RecipeError, match="has no 'dense' settings"):
        r.config_for("dense")
    if r.dense_layers:
        with pytest.raises(RecipeError, match="do not exist"):
            r.check_model(_smollm2_config(num_hidden_layers=max(r.dense_layers)))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(name=""), "name must be a non-empty str"),
        (dict(model_types=()), "model_types must name"),
        (dict(configs={}), "at least one method"),
        (dict(configs={"dense": sparseflow.DenseConfig()}), "unknown method 'dense'"),
        (dict(configs={"pbs": PISAConfig()}), r"configs\['pbs'\] must be a PBSConfig"),
        (dict(dense_layers=(-1,)), "non-negative ints"),
        (dict(dense_layers=(1, 1)), "duplicates"),
        (dict(dense_layers=(4,), num_layers=4), "dense layer 4 >= num_layers=4"),
    ],
)
def test_recipe_validation(kwargs, match):
    base = dict(name="t", description="d", model_types=("llama",), configs={"pbs": PBSConfig()})
    base.update(kwargs)
    with pytest.raises(RecipeError, match=match):
        Recipe(**base)


def test_plan_validation():
    from sparseflow.hf import Plan

    with pytest.raises(ValueError, match="its config is for 'pisa'"):
        Plan("pbs", PISAConfig())
    with pytest.raises(ValueError, match="out of range"):
        Plan("pbs", PBSConfig(), dense_layers=(3,), num_layers=3)
    with pytest.raises(ValueError, match="both dense and given a config"):
        Plan("pbs", PBSConfig(), dense_layers=(1,), layer_configs={1: BSAConfig()})
    with pytest.raises(ValueError, match="backend must be one of"):
        Plan("pbs", PBSConfig(), backend="cuda")
    with pytest.raises(ValueError, match="format 3 is not readable"):
        Plan.from_dict({"format": 3, "config": PBSConfig().to_dict()})
    p = Plan("pbs", PBSConfig(threshold=0.8), dense_layers=(0,), layer_configs={2: BSAConfig(top_k=4)}, num_layers=4)
    assert Plan.from_dict(p.to_dict()) == p
    assert [p.config_for(i).method for i in range(4)] == ["dense", "pbs", "bsa", "pbs"]


def test_imports_stay_light():
    """import sparseflow (and its recipes / hf / convert modules) must not import transformers."""
    code = (
        "import sys, sparseflow, sparseflow.recipes, sparseflow.hf, sparseflow.convert, sparseflow.cli;"
        "sparseflow.recipes.get_recipe('smollm2');"
        "assert 'transformers' not in sys.modules, 'transformers imported'"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_smollm2_pbs_setting_is_a_measured_row_that_meets_the_targets():
    """The shipped PBS setting must be one the recipe measured, and that row must meet the
    recipe's targets (mean KL <= 0.01 nats, top-1 >= 97%) — edits to one without the other fail."""
    r = get_recipe("smollm2")
    cfg = r.config_for("pbs")
    # a row measured with the per-layer choice says permute="layers"; the recipe then carries the
    # permuted layers as layer_overrides on an unpermuted base config
    per_layer = bool(r.layer_overrides.get("pbs"))
    assert not per_layer or (
        cfg.permute is False and all(c == {"permute": True} for c in r.layer_overrides["pbs"].values())
    )
    permute = "layers" if per_layer else cfg.permute
    rows = [
        m
        for m in r.measured["pbs"]
        if m["threshold"] == cfg.threshold and m["permute"] == permute and m.get("scoring", "mean") == cfg.scoring
    ]
    assert len(rows) == 1, rows
    assert rows[0]["mean_kl"] <= 0.01 and rows[0]["top1"] >= 0.97, rows[0]
    assert 0.0 < rows[0]["density"] < 1.0
    # and no measured row meeting the targets is sparser
    ok = [m for m in r.measured["pbs"] if m["mean_kl"] <= 0.01 and m["top1"] >= 0.97]
    assert min(m["density"] for m in ok) == rows[0]["density"]


def test_layer_overrides_reach_the_plan_on_any_base_config():
    cfg = _smollm2_config()
    r = get_recipe("smollm2-code")
    plan = r.plan("pbs", cfg)
    permuted = sorted(i for i, c in plan.layer_configs.items() if c.permute)
    assert permuted == list(r.layer_overrides["pbs"]) and 17 not in permuted and 0 in plan.dense_layers
    assert plan.config.permute is False
    # every non-permuted sparse layer runs the base config
    assert plan.config_for(17) == plan.config and plan.config_for(5).permute is True
    # a user's fields change the base, the per-layer change still applies on top of it
    from sparseflow.convert import build_plan

    p2 = build_plan(cfg, "pbs", recipe="smollm2-code", config={"threshold": 0.95, "permute": False})
    assert p2.config.threshold == 0.95 and p2.config_for(3).threshold == 0.95 and p2.config_for(3).permute is True
    assert p2.config == r.config_for("pbs").replace(threshold=0.95)  # the recipe's other fields kept
    # a JSON string too; a config object replaces the base whole
    p4 = build_plan(cfg, "pbs", recipe="smollm2-code", config='{"dense_tail_blocks": 1}')
    assert p4.config == r.config_for("pbs").replace(dense_tail_blocks=1)
    assert p4.config_for(3) == r.config_for("pbs").replace(dense_tail_blocks=1, permute=True)
    p5 = build_plan(cfg, "pbs", recipe="smollm2-code", config=PBSConfig(dense_tail_blocks=1))
    assert p5.config == PBSConfig(dense_tail_blocks=1)
    # a layer the caller makes dense stays dense
    p3 = build_plan(cfg, "pbs", recipe="smollm2-code", dense_layers="0,3")
    assert 3 not in p3.layer_configs and p3.config_for(3).method == "dense"
    # methods without overrides get none
    assert r.plan("pisa", cfg).layer_configs == {}
    assert r.to_dict()["layer_overrides"]["pbs"]["1"] == {"permute": True}


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"pisa": {1: {"permute": True}}}, "layer_overrides\\['pisa'\\]\\[1\\]"),
        ({"pbs": {-1: {"permute": True}}}, "keys must be non-negative ints"),
        ({"pbs": {0: {"permute": True}}}, "layer 0 is dense and has layer_overrides"),
        ({"bsa": {1: {"top_k": 4}}}, "layer_overrides for 'bsa', which has no config"),
    ],
)
def test_layer_overrides_validation(overrides, match):
    with pytest.raises(RecipeError, match=match):
        Recipe(
            name="x",
            description="",
            model_types=("llama",),
            configs={"pbs": PBSConfig(), "pisa": PISAConfig()},
            dense_layers=(0,),
            layer_overrides=overrides,
        )


def test_layer_overrides_beyond_the_model_are_an_error():
    r = get_recipe("smollm2-code")
    with pytest.raises(RecipeError, match="layer_overrides name layer 12, but the model has 12 layers"):
        r.layer_configs_for("pbs", r.config_for("pbs"), n_layers=12)
