"""Fold K/V that reach SDPA already repeated to every query head back into native GQA.

Models written for kernels without GQA support repeat each key/value head ``n_rep`` times before
calling SDPA; Hugging Face does it under ``torch.export`` (and under ``torch.compile`` whenever a
mask is passed)::

    k[:, :, None, :, :].expand(b, hkv, n_rep, n, d).reshape(b, hkv * n_rep, n, d)

or with ``torch.repeat_interleave(k, n_rep, dim=1)``. Both give query head ``i`` the key/value
head ``i // n_rep``, which is exactly what the sparseflow ops do natively, so the op can take the
un-repeated tensor and never read the copies.

The matcher is deliberately shape-driven: it walks back from the SDPA input through a short
chain of ops that keep row-major element order (unsqueeze, view/reshape/_unsafe_view, flatten,
``x[:, :, None]``-style indexing, full slices, clone/contiguous/alias) around exactly one
``expand``, and then checks on the fake tensors recorded in the graph that

    base [B, Hkv, N, D] --(order-preserving)--> [B, Hkv, 1, N, D] --expand--> [B, Hkv, R, N, D]
         --(order-preserving)--> [B, Hkv*R, N, D]

Since order-preserving reshapes are fully determined by their input and output shapes, these
shape facts prove the chain computes ``repeat_interleave(base, R, dim=1)``. Anything else
(transpose, ``repeat`` = tiling, gathers, real slices) is not folded.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Union

import torch
import torch.fx as fx

__all__ = ["RepeatMatch", "match_repeat_kv", "fold_kv", "fake_of", "erase_dead_chain"]

aten = torch.ops.aten

# ops whose output has the same elements in the same row-major order as their input
_RESHAPE_FUNCS = {
    torch.reshape,
    torch.unsqueeze,
    torch.flatten,
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.unsqueeze.default,
    aten.flatten.using_ints,
}
_RESHAPE_METHODS = {"view", "reshape", "unsqueeze", "flatten"}
_IDENTITY_FUNCS = {
    torch.clone,
    aten.clone.default,
    aten.alias.default,
    aten.contiguous.default,
    aten.lift_fresh_copy.default,
}
_IDENTITY_METHODS = {"clone", "contiguous"}
_EXPAND_FUNCS = {aten.expand.default, torch.broadcast_to}
_EXPAND_METHODS = {"expand"}
_REPEAT_INTERLEAVE_FUNCS = {torch.repeat_interleave, aten.repeat_interleave.self_int}
_REPEAT_INTERLEAVE_METHODS = {"repeat_interleave"}


def fake_of(node: Any) -> Optional[torch.Tensor]:
    """The fake tensor Dynamo (``example_value``) or export (``val``) recorded for a node."""
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("example_value", node.meta.get("val"))
    return val if isinstance(val, torch.Tensor) else None


def _same(a, b) -> bool:
    """Statically equal sizes (ints or SymInts), without adding guards."""
    try:
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return bool(statically_known_true(a == b))
    except Exception:  # pragma: no cover - very old torch
        return str(a) == str(b)


def _same_shape(a: Sequence, b: Sequence) -> bool:
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


def _is_call(node: fx.Node, funcs, methods) -> bool:
    if node.op == "call_function":
        return node.target in funcs
    if node.op == "call_method":
        return node.target in methods
    return False


def _full_slice(s) -> bool:
    return isinstance(s, slice) and s.start in (None, 0) and s.stop is None and s.step in (None, 1)


def _is_view_getitem(node: fx.Node) -> bool:
    """``x[:, :, None, ...]``: only full slices, None and Ellipsis (pure view, order kept)."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return False
    idx = node.args[1] if len(node.args) > 1 else None
    idx = idx if isinstance(idx, tuple) else (idx,)
    return all(i is None or i is Ellipsis or _full_slice(i) for i in idx)


