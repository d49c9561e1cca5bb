"""Name a graph node by the module that called it: the plain qualified module path (Dynamo's and
export's spellings alike) and the layer index read from it, the keys of reports and per-layer
settings."""

from __future__ import annotations

import re
from typing import Optional

import torch.fx as fx

__all__ = ["normalize_module_path", "module_tag", "layer_index"]


_ROOT_RE = re.compile(r"^(?:[LG]\[[^\]]*\](?:\[[^\]]*\])*|self)")


def normalize_module_path(path: str) -> str:
    """Dynamo writes module paths relative to frame locals (``L['self'].model.layers.0``,
    ``L['args'][0].h.1``, ``L['self']._modules['layers']._modules['0']``); export writes plain
    qualified names. Return the plain qualified name relative to the compiled module."""
    s = str(path)
    m = _ROOT_RE.match(s)
    if m:
        s = s[m.end() :]
    s = re.sub(r"\._modules\[['\"]([^'\"]+)['\"]\]", r".\1", s)
    s = re.sub(r"\[['\"]([^'\"]+)['\"]\]", r".\1", s)
    s = re.sub(r"\[(\d+)\]", r".\1", s)
    # getattr(L['self'].layers, '0') style
    while True:
        g = re.search(r"getattr\(([^,()]*), ['\"]([^'\"]+)['\"]\)", s)
        if not g:
            break
        inner = _ROOT_RE.sub("", g.group(1))
        s = s[: g.start()] + inner + "." + g.group(2) + s[g.end() :]
    return s.strip(".")


def module_tag(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1]
    path = path[0] if isinstance(path, (tuple, list)) else path
    return normalize_module_path(path)


_LAYER_RE = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


def layer_index(tag: str) -> Optional[int]:
    """The first integer component of a module path: ``model.layers.3.self_attn`` -> 3,
    ``transformer.h.0.attn`` -> 0, ``encoder.layer.11.attention.self`` -> 11."""
    m = _LAYER_RE.search(tag)
    return int(m.group(1)) if m else None
