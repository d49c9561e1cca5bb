"""SmolLM2's PBS plans for long prompts: the ``smollm2`` recipe's bands from 32K and 128K tokens.

Calibrated on the GPU at the serving length by ``sparseflow calibrate --method pbs --kl-budget
0.025 --tokens 32768 --rope-scaling yarn:auto:32768 --cost time --heldout-text stdlib_docs,copy_log``
(SmolLM2-135M, the default mix of prose, code and copy-heavy text, bf16, H100). The budget holds the
plan's KL on the worst text of the mix, with the calibrator's margin (0.7: a target of 0.0175).
The copy-heavy text is that worst text, well above prose: at budget 0.01 the plan kept half its
layers dense. The plan's own measurements are in ``MEASURED_32K``. The 8K plan kept past its
length runs at 32K with KL 0.0146 on prose; this one with 0.0085, and faster.

From 128K tokens the recipe runs a plan calibrated at 128K the same way (``BAND_128K``): mean
scoring only, at thresholds 0.9-0.99 (the whole grid is about 650 measurements there), budget 0.05
on documentation and clauses (the default mix's prose is shorter than 119K tokens), held out on
source and logs. Early layers need all their keys under YaRN x16: layers 0, 2-10 and 18 stay dense.
It is slower than the 8K plan there (2.45x eager dense at KL 0.064 on prose, an earlier run) at
about half its KL (2.02x at 0.030); the band it replaced, calibrated without threshold 0.99, ran
1.93x at 0.036 in the same run, and the 32K plan kept past its length measured 0.096.
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
            "kl_per_text": {"stdlib_docs": 0.0268, "copy_clauses": 0.0294},
            "top1": 0.879,
            "density": 0.463,
        },
        "heldout": {"kl_per_text": {"stdlib_source": 0.0310, "copy_log": 0.0431}, "top1": 0.867, "density": 0.482},
        # benchmarks/frontier.py at 131072 tokens of pydoc_topics (repeated): the whole forward
        # against eager dense SDPA (1492.1 ms), the band it replaced beside it in the same run
        # (its calibration's grid stopped at threshold 0.98); the converted path was not rerun
        "end_to_end_128k": {
            "compile": {"speedup": 2.02, "mean_kl": 0.0303, "top1": 0.883, "density": 0.468},
            "compile_previous_band": {"speedup": 1.93, "mean_kl": 0.0361, "top1": 0.889, "density": 0.485},
        },
    },
}

BAND_128K = Recipe(
    name="smollm2-128k",
    description=(
        "SmolLM2 from 128K tokens: PBS calibrated at 128K on the GPU (documentation and clauses, mean "
        "scoring; layers 0, 2-10 and 18 dense; H100: 2.02x eager dense at KL 0.030 on prose)"
    ),
    configs={
        "pbs": PBSConfig(block_size=128, segment_size=256, threshold=0.95, permute=True, scoring="mean"),
    },
    dense_layers=(0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 18),
    **_SMOLLM2_135M,
    layer_overrides={
        "pbs": {
            1: {"threshold": 0.99, "permute": False},
            11: {"threshold": 0.98},
            12: {"permute": False},
            13: {"threshold": 0.98, "permute": False},
            14: {"threshold": 0.99, "permute": False},
            15: {"threshold": 0.98, "permute": False},
            16: {"threshold": 0.99},
            17: {"threshold": 0.99, "permute": False},
            19: {"threshold": 0.98},
            20: {"threshold": 0.99},
            23: {"threshold": 0.99},
            24: {"threshold": 0.98},
            25: {"threshold": 0.9, "permute": False},
            28: {"threshold": 0.9},
        }
    },
    measured=MEASURED_128K,
)
