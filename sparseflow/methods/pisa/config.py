"""The PISAConfig: what the pisa method computes (validated, frozen, versioned)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..._config_base import TopKConfig, _check_choice, _check_int


@dataclass(frozen=True)
class PISAConfig(TopKConfig):
    """PISA (pyramid block selection). Forced blocks count inside ``top_k``.

    ``beam``: width of the coarse-to-fine walk. At every level above the leaves the walk keeps
    the best ``beam * top_k`` candidates (forced ones included) instead of ``top_k``; the leaf
    level still keeps ``top_k``, so the attention cost is unchanged and the selection cost grows
    about ``beam``-fold (still ``O(g * beam * K * log(N / C))`` per query). A wider beam lets a
    block whose coarse ancestor scores poorly survive until its own, finer score is known, which
    closes most of the recall gap to a flat exact scan over every block. ``beam=1`` is the
    original walk, bit for bit.
    """

    method: ClassVar[str] = "pisa"
    branching: int = 2
    score: str = "lse"
    beam: int = 1

    def _validate(self) -> None:
        self._validate_common()
        _check_int("branching", self.branching, 2)
        _check_choice("score", self.score, ("lse", "mean", "mean_var"))
        _check_int("beam", self.beam, 1)
