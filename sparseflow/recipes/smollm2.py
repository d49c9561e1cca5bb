"""SmolLM2 (Llama architecture; the 135M model: 30 layers, 9 query / 3 KV heads, head dim 64).

Settings chosen by measurement with ``sparseflow eval`` (:func:`sparseflow.evaluate.evaluate_plans`)
on SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to fp32), the model's native length: the first
8192 tokens of ``pydoc_data.topics``, fidelity over the last 512 next-token predictions, CPU,
reference backend, layer 0 dense in every row. Density is the mean over all 30 attention calls
(the dense layer counts as 1.0). See ``MEASURED`` and ``benchmarks/results/smollm2_*_8k.json``.

* PBS: the target is mean KL <= 0.01 nats and top-1 >= 97%. At 8K the paper's permutation in
  every layer *hurts* this model (0.98: KL 0.115 vs 0.018 without permutation). The damage comes
  from a few layers: permuting layer 7 alone (at 4K) raises KL 2.5x, most others lower it a little.
  A per-layer choice by the model's own KL (``smollm2_study.py --parts calib_kl``: each layer
  permuted alone against the no-permutation curve, 4K tokens) permutes 22 of 29 layers, and with
  it permutation pays: at 8K, with antidiagonal (strided) block scoring, threshold 0.98 gives
  density 0.530, KL 0.0064, top-1 97.9% against 0.575 / 0.0092 / 96.9% without permutation --
  the sparsest measured setting meeting both targets (the previous one, no permutation at 0.985,
  needed density 0.607). The same layers also beat no permutation on the held-out argparse source
  at 4K (0.9: density 0.528 / KL 0.0206 vs 0.565 / 0.0212). They were chosen on the first 4096
  tokens of the same text the 8K rows score, so the 8K rows are not fully held out.
* The H200 study (benchmarks/smollm2_study.py, Python 3.12's texts; all-or-nothing permutation)
  found prose favouring no permutation and 3.12's argparse source favouring permutation; the
  ``smollm2-code`` recipe is a mass-calibrated per-layer choice from that study. The KL-calibrated
  layers here are not yet measured on the GPU study.
* PISA / BSA: K=16 blocks of 64. At 8K neither is close to dense (KL 0.75 / 0.85 at density 0.40)
  — a fixed K covers a shrinking share of an 8K context; PISA stays below BSA at equal K and C.
"""
from ..config import BSAConfig, PBSConfig, PISAConfig
from . import Recipe

# layers that permute: chosen one at a time by the model's KL (benchmarks/smollm2_study.py --parts
# calib_kl, 4096 tokens of pydoc_data.topics, threshold 0.95; benchmarks/results/smollm2_study_calib_kl_4k_cpu.json)
PERMUTED_LAYERS = (1, 3, 4, 5, 6, 8, 9, 10, 11, 12, 15, 16, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29)

_WHERE = ("SmolLM2-135M-Instruct Q4_1->fp32, 8192 tokens of pydoc_data.topics, last 512 positions, "
          "layer 0 dense, CPU reference backend")

