"""Find scaled-dot-product attention in an FX graph and rewrite it into a sparseflow op.

Works on the two graph flavours a user can reach:

* **Dynamo graphs** (what ``torch.compile`` hands a backend, before AOT autograd): SDPA appears as
  ``torch._C._nn.scaled_dot_product_attention`` (== ``F.scaled_dot_product_attention``) with
  ``example_value`` fake tensors on the nodes; ``nn.MultiheadAttention`` appears as one opaque
  ``F.multi_head_attention_forward`` node (Dynamo keeps it in the graph), whose inner SDPA call we
  route to the op (see ``mha_route.mha_forward_routed``).
* **Export graphs** (``torch.export`` after ``run_decompositions({})``): ``aten.scaled_dot_product_attention``
  and, where a graph was captured below the SDPA dispatcher, the backend-specific variants
  (``_scaled_dot_product_flash_attention_for_cpu``, ``_efficient_attention``, ``_flash_attention``,
  ``_cudnn_attention``, ``_attention_math``), with ``val`` fake tensors.

Every call found becomes one :class:`RewriteEntry`: rewritten, or skipped with the reason. A
call is never rewritten unless the fake tensors prove the op can take it (4-D, fp16/bf16/fp32,
no dropout, head counts compatible); the op itself still falls back to dense at run time for
what only the values can tell (masks it cannot fold, decode steps, short sequences), and records
that under ``sparseflow.capture()``.

This module walks the graph and decides each call; the steps live beside it: ``sdpa_targets``
(what is looked for), ``module_tags`` (the call's module and layer), ``sdpa_call`` (reading a
call and the checks), ``mask_rewrite`` (proven masks), ``sdpa_replace`` (the graph edits),
``mha_route`` (``nn.MultiheadAttention``), ``rewrite_options`` / ``rewrite_entry`` (what the pass
is told and what it reports).
"""

from __future__ import annotations

from typing import Dict, List

import torch.fx as fx
import torch.nn.functional as F

from .mask_rewrite import proven_mask, windowed_config
from .mha_route import rewrite_mha
from .module_tags import layer_index, module_tag
from .rewrite_entry import RewriteEntry
from .rewrite_options import RewriteOptions, options_for_call
from .sdpa_call import constant_args_reason, kv_heads, read_sdpa_call, tensor_args_reason
from .sdpa_replace import keep_sdpa_causal, replace_with_op
from .sdpa_targets import FASTPATH_REASON, FUSED_TARGETS, SDPA_TARGETS, SdpaTarget

__all__ = ["rewrite_graph"]


def _rewrite_sdpa(
    graph: fx.Graph, node: fx.Node, spec: SdpaTarget, entry: RewriteEntry, options: RewriteOptions, graph_kind: str
) -> None:
    """Rewrite one SDPA node into the op of its layer's config, or leave it and say why in ``entry``."""
    call = read_sdpa_call(node, spec, entry)
    if call is None:
        return
    options = options_for_call(options, call.kf.shape[-2], entry.notes)
    cfg, why = options.resolve(entry.tag, entry.layer)
    if cfg is None:
        entry.reason = why
        keep_sdpa_causal(graph, node, spec, call, entry)
        return
    entry.reason = constant_args_reason(node, spec, call) or tensor_args_reason(call, entry)
    if entry.reason:
        return
    proven = proven_mask(call.mask, call.qf, call.kf, windows=True) if call.mask is not None else None
    heads = kv_heads(call, entry)
    if heads is None:
        return
    if proven is not None and (proven.sliding_window or proven.chunk_size):
        cfg = windowed_config(cfg, proven, entry)
    replace_with_op(graph, node, spec, cfg, call, heads, proven, entry, options, graph_kind)
    entry.rewritten, entry.reason = True, ""
    entry.method, entry.config = cfg.method, cfg.to_dict()


def rewrite_graph(gm: fx.GraphModule, options: RewriteOptions, *, graph_kind: str = "dynamo") -> List[RewriteEntry]:
    """Rewrite every attention call in ``gm.graph`` in place (then recompile ``gm``); return one
    entry per call found. Never raises for a call it cannot take: that call is kept as is and
    its entry says why (also logged at INFO on the "sparseflow" logger)."""
    graph = gm.graph
    entries: List[RewriteEntry] = []
    seen_per_tag: Dict[str, int] = {}
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        target = node.target
        try:
            spec = SDPA_TARGETS.get(target)
        except TypeError:  # unhashable target
            continue
        is_mha = target is F.multi_head_attention_forward
        fused = FUSED_TARGETS.get(target) if spec is None and not is_mha else None
        if spec is None and not is_mha and fused is None:
            continue
        tag = module_tag(node)
        site = seen_per_tag.get(tag, 0)
        seen_per_tag[tag] = site + 1
        entry = RewriteEntry(
            tag=tag,
            layer=layer_index(tag),
            rewritten=False,
            reason="",
            method=None,
            config=None,
            target=spec.name if spec is not None else ("F.multi_head_attention_forward" if is_mha else fused),
            graph=graph_kind,
            site=site,
        )
        if spec is not None:
            _rewrite_sdpa(graph, node, spec, entry, options, graph_kind)
        elif is_mha:
            rewrite_mha(node, entry, options)
        else:
            entry.reason = FASTPATH_REASON.format(name=fused)
        if not entry.rewritten and not entry.reason:  # pragma: no cover - defensive
            entry.reason = "not rewritten"
        entries.append(entry)
    if options.context_parallel is not None:
        from .context_parallel_rewrite import to_context_parallel

        to_context_parallel(graph, entries, options)
    graph.lint()
    gm.recompile()
    return entries
