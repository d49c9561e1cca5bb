"""Frozen, versioned, serialisable configurations, one per method.

A config says *what* to compute (block sizes, thresholds, K); the backend says *how*. Configs
validate themselves on construction, so a bad value fails where the user wrote it, with the
field's name and the expected range in the message. Each method's config is defined in its
folder (``sparseflow/methods/<method>/config.py``) on the base in :mod:`sparseflow._config_base`;
this module names them all.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, Iterator, Mapping, Optional, Type, Union

from ._config_base import BACKENDS, AttentionConfig, TopKConfig, _check_choice
from .methods.bsa.config import BSAConfig
from .methods.dense.config import DenseConfig
from .methods.pbs.config import PBSConfig
from .methods.pisa.config import PISAConfig

__all__ = [
    "AttentionConfig",
    "DenseConfig",
    "PBSConfig",
    "PISAConfig",
    "BSAConfig",
    "config_from_dict",
    "default_config",
    "METHODS",
    "BACKENDS",
    "TopKConfig",
    "backend_config",
]


class _MethodConfigs(Mapping):
    """Method name -> config class, read from the method registry at each access, so a method
    registered later (``sparseflow.methods.register``) is known here too."""

    def _registry(self):
        from .methods import registry  # the registry's methods import their configs from here

        return registry

    def __getitem__(self, name: str) -> Type[AttentionConfig]:
        registry = self._registry()
        if name not in registry.names():
            raise KeyError(name)
        return registry.spec_for(name).config_type

    def __iter__(self) -> Iterator[str]:
        return iter(self._registry().names())

    def __len__(self) -> int:
        return len(self._registry().names())

    def __repr__(self) -> str:
        return f"METHODS({dict(self)!r})"


METHODS: Mapping[str, Type[AttentionConfig]] = _MethodConfigs()


def default_config(method: str) -> AttentionConfig:
    _check_choice("method", method, tuple(METHODS))
    return METHODS[method]()


def config_from_dict(data: Union[Mapping[str, Any], str]) -> AttentionConfig:
    """Inverse of ``to_dict``/``to_json``; rejects unknown methods, versions and fields."""
    if isinstance(data, str):
        data = json.loads(data)
    data = dict(data)
    method = data.pop("method", None)
    _check_choice("method", method, tuple(METHODS))
    cls = METHODS[method]
    version = data.pop("version", cls.version)
    if version != cls.version:
        raise ValueError(
            f"version must be {cls.version} for {cls.__name__}, got {version}; this sparseflow cannot read that config"
        )
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown fields for {cls.__name__}: {unknown}; expected a subset of {sorted(known)}")
    return cls(**data)


_DEFAULT_INSTANCES: Dict[type, AttentionConfig] = {}


def default_instance(cls: type) -> AttentionConfig:
    """``cls()``, made once per class and shared (configs are frozen)."""
    return _DEFAULT_INSTANCES.get(cls) or _DEFAULT_INSTANCES.setdefault(cls, cls())


def backend_config(cls: type, config: Optional[AttentionConfig], fields: Mapping[str, Any]) -> AttentionConfig:
    """The config a method's backend runs: ``config`` (default ``cls()``), with ``fields`` (the
    keyword form of direct calls, e.g. ``block_size=64``) replaced and validated by the config.
    The defaults live in the config alone."""
    if config is None:
        config = default_instance(cls)
    elif not isinstance(config, cls):
        raise TypeError(f"config must be a {cls.__name__} or None, got {type(config).__name__}")
    if not fields:
        return config
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise TypeError(
            f"unknown {cls.__name__} field(s) {unknown}; the fields are {[f.name for f in dataclasses.fields(cls)]}"
        )
    return config.replace(**fields)
