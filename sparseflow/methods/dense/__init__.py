"""The dense pseudo-method: the rewrite with an SDPA body (proves the pass itself changes nothing)."""

from .config import DenseConfig
from ..registry import MethodSpec, OnnxBody, register

SPEC = register(
    MethodSpec(
        name="dense",
        config_type=DenseConfig,
        backends={},
        onnx=OnnxBody(node_type="DenseAttention", mask="sparseflow.methods.dense.onnx:MASK"),
        sparse=False,
    )
)
