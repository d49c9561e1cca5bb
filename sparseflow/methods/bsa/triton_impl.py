"""BSA, ``backend="triton"``: same signature and result as ``reference.bsa_attention``.

Selection: ``triton_select`` (the fused full-scan selector; selections equal the reference's up to
fp32 rounding, see its ``precision``).
Attention: ``token_sparse_triton`` (forward and dq/dk/dv backward in Triton), so training runs on
the kernels end to end; the selection itself carries no gradient.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...config import backend_config
from ...tuning import DEFAULT_TUNING, Tuning
from ..topk_attention import triton_top_k_attention
from .config import BSAConfig
from .triton_select import bsa_select

__all__ = ["bsa_attention"]


def bsa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    config: Optional[BSAConfig] = None,
    *,
    key_padding_mask: Optional[torch.Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    return_selection: bool = False,
    tuning: Tuning = DEFAULT_TUNING,
    **fields,
):
    """``tuning``: whether the attention's kernels chain (``pdl``, :class:`sparseflow.Tuning`)."""
    cfg = backend_config(BSAConfig, config, fields)
    return triton_top_k_attention(
        "bsa",
        bsa_select,
        q,
        k,
        v,
        cfg,
        key_padding_mask=key_padding_mask,
        is_causal=is_causal,
        scale=scale,
        return_selection=return_selection,
        pdl=tuning.pdl,
    )
