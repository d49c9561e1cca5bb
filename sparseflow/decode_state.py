"""Per-model decoding state: each layer's key cache that a method keeps across ``generate()``
steps (PISA: the pyramid of the keys), so a step appends one key instead of rebuilding it.

A model compiled by :func:`sparseflow.compile` owns one :class:`DecodeState`; its forward runs
with that state active (a ``ContextVar``, so nothing is process-global), and a method's decode
step (``MethodSpec.decode``), on a one-query call without padding, asks the state for the layer's
cache:

* the cache of the same layer (tag) and settings that holds exactly the first ``Nk - 1`` keys of
  this call -- checked by comparing its last key with ``k[..., Nk - 2, :]`` -- gets the new key
  appended;
* anything else (a new prompt, a different batch, a full cache) builds it afresh from the keys.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Callable, Dict, Hashable, Iterator, Optional, Protocol, Tuple

import torch

__all__ = ["DecodeState", "LayerCache", "active", "current"]


class LayerCache(Protocol):
    """What a method's decode cache offers the state: the keys it holds, how many it can hold,
    and an append of new keys ``[B, Hkv, n, D]``."""

    length: int
    capacity: int

    def append(self, k: torch.Tensor) -> None: ...


_ACTIVE: contextvars.ContextVar[Optional["DecodeState"]] = contextvars.ContextVar("sparseflow_decode", default=None)


@dataclass
class _Entry:
    cache: "LayerCache"
    last_key: torch.Tensor  # [B, Hkv, D]: the key at position cache.length - 1


@dataclass
class DecodeState:
    entries: Dict[Tuple, _Entry] = field(default_factory=dict)
    appended: int = 0  # steps served by an O(log N) append
    rebuilt: int = 0  # caches built from scratch

    def clear(self) -> None:
        self.entries.clear()

    def layer_cache(
        self, tag: str, k: torch.Tensor, settings: Hashable, build: Callable[[torch.Tensor, int], LayerCache]
    ) -> LayerCache:
        """The layer's cache holding all ``Nk`` keys of ``k [B, Hkv, Nk, D]``: the one kept for
        ``tag`` and ``settings`` (what the method's cache depends on) with the new key appended,
        or ``build(k, capacity)``."""
        n = k.shape[2]
        key = (tag, settings, k.shape[0], k.shape[1], k.shape[3], k.dtype, str(k.device))
        entry = self.entries.get(key)
        if (
            entry is not None
            and entry.cache.length == n - 1
            and n - 1 < entry.cache.capacity
            and torch.equal(entry.last_key, k[:, :, n - 2])
        ):
            entry.cache.append(k[:, :, n - 1 :])
            self.appended += 1
        else:
            cache = build(k, max(2 * n, n + 1024))
            entry = _Entry(cache, k[:, :, n - 1].clone())
            self.entries[key] = entry
            self.rebuilt += 1
            return cache
        entry.last_key = k[:, :, n - 1].clone()
        return entry.cache


def current() -> Optional[DecodeState]:
    return _ACTIVE.get()


@contextlib.contextmanager
def active(state: Optional[DecodeState]) -> Iterator[Optional[DecodeState]]:
    token = _ACTIVE.set(state)
    try:
        yield state
    finally:
        _ACTIVE.reset(token)
