"""PBS's selections without their attention, for calibration: the densities of several configs on
one layer's q/k, configs differing only in threshold sharing one permutation and one block
estimate (the registry's ``selection_densities``)."""

from __future__ import annotations

import json
from typing import Dict, List, Optional, Sequence

import torch

from .block_selection import selection_density
from .reference import pbs_selections
from .config import PBSConfig
from .tail import mark_tail

__all__ = ["selection_densities"]


def selection_densities(
    q: torch.Tensor, k: torch.Tensor, cfgs: Sequence[PBSConfig], scale: Optional[float]
) -> List[float]:
    """Each config's mean selection density on ``q``/``k`` (causal), as the op reports it."""
    groups: Dict[str, List[int]] = {}
    for i, cfg in enumerate(cfgs):
        groups.setdefault(json.dumps({**cfg.to_dict(), "threshold": None}, sort_keys=True, default=str), []).append(i)
    out: List[float] = [0.0] * len(cfgs)
    for idx in groups.values():
        cfg = cfgs[idx[0]]
        perm, masks = pbs_selections(q, k, cfg, [cfgs[i].threshold for i in idx], is_causal=True, scale=scale)
        for i, mask in zip(idx, masks):
            mask = mark_tail(mask, cfg.dense_tail_blocks)  # as the op reports its selection
            density = selection_density(mask, perm, is_causal=True, block_size=cfg.block_size)
            out[i] = float(density.float().mean())  # as Selection.mean_density
    return out
