"""Use a mask the graph proves (see mask_proof) in the rewrite: check the proof fits the call,
build the op's key-padding mask from it, describe it and put its window into the layer's config
for the report, and erase the mask construction once nothing uses it."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.fx as fx

from ..config import AttentionConfig
from ..methods import windowed
from .gqa_fold import _same, fake_of
from .mask_proof import MaskProof, prove_mask
from .rewrite_entry import RewriteEntry

__all__ = ["proven_mask", "padding_mask_node", "describe_proof", "windowed_config", "erase_if_dead"]

aten = torch.ops.aten


def proven_mask(mask: fx.Node, qf, kf, windows: bool = False) -> Optional[MaskProof]:
    """The mask's proof when it can replace the mask: its key padding is ``[B, Nk]`` of these
    q/k and a causal mask is square (the op's causal is top-left, like SDPA's). ``windows``: a
    causal local window may be part of it (the caller then puts it into the op's config)."""
    proof = prove_mask(mask, windows=windows)
    if proof is None or qf is None or kf is None:
        return None
    if proof.causal and not _same(qf.shape[2], kf.shape[2]):
        return None
    if proof.key_padding is not None:
        pf = fake_of(proof.key_padding)
        if pf is None or pf.dim() != 2 or not (_same(pf.shape[0], qf.shape[0]) and _same(pf.shape[1], kf.shape[2])):
            return None
    return proof


def padding_mask_node(graph: fx.Graph, before: fx.Node, proof: MaskProof) -> Tuple[Optional[fx.Node], bool]:
    """(attn_mask, is_causal) for the op from a proof: the key padding as SDPA's ``[B, 1, 1, Nk]``
    bool form (the op intersects it with causality), built from the ``[B, Nk]`` graph tensor."""
    kp = proof.key_padding
    if kp is None:
        return None, proof.causal
    pf = fake_of(kp)
    with graph.inserting_before(before):
        x = kp if pf.dtype == torch.bool else graph.call_function(aten.ne.Scalar, (kp, 0))
        x = graph.call_function(aten.unsqueeze.default, (x, 1))
        x = graph.call_function(aten.unsqueeze.default, (x, 2))
    _set_fake(x, pf)
    return x, proof.causal


def _set_fake(node: fx.Node, padding_fake) -> None:
    # the [B, 1, 1, Nk] bool value, for passes that read node metadata (export's ``val``)
    try:
        with padding_fake.fake_mode:
            val = (padding_fake != 0)[:, None, None, :]
    except Exception:  # metadata only
        return
    node.meta["val"] = node.meta["example_value"] = val


def describe_proof(proof: MaskProof) -> str:
    parts = (["causal"] if proof.causal else []) + (["key padding [B, Nk]"] if proof.key_padding is not None else [])
    if proof.sliding_window:
        parts.append(f"sliding window {proof.sliding_window}")
    if proof.chunk_size:
        parts.append(f"chunks of {proof.chunk_size}")
    return " + ".join(parts) + " (proven from the graph; the [Nq, Nk] mask is not built)"


def windowed_config(cfg: AttentionConfig, proof: MaskProof, entry: RewriteEntry) -> AttentionConfig:
    """The layer's config with the window its mask was proven to hold (see ``registry.windowed``),
    said in the report."""
    cfg, note = windowed(cfg, proof.sliding_window, proof.chunk_size)
    entry.notes.append(f"windowed layer: sliding_window={cfg.sliding_window}, chunk_size={cfg.chunk_size}")
    if note:
        entry.notes.append(note)
    return cfg


_ASSERT_METADATA = getattr(getattr(aten, "_assert_tensor_metadata", None), "default", None)


def erase_if_dead(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` and, recursively, the inputs only it used (the mask construction)."""
    pending = [node]
    while pending:
        n = pending.pop()
        if n.graph is not graph or n.op not in ("call_function", "call_method"):
            continue
        for u in list(n.users):  # export's dtype/device asserts on the erased values go with them
            if u.target is _ASSERT_METADATA and not u.users:
                graph.erase_node(u)
        if n.users:
            continue
        inputs = list(n.all_input_nodes)
        graph.erase_node(n)
        pending.extend(inputs)
