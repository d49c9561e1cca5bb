"""Prove from an FX graph that an attention mask is causal, key padding, a local window, or a mix.

Hugging Face models build their SDPA mask inside the traced graph under ``torch.compile`` and
``torch.export`` (``arange`` position vectors compared with ``<=``, the ``[B, N]`` attention mask
indexed by (batch, key position), combined with ``&`` and expanded to ``[B, 1, Nq, Nk]``). Handing
that materialised ``[Nq, Nk]`` mask to the sparse op costs a quadratic tensor and a run-time
check per layer. :func:`prove_mask` reads the nodes that produce the mask instead and, when every
one of them is understood, returns what the mask *is*: ``kv <= q`` (causal), ``src[b, kv]``
(key padding from a ``[B, N]`` tensor of the graph), with ``windows=True`` a sliding window
(``kv > q - W``) or chunks (``kv // C == q // C``) on top of causality, or their conjunction.
Anything else (a bias, an unknown op, offsets that do not give exactly these forms) gives
``None`` and the caller keeps the mask.

What transformers 5.25 builds (tiny Mistral, Qwen2 with ``use_sliding_window``, Gemma 3, Cohere2,
Llama 4 text; ``attn_implementation="sdpa"``; Gemma 2 has no SDPA path, eager only):

- sliding layers: ``new_ones(bool) & (kv > q - W) & (kv <= q)``, ``& attention_mask.bool()[b, kv]``
  with an attention mask; Dynamo indexes ``arange + 0`` with ``None``, export unsqueezes it and,
  without an attention mask, reads positions through ``position_ids[b, q]`` and adds the
  packed-sequence check ``cumsum(diff(position_ids) != 1)[b, q] == ...[b, kv]``.
- chunked layers (Llama 4): ``((kv - lp[b]) // C == (q - lp[b]) // C) & (kv <= q)`` where ``lp``
  counts each row's left padding: ``zeros(B, dtype=int64)`` without an attention mask (proven),
  a ``cumsum``/``sum`` of the attention mask with one (chunks then start at each row's first
  token, which ``MaskProof`` cannot state: not proven).
- full layers: under Dynamo without an attention mask (and sliding layers shorter than their
  window) no mask at all, ``is_causal=True``; with one, or under export, the causal mask above.
  Left and right padding build the same graph (the values differ, not the ops).

The analysis is an abstract interpretation over a small vocabulary: integer position vectors
(``arange`` plus a constant, placed on one axis of a broadcast shape by indexing with ``None`` or
``unsqueeze``), their floor division by a constant, and boolean conjunctions of the atoms above.
Both graph flavours are understood: Dynamo's (torch functions, ``operator`` functions, tensor
methods) and export's (``aten`` ops).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Dict, FrozenSet, Optional, Tuple, Union

import torch
import torch.fx as fx

__all__ = ["MaskProof", "prove_mask"]

aten = torch.ops.aten


@dataclass(frozen=True)
class MaskProof:
    """The mask is the conjunction, for query ``p`` and key ``j`` (indices into the attention's
    query and key axes), of: ``j <= p`` when ``causal``; ``key_padding[b, j]`` when not None (a
    ``[B, Nk]`` graph node of any dtype, nonzero = attend); ``p - sliding_window < j`` when
    ``sliding_window`` (the last W keys, the query's own included); ``j // chunk_size ==
    p // chunk_size`` when ``chunk_size``. A window or chunk is only ever proven with ``causal``."""

    causal: bool
    key_padding: Optional[fx.Node]
    sliding_window: int = 0
    chunk_size: int = 0


# --------------------------------------------------------------------------- abstract values


@dataclass(frozen=True)
class _Pos:
    """An integer tensor equal to ``arange(length) + offset`` along ``axis`` of an ``ndim``-D
    broadcast shape (size 1 on every other axis)."""

    axis: int
    ndim: int
    offset: int
    length: Any


@dataclass(frozen=True)
class _Upper:
    """``kv_pos - q_pos <= bound`` (0: SDPA's ``is_causal``)."""

    bound: int


@dataclass(frozen=True)
class _Padding:
    """``src[b, kv_pos + offset]`` for a ``[B, N]`` node ``src``."""

    src: fx.Node
    offset: int


@dataclass(frozen=True)
class _Lower:
    """``kv_pos - q_pos >= bound`` (a sliding window of ``1 - bound`` keys when with causality)."""

    bound: int


@dataclass(frozen=True)
class _Chunk:
    """``kv_pos // size == q_pos // size`` (chunked attention)."""

    size: int


_Atom = Union[_Upper, _Padding, _Lower, _Chunk]


@dataclass(frozen=True)
class _Bool:
    """A boolean tensor equal to the conjunction of ``atoms`` (empty: all True)."""

    atoms: FrozenSet[_Atom]


@dataclass(frozen=True)
class _BoolSource:
    """A ``[B, N]`` graph tensor seen as booleans (the model's attention mask)."""

    node: fx.Node


@dataclass(frozen=True)
class _Const:
    """A tensor whose every element equals ``value`` (an int or a bool), of rank ``ndim`` (None:
    not known)."""

    value: Any
    ndim: Optional[int] = None


@dataclass(frozen=True)
class _FloorDiv:
    """``pos // size`` for a position vector and a positive int (the chunk index of a position)."""

    pos: _Pos
    size: int


_Value = Union[_Pos, _Bool, _BoolSource, _Const, _FloorDiv, int, None]


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int_operand(v: _Value, ndim: int) -> Optional[int]:
    """``v`` as an int to combine elementwise with an ``ndim``-D position vector: a Python int,
    or a constant tensor of no higher rank (a higher one would change the result's rank, which
    the position vector records)."""
    if _is_int(v):
        return v
    if isinstance(v, _Const) and _is_int(v.value) and v.ndim is not None and v.ndim <= ndim:
        return v.value
    return None


_Q_AXIS, _KV_AXIS, _B_AXIS = 2, 3, 0


# --------------------------------------------------------------------------- op vocabulary


_ARANGE = {torch.arange, aten.arange.default, aten.arange.start, aten.arange.start_step}
_ADD = {operator.add, torch.add, aten.add.Tensor, aten.add.Scalar}
_SUB = {operator.sub, torch.sub, aten.sub.Tensor, aten.sub.Scalar}
_COMPARE = {
    "le": {operator.le, torch.le, aten.le.Tensor, aten.le.Scalar},
    "lt": {operator.lt, torch.lt, aten.lt.Tensor, aten.lt.Scalar},
    "ge": {operator.ge, torch.ge, aten.ge.Tensor, aten.ge.Scalar},
    "gt": {operator.gt, torch.gt, aten.gt.Tensor, aten.gt.Scalar},
}
_AND = {
    operator.and_,
    torch.logical_and,
    torch.bitwise_and,
    aten.logical_and.default,
    aten.bitwise_and.Tensor,
    aten.__and__.Tensor,
}
_EXPAND = {aten.expand.default}
_UNSQUEEZE = {torch.unsqueeze, aten.unsqueeze.default}
_TO_COPY = {aten._to_copy.default, aten.to.dtype, aten.to.device, aten.to.dtype_layout}
_ONES = {aten.new_ones.default, torch.ones, aten.ones.default}
_ZEROS = {torch.zeros, aten.zeros.default}
_FLOORDIV = {operator.floordiv, torch.floor_divide, aten.floor_divide.default, aten.floor_divide.Scalar}
# division that floors only with rounding_mode="floor" ("trunc" differs on negative positions)
_DIV = {torch.div, aten.div.Tensor_mode, aten.div.Scalar_mode}
_INDEX = {aten.index.Tensor}
_SLICE = {aten.slice.Tensor}
_DIFF = {torch.diff, aten.diff.default}
_CUMSUM = {torch.cumsum, aten.cumsum.default}
_EQ = {operator.eq, torch.eq, aten.eq.Tensor, aten.eq.Scalar}
_NE = {operator.ne, torch.ne, aten.ne.Tensor, aten.ne.Scalar}
_METHOD_IDENTITY = {"contiguous"}
# tensor methods that are the functions above with ``self`` first
_OPERATORS = {
    "le": operator.le,
    "lt": operator.lt,
    "ge": operator.ge,
    "gt": operator.gt,
    "eq": operator.eq,
    "ne": operator.ne,
    "add": operator.add,
    "sub": operator.sub,
    "floordiv": operator.floordiv,
}
_METHOD_AS_FUNCTION = {
    **_OPERATORS,
    **{f"__{k}__": f for k, f in _OPERATORS.items()},
    "__and__": operator.and_,
    "logical_and": operator.and_,
    "bitwise_and": operator.and_,
    "floor_divide": operator.floordiv,
    "div": torch.div,
}


def _is_bool_dtype(kwargs, args=()) -> bool:
    dt = kwargs.get("dtype")
    if dt is None:
        dt = next((a for a in args if isinstance(a, torch.dtype)), None)
    return dt is torch.bool


def _zeros(args, kwargs) -> _Value:
    """``zeros(shape, dtype=<integer>)``: an int zero of the shape's rank (transformers' left
    padding count for chunked attention when there is no attention mask)."""
    dt = kwargs.get("dtype")
    if not isinstance(dt, torch.dtype) or dt is torch.bool or dt.is_floating_point or dt.is_complex:
        return None
    shape = kwargs.get("size", args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args)
    if not all(_is_int(d) or isinstance(d, fx.Node) for d in shape):
        return None
    return _Const(0, ndim=len(shape))


class _Interpreter:
    def __init__(self):
        self.memo = {}

    def value(self, x) -> _Value:
        if isinstance(x, bool):
            return None
        if isinstance(x, int):
            return x
        if not isinstance(x, fx.Node):
            return None
        if x not in self.memo:
            self.memo[x] = None  # cycles cannot happen in a graph; a failed node stays unknown
            self.memo[x] = self._eval(x)
        return self.memo[x]

    # one job per op family ----------------------------------------------------------------

    def _eval(self, n: fx.Node) -> _Value:
        if n.op == "placeholder" or n.op == "get_attr":
            return None
        if n.op == "call_method":
            return self._method(n)
        if n.op != "call_function":
            return None
        return self._eval_call(n.target, n)

    def _eval_call(self, t, n: fx.Node) -> _Value:
        """The value of ``t(*n.args, **n.kwargs)`` (``n`` a function call, or a method call with
        the tensor as its first argument)."""
        handler = _CALL_HANDLERS.get(t)
        return None if handler is None else handler(self, n)

    def _method(self, n: fx.Node) -> _Value:
        name = n.target
        if name in _METHOD_AS_FUNCTION:
            # Dynamo records ``a == b`` either as ``operator.eq`` or as the method ``a.__eq__(b)``
            # (torch 2.11 on CUDA does the latter); both mean the same op
            return self._eval_call(_METHOD_AS_FUNCTION[name], n)
        if name == "expand":
            return self._expand(self.value(n.args[0]), n.args[1:])
        if name in _METHOD_IDENTITY:
            v = self.value(n.args[0])
            return v if isinstance(v, _Bool) else None
        if name == "cumsum":
            return _zero_cumsum(self.value(n.args[0]))
        if name == "to":
            return self._to(n, n.args[0], n.kwargs, n.args[1:])
        if name == "new_ones":
            return _Bool(frozenset()) if _is_bool_dtype(n.kwargs, n.args[2:]) else None
        if name == "unsqueeze":
            return self._unsqueeze(self.value(n.args[0]), n.args[1])
        if name == "bool":
            return self._as_bool(n.args[0])
        return None

    def _arange(self, n: fx.Node) -> _Value:
        """``arange(end)`` / ``arange(start, end[, 1])`` with an int start; the end may be a
        symbolic size (dynamic shapes: the length is then unknown, None)."""
        args = list(n.args)
        if not 1 <= len(args) <= 3 or (len(args) == 3 and args[2] != 1):
            return None
        start, end = (0, args[0]) if len(args) == 1 else (args[0], args[1])
        if isinstance(start, bool) or not isinstance(start, int):
            return None
        if isinstance(end, int) and not isinstance(end, bool):
            return _Pos(axis=0, ndim=1, offset=start, length=end - start)
        return _Pos(axis=0, ndim=1, offset=start, length=None) if isinstance(end, fx.Node) else None

    def _add(self, n: fx.Node, sign: int = 1) -> _Value:
        """``pos + c`` / ``pos - c`` (``c + pos`` too) for an int ``c`` (a Python int or a
        constant tensor, e.g. ``cache_position[0]`` or a zero left padding ``zeros(B)[b]``)."""
        if n.kwargs.get("alpha", 1) != 1:
            return None
        a, b = self.value(n.args[0]), self.value(n.args[1])
        if sign == 1 and isinstance(b, _Pos) and not isinstance(a, _Pos):
            a, b = b, a
        if not isinstance(a, _Pos):
            return None
        c = _int_operand(b, a.ndim)
        return None if c is None else _Pos(a.axis, a.ndim, a.offset + sign * c, a.length)

    @staticmethod
    def _floordiv(a: _Value, b: _Value) -> _Value:
        """``pos // c`` for a positive int ``c`` (the chunk of a position)."""
        if not isinstance(a, _Pos):
            return None
        c = _int_operand(b, a.ndim)
        return _FloorDiv(a, c) if c is not None and c > 0 else None

    def _getitem(self, n: fx.Node) -> _Value:
        base, idx = self.value(n.args[0]), n.args[1]
        if not isinstance(idx, tuple):
            idx = (idx,)
        if (
            len(idx) == 1
            and isinstance(idx[0], int)
            and not isinstance(idx[0], bool)
            and isinstance(base, _Pos)
            and base.ndim == 1
            and idx[0] >= 0
        ):
            # positions[i] (a 0-d tensor, e.g. cache_position[0] as a mask offset)
            return _Const(base.offset + idx[0], ndim=0)
        basic = all(e is None or isinstance(e, slice) for e in idx)
        if basic and isinstance(base, _Pos) and base.ndim == 1 and None in idx:
            return self._place(base, idx)
        if basic and isinstance(base, _Pos) and None not in idx and len(idx) == base.ndim:
            for d, e in enumerate(idx):  # x[:, a:b]: slices of the position axis
                if e != slice(None):
                    base = self._slice(base, d, e.start, e.stop, 1 if e.step is None else e.step)
            return base
        if not basic:
            return self._index(base, list(idx))
        return None

    @staticmethod
    def _place(pos: _Pos, idx: Tuple) -> Optional[_Pos]:
        """``pos[None, :, None, ...]``: the 1-D position vector on the axis of the one full slice."""
        full = [i for i, e in enumerate(idx) if isinstance(e, slice) and e == slice(None)]
        if len(full) != 1 or any(e is not None for i, e in enumerate(idx) if i != full[0]):
            return None
        return _Pos(axis=full[0], ndim=len(idx), offset=pos.offset, length=pos.length)

    @staticmethod
    def _unsqueeze(v: _Value, dim) -> _Value:
        if not isinstance(v, _Pos) or not isinstance(dim, int):
            return None
        ndim = v.ndim + 1
        d = dim + ndim if dim < 0 else dim
        if not 0 <= d < ndim:
            return None
        return _Pos(v.axis + (1 if d <= v.axis else 0), ndim, v.offset, v.length)

    @staticmethod
    def _expand(v: _Value, sizes) -> _Value:
        """Broadcasting keeps every value; a position vector keeps its axis when the expand only
        adds leading dims or widens size-1 dims (``[1, N] -> [B, N]``)."""
        if isinstance(v, (_Bool, _Const)):
            return v
        sizes = list(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], (list, tuple)) else list(sizes)
        if isinstance(v, _Pos) and len(sizes) >= v.ndim:
            extra = len(sizes) - v.ndim
            own = sizes[extra + v.axis]
            if own == -1 or (isinstance(own, int) and own == v.length):
                return _Pos(v.axis + extra, len(sizes), v.offset, v.length)
        return None

    @staticmethod
    def _slice(v: _Value, dim=0, start=None, end=None, step=1) -> _Value:
        """A contiguous piece of a position vector along its own axis."""
        if not isinstance(v, _Pos) or step != 1 or not isinstance(dim, int):
            return None
        d = dim + v.ndim if dim < 0 else dim
        if d != v.axis:
            return v if (start in (None, 0) and end is None) else None
        start = 0 if start is None else start
        if not isinstance(start, int) or start < 0 or not isinstance(end, int):
            return None
        if not isinstance(v.length, int):
            # a symbolic length: only the first position is known to exist (the packed-sequence
            # check's ``pos[..., :1]``; an empty sequence has no attention to prove)
            return _Pos(v.axis, v.ndim, v.offset, 1) if (start, end) == (0, 1) else None
        end = min(end, v.length)
        return _Pos(v.axis, v.ndim, v.offset + start, max(0, end - start))

    def _diff(self, n: fx.Node) -> _Value:
        """``diff(pos, n=1, dim=axis, prepend=pos[first] - 1)``: all ones (transformers' check
        that position ids hold one packed sequence)."""
        args = list(n.args) + [None] * 4
        x, order, dim, prepend = self.value(args[0]), args[1], args[2], args[3]
        order = n.kwargs.get("n", 1 if order is None else order)
        dim = n.kwargs.get("dim", -1 if dim is None else dim)
        prepend = self.value(n.kwargs.get("prepend", prepend))
        if not isinstance(x, _Pos) or order != 1 or not isinstance(dim, int):
            return None
        if (dim + x.ndim if dim < 0 else dim) != x.axis:
            return None
        if (
            isinstance(prepend, _Pos)
            and prepend.axis == x.axis
            and prepend.ndim == x.ndim
            and prepend.length == 1
            and prepend.offset == x.offset - 1
        ):
            return _Const(1)
        return None

    @staticmethod
    def _equal(a: _Value, b: _Value, negate: bool) -> _Value:
        """``==`` / ``!=`` of constants (the packed-sequence ids of one sequence are all equal);
        ``==`` of the chunks of the query and key positions."""
        if isinstance(a, _FloorDiv) and isinstance(b, _FloorDiv):
            return None if negate else _same_chunk(a, b)
        if isinstance(b, int) and not isinstance(b, bool):
            b = _Const(b)
        if not (isinstance(a, _Const) and isinstance(b, _Const)):
            return None
        same = a.value == b.value
        if negate:
            same = not same
        return _Bool(frozenset()) if same else _Const(False)

    @staticmethod
    def _compare(a: _Value, b: _Value, op: str) -> _Value:
        """``a <op> b`` for position vectors on the key and query axes of a 4-D shape, as a
        bound on ``d = kv - q``: ``d <= 0`` is causality, ``d >= 1 - W`` a sliding window's far
        edge; a bound that every (q, kv) pair of the static lengths satisfies (a sliding window
        wider than the sequence) is all True."""
        if not (isinstance(a, _Pos) and isinstance(b, _Pos) and a.ndim == b.ndim == 4):
            return None
        if {a.axis, b.axis} != {_Q_AXIS, _KV_AXIS}:
            return None
        if a.axis == _Q_AXIS:  # q <op> kv  ->  kv <flipped op> q
            a, b, op = b, a, {"le": "ge", "lt": "gt", "ge": "le", "gt": "lt"}[op]
        kv, q = a, b
        shift = q.offset - kv.offset  # kv_pos <op> q_pos + shift  <=>  (kv - q) <op> shift
        upper = {"le": shift, "lt": shift - 1}.get(op)
        lower = {"ge": shift, "gt": shift + 1}.get(op)
        if _always_holds(kv, q, upper, lower):
            return _Bool(frozenset())
        return _Bool(frozenset({_Upper(upper) if upper is not None else _Lower(lower)}))

    @staticmethod
    def _and(a: _Value, b: _Value) -> _Value:
        if isinstance(a, _Bool) and isinstance(b, _Bool):
            return _Bool(a.atoms | b.atoms)
        return None

    def _to(self, n: fx.Node, src, kwargs, args) -> _Value:
        """``.to(device)`` keeps a value; ``.to(torch.bool)`` of a graph tensor makes a source."""
        v = self.value(src)
        if isinstance(v, _Bool):
            return (
                v
                if (
                    kwargs.get("dtype") in (None, torch.bool)
                    and not any(isinstance(a, torch.dtype) and a is not torch.bool for a in args)
                )
                else None
            )
        if _is_bool_dtype(kwargs, args) and isinstance(src, fx.Node) and v is None:
            return _BoolSource(src)
        return None

    def _as_bool(self, src) -> _Value:
        v = self.value(src)
        if isinstance(v, _Bool):
            return v
        return _BoolSource(src) if isinstance(src, fx.Node) and v is None else None

    def _index(self, base: _Value, idx: list) -> _Value:
        """``src[batch_pos, kv_pos]``: the key padding of a ``[B, N]`` boolean source; a ``[B, N]``
        position tensor (rows ``arange + c``) indexed the same way stays one; a constant indexed
        by positions stays that constant."""
        if isinstance(base, _Const):
            return _index_const(base, [self.value(i) for i in idx])
        if len(idx) != 2:
            return None
        b_pos, kv_pos = self.value(idx[0]), self.value(idx[1])
        if isinstance(base, _Pos) and base.ndim == 2 and base.axis == 1:
            if (
                isinstance(b_pos, _Pos)
                and isinstance(kv_pos, _Pos)
                and b_pos.ndim == kv_pos.ndim == 4
                and b_pos.axis == _B_AXIS
                and b_pos.offset == 0
                and kv_pos.axis in (_Q_AXIS, _KV_AXIS)
            ):
                return _Pos(kv_pos.axis, 4, base.offset + kv_pos.offset, kv_pos.length)
            return None
        if not isinstance(base, _BoolSource):
            return None
        if not (isinstance(b_pos, _Pos) and isinstance(kv_pos, _Pos)):
            return None
        if b_pos.ndim != 4 or kv_pos.ndim != 4 or b_pos.axis != _B_AXIS or kv_pos.axis != _KV_AXIS:
            return None
        if b_pos.offset != 0:
            return None
        return _Bool(frozenset({_Padding(base.node, kv_pos.offset)}))


