"""The choice grid: what a layer can run (:class:`Choice`), what one single-layer run of it
measured (:class:`Measurement`), and the estimate overhead every sparse choice's cost includes
(its method's ``estimate_cost`` in the registry)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..config import AttentionConfig
from ..methods import spec_for, sparse_names
from ..methods.registry import or_list

DEFAULT_THRESHOLDS = (0.9, 0.95, 0.98, 0.99)
DEFAULT_TOP_KS = (8, 16, 32)
DEFAULT_SCORINGS = ("sampled_rows", "mean")


@dataclass(frozen=True)
class Choice:
    """One thing a layer can run: ``changes`` applied to the base config, or dense (None)."""

    changes: Optional[Tuple[Tuple[str, Any], ...]]

    @property
    def dense(self) -> bool:
        return self.changes is None

    @property
    def key(self) -> str:
        if self.changes is None:
            return "dense"
        return ",".join(f"{k}={v}" for k, v in self.changes)

    def config(self, base: AttentionConfig) -> AttentionConfig:
        return base.replace(**dict(self.changes or ()))


DENSE = Choice(None)


@dataclass(frozen=True)
class Measurement:
    kl: float
    top1: float
    density: float
    cost: float

    def to_dict(self) -> Dict[str, float]:
        return dataclasses.asdict(self)


# every cost is in units of the layer's dense attention, and dense's KL is 0 by definition
DENSE_MEASUREMENT = Measurement(kl=0.0, top1=1.0, density=1.0, cost=1.0)
Table = Dict[int, Dict[Choice, Measurement]]  # layer -> its measured choices


def _floats(values) -> Tuple[float, ...]:
    return tuple(float(v) for v in values)


def candidate_choices(
    method: str,
    base: AttentionConfig,
    *,
    thresholds: Optional[Sequence[float]] = None,
    top_ks: Optional[Sequence[int]] = None,
    scorings: Optional[Sequence[str]] = None,
    permutes: Sequence[bool] = (True, False),
) -> List[Choice]:
    """The sparse choices a layer is measured with (dense is always available besides), each a
    valid config of ``method`` on top of ``base``."""
    spec = sparse_spec(method, "method")
    if spec.has_top_k:
        out = [Choice((("top_k", int(k)),)) for k in (top_ks or DEFAULT_TOP_KS)]
    elif spec.has_threshold:
        out = [
            Choice((("threshold", t), ("permute", bool(p)), ("scoring", s)))
            for s in (scorings or DEFAULT_SCORINGS)
            for p in permutes
            for t in _floats(thresholds or DEFAULT_THRESHOLDS)
        ]
    else:
        raise ValueError(f"method {method!r} has neither a top_k nor a threshold to calibrate")
    for c in out:
        try:
            c.config(base)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"choice {c.key} is not a valid {method} config on {base.to_dict()}: {exc}") from None
    return out


def sparse_spec(method: str, arg: str):
    """The spec of a sparse method; ValueError naming them for anything else."""
    if method not in sparse_names():
        raise ValueError(f"{arg} must be {or_list(sparse_names())}, got {method!r}")
    return spec_for(method)


def estimate_overhead(cfg: AttentionConfig) -> float:
    """What one config's selection costs in units of a dense attention call: its method's
    ``estimate_cost`` (0 for a method that selects nothing)."""
    cost = spec_for(cfg).estimate_cost
    return 0.0 if cost is None else float(cost(cfg))
