"""Gemma 3 270M (18 layers, 4 query / 1 KV head, head dim 256; 15 sliding-window layers of 512
keys, global layers 5, 11 and 17; trained to 32K tokens).

Calibrated by ``sparseflow calibrate --method pbs --kl-budget 0.01 --tokens 32768 --text
stdlib_source --heldout-text pydoc_topics --thresholds 0.95,0.98,0.99,0.995`` on an H100 (bf16,
the Q4_K_M GGUF converted by ``sparseflow convert``). The sliding layers are not calibrated: they
run their window exactly (5 blocks of 128 keys: too narrow for PBS's selection to pay off there,
``pbs.window_rule``). The global layers run PBS at threshold 0.95 with
sampled-row scoring, and layer 17 unpermuted with mean scoring.

On this model the global layers need most of their keys: on 32K tokens of code, layers 5 and 11
keep every block at the thresholds that hold the KL budget (mean scoring at density 0.40-0.44
costs KL 0.04-0.07 in layer 5 alone), and layer 17 keeps about 28%. The plan's density over all
18 calls is about 0.76 (the windowed layers count as 1). ``MEASURED`` holds the figures;
docs/results.md the whole table.
"""

from ..config import PBSConfig
from . import Recipe

_WHERE = (
    "H100, bf16, Gemma 3 270M Q4_K_M GGUF converted to bf16, last 512 of 32768 positions, "
    "torch 2.11.0, transformers 5.17.0, Python 3.12.3's stdlib texts"
)

MEASURED = {
    "setup": _WHERE,
    "pbs": {
        "calibration": {"text": "stdlib_source", "mean_kl": 0.0029, "top1": 0.979, "density": 0.761},
        "heldout": {"text": "pydoc_topics", "mean_kl": 0.0050, "top1": 0.951, "density": 0.754},
        "global_layer_density": {"5": 1.0, "11": 1.0, "17": 0.28},
        # the whole forward, 32768 tokens of pydoc_topics repeated, KL against transformers' eager sdpa
        "end_to_end_32k": {"ms": 38.44, "mean_kl": 0.0046, "top1": 0.957, "flex_compile_ms": 50.73},
        "niah_32k": {"dense": 0.50, "recipe": 0.50, "depths": "0.1,0.5,0.9", "samples_per_depth": 4},
    },
}

RECIPE = Recipe(
    name="gemma3",
    description=(
        "Gemma 3 270M: the 15 sliding layers run their 512-key window exactly; the 3 global layers PBS "
        "(threshold 0.95, sampled rows; layer 17 unpermuted, mean scoring), calibrated at 32K within KL 0.01 "
        "(held-out prose: KL 0.005, density 0.75)"
    ),
    model_types=("gemma3_text",),
    configs={
        "pbs": PBSConfig(block_size=128, segment_size=256, threshold=0.95, permute=True, scoring="sampled_rows"),
    },
    num_layers=18,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    layer_overrides={"pbs": {17: {"permute": False, "scoring": "mean"}}},
    measured=MEASURED,
)
