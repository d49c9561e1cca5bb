"""The base of every method's config (serialisation, validation helpers); the method configs
themselves live in ``sparseflow/methods/<method>/config.py`` and are all named by
:mod:`sparseflow.config`. Imports nothing else of sparseflow, so the method folders can build on it."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict

import torch

__all__ = ["AttentionConfig", "TopKConfig", "BACKENDS", "check_window", "window_lower_bounds"]

BACKENDS = ("auto", "reference", "triton", "flex")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")


def _check_choice(name: str, value: Any, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def check_window(sliding_window: Any, chunk_size: Any, is_causal: bool = True) -> None:
    """A local window's two arguments: ints >= 0 (0 = none), and nonzero only with ``is_causal``
    (the window is a lower bound under the causal upper one); else a TypeError / ValueError naming
    the argument and what it takes. The one check of the configs' window fields and of the kernels'
    entry points (sparseflow.kernels.token_blocks re-exports it): this module imports nothing else
    of sparseflow, so the kernels import it without a cycle."""
    for name, value in (("sliding_window", sliding_window), ("chunk_size", chunk_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int >= 0 (0 = none), got {type(value).__name__} ({value!r})")
        if value < 0:
            raise ValueError(f"{name} must be an int >= 0 (0 = none), got {value!r}")
        if value and not is_causal:
            raise ValueError(f"{name}={value} needs is_causal=True (a local window bounds causal attention)")


def window_lower_bounds(positions: torch.Tensor, sliding_window: int, chunk_size: int) -> torch.Tensor:
    """The first key position each query position may see under its local window: the last
    ``sliding_window`` keys up to itself and the keys of its own ``chunk_size`` chunk (0 = no such
    bound). Non-decreasing in the position, which the kernels' whole-block test relies on. Here,
    beside :func:`check_window`, so that every module can read the window's definition without an
    import cycle (sparseflow.kernels.token_blocks re-exports it)."""
    lo = torch.zeros_like(positions)
    if sliding_window:
        lo = torch.maximum(lo, positions - sliding_window + 1)
    if chunk_size:
        lo = torch.maximum(lo, torch.div(positions.clamp_min(0), chunk_size, rounding_mode="floor") * chunk_size)
    return lo


@dataclass(frozen=True)
class AttentionConfig:
    """Base class: the local window every method takes, validation and serialisation.

    A local window is part of what a layer computes, so every config carries one; the rewrite
    sets it from the model (a sliding-window or chunked layer), and 0 means none.
    ``sliding_window = W``: the query at position ``p`` sees the keys ``p - W < j <= p`` (W keys,
    itself included). ``chunk_size = C``: it sees the keys of its own chunk, ``j // C == p // C``,
    up to itself. Both hold with causality only. A window is exact block-sparse attention: with a
    method, a query's blocks are the method's selection intersected with its window; with the
    dense method the layer runs the window exactly.
    """

    method: ClassVar[str] = ""
    version: ClassVar[int] = 1
    sliding_window: int = field(default=0, kw_only=True)
    chunk_size: int = field(default=0, kw_only=True)

    def __post_init__(self):
        check_window(self.sliding_window, self.chunk_size)  # causality is the call's: checked there
        self._validate()

    def _validate(self) -> None:
        """A method's own checks of its fields (none here)."""

    @property
    def has_window(self) -> bool:
        return bool(self.sliding_window or self.chunk_size)

    def without_window(self) -> "AttentionConfig":
        return self if not self.has_window else dataclasses.replace(self, sliding_window=0, chunk_size=0)

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        return {"method": self.method, "version": self.version, **d}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def replace(self, **changes) -> "AttentionConfig":
        return dataclasses.replace(self, **changes)

    @property
    def exact(self) -> bool:
        """True when this config computes dense attention exactly (every visible block)."""
        raise NotImplementedError


@dataclass(frozen=True)
class TopKConfig(AttentionConfig):
    """Shared base of the methods that keep K blocks per query (PISA, BSA)."""

    block_size: int = 64
    top_k: int = 8
    force_sink: bool = True
    force_previous: bool = True
    min_seq_len: int = 0

    @property
    def num_forced(self) -> int:
        return 1 + int(self.force_sink) + int(self.force_previous)

    def _validate_common(self) -> None:
        _check_int("block_size", self.block_size, 1)
        _check_int("top_k", self.top_k, 1)
        _check_bool("force_sink", self.force_sink)
        _check_bool("force_previous", self.force_previous)
        if self.top_k < self.num_forced:
            raise ValueError(
                f"top_k must be >= the number of forced blocks ({self.num_forced}: current"
                f"{', sink' if self.force_sink else ''}{', previous' if self.force_previous else ''}),"
                f" got top_k={self.top_k}"
            )
        _check_int("min_seq_len", self.min_seq_len, 0)

    @property
    def exact(self) -> bool:
        return False  # exact only when top_k covers every visible block: depends on N
