"""Graph passes: find SDPA calls in Dynamo/export FX graphs and rewrite them into sparseflow ops."""

from .gqa_fold import RepeatMatch, fold_kv, match_repeat_kv
from .module_tags import layer_index, module_tag, normalize_module_path
from .rewrite_entry import RewriteEntry
from .rewrite_options import RewriteOptions
from .sdpa_rewrite import rewrite_graph
from .sdpa_targets import SDPA_TARGETS

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
