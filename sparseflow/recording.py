"""Record what each sparseflow op call computed: path taken, fallback reason, selection, density.

Nothing is recorded unless the caller opens a ``capture()`` context, so the ops pay no cost for
bookkeeping by default. The active capture lives in a ``ContextVar``: no process-global state.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from .selection import Selection

__all__ = ["CallRecord", "Capture", "capture", "active_capture", "log_fallback", "RunTally", "tallying", "note_call"]

logger = logging.getLogger("sparseflow")


@dataclass
class CallRecord:
    tag: str  # the module the call came from ("" when called directly)
    method: str
    backend: str  # the backend that ran ("sdpa" for a dense fallback)
    sparse: bool  # False: ran dense attention
    reason: str  # why it ran dense ("" when sparse)
    q_shape: Tuple[int, ...]
    k_shape: Tuple[int, ...]
    selection: Optional[Selection] = None

    @property
    def density(self) -> Optional[float]:
        if self.selection is not None:
            return self.selection.mean_density
        return None if self.sparse else 1.0


@dataclass
class Capture:
    keep_selections: bool = True
    calls: List[CallRecord] = field(default_factory=list)

    def densities(self) -> List[Tuple[str, float]]:
        return [(c.tag, c.density) for c in self.calls if c.density is not None]

    def mean_density(self) -> float:
        vals = [d for _, d in self.densities()]
        return float(sum(vals) / len(vals)) if vals else float("nan")

    def fallbacks(self) -> List[CallRecord]:
        return [c for c in self.calls if not c.sparse]

    def density_per_head(self) -> torch.Tensor:
        """[calls, Hq] mean density per head for every sparse call with a selection."""
        rows = [c.selection.density.float().mean(0).cpu() for c in self.calls if c.selection is not None]
        return torch.stack(rows) if rows else torch.empty(0, 0)


_ACTIVE: contextvars.ContextVar[Optional[Capture]] = contextvars.ContextVar("sparseflow_capture", default=None)


def active_capture() -> Optional[Capture]:
    return _ACTIVE.get()


@contextlib.contextmanager
def capture(keep_selections: bool = True) -> Iterator[Capture]:
    """``with sparseflow.capture() as cap: model(x)`` then read ``cap.calls``."""
    cap = Capture(keep_selections=keep_selections)
    token = _ACTIVE.set(cap)
    try:
        yield cap
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Stop recording (used while an op recomputes its forward for the backward pass)."""
    token, tally_token = _ACTIVE.set(None), _TALLY.set(None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        _TALLY.reset(tally_token)


# Per (tag, method): {reason: number of calls}, "" counting the calls that ran sparse. A model's
# RewriteReport owns one and opens it around every call of the model, so its entries can say
# which rewritten calls ran dense at run time and why (capture() aside, which records far more).
RunTally = Dict[Tuple[str, str], Dict[str, int]]

_TALLY: contextvars.ContextVar[Optional[RunTally]] = contextvars.ContextVar("sparseflow_tally", default=None)


_MAX_REASONS = 16
_OTHER_REASONS = f"other reasons (more than {_MAX_REASONS} distinct ones; sparseflow.capture() records each call)"


@contextlib.contextmanager
def tallying(tally: RunTally) -> Iterator[RunTally]:
    token = _TALLY.set(tally)
    try:
        yield tally
    finally:
        _TALLY.reset(token)


def note_call(method: str, tag: str, sparse: bool, reason: str = "") -> None:
    """Count one op call in the active tally (no-op outside ``tallying``)."""
    tally = _TALLY.get()
    if tally is None:
        return
    per_reason = tally.setdefault((tag, method), {})
    key = "" if sparse else (reason or "dense")
    if key not in per_reason and len(per_reason) >= _MAX_REASONS:
        key = _OTHER_REASONS  # reasons that carry lengths (decode steps) would grow without bound
    per_reason[key] = per_reason.get(key, 0) + 1


_LOGGED: set = set()


def log_fallback(method: str, tag: str, reason: str) -> None:
    # First occurrence of a (method, layer, reason) at INFO, repeats at DEBUG: a generate() loop
    # would otherwise print one line per layer per token.
    key = (method, tag, reason)
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info("sparseflow: %s attention%s runs dense: %s", method, f" at {tag}" if tag else "", reason)
    elif logger.isEnabledFor(logging.DEBUG):
        logger.debug("sparseflow: %s attention%s runs dense: %s", method, f" at {tag}" if tag else "", reason)
    if _TALLY.get() is not None:
        note_call(method, tag, False, reason)
