"""The dense pseudo-method: the rewrite with an SDPA body (proves the pass itself changes nothing)."""

from .tuning import DenseTuning
from .config import DenseConfig
from ..registry import Backend, MethodSpec, OnnxBody, register

# the backends run only windowed calls (a config with sliding_window or chunk_size): exact
# attention within the window, as block-sparse attention; without a window the op runs SDPA
SPEC = register(
    MethodSpec(
        tuning_type=DenseTuning,
        name="dense",
        config_type=DenseConfig,
        backends={
            "reference": Backend("sparseflow.methods.dense.reference:window_attention", "always", windows=True),
            "triton": Backend("sparseflow.methods.dense.window:triton_window_attention", "always", windows=True),
            "flex": Backend("sparseflow.methods.dense.window:flex_window_attention", "cuda", windows=True),
        },
        onnx=OnnxBody(node_type="DenseAttention", mask="sparseflow.methods.dense.onnx:MASK"),
        sparse=False,
    )
)
