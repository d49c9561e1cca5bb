"""A call's mask and local window as the dispatch sees them, and dense SDPA for the calls the
sparse path does not take.

The window a call computes is the config's (``sliding_window``, ``chunk_size``) intersected with
the one its ``attn_mask`` holds (see :func:`sparseflow.masks.analyse_mask`); a call that runs
dense applies it as a mask.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from . import recording as _capture
from .config import AttentionConfig
from .masks import MaskAnalysis, window_mask, with_causality
from .op_backends import DENSE_CHOICE

__all__ = [
    "MaskView",
    "sdpa",
    "with_window_mask",
    "with_config_window",
    "merged_window",
    "dense_sdpa",
]


class MaskView(NamedTuple):
    """The fields of a mask analysis that ``op_backends.call_impl`` reads."""

    key_padding_mask: Optional[torch.Tensor]
    is_causal: bool
    sliding_window: int = 0
    chunk_size: int = 0


def with_config_window(mask: MaskAnalysis, cfg: AttentionConfig) -> MaskAnalysis:
    return dataclasses.replace(mask, sliding_window=cfg.sliding_window, chunk_size=cfg.chunk_size)


def merged_window(mask: MaskAnalysis, cfg: AttentionConfig) -> Tuple[MaskAnalysis, str]:
    """The call's window: the config's and the one the mask holds, intersected; a reason to run
    dense when they cannot be one window (two different chunk sizes, or a window and chunks)."""
    sliding = min((w for w in (mask.sliding_window, cfg.sliding_window) if w), default=0)
    chunks = {c for c in (mask.chunk_size, cfg.chunk_size) if c}
    if len(chunks) > 1 or (chunks and sliding):
        return with_config_window(mask, cfg), (
            f"the attn_mask's window (sliding_window={mask.sliding_window}, chunk_size={mask.chunk_size}) and the "
            f"config's (sliding_window={cfg.sliding_window}, chunk_size={cfg.chunk_size}) are not one window"
        )
    chunk = min(chunks, default=0)
    if (sliding, chunk) == (mask.sliding_window, mask.chunk_size):  # nothing to merge (most calls)
        return mask, ""
    return dataclasses.replace(mask, sliding_window=sliding, chunk_size=chunk), ""


def with_window_mask(attn_mask, q: torch.Tensor, n_k: int, window: Tuple[int, int]) -> torch.Tensor:
    """``attn_mask`` (None, bool or additive) intersected with causality and the local window, on q's device."""
    wm = window_mask(q.shape[2], n_k, window[0], window[1], q.device)
    if attn_mask is None:
        return wm
    if attn_mask.dtype == torch.bool:
        return attn_mask & wm
    return attn_mask.masked_fill(~wm, float("-inf"))


def sdpa(q, k, v, attn_mask, is_causal, scale):
    group = q.shape[1] // k.shape[1]
    if attn_mask is not None and is_causal:
        # the op's mask with is_causal is their intersection; SDPA's math and CUDA kernels refuse the pair
        attn_mask, is_causal = with_causality(attn_mask, q.shape[2], k.shape[2]), False
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=group > 1
    )


def dense_sdpa(
    method: str, tag: str, reason: str, q, k, v, attn_mask, is_causal, scale, cap, window: Tuple[int, int] = (0, 0)
) -> torch.Tensor:
    """Dense SDPA for a call the plan sends there: logged (and tallied) with its reason, recorded;
    the result as SDPA lays it out (a caller that re-lays it out saves a copy). ``window``: the
    call's (sliding_window, chunk_size), applied as a mask."""
    if reason:
        _capture.log_fallback(method, tag, reason)
    if window != (0, 0):
        attn_mask, is_causal = with_window_mask(attn_mask, q, k.shape[2], window), False
    out = sdpa(q, k, v, attn_mask, is_causal, scale)
    if cap is not None:
        cap.calls.append(_capture.CallRecord(tag, method, DENSE_CHOICE, False, reason, tuple(q.shape), tuple(k.shape)))
    return out
