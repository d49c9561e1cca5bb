"""Attention in plain PyTorch over an explicit set of visible keys: the oracle every method is
compared with (the property suite's fp64 reference, the dense method's windowed calls).

fp32 (or fp64 when given fp64) accumulation, native GQA by reshaping queries into groups instead of
repeating K/V, key padding, and zeros (not NaN) for a query that sees no key.
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_padding_mask: Optional[torch.Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    key_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``key_mask``: optional ``[B, Hq, Nq, Nk]`` bool restricting which keys each query sees
    (the masked-dense oracle for a sparse selection)."""
    b, hq, n_q, d = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    qg = q.to(acc).reshape(b, hkv, g, n_q, d)
    logits = torch.einsum("bhgqd,bhkd->bhgqk", qg, k.to(acc)) * scale
    visible = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device)
    if is_causal:
        # bottom-right aligned: query i sits at position i + Nk - Nq
        visible = visible.tril(diagonal=n_k - n_q)
    visible = visible.expand(b, 1, 1, n_q, n_k)
    if key_padding_mask is not None:
        visible = visible & key_padding_mask[:, None, None, None, :]
    if key_mask is not None:
        visible = visible & key_mask.reshape(b, hkv, g, n_q, n_k)
    logits = logits.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # rows with no visible key -> 0
    out = torch.einsum("bhgqk,bhkd->bhgqd", probs, v.to(acc))
    return out.reshape(b, hq, n_q, v.shape[-1]).to(q.dtype)
