"""PISA (pyramid block selection) in plain PyTorch: the oracle for every other backend.

Selection walks a pyramid of mean key summaries from the root down, per query token, keeping at
most ``beam * top_k`` nodes per level above the leaves and ``top_k`` leaves; the kept leaf
blocks are attended with :func:`sparseflow.kernels.token_blocks.attend_selected_blocks`.

Pyramid (per KV head, built by :func:`build_pyramid`): level 1 = leaf blocks of ``C`` keys, level
``l+1`` node ``u`` merges level-``l`` nodes ``u*g .. u*g+g-1`` (the last group may be short: the
pyramid is conceptually padded with empty nodes up to a power of ``g``). Every node's summary is
the mean of the valid keys below it; a node with no valid key has a zero summary and is never a
candidate. Node ``u`` of level ``l`` covers leaves ``[u*g**(l-1), (u+1)*g**(l-1))``.

Walk for query ``i`` (position ``p_i``, horizon ``h_i``; see token_blocks):

* level ``L`` (the root, a single node) is kept if it holds a visible key;
* at each lower level the candidates are the children of the kept nodes that hold a visible key
  (so nodes entirely in the future of ``p_i`` and nodes without valid keys are dropped);
* *forced* candidates are kept without scoring: the ancestors of the visible forced leaves
  (current / previous / sink) and the node that contains position ``p_i`` (in causal mode the
  only node that can straddle ``p_i``; forcing it keeps future keys out of every score even when
  the current leaf itself has no visible key because of padding);
* if the candidates fit in the level's width all are kept; otherwise the forced ones plus the
  best-scoring others, the width in total, ties to the lower index. The width is ``top_k`` at the
  leaf level and ``beam * top_k`` at every level above it (``beam=1``: ``top_k`` everywhere, the
  plain walk; a wider beam keeps more coarse candidates alive until their finer scores are
  known, at ``beam`` times the selection cost).

Scores are computed in fp32 (fp64 for fp64 inputs), per query head, and summed over the query
heads of the GQA group:

* ``"lse"``: intermediate node: ``log sum_c exp(q . kbar_c * scale)`` over its children that hold
  a visible key; leaf: exact LSE over its valid raw keys;
* ``"mean"`` (PISA-1): ``q . kbar_u * scale`` with ``kbar_u`` the node's own (token-weighted) mean;
* ``"mean_var"`` (PISA-2): mean + 1/2 population variance of the child logits (unweighted over the
  children that hold a visible key; for a leaf, over its valid raw key logits).

Scored nodes never hold a key after ``p_i`` (only the node containing ``p_i`` can, and it is
forced), so selection is exactly causal.

Local window (``sliding_window`` / ``chunk_size``, causal only; see
:func:`sparseflow.kernels.token_blocks.window_lower_bounds`): query ``i`` chooses among the
blocks from its window's first leaf block ``f_i = lo(p_i) // C`` on. The walk is restricted to
that range: a node wholly before ``f_i`` (its last leaf ``< f_i``, i.e. ``u < f_i // g**(l-1)``)
is never a candidate, so it is neither expanded nor kept, and a forced leaf before ``f_i`` (the
sink, the previous block) is not forced, nor are its ancestors. Scores are those of the walk
without a window: a node straddling ``f_i`` (at most one per level) is scored on all its
children, as BSA scores the window's first block by its whole mean. The attention then applies
the window's key bound element-wise. Without a window ``f_i = 0`` and nothing changes.

This walk is the oracle of PISA's selection contract: another walk may keep other nodes only
among near-ties, within the tolerance of the precision it scores in (``tolerance.py`` derives
it, ``tolerance_check.py`` replays this walk on the other walk's kept nodes level by level;
docs/methods.md, "PISA's selection contract"). ``_make_walk``, ``_level_candidates`` and
``_level_scores`` are the pieces that replay shares with the walk.
"""

from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Tuple

import torch

from ...config import backend_config
from ...kernels import token_blocks as tb
from ..topk_attention import reference_top_k_selection
from .config import PISAConfig

__all__ = ["build_pyramid", "pisa_select", "pisa_attention", "pisa_reference_selection", "SCORES", "check_beam"]