def _is_full_aten_slice(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target is not aten.slice.Tensor:
        return False
    args = list(node.args) + [None] * (5 - len(node.args))
    start, step = args[2], node.kwargs.get("step", args[4])
    start = node.kwargs.get("start", start)
    if start not in (None, 0) or step not in (None, 1):
        return False
    a, b = fake_of(node.args[0]), fake_of(node)
    return a is not None and b is not None and _same_shape(a.shape, b.shape)


def _order_preserving(node: fx.Node) -> bool:
    return (
        _is_call(node, _RESHAPE_FUNCS, _RESHAPE_METHODS)
        or _is_call(node, _IDENTITY_FUNCS, _IDENTITY_METHODS)
        or _is_view_getitem(node)
        or _is_full_aten_slice(node)
    )


@dataclass(frozen=True)
class RepeatMatch:
    base: fx.Node  # the un-repeated [B, Hkv, N, D] tensor
    n_rep: int
    chain: Tuple[fx.Node, ...]  # the nodes between base (exclusive) and the SDPA input (inclusive)


def _static_int(x) -> Optional[int]:
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x
    try:
        return int(x) if hasattr(x, "node") and x.node.is_constant() else None  # constant SymInt
    except Exception:
        return None


def _match_repeat_interleave(node: fx.Node) -> Optional[RepeatMatch]:
    if not _is_call(node, _REPEAT_INTERLEAVE_FUNCS, _REPEAT_INTERLEAVE_METHODS):
        return None
    if node.target is aten.repeat_interleave.self_int:
        names = ("self", "repeats", "dim", "output_size")
    else:
        names = ("input", "repeats", "dim", "output_size")
    bound = dict(zip(names, node.args))
    bound.update(node.kwargs)
    src = bound.get("input", bound.get("self"))
    reps, dim = _static_int(bound.get("repeats")), bound.get("dim")
    base, out = fake_of(src), fake_of(node)
    if reps is None or reps < 1 or base is None or out is None or base.dim() != 4 or dim not in (1, -3):
        return None
    b, h, n, d = base.shape
    if not _same_shape(out.shape, (b, h * reps, n, d)):
        return None
    return RepeatMatch(src, reps, (node,))


def match_repeat_kv(node: Any) -> Optional[RepeatMatch]:
    """If ``node`` is a 4-D tensor made by repeating each head of a 4-D base R times (the
    repeat_kv / repeat_interleave(dim=1) pattern), return the base and R."""
    if not isinstance(node, fx.Node):
        return None
    out = fake_of(node)
    if out is None or out.dim() != 4:
        return None
    chain: List[fx.Node] = []
    found = _back_to_expand(node, chain)
    if not isinstance(found, fx.Node):
        return found  # a repeat_interleave's match, or None
    expand = found
    chain.append(expand)
    e_out = fake_of(expand)
    cur = expand.args[0] if expand.args else None
    if not isinstance(cur, fx.Node):
        return None
    e_in = fake_of(cur)
    if e_in is None or e_out is None or e_in.dim() != 5 or e_out.dim() != 5:
        return None
    base = _back_to_base(cur, chain)
    if base is None:
        return None
    b, h, n, d = fake_of(base).shape
    reps = _static_int(e_out.shape[2])
    if reps is None or reps < 1:
        return None
    if not (
        _same_shape(e_in.shape, (b, h, 1, n, d))
        and _same_shape(e_out.shape, (b, h, reps, n, d))
        and _same_shape(out.shape, (b, h * reps, n, d))
    ):
        return None
    return RepeatMatch(base, reps, tuple(chain))


def _back_to_expand(node: fx.Node, chain: List[fx.Node]) -> Union[fx.Node, RepeatMatch, None]:
    """From the repeated tensor back through order-preserving ops (appended to ``chain``) to the
    expand (returned), or to a repeat_interleave (its whole match returned); else None."""
    cur: Any = node
    while True:
        ri = _match_repeat_interleave(cur)
        if ri is not None:
            return RepeatMatch(ri.base, ri.n_rep, tuple(chain) + ri.chain)
        if _is_call(cur, _EXPAND_FUNCS, _EXPAND_METHODS):
            return cur
        if not _order_preserving(cur) or len(chain) > 8:
            return None
        chain.append(cur)
        cur = cur.args[0] if cur.args else None
        if not isinstance(cur, fx.Node):
            return None


def _back_to_base(cur: fx.Node, chain: List[fx.Node]) -> Optional[fx.Node]:
    """From the expand's input back through order-preserving ops (appended to ``chain``) to a
    4-D tensor, the repeat's base; None if there is none."""
    base: Any = cur
    while True:
        t = fake_of(base)
        if t is None:
            return None
        if t.dim() == 4:
            return base
        if not _order_preserving(base) or len(chain) > 16:
            return None
        chain.append(base)
        base = base.args[0] if base.args else None
        if not isinstance(base, fx.Node):
            return None


def fold_kv(k: Any, v: Any, n_q_heads) -> Tuple[Optional[RepeatMatch], Optional[RepeatMatch], str]:
    """Match K and V together. Folding only one of them would hand the op K and V with different
    head counts, so both fold (same R, Hkv*R == Hq) or neither; the string says why not."""
    mk, mv = match_repeat_kv(k), match_repeat_kv(v)
    if mk is None and mv is None:
        return None, None, ""
    if mk is None or mv is None:
        return None, None, f"only {'K' if mv is None else 'V'} is a repeat of fewer heads; K/V passed repeated"
    if mk.n_rep != mv.n_rep:
        return None, None, f"K repeated x{mk.n_rep} but V x{mv.n_rep}; K/V passed repeated"
    hkv_k, hkv_v = fake_of(mk.base).shape[1], fake_of(mv.base).shape[1]
    if not (_same(hkv_k, hkv_v) and _same(hkv_k * mk.n_rep, n_q_heads)):
        return None, None, "repeated K/V heads do not line up with the query heads; K/V passed repeated"
    return mk, mv, ""


def erase_dead_chain(graph: fx.Graph, match: RepeatMatch) -> None:
    """Remove the repeat nodes that nothing uses any more (all are pure tensor ops)."""
    for node in match.chain:  # ordered from the SDPA input back to the base
        if not getattr(node, "_erased", False) and node.graph is graph and not node.users:
            graph.erase_node(node)
