"""The shipped ``gemma3`` recipe: it is the plan ``sparseflow calibrate`` wrote at 32K on the GPU,
``recipe="auto"`` picks it for a model of Gemma 3 270M's shape (and for no other), and a compiled
model runs PBS on the three global layers with layer 17's override, every sliding layer its window."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import sparseflow
from sparseflow.recipes import get_recipe, load_recipe, resolve_recipe

CALIBRATED_PLAN = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "gemma3_plan_32k_h100.json"
GLOBAL_LAYERS = (5, 11, 17)


def _gemma3_270m_shaped(**overrides):
    """A tiny random Gemma 3 with the 270M model's attention shape (18 layers, 4 query heads, 1 KV
    head, head dim 256, sliding window 512, every 6th layer global) and small everything else."""
    tf = pytest.importorskip("transformers")
    kw = dict(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=18,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        sliding_window=512,
        vocab_size=128,
    )
    kw.update(overrides)
    torch.manual_seed(0)
    return tf.Gemma3ForCausalLM(tf.Gemma3TextConfig(**kw)).eval()


def test_shipped_recipe_is_the_calibrated_plan():
    shipped, calibrated = get_recipe("gemma3"), load_recipe(CALIBRATED_PLAN)
    assert shipped.configs == calibrated.configs
    assert shipped.layer_overrides == calibrated.layer_overrides
    assert shipped.dense_layers == calibrated.dense_layers
    for field in ("model_types", "num_layers", "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert getattr(shipped, field) == getattr(calibrated, field), field


def test_auto_picks_gemma3_only_for_its_shape():
    assert resolve_recipe("auto", _gemma3_270m_shaped().config) is get_recipe("gemma3")
    assert resolve_recipe("auto", _gemma3_270m_shaped(num_hidden_layers=12).config) is None
    assert resolve_recipe("auto", _gemma3_270m_shaped(head_dim=64).config) is None


def test_compile_auto_runs_pbs_on_the_global_layers(caplog):
    model = _gemma3_270m_shaped()
    with caplog.at_level(logging.INFO, logger="sparseflow"):
        sparseflow.compile(model, method="pbs", backend="reference", inner_backend="eager")
    assert "recipe 'gemma3' applied: pbs" in caplog.text
    with sparseflow.capture() as cap, torch.no_grad():
        model(torch.randint(0, 128, (1, 600)), use_cache=False)  # past one window
    assert sorted(c.method for c in cap.calls) == ["dense"] * 15 + ["pbs"] * 3
    rep = sparseflow.report(model)
    assert rep.recipe == "gemma3"
    by_layer = {e.layer: e for e in rep.entries}
    base = get_recipe("gemma3").config_for("pbs")
    for i in GLOBAL_LAYERS:
        want = base.replace(permute=False, scoring="mean") if i == 17 else base
        assert by_layer[i].config == want.to_dict(), i
    windowed = [i for i, e in by_layer.items() if any("windowed layer" in n for n in e.notes)]
    assert windowed == [i for i in range(18) if i not in GLOBAL_LAYERS]