def _always_holds(kv: _Pos, q: _Pos, upper: Optional[int], lower: Optional[int]) -> bool:
    """Whether every (q, kv) pair of static lengths satisfies ``lower <= kv - q <= upper`` (one of
    them None): e.g. a sliding window wider than the sequence."""
    if not (_is_int(kv.length) and _is_int(q.length)):
        return False
    max_d, min_d = kv.length - 1, -(q.length - 1)
    return (upper is not None and max_d <= upper) or (lower is not None and min_d >= lower)


def _same_chunk(a: _FloorDiv, b: _FloorDiv) -> _Value:
    """``a == b`` for the chunks of the query and key positions: chunked attention when both
    positions carry the same offset and the chunk size divides it (another offset moves the chunk
    boundaries off multiples of the size, which :class:`MaskProof` cannot state)."""
    pa, pb = a.pos, b.pos
    if a.size != b.size or not (pa.ndim == pb.ndim == 4 and {pa.axis, pb.axis} == {_Q_AXIS, _KV_AXIS}):
        return None
    if pa.offset != pb.offset or pa.offset % a.size:
        return None
    return _Bool(frozenset({_Chunk(a.size)}))


def _index_const(base: _Const, indices: list) -> _Value:
    """``const[pos, ...]``: the same constant, of the indices' rank when they index every axis."""
    if not indices or not all(isinstance(i, _Pos) for i in indices):
        return None
    every_axis = base.ndim is not None and len(indices) == base.ndim
    return _Const(base.value, ndim=max(i.ndim for i in indices) if every_axis else None)


