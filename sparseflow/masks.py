"""Recognise the attention masks models hand to SDPA.

The sparse ops understand two things: causality and key padding. A 4-D boolean mask that is
exactly ``causal & key_padding`` (what Hugging Face builds under ``torch.export``) or exactly
``key_padding`` broadcast over queries is folded into ``(is_causal, key_padding_mask)``. Any
other mask is reported as unsupported so the caller runs dense attention and says why.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["MaskAnalysis", "analyse_mask"]


@dataclass(frozen=True)
class MaskAnalysis:
    supported: bool
    is_causal: bool = False
    key_padding_mask: Optional[torch.Tensor] = None  # [B, Nk] bool, True = valid; None = all valid
    reason: str = ""


def _as_bool(mask: torch.Tensor) -> Optional[torch.Tensor]:
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point():
        # Additive masks are folded only when every entry is exactly 0 or -inf: any other value
        # (finite "large negative", a bias) changes the result and is not a visibility mask.
        zero = mask == 0
        if bool((zero | torch.isneginf(mask)).all()):
            return zero
    return None


def _padding_or_none(kpm: torch.Tensor) -> Optional[torch.Tensor]:
    return None if bool(kpm.all()) else kpm.contiguous()


def analyse_mask(
    attn_mask: Optional[torch.Tensor], is_causal: bool, batch: int, n_q: int, n_k: int
) -> MaskAnalysis:
    if attn_mask is None:
        return MaskAnalysis(True, is_causal=is_causal)
    if attn_mask.dim() == 2 and attn_mask.dtype == torch.bool and attn_mask.shape == (batch, n_k):
        # [B, Nk] key padding (sparseflow's own form) combines with either causality
        return MaskAnalysis(True, is_causal=is_causal, key_padding_mask=_padding_or_none(attn_mask))
    if is_causal:
        # SDPA itself rejects a 4-D mask together with is_causal; keep the same contract.
        return MaskAnalysis(False, reason="attn_mask together with is_causal=True")
    mask = _as_bool(attn_mask)
    if mask is None:
        return MaskAnalysis(False, reason=f"attn_mask of dtype {attn_mask.dtype} with values other than 0/-inf")
    if mask.dim() != 4:
        return MaskAnalysis(False, reason=f"attn_mask of rank {mask.dim()} (expected a 4-D mask or [B, Nk] key padding)")
    if mask.shape[-2:] != (n_q, n_k) and not (mask.shape[-2] == 1 and mask.shape[-1] == n_k):
        return MaskAnalysis(False, reason=f"attn_mask of shape {tuple(mask.shape)}")
    if mask.shape[1] != 1 and not bool((mask == mask[:, :1]).all()):
        return MaskAnalysis(False, reason="attn_mask that differs between heads")
    m = mask[:, 0].expand(batch, mask.shape[-2], n_k)  # [B, Nq or 1, Nk]
    if m.shape[1] == 1:
        return MaskAnalysis(True, is_causal=False, key_padding_mask=_padding_or_none(m[:, 0]))
    # Non-causal key padding: every query row equals the first.
    if bool((m == m[:, :1]).all()):
        return MaskAnalysis(True, is_causal=False, key_padding_mask=_padding_or_none(m[:, 0]))
    if n_q == n_k:
        kpm = m[:, -1]  # the last query sees every earlier key that is valid
        causal = torch.ones(n_q, n_k, dtype=torch.bool, device=m.device).tril()
        if bool((m == (causal[None] & kpm[:, None, :])).all()):
            return MaskAnalysis(True, is_causal=True, key_padding_mask=_padding_or_none(kpm))
    return MaskAnalysis(False, reason="attn_mask that is neither causal nor key padding")
