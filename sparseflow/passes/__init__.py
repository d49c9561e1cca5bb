"""Graph passes: find SDPA calls in Dynamo/export FX graphs and rewrite them into sparseflow ops."""

from .gqa_fold import RepeatMatch, fold_kv, match_repeat_kv
from .sdpa_rewrite import (
    SDPA_TARGETS,
    RewriteEntry,
    RewriteOptions,
    layer_index,
    module_tag,
    normalize_module_path,
    rewrite_graph,
)

__all__ = [
    "RepeatMatch",
    "fold_kv",
    "match_repeat_kv",
    "SDPA_TARGETS",
    "RewriteEntry",
    "RewriteOptions",
    "layer_index",
    "module_tag",
    "normalize_module_path",
    "rewrite_graph",
]
