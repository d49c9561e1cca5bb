"""BSA (flat top-k block selection, the baseline): its spec in the method registry."""

from .tuning import BSATuning
from .config import BSAConfig
from ..registry import Backend, BenchPart, MethodSpec, OnnxBody, register
from ..topk import TOPK_ONNX_FIELDS, exact_top_k, top_k_window_rule

_KERNELS = __name__  # the backends are modules of this package

# the full scan's rough cost in units of the layer's dense attention: it scores every visible
# block of every query tile, O(N^2 / B) block scores
SCAN_COST = 0.03

SPEC = register(
    MethodSpec(
        tuning_type=BSATuning,
        name="bsa",
        config_type=BSAConfig,
        backends={
            "reference": Backend(f"{_KERNELS}.reference:bsa_attention", differentiable="always", windows=True),
            "triton": Backend(
                f"{_KERNELS}.triton_impl:bsa_attention",
                differentiable="always",
                windows=True,
                tuned=True,
                compact_graph=True,
            ),
            "flex": Backend(f"{_KERNELS}.flex:bsa_attention", differentiable="cuda", windows=True),
        },
        onnx=OnnxBody(
            node_type="BSAAttention", mask="sparseflow.methods.bsa.onnx:MASK", fields=TOPK_ONNX_FIELDS, windows=True
        ),
        has_top_k=True,
        exact=exact_top_k,
        selection=f"{_KERNELS}.reference:bsa_reference_selection",
        estimate_cost=lambda cfg: SCAN_COST,
        window_rule=top_k_window_rule,
        # PISA's baseline: timed beside it, in its part
        bench=BenchPart(
            "pisa.py",
            checks=(BSAConfig(block_size=32, top_k=4),),
            timings=((BSAConfig(), (4096, 32, 2, 64)), (BSAConfig(), (8192, 32, 2, 64))),
        ),
    )
)
