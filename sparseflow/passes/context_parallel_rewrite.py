"""Turn a rewritten graph's attention ops into context-parallel ones.

Under sequence sharding every attention call of the model must see the whole sequence: one call
left as plain SDPA would attend within its rank's shard only, a silently wrong answer. So this
step runs after the rewrite and refuses a graph where any attention call was kept; calls the user
kept dense (``skip_layers``, ``filter_fn``, a recipe's dense layers) reach it as the dense op.
"""

from __future__ import annotations

import json
from typing import Any, List

import torch
import torch.fx as fx

from ..config import METHODS
from ..methods import spec_for
from ..op_schema import FIELDS, op_for

__all__ = ["to_context_parallel"]


def _refuse_kept_calls(entries: List[Any]) -> None:
    kept = [e for e in entries if not e.rewritten]
    if kept:
        where = "; ".join(f"{e.tag or '<root>'}: {e.reason}" for e in kept[:3])
        raise ValueError(
            f"context_parallel needs every attention call of the model rewritten, but {len(kept)} would stay "
            f"plain SDPA (each would attend within its rank's shard only): {where}"
        )


def _group_name(cp) -> str:
    from ..context_parallel import process_group

    return process_group(cp.group).group_name


def to_context_parallel(graph: fx.Graph, entries: List[Any], options) -> None:
    """Replace each ``sparseflow::<method>_attention`` call of ``graph`` by
    ``sparseflow::cp_attention`` with the same config, tuning, backend and tag."""
    from .. import context_parallel_op  # noqa: F401  (registers sparseflow::cp_attention)

    _refuse_kept_calls(entries)
    cp = options.context_parallel
    group, tuning = _group_name(cp), json.dumps(options.tuning.to_dict(), sort_keys=True)
    targets = {op_for(m): m for m in METHODS}
    for node in list(graph.nodes):
        method = targets.get(node.target) if node.op == "call_function" else None
        if method is None:
            continue
        names = [name for name, _ in FIELDS[method]]
        q, k, v, mask, is_causal, scale = node.args[:6]
        config = METHODS[method](**dict(zip(names, node.args[6 : 6 + len(names)])))
        backend, tag = node.args[-2], node.args[-1]
        if not spec_for(method).sparse:
            backend = "auto"  # a layer kept as SDPA: the dense op has no other backend
        with graph.inserting_before(node):
            new = graph.call_function(
                torch.ops.sparseflow.cp_attention.default,
                (q, k, v, mask, is_causal, scale, config.to_json(), tuning, group, cp.sharding, backend, tag),
            )
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
