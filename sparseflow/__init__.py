"""sparseflow: rewrite scaled-dot-product attention into sparse-attention custom ops.

Importing registers the ``sparseflow::*`` ops (torch only); Triton, transformers and ONNX are
imported lazily by the backends and tools that need them.
"""

from . import ops, passes
from .api import InspectionResult, RewriteReport, compile, export, inspect, report
from .context_parallel import ContextParallel
from .config import AttentionConfig, BSAConfig, DenseConfig, PBSConfig, PISAConfig, config_from_dict, default_config
from .ops import attention, bsa_attention, dense_attention, pbs_attention, pisa_attention
from .recording import CallRecord, Capture, capture
from .selection import Selection
from .tuning import Tuning
from ._version import __version__

__all__ = [
    "AttentionConfig",
    "BSAConfig",
    "CallRecord",
    "Capture",
    "ContextParallel",
    "DenseConfig",
    "InspectionResult",
    "PBSConfig",
    "PISAConfig",
    "RewriteReport",
    "Selection",
    "Tuning",
    "attention",
    "bsa_attention",
    "capture",
    "compile",
    "config_from_dict",
    "default_config",
    "dense_attention",
    "export",
    "export_onnx",
    "inspect",
    "ops",
    "passes",
    "pbs_attention",
    "pisa_attention",
    "report",
    "__version__",
]


def export_onnx(*args, **kwargs):
    """Export a model rewritten with a sparseflow method to ONNX (see :mod:`sparseflow.onnx_export`;
    needs ``pip install sparseflow[onnx]``). Imported lazily: ``import sparseflow`` never imports
    onnx or onnxscript."""
    from .onnx_export import export_onnx as _export_onnx

    return _export_onnx(*args, **kwargs)
