"""Random inputs of the PISA / BSA selection tests: q, k, v and an optional key padding mask with
leading padding in the first batch row and trailing padding in the last, on the test device."""

from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def qkv_inputs(b, hq, hkv, nq, nk, d, dtype, pad, seed=0):
    """``(q, k, v, key_padding_mask or None)``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, nq, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, nk, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, nk, d, generator=g).to(dtype)
    kpm = None
    if pad:
        kpm = torch.ones(b, nk, dtype=torch.bool, device=DEVICE)
        kpm[0, :11] = False  # leading padding (left-padded batch row)
        kpm[-1, nk - 17 :] = False  # trailing padding
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), kpm


def walk_inputs(b, hq, hkv, nq, nk, d, dtype, pad, seed=0):
    """``(q, k, key_padding_mask or None)``: :func:`qkv_inputs` without v (the same q and k)."""
    q, k, _, kpm = qkv_inputs(b, hq, hkv, nq, nk, d, dtype, pad, seed)
    return q, k, kpm