# --------------------------------------------------------------------------- public


def _causal(atoms: FrozenSet[_Atom]) -> Optional[bool]:
    """Whether the upper bounds make the mask causal (the tightest one is 0; a looser one beside
    it adds nothing), None when they make it something else (a shifted diagonal)."""
    bounds = [a.bound for a in atoms if isinstance(a, _Upper)]
    if not bounds:
        return False
    return True if min(bounds) == 0 else None


def _sliding_window(atoms: FrozenSet[_Atom]) -> Optional[int]:
    """The window the lower bounds leave (the tightest one counts), 0 for none, None when they
    leave no key at all."""
    bounds = [a.bound for a in atoms if isinstance(a, _Lower)]
    if not bounds:
        return 0
    window = 1 - max(bounds)
    return window if window >= 1 else None


def _chunk_size(atoms: FrozenSet[_Atom]) -> Optional[int]:
    """The chunk size, 0 for none, None for several (their intersection is no single chunking)."""
    sizes = {a.size for a in atoms if isinstance(a, _Chunk)}
    if len(sizes) > 1:
        return None
    return next(iter(sizes), 0)


def prove_mask(mask: fx.Node, *, windows: bool = False) -> Optional[MaskProof]:
    """What ``mask`` (an SDPA ``attn_mask`` node) provably is, or None when not proven.

    ``windows`` also proves sliding-window and chunked causal masks (``MaskProof.sliding_window``
    / ``chunk_size``). It is off by default so that a caller reading only ``causal`` and
    ``key_padding`` never takes a window for full causality."""
    if not isinstance(mask, fx.Node):
        return None
    v = _Interpreter().value(mask)
    if not isinstance(v, _Bool):
        return None
    padding = [a for a in v.atoms if isinstance(a, _Padding)]
    if len(padding) > 1 or (padding and padding[0].offset != 0):
        return None
    causal, window, chunk = _causal(v.atoms), _sliding_window(v.atoms), _chunk_size(v.atoms)
    if causal is None or window is None or chunk is None:
        return None
    if (window or chunk) and not (windows and causal):
        return None
    return MaskProof(
        causal=causal,
        key_padding=padding[0].src if padding else None,
        sliding_window=window,
        chunk_size=chunk,
    )