MEASURED = {
    "setup": _WHERE,
    "pbs": [
        # block 128, segment 256, mean-pooled block scoring unless noted
        {"threshold": 0.80, "permute": True, "density": 0.264, "mean_kl": 0.8464, "top1": 0.691},
        {"threshold": 0.90, "permute": True, "density": 0.339, "mean_kl": 0.7541, "top1": 0.709},
        {"threshold": 0.95, "permute": True, "density": 0.421, "mean_kl": 0.1811, "top1": 0.879},
        {"threshold": 0.98, "permute": True, "density": 0.524, "mean_kl": 0.1147, "top1": 0.912},
        {"threshold": 0.99, "permute": True, "density": 0.596, "mean_kl": 0.0175, "top1": 0.965},
        {"threshold": 0.80, "permute": False, "density": 0.271, "mean_kl": 0.2826, "top1": 0.816},
        {"threshold": 0.90, "permute": False, "density": 0.358, "mean_kl": 0.1418, "top1": 0.863},
        {"threshold": 0.95, "permute": False, "density": 0.446, "mean_kl": 0.0559, "top1": 0.904},
        {"threshold": 0.98, "permute": False, "density": 0.554, "mean_kl": 0.0181, "top1": 0.947},
        {"threshold": 0.99, "permute": False, "density": 0.627, "mean_kl": 0.0066, "top1": 0.969},
        {"threshold": 0.995, "permute": False, "density": 0.690, "mean_kl": 0.0032, "top1": 0.986},
        {"threshold": 0.98, "permute": False, "scoring": "antidiagonal", "density": 0.575, "mean_kl": 0.0092, "top1": 0.969},
        {"threshold": 0.985, "permute": False, "scoring": "antidiagonal", "density": 0.607, "mean_kl": 0.0038, "top1": 0.977},
        {"threshold": 0.99, "permute": False, "scoring": "antidiagonal", "density": 0.648, "mean_kl": 0.0019, "top1": 0.982},
        {"threshold": 0.90, "permute": False, "scoring": "antidiagonal", "density": 0.374, "mean_kl": 0.0449, "top1": 0.922},
        {"threshold": 0.92, "permute": False, "scoring": "antidiagonal", "density": 0.404, "mean_kl": 0.0411, "top1": 0.920},
        {"threshold": 0.95, "permute": False, "scoring": "antidiagonal", "density": 0.464, "mean_kl": 0.0253, "top1": 0.934},
        # "layers": permutation only in PERMUTED_LAYERS (benchmarks/results/smollm2_calib_kl_layers*_8k_cpu.json)
        {"threshold": 0.95, "permute": "layers", "density": 0.430, "mean_kl": 0.0516, "top1": 0.928},
        {"threshold": 0.98, "permute": "layers", "density": 0.534, "mean_kl": 0.0117, "top1": 0.957},
        {"threshold": 0.90, "permute": "layers", "scoring": "antidiagonal", "density": 0.346, "mean_kl": 0.0490, "top1": 0.912},
        {"threshold": 0.92, "permute": "layers", "scoring": "antidiagonal", "density": 0.372, "mean_kl": 0.0293, "top1": 0.926},
        {"threshold": 0.95, "permute": "layers", "scoring": "antidiagonal", "density": 0.427, "mean_kl": 0.0154, "top1": 0.959},
        {"threshold": 0.98, "permute": "layers", "scoring": "antidiagonal", "density": 0.530, "mean_kl": 0.0064, "top1": 0.979},
    ],
    "pisa": [{"top_k": 16, "density": 0.402, "mean_kl": 0.7465, "top1": 0.699}],
    "bsa": [{"top_k": 16, "density": 0.402, "mean_kl": 0.8511, "top1": 0.684}],
    "at_2k": "2048 tokens, last 256 positions: PISA K=16 KL 0.0063 vs BSA 0.0199; PBS 0.95 with permutation KL 0.0018",
}

RECIPE = Recipe(
    name="smollm2",
    description=("SmolLM2 family (Llama architecture): layer 0 dense; PBS with antidiagonal scoring, threshold "
                 "0.98, permutation in the 22 layers a KL calibration chose (8K: density 0.53, KL 0.0064, top-1 97.9%); "
                 "PISA/BSA with K=16 blocks of 64"),
    model_types=("llama",),
    configs={
        "pbs": PBSConfig(block_size=128, segment_size=256, threshold=0.98, permute=False, scoring="antidiagonal"),
        "pisa": PISAConfig(block_size=64, top_k=16),
        "bsa": BSAConfig(block_size=64, top_k=16),
    },
    dense_layers=(0,),
    head_dim=64,
    layer_overrides={"pbs": {i: {"permute": True} for i in PERMUTED_LAYERS}},
    measured=MEASURED,
)
