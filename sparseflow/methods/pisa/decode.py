"""One generate() step of a PISA layer on the model's cached pyramid (O(log N) append)."""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch

from .pyramid_cache import PyramidCache


def _pyramid(k: torch.Tensor, capacity: int, *, cfg) -> PyramidCache:
    return PyramidCache(k, capacity=capacity, block_size=cfg.block_size, branching=cfg.branching)


def decode_step(
    state, tag: str, cfg, tuning, q, k, v, scale, return_selection: bool
) -> Tuple[torch.Tensor, Optional[object]]:
    cache = state.layer_cache(tag, k, (cfg.block_size, cfg.branching), functools.partial(_pyramid, cfg=cfg))
    out, idx = cache.decode_step(
        q,
        k,
        v,
        top_k=cfg.top_k,
        score=cfg.score,
        scale=scale,
        force_sink=cfg.force_sink,
        force_previous=cfg.force_previous,
        append=False,
        beam=cfg.beam,
        tuning=tuning,
    )
    if not return_selection:
        return out, None
    from ...kernels import token_blocks as tb

    sel = tb.selection_for_indices(
        "pisa", idx.long(), q, k, key_padding_mask=None, is_causal=True, block_size=cfg.block_size
    )
    return out, sel
