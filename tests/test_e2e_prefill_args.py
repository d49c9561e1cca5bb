"""benchmarks/e2e_prefill.py's arguments: by default the whole grid the end-to-end table needs."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

import e2e_prefill  # noqa: E402

from sparseflow.methods import sparse_names  # noqa: E402
from sparseflow.recipes import get_recipe, list_recipes  # noqa: E402


def test_defaults_run_every_setting_through_both_paths_at_every_length():
    args = e2e_prefill.parse_args([])
    assert args.ns == [8192, 16384, 32768, 65536, 131072] and args.compile_ns == args.ns
    assert args.compile_settings == args.settings
    assert set(args.paths) == {"converted", "compile", "compile_dense"}
    methods = {s for s in args.settings if ":" not in s}
    assert methods == set(sparse_names())  # every method at its defaults
    # and the distinct plan of every shipped recipe for SmolLM2's family (smollm2-code shares
    # smollm2's PISA and BSA entries); a recipe for another family (gemma3) does not run on this model
    ran = {_plan_key(s) for s in args.settings if ":" in s}
    llama = [name for name in list_recipes() if "llama" in get_recipe(name).model_types]
    assert len(llama) >= 2 and "gemma3" not in llama
    assert ran == {_plan_key(f"{name}:{m}") for name in llama for m in get_recipe(name).configs}


def _plan_key(setting):
    method, cfg, dense, layer_cfgs, _ = e2e_prefill.plan_parts(setting)
    return method, cfg.to_json(), tuple(dense), tuple(sorted((i, c.to_json()) for i, c in layer_cfgs.items()))


def test_narrowed_compile_rows_and_checked_lists():
    args = e2e_prefill.parse_args(["--ns", "8192,32768", "--compile-ns", "32768", "--compile-settings", "pbs"])
    assert args.compile_ns == [32768] and args.compile_settings == ["pbs"] and args.ropes == ["plain", "yarn"]
    assert args.yarn_length is None  # each length's own YaRN factor
    assert e2e_prefill.parse_args(["--yarn-length", "32768"]).yarn_length == 32768
    for bad in (["--paths", "eager"], ["--ropes", "ntk"], ["--reps", "0"], ["--yarn-length", "8192"]):
        with pytest.raises(SystemExit):
            e2e_prefill.parse_args(bad)


def test_a_recipe_file_is_a_setting(tmp_path):
    from sparseflow.config import PBSConfig
    from sparseflow.recipes import Recipe

    plan = Recipe(
        name="calibrated-test",
        description="a calibrated plan",
        model_types=("llama",),
        configs={"pbs": PBSConfig(threshold=0.95)},
        dense_layers=(0, 3),
        layer_overrides={"pbs": {2: {"threshold": 0.99}}},
    )
    path = tmp_path / "plan.json"
    plan.save(path)
    method, cfg, dense, per_layer, recipe = e2e_prefill.plan_parts(f"{path}:pbs")
    assert (method, cfg.threshold, dense, recipe) == ("pbs", 0.95, (0, 3), "calibrated-test")
    assert per_layer[2].threshold == 0.99
    assert e2e_prefill.parse_settings(f"pbs,{path}:pbs") == ["pbs", f"{path}:pbs"]
    with pytest.raises(ValueError, match="name the recipe"):
        e2e_prefill.plan_parts("auto:pbs")
    with pytest.raises(ValueError, match="missing.json"):
        e2e_prefill.plan_parts(f"{tmp_path / 'missing.json'}:pbs")


def test_env_info_is_the_common_one_with_transformers():
    """The whole-model scripts' env: every field of benchmarks/common.py's (the same device rule)
    plus the transformers version."""
    import common
    import transformers

    env = e2e_prefill.env_info("cpu")
    base = common.env_info("cpu")
    assert env["transformers"] == transformers.__version__
    assert set(env) == set(base) | {"transformers"}
    assert {k: v for k, v in env.items() if k not in ("date", "transformers")} == {
        k: v for k, v in base.items() if k != "date"
    }


def test_a_layer_left_dense_by_the_rewrite_counts_one_in_the_density():
    # sparseflow.compile leaves a recipe's dense layers alone, so they record no call; the
    # converted path records them as dense calls: both report one density for the same plan
    import torch
    import transformers

    import sparseflow
    from sparseflow.config import PBSConfig
    from sparseflow.recipes import Recipe

    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, 128, (1, 512))
    dense_logits = e2e_prefill.last_logits(model, ids, 16)
    recipe = Recipe(
        name="two-dense", description="layers 0 and 1 dense", model_types=("llama",),
        configs={"pbs": PBSConfig(block_size=64, segment_size=128, threshold=0.5)}, dense_layers=(0, 1),
    )  # fmt: skip
    compiled = sparseflow.compile(model, method="pbs", recipe=recipe, backend="reference")
    with sparseflow.capture(keep_selections=False) as cap:
        e2e_prefill.last_logits(compiled, ids, 16)
    recorded = [c.density for c in cap.calls]
    assert len(recorded) == 2 and all(d < 0.95 for d in recorded)
    row = e2e_prefill.fidelity_row(compiled, ids, dense_logits, 16)
    assert row["density"] == pytest.approx((2.0 + sum(recorded)) / 4)
