"""SmolLM2's PBS plans for long prompts: the ``smollm2`` recipe's bands from 32K and 128K tokens.

Calibrated on the GPU at the serving length by ``sparseflow calibrate --method pbs --kl-budget
0.025 --tokens 32768 --rope-scaling yarn:auto:32768 --cost time --heldout-text stdlib_docs,copy_log``
(SmolLM2-135M, the default mix of prose, code and copy-heavy text, bf16, H100). The budget holds the
plan's KL on the worst text of the mix, with the calibrator's margin (0.7: a target of 0.0175).
The copy-heavy text is that worst text, well above prose: at budget 0.01 the plan kept half its
layers dense. The plan's own measurements are in ``MEASURED_32K``. The 8K plan kept past its
length runs at 32K with KL 0.0146 on prose; this one with 0.0085, and faster.

From 128K tokens the recipe runs a plan calibrated at 128K the same way (``BAND_128K``): mean
scoring only (the whole grid is about 650 measurements there, two device calls), budget 0.05 on
documentation and clauses (the default mix's prose is shorter than 119K tokens), held out on source
and logs. Early layers need all their keys under YaRN x16: layers 0-10 and 18 stay dense. It is
slower than the 8K plan there (1.96x against 2.45x eager dense) at about half its KL (0.036 against
0.064 on prose); the 32K plan kept past its length measured 0.096.
"""

from ..config import PBSConfig
from . import Recipe

_WHERE = "H100, bf16, SmolLM2-135M Q4_1 GGUF, YaRN to 32768, torch 2.11.0, transformers 5.17.0, last 512 positions"

MEASURED_32K = {
    "setup": _WHERE,
    "pbs": {
        # the calibration's own measurement, 32768 tokens of each text
        "calibration": {
            "budget": 0.025,
            "kl_per_text": {"pydoc_topics": 0.0093, "stdlib_source": 0.0088, "copy_clauses": 0.0156},
            "top1": 0.953,
            "density": 0.341,
        },
        "heldout": {"kl_per_text": {"stdlib_docs": 0.0112, "copy_log": 0.0067}, "top1": 0.926, "density": 0.337},
        # benchmarks/frontier.py at 32768 tokens of pydoc_topics: the whole forward against eager
        # dense SDPA (131.40 ms), the 8K plan beside it in the same run
        "end_to_end_32k": {
            "compile": {"speedup": 2.08, "mean_kl": 0.0085, "top1": 0.947},
            "converted": {"speedup": 1.48, "mean_kl": 0.0093, "top1": 0.953},
            "compile_8k_plan": {"speedup": 1.83, "mean_kl": 0.0146, "top1": 0.939},
        },
        "end_to_end_128k": {"compile": {"speedup": 2.85, "mean_kl": 0.0959, "top1": 0.781}},
    },
}

# the model both bands were calibrated on: another model of the family drops them (Recipe.fitted)
_SMOLLM2_135M = dict(model_types=("llama",), num_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64)

BAND_32K = Recipe(
    name="smollm2-32k",
    description=(
        "SmolLM2 from 32K tokens: PBS calibrated at 32K on the GPU (prose, code and copy-heavy text; "
        "layers 0, 5, 7, 8 and 18 dense; H100: 2.08x eager dense at KL 0.0085 on prose)"
    ),
    configs={
        "pbs": PBSConfig(block_size=128, segment_size=256, threshold=0.9, permute=False, scoring="mean"),
    },
    dense_layers=(0, 5, 7, 8, 18),
    **_SMOLLM2_135M,
    layer_overrides={
        "pbs": {
            2: {"threshold": 0.95, "permute": True},
            3: {"threshold": 0.98, "permute": True, "scoring": "sampled_rows"},
            4: {"permute": True, "scoring": "sampled_rows"},
            6: {"permute": True, "scoring": "sampled_rows"},
            9: {"scoring": "sampled_rows"},
            10: {"permute": True, "scoring": "sampled_rows"},
            14: {"threshold": 0.98},
            15: {"threshold": 0.95},
            17: {"threshold": 0.98},
            19: {"threshold": 0.95},
            20: {"threshold": 0.98, "permute": True},
            21: {"permute": True},
            23: {"threshold": 0.98, "permute": True},
            24: {"permute": True, "scoring": "sampled_rows"},
            26: {"permute": True},
            28: {"permute": True},
        }
    },
    measured=MEASURED_32K,
)


_WHERE_128K = (
    "H100, bf16, SmolLM2-135M Q4_1 GGUF, YaRN to 131072, torch 2.11.0, transformers 5.17.0, last 512 positions"
)

MEASURED_128K = {
    "setup": _WHERE_128K,
    "pbs": {
        # the calibration's own measurement, 131072 tokens of each text
        "calibration": {
            "budget": 0.05,
            "kl_per_text": {"stdlib_docs": 0.0301, "copy_clauses": 0.0320},
            "top1": 0.889,
            "density": 0.481,
        },
        "heldout": {"kl_per_text": {"stdlib_source": 0.0350, "copy_log": 0.0374}, "top1": 0.887, "density": 0.498},
        # benchmarks/frontier.py at 131072 tokens of pydoc_topics (repeated): the whole forward
        # against eager dense SDPA (1488.2 ms), the 8K plan beside it in the same run
        "end_to_end_128k": {
            "compile": {"speedup": 1.96, "mean_kl": 0.0361, "top1": 0.889, "density": 0.485},
            "converted": {"speedup": 1.75, "mean_kl": 0.0313, "top1": 0.896, "density": 0.485},
            "compile_8k_plan": {"speedup": 2.45, "mean_kl": 0.0640, "top1": 0.816, "density": 0.217},
        },
    },
}

BAND_128K = Recipe(
    name="smollm2-128k",
    description=(
        "SmolLM2 from 128K tokens: PBS calibrated at 128K on the GPU (documentation and clauses, mean "
        "scoring; layers 0-10 and 18 dense; H100: 1.96x eager dense at KL 0.036 on prose)"
    ),
    configs={
        "pbs": PBSConfig(block_size=128, segment_size=256, threshold=0.98, permute=True, scoring="mean"),
    },
    dense_layers=(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 18),
    **_SMOLLM2_135M,
    layer_overrides={
        "pbs": {
            12: {"threshold": 0.95, "permute": False},
            13: {"permute": False},
            14: {"permute": False},
            15: {"permute": False},
            17: {"permute": False},
            21: {"threshold": 0.95},
            22: {"threshold": 0.95},
            25: {"threshold": 0.9, "permute": False},
            26: {"threshold": 0.95},
            27: {"threshold": 0.95},
            28: {"threshold": 0.9},
            29: {"threshold": 0.95},
        }
    },
    measured=MEASURED_128K,
)
