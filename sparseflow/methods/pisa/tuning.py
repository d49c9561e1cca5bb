"""PISA's launch options (``Tuning(pisa_walk=..., pisa_warps=..., pisa_leaf_bytes=...)``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional, Tuple

from ..._tuning_base import MethodTuning, check_choice, check_optional_int, choice_field

__all__ = ["PISATuning", "WALKS", "WARPS", "SCORES"]

WALKS = ("auto", "per_token", "tiled", "scan", "leaf_pairs")
WARPS = (1, 2, 4, 8, 16, 32)  # Triton launches a power-of-two number of warps
SCORES = ("fp32", "bf16", "tf32")


@dataclass(frozen=True)
class PISATuning(MethodTuning):
    """``walk``: how the selection walk is parallelised (the selection is the same):
    ``"per_token"``, one program per query token (``methods/pisa/triton_select_per_token``);
    ``"tiled"``, one program per tile of consecutive queries sharing the scoring of each level
    (``methods/pisa/triton_select_tiled``; shapes it does not cover run per token, logged);
    ``"scan"``, query tiles score every node above the leaves, the per-token walk reads those
    scores down to its leaf candidates, and the (query, leaf) pairs are scored a leaf at a time
    (``methods/pisa/triton_select_scan``; calls it does not cover run per token, logged);
    ``"leaf_pairs"``, the scan without its node table (which grows as ``N**2``): the per-token
    walk scores the nodes above the leaves itself and the leaf pairs are scored as in the scan
    (``methods/pisa/triton_select_pairs``; calls with no leaf to score run per token, logged); in
    decoding (``PyramidCache``) it splits the walk's leaf level off, each query's candidate leaves
    scored by chunks side by side (``methods/pisa/triton_select_leaf_split``);
    ``"auto"``: on CUDA the scan where it applies (faster at every shape timed), else the leaf
    pairs where there are leaves to score, else per token; in decoding the leaf level split off
    in the graph-capturable step (``decode_step_static``) on CUDA, else per token.
    ``warps`` / ``leaf_bytes``: warps per program of the walk and the shared memory budget of one
    leaf-level chunk; None picks by the walk's candidate width (1 warp and 16 KB up to 16
    candidates, else 4 warps and 64 KB); the tiled walk takes ``warps`` (None: 8, chosen by
    register use) and sizes its chunks by its tile.
    ``scores``: the arithmetic of the walk's q . summary dots (the scores of the pyramid's nodes
    above the leaves, and the leaves' own for ``score="mean"``), in every walk and in decoding.
    ``"fp32"``: the reference's arithmetic, its selection exactly, ties included. ``"bf16"`` /
    ``"tf32"``: both operands rounded to nearest (ties to even) in that format, fp32 accumulation
    (one tensor-core dot in the scan walk instead of its three-part fp32 emulation); the selection
    may then differ from the reference's among near-ties only, within PISA's selection contract
    with that precision's tolerance (``methods/pisa/tolerance_check``; docs/methods.md, "PISA's
    selection contract"). The leaf level's LSE over the raw 16-bit keys stays as it is (its
    products are exact). Unlike the other options, a lower precision may change the selection,
    within that contract.
    PISA's walk and attention chain their launches under ``Tuning.pdl``."""

    method: ClassVar[str] = "pisa"
    shared: ClassVar[Tuple[str, ...]] = ("cuda_graphs", "pdl")

    walk: str = choice_field("auto", "str")
    warps: Optional[int] = choice_field(None, "int?")
    leaf_bytes: Optional[int] = choice_field(None, "int?")
    scores: str = choice_field("fp32", "str")

    def __post_init__(self):
        check_choice(self.label("walk"), self.walk, WALKS)
        check_optional_int(self.label("warps"), self.warps)
        if self.warps is not None and self.warps not in WARPS:
            raise ValueError(f"{self.label('warps')} must be None or one of {list(WARPS)}, got {self.warps}")
        check_optional_int(self.label("leaf_bytes"), self.leaf_bytes)
        if self.leaf_bytes is not None and self.leaf_bytes < 1:
            raise ValueError(f"{self.label('leaf_bytes')} must be None or an int >= 1, got {self.leaf_bytes}")
        check_choice(self.label("scores"), self.scores, SCORES)
