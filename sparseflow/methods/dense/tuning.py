"""The dense method's launch options: none of its own. Its windowed calls run Triton kernels, so
its op takes ``Tuning.cuda_graphs``: a call traced by ``torch.compile`` must not replay an
op-level CUDA graph (``Tuning.traced``), which it would with the default the op rebuilds from an
argument it was never given."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..._tuning_base import MethodTuning

__all__ = ["DenseTuning"]


@dataclass(frozen=True)
class DenseTuning(MethodTuning):
    method: ClassVar[str] = "dense"
