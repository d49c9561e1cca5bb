"""The DenseConfig: what the dense method computes (validated, frozen, versioned)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..._config_base import AttentionConfig


@dataclass(frozen=True)
class DenseConfig(AttentionConfig):
    """The rewrite with a dense body: proves the pass itself changes nothing."""

    method: ClassVar[str] = "dense"

    @property
    def exact(self) -> bool:
        return True
