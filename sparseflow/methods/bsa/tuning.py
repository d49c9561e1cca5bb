"""BSA's launch options: none of its own; its scan and attention chain their launches under
``Tuning.pdl``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Tuple

from ..._tuning_base import MethodTuning

__all__ = ["BSATuning"]


@dataclass(frozen=True)
class BSATuning(MethodTuning):
    method: ClassVar[str] = "bsa"
    shared: ClassVar[Tuple[str, ...]] = ("cuda_graphs", "pdl")
