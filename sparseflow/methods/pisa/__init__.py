"""PISA (pyramid block selection): its spec in the method registry."""

from .tuning import PISATuning
from .config import PISAConfig
from ..registry import Backend, BenchPart, Decode, MethodSpec, OnnxBody, register
from ..topk import TOPK_ONNX_FIELDS, exact_top_k, top_k_window_rule

_KERNELS = __name__  # the backends are modules of this package

# the pyramid walk's rough cost in units of the layer's dense attention: it scores O(N K log N)
# nodes, where dense scores O(N^2) keys
WALK_COST = 0.02

SPEC = register(
    MethodSpec(
        tuning_type=PISATuning,
        name="pisa",
        config_type=PISAConfig,
        backends={
            "reference": Backend(f"{_KERNELS}.reference:pisa_attention", differentiable="always", windows=True),
            "triton": Backend(
                f"{_KERNELS}.triton_impl:pisa_attention",
                differentiable="always",
                windows=True,
                tuned=True,
                compact_graph=True,
            ),
            "flex": Backend(f"{_KERNELS}.flex:pisa_attention", differentiable="cuda", windows=True),
        },
        onnx=OnnxBody(
            node_type="PISAAttention",
            mask="sparseflow.methods.pisa.onnx:MASK",
            fields=TOPK_ONNX_FIELDS | {"branching", "score", "beam"},
            windows=True,
        ),
        # generate(): the Triton backend appends each token to the model's cached pyramid
        decode=Decode(backend="triton", step="sparseflow.methods.pisa.decode:decode_step"),
        has_top_k=True,
        exact=exact_top_k,
        selection=f"{_KERNELS}.reference:pisa_reference_selection",
        selection_check=f"{_KERNELS}.tolerance_check:check_selection",
        estimate_cost=lambda cfg: WALK_COST,
        window_rule=top_k_window_rule,
        # the paper's latency setting at small lengths, and a K=32 call at a model's shape
        bench=BenchPart(
            "pisa.py",
            checks=(PISAConfig(block_size=32, top_k=4),),
            timings=(
                (PISAConfig(), (4096, 32, 2, 64)),
                (PISAConfig(), (8192, 32, 2, 64)),
                (PISAConfig(top_k=32), (16384, 32, 8, 128)),
            ),
        ),
    )
)
