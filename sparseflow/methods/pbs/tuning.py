"""PBS's launch options (``Tuning(pbs_select=..., pbs_kv_layout=..., pbs_tma=...,
pbs_moments_product=...)``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..._tuning_base import MethodTuning, check_choice, choice_field

__all__ = ["PBSTuning", "SELECT", "KV_LAYOUTS", "MOMENTS_PRODUCTS"]

SELECT = ("auto", "triton", "reference")
KV_LAYOUTS = ("permuted", "gather")
MOMENTS_PRODUCTS = ("tf32", "ieee")


@dataclass(frozen=True)
class PBSTuning(MethodTuning):
    """``select``: the implementation of stages 1-3 (proxy scores, permutation, block selection).
    ``"triton"``: the Triton kernels of ``methods/pbs/triton_select``; ``"reference"``: the
    reference's torch stages; ``"auto"``: Triton on CUDA, the reference elsewhere.
    ``kv_layout``: ``"permuted"`` writes K/V once in permuted order so the attention kernel streams
    contiguous tiles; ``"gather"`` reads the original rows through the permutation.
    ``tma``: let the attention kernel use TMA loads where the device and layout allow (Hopper or
    newer, permuted layout, 16-byte aligned rows); False never does.
    ``moments_product``: the arithmetic of ``scoring="moments"``'s spread in the Triton selection:
    ``"tf32"`` runs its products on TF32 tensor cores, each block logit within the stated tolerance
    of its exact value (``methods/pbs/moments.py``), so the selection may differ from the
    reference's among near-ties; ``"ieee"`` computes them in fp32 as the reference does."""

    method: ClassVar[str] = "pbs"

    select: str = choice_field("auto", "str")
    kv_layout: str = choice_field("permuted", "str")
    tma: bool = choice_field(True, "bool")
    moments_product: str = choice_field("tf32", "str")

    def __post_init__(self):
        check_choice(self.label("select"), self.select, SELECT)
        check_choice(self.label("kv_layout"), self.kv_layout, KV_LAYOUTS)
        check_choice(self.label("moments_product"), self.moments_product, MOMENTS_PRODUCTS)
        if not isinstance(self.tma, bool):
            raise TypeError(f"{self.label('tma')} must be a bool, got {type(self.tma).__name__} ({self.tma!r})")
