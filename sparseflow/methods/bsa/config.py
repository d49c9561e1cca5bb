"""The BSAConfig: what the bsa method computes (validated, frozen, versioned)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..._config_base import TopKConfig


@dataclass(frozen=True)
class BSAConfig(TopKConfig):
    """Block-sparse baseline: score every visible block by q·mean(K_block), take the top K."""

    method: ClassVar[str] = "bsa"

    def _validate(self) -> None:
        self._validate_common()
