"""Diagnostics of one selection: which original key blocks a head's queries attend.

:func:`block_map` turns any :class:`sparseflow.selection.Selection` (PBS block masks over permuted
keys, or PISA/BSA per-token leaf blocks) into one picture: for one query head, the fraction of
keys of each *original-order* key block that each query block attends. It never builds the
quadratic key mask, so it works at the model's native length.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..selection import Selection

__all__ = ["block_map"]


def block_map(selection: Selection, head: int, *, batch: int = 0, block_size: Optional[int] = None) -> torch.Tensor:
    """``[nQB, nKB]`` float: fraction of the keys of original key block ``kb`` that the queries of
    query block ``qb`` attend, for query head ``head`` (blocks of ``block_size``, default the
    selection's). Causality is not applied: a selected block counts whole."""
    if not isinstance(selection, Selection):
        raise TypeError(f"selection must be a sparseflow Selection, got {type(selection).__name__}")
    hq = selection.density.shape[1]
    if isinstance(head, bool) or not isinstance(head, int) or not (0 <= head < hq):
        raise ValueError(f"head must be an int in [0, {hq - 1}], got {head!r}")
    bs = int(block_size or selection.block_size)
    if bs < 1:
        raise ValueError(f"block_size must be >= 1, got {bs}")
    n = selection.num_keys
    nb = -(-n // bs)
    if selection.block_mask is not None:
        return _pbs_map(selection, head, batch, bs, nb)
    if selection.block_indices is not None:
        return _token_map(selection, head, batch, bs, nb)
    raise ValueError(f"selection of method {selection.method!r} carries no blocks (was it stripped by capture?)")


def _pbs_map(sel: Selection, head: int, b: int, bs: int, nb: int) -> torch.Tensor:
    mask = sel.block_mask[b, head].float()  # [nQB_sel, nKB_sel] over permuted key slots
    perm = sel.permutation[b]
    hp = head // (sel.density.shape[1] // perm.shape[0])
    n = sel.num_keys
    sbs = sel.block_size
    slot_block = torch.arange(n, device=mask.device) // sbs
    per_slot = mask[:, slot_block]  # [nQB_sel, N]: slot j selected for query block qb
    orig_block = perm[hp].to(mask.device) // bs
    out = torch.zeros(mask.shape[0], nb, dtype=torch.float32, device=mask.device)
    out.index_add_(1, orig_block, per_slot)
    counts = torch.bincount(orig_block, minlength=nb).clamp_min(1).float()
    out = out / counts
    # rows are query blocks of the selection's size; regroup them to ``bs`` when they differ
    q_block = torch.arange(n, device=mask.device) // sbs
    rows = out[q_block]  # [N, nb] one row per query token
    return _pool_rows(rows, bs, nb)


def _token_map(sel: Selection, head: int, b: int, bs: int, nb: int) -> torch.Tensor:
    idx = sel.block_indices[b]  # [Hkv, Nq, K] leaf blocks of sel.block_size
    hkv = idx.shape[0]
    g = sel.density.shape[1] // hkv
    rows_idx = idx[head // g]  # [Nq, K]
    n_leaf = -(-sel.num_keys // sel.block_size)
    chosen = torch.zeros(rows_idx.shape[0], n_leaf + 1, dtype=torch.float32, device=idx.device)
    safe = torch.where(rows_idx < 0, torch.full_like(rows_idx, n_leaf), rows_idx)
    chosen.scatter_(1, safe, 1.0)
    chosen = _pool_rows(chosen[:, :n_leaf], bs, nb)  # [nb, n_leaf]: query tokens -> query blocks first
    # leaf blocks -> keys -> key blocks of bs (fraction of each block's keys covered)
    key_leaf = torch.arange(sel.num_keys, device=idx.device) // sel.block_size
    per_key = chosen[:, key_leaf]  # [nb, N]
    key_block = torch.arange(sel.num_keys, device=idx.device) // bs
    out = torch.zeros(nb, nb, dtype=torch.float32, device=idx.device)
    out.index_add_(1, key_block, per_key)
    return out / torch.bincount(key_block, minlength=nb).clamp_min(1).float()


def _pool_rows(rows: torch.Tensor, bs: int, nb: int) -> torch.Tensor:
    n = rows.shape[0]
    q_block = torch.arange(n, device=rows.device) // bs
    out = torch.zeros(nb, rows.shape[1], dtype=torch.float32, device=rows.device)
    out.index_add_(0, q_block, rows)
    return out / torch.bincount(q_block, minlength=nb).clamp_min(1).float()[:, None]
