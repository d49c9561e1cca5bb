"""PISA, ``backend="triton"``: same signature and result as ``reference.pisa_attention``.

Selection: ``triton_select`` (pyramid build + fused walk; selections equal the reference's).
Attention: ``token_sparse_triton`` (forward and dq/dk/dv backward in Triton), so training runs on
the kernels end to end; the selection itself carries no gradient.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from ...config import backend_config
from ...tuning import DEFAULT_TUNING, Tuning
from ..topk_attention import triton_top_k_attention
from .config import PISAConfig
from .triton_select import pisa_select

__all__ = ["pisa_attention"]


def pisa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    config: Optional[PISAConfig] = None,
    *,
    key_padding_mask: Optional[torch.Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    return_selection: bool = False,
    tuning: Tuning = DEFAULT_TUNING,
    **fields,
):
    """``tuning``: the selection walk's launch settings and whether the kernels chain
    (:class:`sparseflow.Tuning`)."""
    cfg = backend_config(PISAConfig, config, fields)
    return triton_top_k_attention(
        "pisa",
        functools.partial(pisa_select, tuning=tuning),
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
