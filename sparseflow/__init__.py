"""sparseflow: rewrite scaled-dot-product attention into sparse-attention custom ops."""
from .config import AttentionConfig, BSAConfig, DenseConfig, PBSConfig, PISAConfig, config_from_dict, default_config
from .selection import Selection
from .recording import capture, Capture, CallRecord
from . import ops
from .ops import attention, bsa_attention, dense_attention, pbs_attention, pisa_attention

__version__ = "0.1.0"
from .api import InspectionResult, RewriteReport, compile, export, inspect, report
from . import passes


def export_onnx(*args, **kwargs):
    """Export a model rewritten with a sparseflow method to ONNX (see :mod:`sparseflow.onnx_export`;
    needs ``pip install sparseflow[onnx]``). Imported lazily: ``import sparseflow`` never imports
    onnx or onnxscript."""
    from .onnx_export import export_onnx as _export_onnx

    return _export_onnx(*args, **kwargs)
