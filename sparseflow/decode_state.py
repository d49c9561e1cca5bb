"""Per-model decoding state for PISA: the pyramid of each layer's keys kept
across ``generate()`` steps, so a step appends one key in O(log N) instead of rebuilding.

A model compiled by :func:`sparseflow.compile` owns one :class:`DecodeState`; its forward runs
with that state active (a ``ContextVar``, so nothing is process-global), and the PISA op, on a
one-query call without padding on the Triton backend, asks the state for the layer's pyramid:

* the pyramid of the same layer (tag) and config that holds exactly the first ``Nk - 1`` keys of
  this call -- checked by comparing its last key with ``k[..., Nk - 2, :]`` -- gets the new key
  appended (one launch);
* anything else (a new prompt, a different batch, a full cache) builds it afresh from the keys.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Dict, Iterator, Optional, Tuple

import torch

__all__ = ["DecodeState", "active", "current"]

_ACTIVE: contextvars.ContextVar[Optional["DecodeState"]] = contextvars.ContextVar("sparseflow_decode", default=None)


@dataclass
class _Entry:
    cache: object  # methods.pisa.pyramid_cache.PyramidCache
    last_key: torch.Tensor  # [B, Hkv, D]: the key at position cache.length - 1


@dataclass
class DecodeState:
    entries: Dict[Tuple, _Entry] = field(default_factory=dict)
    appended: int = 0  # steps served by an O(log N) append
    rebuilt: int = 0  # pyramids built from scratch

    def clear(self) -> None:
        self.entries.clear()

    def pyramid(self, tag: str, k: torch.Tensor, *, block_size: int, branching: int):
        """The layer's pyramid holding all ``Nk`` keys of ``k [B, Hkv, Nk, D]``."""
        from .methods.pisa.pyramid_cache import PyramidCache

        n = k.shape[2]
        key = (tag, block_size, branching, k.shape[0], k.shape[1], k.shape[3], k.dtype, str(k.device))
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
            cache = PyramidCache(k, capacity=max(2 * n, n + 1024), block_size=block_size, branching=branching)
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
