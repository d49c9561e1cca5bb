"""A Triton walk's trace: the node ids it keeps at every level, for the selection contract's checker.

:func:`walk_trace_triton` runs one of the Triton walks (``Tuning.pisa_walk``, at
``Tuning.pisa_scores``) on a call and returns its trace in ``tolerance_check.walk_trace``'s format:
one ``[B, Hkv, Nq, W]`` int64 tensor a level, leaves first, root last, ``-1`` padded, which
``tolerance_check.selection_within_tolerance`` checks level by level.

**How the kept sets come out.** The walks keep a level's nodes in registers and write only the
leaves. Each walk kernel takes a debug output, compiled out unless ``TRACE`` is set: an int32
``[B*Hkv, Nq, levels, KP]`` table into which every level's kept set is stored right where the
walk computes it (``KP`` kept slots, ``-1`` where none). That is the simplest way that reports
what the kernel really kept (re-running the walk with the pyramid cut at each level would run it
once a level, and would test a walk the real calls never run), and it costs nothing when off:
``TRACE`` is a constexpr, and the ops (``pisa_select_fwd``, ``pisa_select_tiled_fwd``,
``pisa_select_scan_fwd``, ``pisa_select_pairs_fwd``) never set it; this module calls their
bodies (``per_token_walk``, ``tiled_walk``, ``scan_walk``, ``pairs_walk``) with the table. Per walk:

* per-token: the levels it walks are stored after each keep; the levels from its start level up
  (those no wider than their width, which keep every visible node unscored) are stored from the
  same visibility test the start uses;
* tiled: every level from the root down, after each keep;
* scan: its middle stage (the rows walk, ``triton_select_scan_walk``, or the per-token kernel with
  ``PRE_SCORES``) stores the levels above the leaves as above; the leaf level is the walk's output (stages 3-4 keep the leaves). For
  ``score="mean"`` the middle stage walks to the leaves itself and stores them too;
* leaf pairs: as the scan (its walk is the same kernel, scoring the nodes itself).

The walk runs as ``pisa_select`` would run it (same pyramid, same kernels and launch settings);
like ``pisa_select``, a shape the asked walk does not cover falls back to the per-token walk, and
:func:`walk_trace_triton` then raises unless ``fallback=True`` (a test must know which walk it
checked). Tests and studies only: it imports Triton.
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch

from ...config import backend_config
from ...kernels.token_blocks import selection_width
from ...tuning import DEFAULT_TUNING, Tuning
from . import triton_select as ts
from .config import PISAConfig
from .triton_select_common import SCORE_CODES, kept_slots, walk_summaries

__all__ = ["walk_trace_triton", "walk_that_runs"]


def walk_that_runs(q, k, cfg: PISAConfig, tuning: Tuning) -> str:
    """The walk ``pisa_select`` runs for this call and ``tuning``: "scan", "leaf_pairs", "tiled" or "per_token"
    (``pisa_walk="auto"``: the scan where it covers the call on CUDA, else per token; a shape the
    asked walk does not cover: per token)."""
    n_k = k.shape[2]
    top_k = selection_width(cfg.top_k, n_k, cfg.block_size)
    summ_cols = sum(ts.level_sizes(max(1, -(-n_k // cfg.block_size)), cfg.branching))
    summ = torch.empty(0, 0, summ_cols, 0)  # only its node count is read
    score = SCORE_CODES[cfg.score]
    if ts._use_scan_walk(tuning, q, k, summ, score, cfg.block_size, top_k, cfg.beam, cfg.branching):
        return "scan"
    if ts._use_pairs_walk(tuning, q, k, cfg.block_size, top_k, cfg.beam, cfg.branching):
        return "leaf_pairs"
    if ts._use_tiled_walk(tuning, q.shape[1] // k.shape[1], cfg.beam, top_k, cfg.branching):
        return "tiled"
    return "per_token"


def walk_trace_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    config: Optional[PISAConfig] = None,
    *,
    key_padding_mask: Optional[torch.Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    tuning: Tuning = DEFAULT_TUNING,
    fallback: bool = False,
    **fields,
) -> List[torch.Tensor]:
    """The trace of the Triton walk ``tuning`` picks (module docstring), leaves first, root last;
    ``[]`` when there is nothing to select. ``fallback``: accept the per-token walk where the
    asked walk does not cover the call (else a ValueError names the walk that would run;
    ``pisa_walk="auto"`` takes the walk it picks)."""
    cfg = backend_config(PISAConfig, config, fields)
    b, hq, n_q, d = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    if n_k == 0 or b == 0 or n_q == 0:
        return []
    walk = walk_that_runs(q, k, cfg, tuning)
    if tuning.pisa_walk != "auto" and walk != tuning.pisa_walk and not fallback:
        raise ValueError(f"pisa_walk={tuning.pisa_walk!r} does not cover this call: the {walk} walk would run")
    top_k = selection_width(cfg.top_k, n_k, cfg.block_size)
    sc = 1.0 / math.sqrt(d) if scale is None else float(scale)
    with torch.no_grad():
        summ, nfv, sizes, lvl_off, lvl_span = ts.build_pyramid(
            k.detach(), block_size=cfg.block_size, branching=cfg.branching, key_padding_mask=key_padding_mask
        )
        kpm = None if key_padding_mask is None else key_padding_mask.to(device=q.device, dtype=torch.int8).contiguous()
        kp = kept_slots(cfg.beam, top_k)
        trace = torch.full((b * hkv, n_q, len(sizes), kp), -1, dtype=torch.int32, device=q.device)
        args = (
            q.detach(),
            k.detach(),
            kpm,
            walk_summaries(summ, tuning.pisa_scores),
            nfv,
            lvl_off,
            lvl_span,
            sc,
            bool(is_causal),
            SCORE_CODES[cfg.score],
            int(cfg.block_size),
            int(cfg.branching),
            int(top_k),
            bool(cfg.force_sink),
            bool(cfg.force_previous),
            int(cfg.beam),
        )
        window = (int(cfg.sliding_window), int(cfg.chunk_size))
        scores = tuning.pisa_scores
        if walk == "scan":
            from .triton_select_scan import scan_walk

            idx = scan_walk(*args, False, *window, scores, trace)
            if cfg.score != "mean":  # stages 3-4 keep the leaves: the output is the leaf level
                trace[:, :, 0, :top_k] = idx.view(b * hkv, n_q, top_k)
        elif walk == "leaf_pairs":
            from .triton_select_pairs import pairs_walk

            idx = pairs_walk(*args, tuning.pisa_warps, False, *window, scores, trace)
            if cfg.score != "mean":
                trace[:, :, 0, :top_k] = idx.view(b * hkv, n_q, top_k)
        elif walk == "tiled":
            from .triton_select_tiled import tiled_walk

            tiled_walk(*args, tuning.pisa_warps, None, *window, scores, trace)
        else:
            from .triton_select_per_token import per_token_walk

            per_token_walk(*args, tuning.pisa_warps, tuning.pisa_leaf_bytes, None, *window, scores, trace)
        levels = trace.view(b, hkv, n_q, len(sizes), kp).long()
    return [levels[:, :, :, lv] for lv in range(len(sizes))]