SCORES = ("lse", "mean", "mean_var")


def check_beam(beam) -> int:
    """``beam`` as an int >= 1, else a TypeError / ValueError naming it."""
    if isinstance(beam, bool) or not isinstance(beam, int):
        raise TypeError(f"beam must be an int >= 1, got {type(beam).__name__} ({beam!r})")
    if beam < 1:
        raise ValueError(f"beam must be >= 1, got {beam}")
    return beam


def build_pyramid(
    k: torch.Tensor,
    *,
    block_size: int,
    branching: int,
    key_padding_mask: Optional[torch.Tensor] = None,
) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Mean-key pyramid of ``k [B, Hkv, Nk, D]``.

    Returns one ``(summaries, token_counts)`` pair per level, leaves first and the root (a single
    node) last: ``summaries [B, Hkv, n_l, D]`` (fp32, fp64 for fp64 keys) is the mean of the valid
    keys below each node (zeros where there is none), ``token_counts [B, n_l]`` int64 the number
    of those keys. ``n_1 = ceil(Nk / C)``, ``n_{l+1} = ceil(n_l / g)``.
    """
    sums, counts = tb.leaf_block_sums(k, block_size, key_padding_mask)
    levels = []
    while True:
        summaries = sums / counts.clamp_min(1)[:, None, :, None].to(sums.dtype)
        levels.append((summaries, counts))
        n = counts.shape[-1]
        if n <= 1:
            break
        pad = -n % branching
        if pad:
            sums = torch.nn.functional.pad(sums, (0, 0, 0, pad))
            counts = torch.nn.functional.pad(counts, (0, pad))
        b, hkv, m, d = sums.shape
        sums = sums.view(b, hkv, m // branching, branching, d).sum(3)
        counts = counts.view(b, m // branching, branching).sum(-1)
    return levels


def _level_first_valid(first_valid: torch.Tensor, n_levels: int, branching: int, n_k: int) -> List[torch.Tensor]:
    """First valid key position of every node of every level (``Nk`` where none), leaves first."""
    out = [first_valid]
    cur = first_valid
    for _ in range(n_levels - 1):
        pad = -cur.shape[-1] % branching
        if pad:
            cur = torch.nn.functional.pad(cur, (0, pad), value=n_k)
        cur = cur.view(cur.shape[0], -1, branching).amin(-1)
        out.append(cur)
    return out


def _gather_nodes(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``table [B, Hkv, n, ...]``, ``ids [B, Hkv, Q, M]`` (in range) -> ``[B, Hkv, Q, M, ...]``."""
    return tb.gather_blocks(table, ids)


