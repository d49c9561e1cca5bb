"""SmolLM2 (Llama architecture; the 135M model: 30 layers, 9 query / 3 KV heads, head dim 64).

Settings chosen by measurement with ``sparseflow.evaluate.evaluate_plans`` (what ``sparseflow
eval`` runs) on SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to fp32), the first 2048 tokens of
``pydoc_data.topics``, fidelity over the last 256 next-token predictions, CPU, reference backend,
layer 0 dense in every row. Density is the mean over all 30 attention calls (the dense layer
counts as 1.0). See ``MEASURED``.

* PBS: threshold 0.95 is the lowest measured threshold meeting mean KL <= 0.01 nats and top-1
  >= 97% (0.90 reaches density 0.69 but top-1 0.94). At 0.95, permutation beats the same selector
  without permutation on both axes (density 0.77 vs 0.85, KL 0.0018 vs 0.0054).
* PISA / BSA: K=16 blocks of 64. At 2K tokens K=16 covers a large share of the visible blocks;
  PISA's KL is below BSA's at equal K (K=8: 0.041 vs 0.083; K=16: 0.0063 vs 0.0199). Neither reaches top-1 >= 97% at
  K=16 on 2K tokens (PISA 0.953); not yet measured at 8K.
"""
from ..config import BSAConfig, PBSConfig, PISAConfig
from . import Recipe

_WHERE = "SmolLM2-135M-Instruct Q4_1->fp32, 2048 tokens of pydoc_data.topics, last 256 positions, layer 0 dense"

MEASURED = {
    "setup": _WHERE,
    "pbs": [
        {"threshold": 0.90, "permute": True, "density": 0.692, "mean_kl": 0.0093, "p99_kl": 0.089, "top1": 0.941},
        {"threshold": 0.95, "permute": True, "density": 0.773, "mean_kl": 0.0018, "p99_kl": 0.021, "top1": 0.973},
        {"threshold": 0.98, "permute": True, "density": 0.864, "mean_kl": 0.0007, "p99_kl": 0.013, "top1": 0.992},
        {"threshold": 0.95, "permute": False, "density": 0.851, "mean_kl": 0.0054, "p99_kl": 0.054, "top1": 0.965},
    ],
    "pisa": [
        {"top_k": 8, "density": 0.599, "mean_kl": 0.0412, "p99_kl": 0.433, "top1": 0.902},
        {"top_k": 16, "density": 0.844, "mean_kl": 0.0063, "p99_kl": 0.062, "top1": 0.953},
    ],
    "bsa": [
        {"top_k": 8, "density": 0.599, "mean_kl": 0.0829, "p99_kl": 0.609, "top1": 0.844},
        {"top_k": 16, "density": 0.844, "mean_kl": 0.0199, "p99_kl": 0.150, "top1": 0.926},
    ],
}

RECIPE = Recipe(
    name="smollm2",
    description="SmolLM2 family (Llama architecture): layer 0 dense, PBS at threshold 0.95, PISA/BSA with K=16 blocks of 64",
    model_types=("llama",),
    configs={
        "pbs": PBSConfig(block_size=128, segment_size=256, threshold=0.95),
        "pisa": PISAConfig(block_size=64, top_k=16),
        "bsa": BSAConfig(block_size=64, top_k=16),
    },
    dense_layers=(0,),
    head_dim=64,
    measured=MEASURED,
)
