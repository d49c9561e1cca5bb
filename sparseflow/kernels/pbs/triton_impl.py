"""PBS-Attn, ``backend="triton"``: same signature and result as ``reference.pbs_attention``.

Stages (SPEC §3):

1. proxy key scores, 2. segmented permutation, 3. block selection -- on CUDA the Triton kernels
   of ``triton_select`` (identical selections to the reference in the CPU-interpreter tests and
   in ``benchmarks/pbs.py --part check`` on the H200, and 8.6x faster than the torch stages at
   8K: benchmarks/results/pbs_h200_total_2026-11-29.log); elsewhere (the interpreter) the
   reference's torch stages. ``SPARSEFLOW_PBS_SELECT=reference|triton`` overrides;
4. attention -- the Triton kernel ``sparseflow::pbs_block_sparse_fwd`` (``triton_attention``).

K/V layout for the kernel (``SPARSEFLOW_PBS_KV`` = ``permuted`` | ``gather``):

* ``permuted``: one gather pass writes K/V in permuted order, one head per permutation head
  (``[B, Hp, N, D]``); under per-KV-head permutation that is Hkv heads, so K/V are never
  repeated; under per-query-head permutation each query head has its own key order, so the
  permuted copy has Hq heads. The kernel then streams contiguous tiles (TMA on Hopper).
* ``gather``: the kernel reads the original ``[B, Hkv, N, D]`` K/V rows through the
  permutation (no copy, no TMA).
"""
from __future__ import annotations

import math
import os
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from ...selection import Selection
from . import reference as _ref
from .triton_attention import block_mask_to_indices, key_positions, pbs_block_sparse_attention

__all__ = ["pbs_attention", "permute_kv", "kv_layout", "select_impl"]


def select_impl(device: Optional[torch.device] = None) -> str:
    """``SPARSEFLOW_PBS_SELECT``: ``reference`` (the reference's torch stages 1-3) or ``triton``
    (``triton_select``: Triton proxy scoring, segment sort and -- for ``scoring="mean"`` -- the
    one-kernel block selection that writes the attention's block lists). Unset: ``triton`` on
    CUDA, ``reference`` elsewhere."""
    default = "triton" if device is not None and device.type == "cuda" else "reference"
    impl = os.environ.get("SPARSEFLOW_PBS_SELECT", default)
    if impl not in ("reference", "triton"):
        raise ValueError(f"SPARSEFLOW_PBS_SELECT must be 'reference' or 'triton', got {impl!r}")
    return impl


def kv_layout() -> str:
    layout = os.environ.get("SPARSEFLOW_PBS_KV", "permuted")
    if layout not in ("permuted", "gather"):
        raise ValueError(f"SPARSEFLOW_PBS_KV must be 'permuted' or 'gather', got {layout!r}")
    return layout


def permute_kv(x: Tensor, permutation: Tensor) -> Tensor:
    """``[B, Hkv, N, D]`` -> ``[B, Hp, N, D]`` with slot ``j`` of permutation head ``p`` holding
    row ``permutation[b, p, j]`` of KV head ``p // (Hp // Hkv)`` (one gather, no repeat first)."""
    b, hkv, n, d = x.shape
    hp = permutation.shape[1]
    kv_of_p = torch.arange(hp, device=x.device) // (hp // hkv)  # [Hp]
    base = (torch.arange(b, device=x.device)[:, None] * hkv + kv_of_p[None, :]) * n  # [B, Hp]
    rows = (base[:, :, None] + permutation).reshape(-1)
    return x.reshape(b * hkv * n, d).index_select(0, rows).view(b, hp, n, d)


