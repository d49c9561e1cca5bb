"""How the Triton kernels run, as opposed to what they compute (the method configs).

A :class:`Tuning` changes speed, never results (but PISA's ``pisa_scores`` below fp32, which keeps
its selection within the method's tolerance contract). It holds each method's own launch options (a
:class:`MethodTuning` subclass in the method's folder, named by its registry entry) and the launch
mechanics every method shares (CUDA-graph replay, programmatic dependent launch). This module
names no method: the methods' option classes reach it through the registry.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Dict, Mapping, Optional, Tuple, Type

from ._tuning_base import MethodTuning, check_bool
from .methods import registry as _registry

__all__ = ["Tuning", "MethodTuning", "DEFAULT_TUNING", "fields_of", "check_tuning"]


# Tuning's own fields, every method's launch mechanics: (name, default, op-schema type)
_SHARED = (("cuda_graphs", True, "bool"), ("pdl", False, "bool"))


def _method_types() -> Dict[str, Type[MethodTuning]]:
    return {s.name: s.tuning_type for s in _registry.specs() if s.tuning_type is not None}


class Tuning:
    """Launch options of the Triton backends (``backend="triton"``, or ``"auto"`` choosing it).

    Two kinds of options. A method's own (its ``MethodTuning`` class in ``methods/<m>/tuning.py``,
    named by its registry entry), passed as ``<method>_<field>``: for instance PBS's
    ``pbs_select`` / ``pbs_kv_layout`` / ``pbs_tma`` and PISA's ``pisa_walk`` / ``pisa_warps`` /
    ``pisa_leaf_bytes`` (each documented on its class), or whole as ``<method>=PBSTuning(...)``.
    And the launch mechanics every method shares:

    ``cuda_graphs``: replay an eager ``backend="triton"`` call without gradient from a CUDA graph,
    recorded on the second call of the same signature (method config, shapes, strides, dtypes,
    device, stream), instead of launching its kernels one by one: the same kernels on the same
    inputs, so the same result, at a fraction of the host cost (:mod:`sparseflow.graph_replay`).
    False launches them every call. Calls inside another capture (``torch.cuda.graph``) are
    captured by it as they are. In a graph traced by ``torch.compile``, the calls of a model
    compiled by ``sparseflow.compile`` without Inductor's CUDA graphs replay too; under Inductor's
    CUDA graphs (``mode="reduce-overhead"``), and in a graph compiled by other means, they never
    do (see :meth:`Tuning.traced`).
    ``pdl``: launch the kernels of the methods that chain them (their ``MethodTuning.shared``
    lists ``pdl``) as links of a programmatic-dependent-launch chain (:mod:`sparseflow.kernels.pdl`;
    Hopper or newer, compiled Triton), so that each kernel is scheduled while the one before it
    drains: the same output bit for bit. Eager calls and CUDA graphs chain; calls traced by
    ``torch.compile`` launch plainly (logged). Elsewhere it changes nothing.

    A :class:`Tuning` changes speed, never results (``pisa_scores`` below fp32 aside: it keeps
    PISA's selection within its stated tolerance). It is passed to :func:`sparseflow.compile`,
    :func:`sparseflow.export` or :func:`sparseflow.attention` and travels with every call as op
    arguments (each op takes its method's fields and the shared ones it lists, see
    :func:`fields_of`), so it is read per call and works under ``torch.compile(fullgraph=True)``.
    The defaults are the measured best choices. Frozen and hashable; unknown keywords are a
    ``TypeError``.
    """

    __slots__ = ("cuda_graphs", "pdl", "_options", "_per_method", "_hash")

    def __init__(self, *, cuda_graphs: bool = True, pdl: bool = False, **options: Any):
        check_bool("Tuning.cuda_graphs", cuda_graphs)
        check_bool("Tuning.pdl", pdl)
        object.__setattr__(self, "cuda_graphs", cuda_graphs)
        object.__setattr__(self, "pdl", pdl)
        object.__setattr__(self, "_options", options)
        object.__setattr__(self, "_per_method", None)
        object.__setattr__(self, "_hash", None)
        if options:  # checked where they are written (the defaults are read once the methods registered)
            self._methods()

    def _methods(self) -> Mapping[str, MethodTuning]:
        if self._per_method is None:
            object.__setattr__(self, "_per_method", _resolve(self._options))
        return self._per_method

    def of(self, method: str) -> Optional[MethodTuning]:
        """The method's own options (None for a method that has none)."""
        return self._methods().get(method)

    def __getattr__(self, key: str) -> Any:
        # a method's field by its Tuning keyword: tuning.pbs_select is tuning.of("pbs").select
        method, _, name = key.partition("_")
        own = self._methods().get(method) if not key.startswith("_") else None
        if own is None and not key.startswith("_"):  # a method registered after this tuning was made:
            own = _method_types().get(method)  # its option class, whose attributes are the defaults
        if own is not None and hasattr(own, name):
            return getattr(own, name)
        raise AttributeError(f"'Tuning' object has no attribute {key!r}")

    def __setattr__(self, key: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {key!r}")

    def _key(self) -> Tuple:
        return (self.cuda_graphs, self.pdl, tuple(sorted(self._methods().items())))

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Tuning) and self._key() == other._key()

    def __hash__(self) -> int:
        # kept: a call's tuning is hashed on every op call (the config cache's key)
        if self._hash is None:
            object.__setattr__(self, "_hash", hash(self._key()))
        return self._hash

    def __repr__(self) -> str:
        defaults = DEFAULT_TUNING.to_dict()
        changed = {k: v for k, v in self.to_dict().items() if v != defaults.get(k)}
        return "Tuning(" + ", ".join(f"{k}={v!r}" for k, v in changed.items()) + ")"

    def __reduce__(self):
        return (_from_flat, (self.to_dict(),))

    def to_dict(self) -> Dict[str, Any]:
        """Every option by its ``Tuning`` keyword (a method's fields first, then the shared ones)."""
        flat = {
            f"{m}_{f.name}": getattr(own, f.name) for m, own in self._methods().items() for f in dataclasses.fields(own)
        }
        return {**flat, "cuda_graphs": self.cuda_graphs, "pdl": self.pdl}

    @classmethod
    def from_dict(cls, data: Any, where: str = "tuning") -> "Tuning":
        """Inverse of ``to_dict``; ``where`` names the source in errors. Unknown fields are a
        ``ValueError`` that names them (a field of a newer sparseflow is not silently dropped)."""
        if not isinstance(data, Mapping):
            raise TypeError(f"{where} must be a dict, got {type(data).__name__}")
        known = set(_known(_method_types()))
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{where} has unknown fields {unknown}; known: {sorted(known)}")
        return cls(**data)

    def replace(self, **changes) -> "Tuning":
        return Tuning(**{**self.to_dict(), **changes})

    def traced(self) -> "Tuning":
        """This tuning for a call that ``torch.compile`` traces into its graph: no op-level CUDA
        graphs. The compiled graph is Inductor's to capture (``mode="reduce-overhead"``), and an
        op-level graph recorded while Inductor warms its graphs up would leave the graph's static
        inputs in Inductor's memory pool, which Inductor refuses at the first call."""
        if not self.cuda_graphs:
            return self
        # built field by field, not through replace(): torch.compile traces this call
        off = object.__new__(Tuning)
        object.__setattr__(off, "cuda_graphs", False)
        object.__setattr__(off, "pdl", self.pdl)
        object.__setattr__(off, "_options", self._options)
        object.__setattr__(off, "_per_method", self._methods())
        object.__setattr__(off, "_hash", None)
        return off


def _resolve(options: Mapping[str, Any]) -> Mapping[str, MethodTuning]:
    """Each registered method's options from ``Tuning``'s keywords (``<method>_<field>``, or the
    method's whole option object as ``<method>=``), the defaults elsewhere."""
    types_ = _method_types()
    given: Dict[str, Dict[str, Any]] = {m: {} for m in types_}
    whole: Dict[str, MethodTuning] = {}
    for key, value in options.items():
        if key in types_:
            if not isinstance(value, types_[key]):
                raise TypeError(f"Tuning.{key} must be a {types_[key].__name__}, got {type(value).__name__}")
            whole[key] = value
            continue
        method, _, name = key.partition("_")
        if method not in types_ or name not in {f.name for f in dataclasses.fields(types_[method])}:
            raise TypeError(f"Tuning() got an unexpected keyword argument {key!r}; known: {_known(types_)}")
        given[method][name] = value
    per_method = {}
    for method, cls in types_.items():
        base = whole.get(method, cls())
        per_method[method] = dataclasses.replace(base, **given[method]) if given[method] else base
    return types.MappingProxyType(per_method)


def _from_flat(data: Dict[str, Any]) -> Tuning:
    return Tuning(**data)


def _known(types_: Mapping[str, Type[MethodTuning]]) -> list:
    own = [f"{m}_{f.name}" for m, cls in types_.items() for f in dataclasses.fields(cls)]
    return own + [name for name, _, _ in _SHARED]


DEFAULT_TUNING = Tuning()


def fields_of(method: str) -> Tuple[Tuple[str, str], ...]:
    """The tuning fields the ``method`` op takes, as ``(Tuning keyword, schema type)``: the
    method's own fields, then the shared ones its tuning class lists (empty for a method without
    one)."""
    cls = _method_types().get(method)
    if cls is None:
        return ()
    own = tuple((f"{method}_{f.name}", f.metadata["schema"]) for f in dataclasses.fields(cls))
    return own + tuple((name, schema) for name, _, schema in _SHARED if name in cls.shared)


def check_tuning(tuning: Any, arg: str = "tuning") -> Tuning:
    """``tuning`` (None: the defaults) after checking it is a :class:`Tuning`."""
    if tuning is None:
        return DEFAULT_TUNING
    if not isinstance(tuning, Tuning):
        raise TypeError(f"{arg} must be a sparseflow.Tuning or None, got {type(tuning).__name__}")
    return tuning
