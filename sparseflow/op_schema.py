"""The ops' argument lists: each method's schema, derived from its config dataclass and its fields
of :class:`sparseflow.Tuning`, and the two ways between a config and the op's flattened
arguments (:func:`op_args` flattens, :func:`config_entry` rebuilds, once per distinct tuple).

Torch-only and free of the ops themselves, so every layer of the dispatch (and the graph
passes, the ONNX export and context parallelism) can read the argument order from here.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch

from . import methods as _methods
from .config import AttentionConfig
from .tuning import DEFAULT_TUNING, Tuning
from .tuning import fields_of as _tuning_fields

__all__ = [
    "IMPLEMENTATIONS",
    "FIELDS",
    "NAMES",
    "TUNING_NAMES",
    "CACHE_LIMIT",
    "OP_CONTRACT",
    "ConfigEntry",
    "schema",
    "op_for",
    "op_args",
    "config_entry",
    "config_call",
    "impl_kwargs",
]

_SCHEMA_TYPES = {int: "int", float: "float", bool: "bool", str: "str"}


class _Implementations(Mapping):
    """``{(method, backend): "module:function"}`` read live from the method registry (read-only:
    a backend is added by registering a method's spec, see :mod:`sparseflow.methods`)."""

    def __getitem__(self, key: Tuple[str, str]) -> str:
        if not (isinstance(key, tuple) and len(key) == 2) or key[0] not in _methods.names():
            raise KeyError(key)
        backend = _methods.spec_for(key[0]).backends.get(key[1])
        if backend is None:
            raise KeyError(key)
        return backend.target

    def __iter__(self) -> Iterator[Tuple[str, str]]:
        return iter([(s.name, b) for s in _methods.specs() for b in s.backends])

    def __len__(self) -> int:
        return sum(len(s.backends) for s in _methods.specs())


IMPLEMENTATIONS: Mapping[Tuple[str, str], str] = _Implementations()


def _config_fields(cls) -> List[dataclasses.Field]:
    return list(dataclasses.fields(cls))


def _field_type(f: dataclasses.Field) -> type:
    t = f.type if isinstance(f.type, type) else {"int": int, "float": float, "bool": bool, "str": str}[f.type]
    return t


def schema(method: str) -> str:
    """The op's schema: q, k, v and the SDPA arguments, the config's fields, the tuning's, then
    ``backend`` and ``tag``."""
    config = [
        f"{_SCHEMA_TYPES[_field_type(f)]} {f.name}" for f in _config_fields(_methods.spec_for(method).config_type)
    ]
    tuning = [f"{kind} {name}" for name, kind in _tuning_fields(method)]
    fields = "".join(f"{a}, " for a in config + tuning)
    return (
        "(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, bool is_causal, float? scale, "
        f"{fields}str backend, str tag) -> Tensor"
    )


def op_for(method: str):
    """The OpOverload of a method's op, e.g. ``torch.ops.sparseflow.pbs_attention.default``."""
    return getattr(torch.ops.sparseflow, f"{method}_attention").default


def op_args(config: AttentionConfig, tuning: Optional[Tuning] = None) -> List[Any]:
    """The config's values, then the tuning's fields of its method (default: ``Tuning()``), in
    schema order: the positional arguments between ``scale`` and ``backend``."""
    tuning = DEFAULT_TUNING if tuning is None else tuning
    values = [
        float(getattr(config, name)) if kind is float else getattr(config, name) for name, kind in FIELDS[config.method]
    ]
    return values + [getattr(tuning, name) for name in TUNING_NAMES[config.method]]


# Per method, precomputed so op_args stays traceable by Dynamo (it cannot introspect dataclass
# fields): the config's fields with their types, their names, and the tuning's op arguments.
FIELDS: Dict[str, Tuple[Tuple[str, type], ...]] = {}
NAMES: Dict[str, Tuple[str, ...]] = {}
TUNING_NAMES: Dict[str, Tuple[str, ...]] = {}


def add_method_tables(method: str) -> None:
    """Fill the tables above for a registered method (``sparseflow.ops`` does, as it defines the op)."""
    FIELDS[method] = tuple((f.name, _field_type(f)) for f in _config_fields(_methods.spec_for(method).config_type))
    NAMES[method] = tuple(name for name, _ in FIELDS[method])
    TUNING_NAMES[method] = tuple(name for name, _ in _tuning_fields(method))


for _name in _methods.names():
    add_method_tables(_name)
DEFAULT_TUNING.to_dict()  # the defaults' per-method options resolved now, not inside a traced call


# --------------------------------------------------------------------------- the configs of op calls
# A decided call should cost what SDPA costs: everything that depends only on the call's
# arguments is built once per distinct argument tuple and looked up afterwards. Here the config
# object and its implementation kwargs (the auto choice and its reason: sparseflow.autobackend).


class ConfigEntry(NamedTuple):
    cfg: AttentionConfig
    kwargs: Dict[str, Any]  # the implementation's keyword arguments (all fields but min_seq_len)
    serial: int  # never reused, so a key holding it can never mean another config
    tuning: Tuning
    values: Tuple  # the op's flattened config and tuning arguments it was built from


# the ops' contract revision: bumped when what a fake implementation answers changes (2: outputs in
# [B, N, H, D] memory), so that compiled code cached under another revision is not reused
OP_CONTRACT = 2
CACHE_LIMIT = 512  # distinct configs per process; past it the caches start over (correct, slower)
_BY_VALUES: Dict[Tuple, ConfigEntry] = {}
_BY_CONFIG: Dict[Tuple[AttentionConfig, Tuning], Tuple[Tuple, ConfigEntry]] = {}
_SERIALS = itertools.count()


def config_entry(method: str, values: Tuple) -> ConfigEntry:
    """The config and tuning the op's flattened arguments (between ``scale`` and ``backend``)
    describe, validated and built once per tuple."""
    # the types are part of the key: True == 1 and 1 == 1.0, yet a config validates its types
    key = (method, values, tuple(map(type, values)))
    entry = _BY_VALUES.get(key)
    if entry is None:
        names = NAMES[method]
        cfg = _methods.spec_for(method).config_type(**dict(zip(names, values)))
        tuning = Tuning(**dict(zip(TUNING_NAMES[method], values[len(names) :])))
        entry = ConfigEntry(cfg, impl_kwargs(cfg), next(_SERIALS), tuning, values)
        if len(_BY_VALUES) >= CACHE_LIMIT:
            _BY_VALUES.clear()
        _BY_VALUES[key] = entry
    return entry


def config_call(config: AttentionConfig, tuning: Tuning = DEFAULT_TUNING) -> Tuple[Tuple, ConfigEntry]:
    """(op arguments, entry) of a config and tuning, as the op would rebuild them from those arguments."""
    key = (config, tuning)
    try:
        hit = _BY_CONFIG.get(key)
    except TypeError:  # an unhashable (non-frozen) subclass: no caching
        hit = None
    if hit is None:
        values = tuple(op_args(config, tuning))
        hit = (values, config_entry(config.method, values))
        try:
            if len(_BY_CONFIG) >= CACHE_LIMIT:
                _BY_CONFIG.clear()
            _BY_CONFIG[key] = hit
        except TypeError:
            pass
    return hit


def impl_kwargs(cfg: AttentionConfig) -> Dict[str, Any]:
    # min_seq_len is the dispatcher's (dense below it); implementations take the method's fields
    return {name: getattr(cfg, name) for name in NAMES[cfg.method] if name != "min_seq_len"}
