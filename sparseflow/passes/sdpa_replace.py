"""The graph edits for one SDPA call the pass has decided on: the op node in place of the SDPA
node (with its meta, fake output and, in export graphs, SDPA's output layout), or the SDPA node
kept with ``is_causal=True`` in place of a proven causal mask."""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.fx as fx

from ..config import AttentionConfig
from ..ops import op_args, op_for
from .gqa_fold import erase_dead_chain, fake_of
from .mask_rewrite import describe_proof, erase_if_dead, padding_mask_node, proven_mask
from .rewrite_entry import RewriteEntry
from .rewrite_options import RewriteOptions
from .sdpa_call import KVHeads, SdpaCall
from .sdpa_targets import SdpaTarget

__all__ = ["replace_with_op", "keep_sdpa_causal"]

aten = torch.ops.aten


def keep_sdpa_causal(graph: fx.Graph, node: fx.Node, spec: SdpaTarget, call: SdpaCall, entry: RewriteEntry) -> None:
    """A call kept as SDPA whose materialised mask is proven purely causal gets ``is_causal=True``
    in place of the mask (the same result): transformers hands a compiled model's every layer an
    ``[N, N]`` mask, which SDPA would build and then run a masked kernel over all ``N x N`` (4x
    the causal kernel's time at 128K on the H200). A mask with key padding is kept: SDPA cannot
    take it together with ``is_causal``."""
    if spec.returns_tuple or spec.mask_arg is None or call.mask is None or call.is_causal is not False:
        return
    proof = proven_mask(call.mask, call.qf, call.kf)
    if proof is None or not proof.causal or proof.key_padding is not None:
        return
    old_mask = call.mask
    _set_node_arg(node, spec.schema, spec.mask_arg, None)
    _set_node_arg(node, spec.schema, "is_causal", True)
    entry.is_causal = True
    entry.mask = describe_proof(proof)
    entry.notes.append("SDPA kept, with is_causal=True in place of its proven causal mask")
    erase_if_dead(graph, old_mask)


def _set_node_arg(node: fx.Node, schema, name: str, value) -> None:
    """Set argument ``name`` of ``node`` where the node passes it (positionally or by keyword)."""
    index = [a.name for a in schema.arguments].index(name)
    if index < len(node.args):
        node.update_arg(index, value)
    else:
        node.update_kwarg(name, value)


def replace_with_op(
    graph: fx.Graph,
    node: fx.Node,
    spec: SdpaTarget,
    cfg: AttentionConfig,
    call: SdpaCall,
    heads: KVHeads,
    proven,
    entry: RewriteEntry,
    options: RewriteOptions,
    graph_kind: str,
) -> None:
    """Insert the op call in place of the SDPA node (a proven mask replaced by its key padding),
    give it the node's meta and fake output, and erase what the node alone used."""
    op = op_for(cfg.method)
    mask, is_causal, scale = call.mask, call.is_causal, call.scale
    old_mask = None
    if proven is not None:
        old_mask, (mask, is_causal) = mask, padding_mask_node(graph, node, proven)
        entry.mask = describe_proof(proven)
    op_call_args = (
        call.q,
        heads.k,
        heads.v,
        mask,
        is_causal,
        None if scale is None else float(scale),
        *op_args(cfg, options.call_tuning(graph_kind)),
        options.backend,
        entry.tag,
    )
    with graph.inserting_before(node):
        new = graph.call_function(op, args=op_call_args)
    new.meta.update({k_: v_ for k_, v_ in node.meta.items() if k_ not in ("val", "example_value", "tensor_meta")})
    val = _fake_output(op, op_call_args)
    old_out = fake_of(next(iter(node.users))) if spec.returns_tuple else fake_of(node)
    if val is not None:
        keys = [k_ for k_ in ("val", "example_value") if k_ in node.meta] or ["val"]
        for k_ in keys:
            new.meta[k_] = val
    result = new
    if graph_kind == "export" and old_out is not None and val is not None:
        result = _restore_layout(graph, new, old_out, val)
    if spec.returns_tuple:
        for u in list(node.users):
            u.replace_all_uses_with(result)
            graph.erase_node(u)
    else:
        node.replace_all_uses_with(result)
    graph.erase_node(node)
    for m in (heads.folded_k, heads.folded_v):
        if m is not None:
            erase_dead_chain(graph, m)
    if old_mask is not None:
        erase_if_dead(graph, old_mask)


def _fake_output(op, args) -> Optional[torch.Tensor]:
    """The op's output as a fake tensor, for the new node's metadata."""
    fakes = [fake_of(a) if isinstance(a, fx.Node) else a for a in args]
    q = fakes[0]
    mode = getattr(q, "fake_mode", None)
    if mode is None:
        return None
    try:
        with mode:
            return op(*fakes)
    except Exception:  # metadata only: never fail the rewrite for it
        return None


def _stride_order(t: torch.Tensor) -> Optional[List[int]]:
    """Dims from outermost to innermost in memory (None when it cannot be told)."""
    try:  # handles symbolic strides too
        from torch._prims_common import compute_elementwise_output_logical_to_physical_perm

        perm = compute_elementwise_output_logical_to_physical_perm(t)
        return list(perm[0] if isinstance(perm, tuple) and isinstance(perm[0], (list, tuple)) else perm)
    except Exception:
        pass
    try:
        strides = [int(s) for s in t.stride()]
        sizes = [int(s) for s in t.shape]
    except Exception:
        return None
    return sorted(range(t.dim()), key=lambda d: (-strides[d], -sizes[d], d))


def _restore_layout(graph: fx.Graph, new: fx.Node, old_out: torch.Tensor, val: torch.Tensor) -> fx.Node:
    """Give the op's output (``[B, N, H, D]``-major memory) the memory layout SDPA's output had.

    Export graphs are functional: a ``.contiguous()`` that was a no-op on SDPA's output (on the
    CPU and CUDA, SDPA mostly returns [B, N, H, D]-major memory, as the op does) is gone from the
    graph, and a later ``view`` relies on that layout. When the two differ: permute to the old
    memory order, copy, permute back."""
    order = _stride_order(old_out)
    if order is None or order == _stride_order(val):
        return new
    inverse = [order.index(d) for d in range(len(order))]
    with graph.inserting_after(new):
        p1 = graph.call_function(aten.permute.default, (new, order))
    with graph.inserting_after(p1):
        c = graph.call_function(aten.clone.default, (p1,), {"memory_format": torch.contiguous_format})
    with graph.inserting_after(c):
        p2 = graph.call_function(aten.permute.default, (c, inverse))
    for n_ in (p1, c, p2):
        n_.meta.update({k_: v_ for k_, v_ in new.meta.items() if k_ not in ("val", "example_value", "tensor_meta")})
    try:
        with val.fake_mode:
            v1 = val.permute(order)
            v2 = v1.clone(memory_format=torch.contiguous_format)
            p1.meta["val"], c.meta["val"], p2.meta["val"] = v1, v2, v2.permute(inverse)
    except Exception:  # metadata only
        pass
    return p2