def pbs_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    key_padding_mask: Optional[Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    block_size: int = 128,
    segment_size: int = 256,
    threshold: float = 0.9,
    force_sink: bool = True,
    permute: bool = True,
    gqa_permutation: str = "query_head",
    scoring: str = "mean",
    antidiagonal_stride: int = 8,
    causal_proxy: bool = False,
    return_selection: bool = False,
) -> Union[Tensor, Tuple[Tensor, Selection]]:
    """PBS-Attn prefill with the Triton attention kernel. ``q: [B, Hq, N, D]``,
    ``k, v: [B, Hkv, N, D]`` (Nq == Nk); output ``[B, Hq, N, D]`` in ``q.dtype``."""
    bsz, hq, n, d = q.shape
    hkv = k.shape[1]
    if gqa_permutation not in ("query_head", "kv_head"):
        raise ValueError(f"gqa_permutation must be 'query_head' or 'kv_head', got {gqa_permutation!r}")
    if k.shape[2] != n:
        raise ValueError(f"PBS needs Nq == Nk, got Nq={n}, Nk={k.shape[2]}")
    if v.shape[-1] != d:
        raise ValueError(f"the Triton PBS kernel needs v's head dim == q's ({d}), got {v.shape[-1]}")
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.to(torch.bool)
    hp = hq if gqa_permutation == "query_head" else hkv
    kernels = select_impl(q.device) == "triton"
    if kernels:
        from . import triton_select as _sel

        score_fn, perm_fn = _sel.key_scores, _sel.segment_permutation
    else:
        score_fn, perm_fn = _ref.key_scores, _ref.segment_permutation
    with torch.no_grad():
        qd, kd = q.detach(), k.detach()
        if permute:
            scores = score_fn(qd, kd, key_padding_mask=key_padding_mask, scale=scale, block_size=block_size,
                              segment_size=segment_size, causal_proxy=causal_proxy, gqa_permutation=gqa_permutation)
            perm = perm_fn(scores, segment_size=segment_size, key_padding_mask=key_padding_mask)
        else:
            perm = torch.arange(n, device=q.device).expand(bsz, hp, n).clone()
        if kernels and scoring == "mean":
            out, block_mask = _fused_select_attention(
                q, k, v, perm, key_padding_mask=key_padding_mask, is_causal=is_causal, scale=scale,
                block_size=block_size, segment_size=segment_size, threshold=threshold, force_sink=force_sink,
                mask_segment=segment_size if permute else block_size, want_mask=return_selection,
            )
            return _finish(out, block_mask, perm, key_padding_mask, is_causal, block_size, n, return_selection)
        block_mask = _ref.select_blocks(
            qd, kd, perm, key_padding_mask=key_padding_mask, is_causal=is_causal, scale=scale,
            block_size=block_size, segment_size=segment_size, threshold=threshold, force_sink=force_sink,
            scoring=scoring, antidiagonal_stride=antidiagonal_stride,
        )
        out = attention_from_selection(
            q, k, v, perm, block_mask, key_padding_mask=key_padding_mask, is_causal=is_causal, scale=scale,
            block_size=block_size, segment_size=segment_size if permute else block_size,
        )
    return _finish(out, block_mask, perm, key_padding_mask, is_causal, block_size, n, return_selection)


def _fused_select_attention(q, k, v, perm, *, key_padding_mask, is_causal, scale, block_size, segment_size,
                            threshold, force_sink, mask_segment, want_mask):
    from .triton_select import select_block_lists

    kk = permute_kv(k, perm)
    kv_num, kv_full, kv_idx, block_mask = select_block_lists(
        q, kk, perm, key_padding_mask=key_padding_mask, is_causal=is_causal, scale=scale, block_size=block_size,
        segment_size=segment_size, threshold=threshold, force_sink=force_sink, mask_segment=mask_segment,
        return_block_mask=want_mask,
    )
    has_pad = key_padding_mask is not None and not bool(key_padding_mask.all())
    kpos = key_positions(perm, key_padding_mask if has_pad else None)
    if kv_layout() == "gather":
        kk, vv, gather = k, v, True
    else:
        vv, gather = permute_kv(v, perm), False
    out = pbs_block_sparse_attention(
        q, kk, vv, kpos, kv_num, kv_full, kv_idx, scale=scale, block_size=block_size,
        is_causal=is_causal, has_padding=has_pad, gather=gather,
    )
    return out, block_mask


def _finish(out, block_mask, perm, key_padding_mask, is_causal, block_size, n, return_selection):
    if not return_selection:
        return out
    density = _ref.selection_density(block_mask, perm, key_padding_mask=key_padding_mask, is_causal=is_causal,
                                     block_size=block_size)
    sel = Selection(
        method="pbs", density=density, block_size=block_size, is_causal=is_causal, num_keys=n,
        block_mask=block_mask, permutation=perm, key_padding_mask=key_padding_mask,
    )
    return out, sel


def attention_from_selection(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    permutation: Tensor,
    block_mask: Tensor,
    *,
    key_padding_mask: Optional[Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    block_size: int = 128,
    segment_size: int = 256,
    layout: Optional[str] = None,
) -> Tensor:
    """Step 4 alone: the Triton kernel over a given permutation ``[B, Hp, N]`` and block mask
    ``[B, Hq, nB, nB]`` (the reference's ``permuted_block_attention`` contract; forward only)."""
    layout = kv_layout() if layout is None else layout
    n = q.shape[2]
    has_pad = key_padding_mask is not None and not bool(key_padding_mask.all())
    kpos = key_positions(permutation, key_padding_mask if has_pad else None)
    kv_num, kv_full, kv_idx = block_mask_to_indices(
        block_mask, num_keys=n, block_size=block_size, segment_size=segment_size,
        is_causal=is_causal, has_padding=has_pad,
    )
    if layout == "gather":
        kk, vv, gather = k, v, True
    else:
        kk, vv, gather = permute_kv(k, permutation), permute_kv(v, permutation), False
    return pbs_block_sparse_attention(
        q, kk, vv, kpos, kv_num, kv_full, kv_idx, scale=scale, block_size=block_size,
        is_causal=is_causal, has_padding=has_pad, gather=gather,
    )
