"""SmolLM2 on source code: PBS with a per-layer permutation choice.

On code (Lib/argparse.py, the second study text) PBS's permutation pays on this model -- at 8K the
permuted selector's KL lies below the unpermuted one at every density from 0.3 to 0.55 -- while on
English prose (pydoc_data.topics) this layer choice hurts. The default ``smollm2`` recipe (22
KL-calibrated layers, sampled-row scoring) is as good on code and also pays on prose; this recipe
stays for comparison.
This recipe keeps layer 0 dense and permutes the layers that a calibration chose: for each layer
the attention mass of the last 512 queries that PBS keeps with and without permutation is
measured on 8K tokens of pydoc_data.topics at thresholds 0.6-0.995, both interpolated to equal
densities, and the layer permutes where permuting keeps more (layers 17-19 do not). Scoring is
antidiagonal (PBS+).

Measured on an H200 (reference backend, fp32; SmolLM2-135M-Instruct Q4_1 dequantised; Python
3.12.3's stdlib texts; last 512 of 8192 positions):

* argparse source: threshold 0.9 -> density 0.341, mean KL 0.0133, top-1 95.5%; 0.95 -> 0.424 /
  0.0050 / 97.7%; 0.8 -> 0.264 / 0.0259. All permuted or all unpermuted selectors with mean
  scoring reach KL 0.024 / 0.032 at density 0.35.
* pydoc prose: 0.9 -> density 0.334, KL 0.249 -- do not use this recipe for prose.
"""

import dataclasses

from ..config import PBSConfig
from .smollm2 import RECIPE as _SMOLLM2

PERMUTED_LAYERS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29)

MEASURED = {
    "setup": (
        "H200, reference backend fp32, SmolLM2-135M-Instruct Q4_1->fp32, 8192 tokens, last 512 positions, "
        "layer 0 dense, Python 3.12.3 stdlib texts"
    ),
    "pbs": [
        {"text": "argparse_source", "threshold": 0.8, "density": 0.264, "mean_kl": 0.0259, "top1": 0.959},
        {"text": "argparse_source", "threshold": 0.9, "density": 0.341, "mean_kl": 0.0133, "top1": 0.955},
        {"text": "argparse_source", "threshold": 0.95, "density": 0.424, "mean_kl": 0.0050, "top1": 0.977},
        {"text": "argparse_source", "threshold": 0.98, "density": 0.528, "mean_kl": 0.0022, "top1": 0.984},
        {"text": "pydoc_topics", "threshold": 0.9, "density": 0.334, "mean_kl": 0.2486, "top1": 0.779},
    ],
    "calibration": (
        "kept attention mass of the last 512 queries with and without permutation, per layer, "
        "8192 tokens of pydoc_data.topics, thresholds 0.6-0.995 (base 'antidiag')"
    ),
}

# the smollm2 recipe with another PBS setting: same model checks, dense layer and PISA/BSA configs
RECIPE = dataclasses.replace(
    _SMOLLM2,
    name="smollm2-code",
    description=(
        "SmolLM2 on source code: PBS antidiagonal, threshold 0.9, permutation in the 26 calibrated layers "
        "(8K argparse: density 0.34, KL 0.013); layer 0 dense. For prose use 'smollm2'"
    ),
    configs={
        **_SMOLLM2.configs,
        "pbs": PBSConfig(block_size=128, segment_size=256, threshold=0.9, permute=False, scoring="antidiagonal"),
    },
    layer_overrides={"pbs": {i: {"permute": True} for i in PERMUTED_LAYERS}},
    longer=(),  # smollm2's bands replace its PBS plan for long prompts, not this code setting
    measured=MEASURED,
)
