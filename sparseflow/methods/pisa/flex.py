"""PISA on FlexAttention (``backend="flex"``).

Selection: the reference's pyramid walk (:func:`sparseflow.methods.pisa.reference.pisa_select`),
so the selected blocks -- and the reported :class:`~sparseflow.selection.Selection` -- are the
reference's exactly. Attention: compiled ``flex_attention`` through
:func:`sparseflow.kernels.flex_common.token_block_attention` -- a query tile's block list is the
union of its tokens' selections, and a ``mask_mod`` does the per-token membership test (bitset
lookup ``bits[b, h // G, q_idx, blk // 32]``), causality and key padding. K/V keep their ``Hkv``
heads (native GQA). On CPU, flex is inference only.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...config import backend_config
from ..topk_attention import flex_top_k_attention
from .config import PISAConfig
from .reference import pisa_select

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
    q_tile: Optional[int] = None,
    kv_tile: Optional[int] = None,
    **fields,
):
    """PISA attention with compiled FlexAttention: same signature, selection and result (to
    floating-point tolerance) as :func:`sparseflow.methods.pisa.reference.pisa_attention`.
    ``q_tile`` / ``kv_tile``: the BlockMask's query rows / key columns per tile (default
    ``block_size``; ``kv_tile`` a multiple of it)."""
    cfg = backend_config(PISAConfig, config, fields)
    return flex_top_k_attention(
        "pisa",
        pisa_select,
        q,
        k,
        v,
        cfg,
        key_padding_mask=key_padding_mask,
        is_causal=is_causal,
        scale=scale,
        return_selection=return_selection,
        q_tile=q_tile,
        kv_tile=kv_tile,
    )