def _call_handlers() -> Dict[Any, Callable[["_Interpreter", fx.Node], _Value]]:
    """Each function target the proof reads, with how the evaluator values its call. A target in
    two families keeps the first (the order below)."""
    first = lambda s, n: s.value(n.args[0])  # noqa: E731
    second = lambda s, n: s.value(n.args[1])  # noqa: E731
    families = [
        (_ARANGE, lambda s, n: s._arange(n)),
        (_ADD, lambda s, n: s._add(n)),
        ({operator.getitem}, lambda s, n: s._getitem(n)),
        (_UNSQUEEZE, lambda s, n: s._unsqueeze(first(s, n), n.args[1])),
    ]
    families += [
        (targets, lambda s, n, op=op: s._compare(first(s, n), second(s, n), op)) for op, targets in _COMPARE.items()
    ]
    families += [
        (_SUB, lambda s, n: s._add(n, sign=-1)),
        (_FLOORDIV, lambda s, n: s._floordiv(first(s, n), second(s, n))),
        (
            _DIV,
            lambda s, n: s._floordiv(first(s, n), second(s, n)) if n.kwargs.get("rounding_mode") == "floor" else None,
        ),
        (_AND, lambda s, n: s._and(first(s, n), second(s, n))),
        (_EXPAND, lambda s, n: s._expand(first(s, n), n.args[1])),
        (_SLICE, lambda s, n: s._slice(first(s, n), *n.args[1:])),
        (_DIFF, lambda s, n: s._diff(n)),
        (_CUMSUM, lambda s, n: _zero_cumsum(first(s, n))),
        (_EQ, lambda s, n: s._equal(first(s, n), second(s, n), negate=False)),
        (_NE, lambda s, n: s._equal(first(s, n), second(s, n), negate=True)),
        (_TO_COPY, lambda s, n: s._to(n, n.args[0], n.kwargs, n.args[1:])),
        (_ONES, lambda s, n: _Bool(frozenset()) if _is_bool_dtype(n.kwargs) else None),
        (_ZEROS, lambda s, n: _zeros(n.args, n.kwargs)),
        (_INDEX, lambda s, n: s._index(first(s, n), list(n.args[1]))),
    ]
    table: Dict[Any, Callable[["_Interpreter", fx.Node], _Value]] = {}
    for targets, handler in families:
        for t in targets:
            table.setdefault(t, handler)
    return table


def _zero_cumsum(v: _Value) -> _Value:
    """A cumsum's value: that of a cumsum of zeros (0), else unknown."""
    return _Const(0) if isinstance(v, _Const) and v.value in (0, False) else None


_CALL_HANDLERS = _call_handlers()