def _gather_batch(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``table [B, n]``, ``ids [B, Hkv, Q, M]`` (in range) -> ``[B, Hkv, Q, M]``."""
    b = ids.shape[0]
    return table.gather(1, ids.reshape(b, -1)).view(ids.shape)


def _reduce_logits(logits: torch.Tensor, ok: torch.Tensor, score: str) -> torch.Tensor:
    """``logits [B, Hkv, G, Q, M, J]``, ``ok [B, Hkv, 1, Q, M, J]`` -> per-head score ``[B, Hkv, G, Q, M]``."""
    if score == "lse":
        return torch.logsumexp(logits.masked_fill(~ok, -math.inf), dim=-1)
    # where, not a 0/1 product: the logit of a hidden (padded, future) key may be NaN/inf
    cnt = ok.sum(-1).clamp_min(1).to(logits.dtype)
    zero = torch.zeros((), dtype=logits.dtype, device=logits.device)
    mean = torch.where(ok, logits, zero).sum(-1) / cnt
    var = torch.where(ok, (logits - mean[..., None]) ** 2, zero).sum(-1) / cnt
    return mean + 0.5 * var


def _scores(
    level: int,
    cand: torch.Tensor,
    qg: torch.Tensor,
    kblocks: torch.Tensor,
    n_k: int,
    pyramid,
    first_valid_levels,
    horizons: torch.Tensor,
    key_padding_mask: Optional[torch.Tensor],
    *,
    scale: float,
    block_size: int,
    branching: int,
    score: str,
) -> torch.Tensor:
    """Group-summed scores ``[B, Hkv, Q, M]`` of candidate nodes ``cand`` (level index ``level``,
    0 = leaves) for the chunk's queries ``qg [B, Hkv, G, Q, D]`` with horizons ``[Q]``."""
    b, hkv, nq, m = cand.shape
    if score == "mean":
        summ = _gather_nodes(pyramid[level][0], cand)  # [B, Hkv, Q, M, D]
        per_head = torch.einsum("bhgqd,bhqmd->bhgqm", qg, summ) * scale
        return per_head.sum(2)
    if level == 0:
        # raw keys of each candidate leaf block
        offs = torch.arange(block_size, device=cand.device)
        pos = cand[..., None] * block_size + offs  # [B, Hkv, Q, M, C]
        ok = (pos < n_k) & (pos <= horizons.view(1, 1, nq, 1, 1))
        if key_padding_mask is not None:
            safe = torch.where(ok, pos, torch.zeros_like(pos))
            ok = ok & key_padding_mask.gather(1, safe.reshape(b, -1)).view_as(pos)
        keys = _gather_nodes(kblocks, cand)  # [B, Hkv, Q, M, C, D]
        logits = torch.einsum("bhgqd,bhqmjd->bhgqmj", qg, keys) * scale
    else:
        child_summ, child_cnt = pyramid[level - 1]
        n_child = child_cnt.shape[-1]
        child = cand[..., None] * branching + torch.arange(branching, device=cand.device)  # [B,Hkv,Q,M,g]
        ok = child < n_child
        child = torch.where(ok, child, torch.zeros_like(child))
        fv = _gather_batch(first_valid_levels[level - 1], child.flatten(-2)).view_as(child)
        ok = ok & (fv <= horizons.view(1, 1, nq, 1, 1))  # holds a visible (hence valid) key
        summ = _gather_nodes(child_summ, child.flatten(-2)).view(b, hkv, nq, m, branching, -1)
        logits = torch.einsum("bhgqd,bhqmjd->bhgqmj", qg, summ) * scale
    return _reduce_logits(logits, ok[:, :, None], score).sum(2)


def _select(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    key_padding_mask: Optional[torch.Tensor],
    is_causal: bool,
    scale: Optional[float],
    block_size: int,
    top_k: int,
    branching: int,
    score: str,
    force_sink: bool,
    force_previous: bool,
    beam: int = PISAConfig.beam,
    sliding_window: int = PISAConfig.sliding_window,
    chunk_size: int = PISAConfig.chunk_size,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(block_indices [B, Hkv, Nq, top_k], n_visible [B, Nq]); ``n_visible`` counts the blocks
    from each query's window's first block on (every visible block without a window)."""
    walk, n_visible = _make_walk(
        q,
        k,
        key_padding_mask=key_padding_mask,
        is_causal=is_causal,
        scale=scale,
        block_size=block_size,
        top_k=top_k,
        branching=branching,
        score=score,
        force_sink=force_sink,
        force_previous=force_previous,
        beam=beam,
        sliding_window=sliding_window,
        chunk_size=chunk_size,
    )
    if walk is None:  # nothing to select from, or for
        width = tb.selection_width(top_k, k.shape[2], block_size)
        shape = (q.shape[0], k.shape[1], q.shape[2], width)
        return torch.full(shape, -1, dtype=torch.long, device=q.device), n_visible
    kept, ok = _walk_levels(walk)
    result = tb.pad_indices(torch.where(ok, kept, torch.full_like(kept, -1)), walk.top_k)
    return result, n_visible


def _make_walk(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    key_padding_mask: Optional[torch.Tensor],
    is_causal: bool,
    scale: Optional[float],
    block_size: int,
    top_k: int,
    branching: int,
    score: str,
    force_sink: bool,
    force_previous: bool,
    beam: int,
    sliding_window: int,
    chunk_size: int,
) -> Tuple[Optional["_Walk"], torch.Tensor]:
    """(the validated inputs of one call's walk, or None when there is nothing to select from or
    for; n_visible [B, Nq]). The tolerance checker replays walks from the same object."""
    if score not in SCORES:
        raise ValueError(f"score must be one of {list(SCORES)}, got {score!r}")
    if branching < 2:
        raise ValueError(f"branching must be >= 2, got {branching}")
    check_beam(beam)
    tb.check_window(sliding_window, chunk_size, is_causal)
    b, hq, n_q, d = q.shape
    _, hkv, n_k, _ = k.shape
    dev = q.device
    if n_k == 0 or b == 0 or n_q == 0:
        return None, torch.zeros(b, n_q, dtype=torch.long, device=dev)
    cdt = tb.compute_dtype(q.dtype)
    kpm = None if key_padding_mask is None else key_padding_mask.to(device=dev, dtype=torch.bool)
    kf = k.to(cdt)
    pyramid = build_pyramid(kf, block_size=block_size, branching=branching, key_padding_mask=kpm)
    first_valid = tb.leaf_first_valid(kpm, b, n_k, block_size, dev)
    horizons = tb.query_horizons(n_q, n_k, is_causal=is_causal, device=dev)
    positions = tb.query_positions(n_q, n_k, dev)
    first_blocks = tb.window_first_blocks(positions, block_size, sliding_window, chunk_size)  # [Nq]
    walk = _Walk(
        qg=tb.group_queries(q, hkv).to(cdt),
        kblocks=tb.key_blocks(kf, block_size),  # [B, Hkv, nB, C, D]
        n_k=n_k,
        pyramid=pyramid,
        fvl=_level_first_valid(first_valid, len(pyramid), branching, n_k),
        horizons=horizons,
        kpm=kpm,
        sc=tb.default_scale(q, scale),
        block_size=block_size,
        g=branching,
        score=score,
        cdt=cdt,
        top_k=tb.selection_width(top_k, n_k, block_size),
        beam=beam,
        anc_leaf=_ancestor_leaves(first_valid, horizons, first_blocks, n_k, block_size, force_sink, force_previous),
        first_blocks=first_blocks,
    )
    return walk, tb.count_window_blocks(first_valid, horizons, first_blocks, n_k)


class _Walk(NamedTuple):
    """What every level of one call's pyramid walk reads."""

    qg: torch.Tensor  # grouped queries, compute dtype
    kblocks: torch.Tensor  # [B, Hkv, nB, C, D]
    n_k: int
    pyramid: List[torch.Tensor]
    fvl: List[torch.Tensor]  # first valid key under each node, per level
    horizons: torch.Tensor  # [Nq] the last key each query may see
    kpm: Optional[torch.Tensor]
    sc: float
    block_size: int
    g: int  # branching
    score: str
    cdt: torch.dtype
    top_k: int
    beam: int
    anc_leaf: torch.Tensor  # [B, Nq, 4] forced leaves and the current leaf (-1: none)
    first_blocks: torch.Tensor  # [Nq] the first leaf of each query's window (0: none)


def _ancestor_leaves(
    first_valid, horizons, first_blocks, n_k: int, block_size: int, force_sink: bool, force_previous: bool
) -> torch.Tensor:
    """``[B, Nq, 4]``: the forced leaf blocks of each query (``[B, Nq, 3]``) and the leaf holding
    its position regardless of visibility; a node is forced when it is an ancestor of one. A
    forced leaf before the query's window (``first_blocks [Nq]``) is dropped: else its ancestor
    straddling the window would be forced for it. The current leaf is always in the window."""
    b, n_q = first_valid.shape[0], horizons.shape[0]
    positions = tb.query_positions(n_q, n_k, horizons.device)
    forced_leaf = tb.forced_leaf_blocks(
        positions,
        horizons,
        first_valid,
        block_size=block_size,
        force_sink=force_sink,
        force_previous=force_previous,
    )  # [B, Nq, 3]
    forced_leaf = torch.where(
        forced_leaf >= first_blocks.view(1, n_q, 1), forced_leaf, torch.full_like(forced_leaf, -1)
    )
    current = torch.where(
        (positions >= 0) & (positions < n_k),
        torch.div(positions, block_size, rounding_mode="floor"),
        torch.full_like(positions, -1),
    )  # [Nq], the leaf holding p_i regardless of visibility
    return torch.cat([forced_leaf, current.view(1, n_q, 1).expand(b, n_q, 1)], dim=-1)


def _walk_levels(w: _Walk, trace: Optional[List[torch.Tensor]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(kept, ok)`` ``[B, Hkv, Nq, top_k]``: the leaf blocks the walk from the root keeps.
    The walk runs level by level over all queries at once (the bookkeeping is
    ``[B, Hkv, Nq, g*K]``); only the scoring, which gathers summaries or raw keys, is chunked
    over queries. A node wholly before a query's window is no candidate of it. ``trace``: a list
    that receives each level's kept node ids (``-1`` padded), the root's first, the leaves' last."""
    b, hkv, n_q = w.kblocks.shape[0], w.kblocks.shape[1], w.horizons.shape[0]
    top = len(w.pyramid) - 1
    # root: a single node, kept if it holds a visible key
    kept = torch.zeros(b, hkv, n_q, 1, dtype=torch.long, device=w.kblocks.device)
    ok = (w.fvl[top][:, :1] <= w.horizons.view(1, n_q)).view(b, 1, n_q, 1).expand(b, hkv, n_q, 1)
    if trace is not None:
        trace.append(torch.where(ok, kept, torch.full_like(kept, -1)))
    for level in range(top - 1, -1, -1):
        cand, valid, forced, width = _level_candidates(w, level, kept, ok)
        need = (valid.sum(-1) > width).any(1).any(0)  # [Nq]: some row must be scored
        scores = _level_scores(w, level, cand, need) if bool(need.any()) else None
        kept, ok = tb.select_top_k(cand, valid, forced, scores, width)
        if trace is not None:
            trace.append(kept)  # -1 where not ok
        kept = torch.where(ok, kept, torch.zeros_like(kept))
    return kept, ok


def _level_candidates(
    w: _Walk, level: int, kept: torch.Tensor, ok: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``(cand, valid, forced, width)`` of level ``level`` (0 = leaves) given the nodes ``kept``
    (``ok``) of the level above: ``cand [B, Hkv, Nq, w*g]`` their children (ascending where
    valid, 0 elsewhere), ``valid`` those holding a visible key inside the query's window,
    ``forced`` the valid ones kept without scoring, and the level's width."""
    n_q, g, dev = w.horizons.shape[0], w.g, kept.device
    hz = w.horizons.view(1, 1, n_q, 1)
    n_l = w.fvl[level].shape[-1]
    cand = (kept[..., None] * g + torch.arange(g, device=dev)).flatten(-2)  # [B, Hkv, Nq, w*g]
    valid = ok.repeat_interleave(g, dim=-1) & (cand < n_l)
    cand = torch.where(valid, cand, torch.zeros_like(cand))
    valid = valid & (_gather_batch(w.fvl[level], cand) <= hz)  # holds a visible key
    span = g**level  # leaves under one node of this level
    # in the window: the node's last leaf is at or after the window's first one
    valid = valid & (cand >= torch.div(w.first_blocks, span, rounding_mode="floor").view(1, 1, n_q, 1))
    anc = torch.where(w.anc_leaf >= 0, torch.div(w.anc_leaf, span, rounding_mode="floor"), w.anc_leaf)
    forced = (cand[..., None] == anc[:, None, :, None, :]).any(-1) & valid
    width = w.top_k if level == 0 else w.beam * w.top_k  # nodes kept at this level
    return cand, valid, forced, width


def _level_scores(w: _Walk, level: int, cand: torch.Tensor, need: torch.Tensor) -> torch.Tensor:
    """Scores of the candidates ``cand`` of one level, computed in query chunks bounded by
    ``tb.chunk_rows`` and only for the chunks where ``need`` says some row must be scored."""
    b, hkv, n_q, m = cand.shape
    d = w.qg.shape[-1]
    per_row = b * hkv * m * (w.block_size if level == 0 and w.score != "mean" else w.g) * max(d, w.qg.shape[2])
    step = tb.chunk_rows(n_q, per_row)
    scores = torch.zeros(cand.shape, dtype=w.cdt, device=cand.device)
    for s in range(0, n_q, step):
        e = min(n_q, s + step)
        if not bool(need[s:e].any()):
            continue
        scores[:, :, s:e] = _scores(
            level,
            cand[:, :, s:e],
            w.qg[:, :, :, s:e],
            w.kblocks,
            w.n_k,
            w.pyramid,
            w.fvl,
            w.horizons[s:e],
            w.kpm,
            scale=w.sc,
            block_size=w.block_size,
            branching=w.g,
            score=w.score,
        )
    return scores


def pisa_select(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    key_padding_mask: Optional[torch.Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    block_size: int = PISAConfig.block_size,
    top_k: int = PISAConfig.top_k,
    branching: int = PISAConfig.branching,
    score: str = PISAConfig.score,
    force_sink: bool = PISAConfig.force_sink,
    force_previous: bool = PISAConfig.force_previous,
    beam: int = PISAConfig.beam,
    sliding_window: int = PISAConfig.sliding_window,
    chunk_size: int = PISAConfig.chunk_size,
) -> torch.Tensor:
    """PISA block selection: ``[B, Hkv, Nq, top_k]`` int64 leaf block ids per query token, shared
    by the query heads of a GQA group, ascending, ``-1`` padded; exactly
    ``min(top_k, #visible blocks)`` distinct visible blocks, forced blocks included (width
    ``min(top_k, #blocks)``: a larger ``top_k`` is the exact mode at its cost). ``beam``:
    the walk keeps ``beam * top_k`` nodes at every level above the leaves (see the module
    docstring; 1 = the plain walk). With a local window (causal only) the visible blocks are
    those from the window's first block on, and the walk stays inside them (module docstring)."""
    with torch.no_grad():
        idx, _ = _select(
            q,
            k,
            key_padding_mask=key_padding_mask,
            is_causal=is_causal,
            scale=scale,
            block_size=block_size,
            top_k=top_k,
            branching=branching,
            score=score,
            force_sink=force_sink,
            force_previous=force_previous,
            beam=beam,
            sliding_window=sliding_window,
            chunk_size=chunk_size,
        )
    return idx


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
    **fields,
):
    """PISA attention: select blocks (no gradient), then attend them (differentiable in q, k, v).

    Returns ``[B, Hq, Nq, D]`` in ``q.dtype``, plus
    the :class:`Selection` when ``return_selection``. A config's local window: the walk inside
    each query's window, and the window's bound on the keys of its first block.
    """
    cfg = backend_config(PISAConfig, config, fields)
    block_size, top_k, branching = cfg.block_size, cfg.top_k, cfg.branching
    score, force_sink, force_previous = cfg.score, cfg.force_sink, cfg.force_previous
    beam = cfg.beam
    window = dict(sliding_window=cfg.sliding_window, chunk_size=cfg.chunk_size)
    with torch.no_grad():
        idx, n_visible = _select(
            q.detach(),
            k.detach(),
            key_padding_mask=key_padding_mask,
            is_causal=is_causal,
            scale=scale,
            block_size=block_size,
            top_k=top_k,
            branching=branching,
            score=score,
            force_sink=force_sink,
            force_previous=force_previous,
            beam=beam,
            **window,
        )
    out = tb.attend_selected_blocks(
        q,
        k,
        v,
        idx,
        key_padding_mask=key_padding_mask,
        is_causal=is_causal,
        scale=scale,
        block_size=block_size,
        **window,
    )
    if not return_selection:
        return out
    sel = tb.make_selection(
        "pisa",
        idx,
        n_visible,
        num_query_heads=q.shape[1],
        block_size=block_size,
        is_causal=is_causal,
        num_keys=k.shape[2],
        key_padding_mask=key_padding_mask,
        **window,  # its key masks hold the window's keys only, as the attention above
    )
    return out, sel


def pisa_reference_selection(q: torch.Tensor, k: torch.Tensor, cfg: PISAConfig, **call):
    """The :class:`~sparseflow.selection.Selection` :func:`pisa_attention` reports, without the
    attention (the registry's ``selection``; ``call``: ``key_padding_mask``, ``is_causal``, ``scale``)."""
    return reference_top_k_selection("pisa", pisa_select, q, k, cfg, **call)
