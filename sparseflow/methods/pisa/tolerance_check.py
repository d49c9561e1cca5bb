"""The PISA selection contract with a tolerance, checked level by level.

**The rule.** A walk's selection is described by its *trace*: the node ids it keeps at every level
of the pyramid, ``trace[l] [B, Hkv, Nq, W_l]`` (``-1`` padded, any order), leaves first
(``trace[0]`` is the selection) and the root last. The checker replays the reference walk on the
trace's own kept sets: at each level the candidates are the children of the nodes the trace keeps
one level up, exactly as the reference defines them (in range, holding a visible key, inside the
query's window). Per (batch, KV head, query) row the trace must then

1. keep candidates only, each once (causality, padding and the window stay exact);
2. keep every forced candidate (sink, previous and current blocks and their ancestors);
3. keep exactly ``min(width, #candidates)`` nodes (``top_k`` at the leaves, ``beam * top_k``
   above: the count and the exact mode stay exact);
4. keep near-ties only: with the reference's own fp32 scores ``s`` of these candidates, every kept
   non-forced node ``n`` and every candidate ``m`` left out satisfy ``s(n) + 2 delta > s(m)``, or
   ``s(n) + 2 delta == s(m)`` and ``n < m`` (the reference's tie rule).

Rule 4 holds exactly when the level's kept set is what the reference keeps from these candidates
after moving each score by at most ``delta`` (raise the kept ones by ``delta``, lower the others):
a trace passes every level exactly when it *is* the reference walk run on scores perturbed by at
most ``delta`` each, so ``delta = 0`` asks for the reference's selection itself. It implies the
issue's leaf rule: every kept block scores at least the ``K``-th best score among the same
candidates minus ``2 delta``. ``delta`` (``tolerance.score_tolerance``) bounds how far a score
computed with operands rounded to ``precision`` lies from the reference's fp32 score, so any walk
that keeps the best ``width`` candidates by such scores passes.

The trace is needed because the leaf selection alone does not say which coarse nodes a walk kept:
a fast walk exposes its kept sets per level for its tests. :func:`walk_trace` gives the
reference's trace, or the trace of the reference walk scoring with operands rounded to a precision
(an emulated tensor-core walk); ``triton_trace.walk_trace_triton`` gives a Triton walk's own
(``Tuning.pisa_scores``: fp32, bf16 or tf32).
"""

from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Sequence

import torch

from ...config import backend_config
from . import reference as ref
from .config import PISAConfig
from .tolerance import grouped_score_error_bound, key_bounds, round_to_precision

__all__ = ["ToleranceReport", "walk_trace", "selection_within_tolerance", "check_selection", "RULES"]

# the rules in the order a row's first broken one is reported
RULES = ("candidate", "duplicate", "count", "forced", "near_tie")
_NONE = torch.iinfo(torch.long).max  # sorts after every node id


class ToleranceReport(NamedTuple):
    """What :func:`selection_within_tolerance` found. The first violation is the first row (in
    batch, KV head, query order) of the highest level that breaks a rule; ``rule`` is "" and the
    location -1 when there is none."""

    ok: bool
    rule: str  # one of RULES, "" when ok
    level: int  # 0 = leaves
    batch: int
    kv_head: int
    query: int
    node: int  # the offending node id (the worst kept one for "near_tie"); -1 for "count"
    margin: float  # near_tie: s(worst kept) + 2 delta - s(best left out); nan for the exact rules
    min_margin: float  # the smallest near-tie margin of any scored row (inf: none was scored)
    leaf_agreement: float  # share of the reference's leaf blocks the selection also keeps


def _walk_of(q, k, cfg: PISAConfig, key_padding_mask, is_causal: bool, scale):
    return ref._make_walk(
        q,
        k,
        key_padding_mask=key_padding_mask,
        is_causal=is_causal,
        scale=scale,
        block_size=cfg.block_size,
        top_k=cfg.top_k,
        branching=cfg.branching,
        score=cfg.score,
        force_sink=cfg.force_sink,
        force_previous=cfg.force_previous,
        beam=cfg.beam,
        sliding_window=cfg.sliding_window,
        chunk_size=cfg.chunk_size,
    )[0]


def _rounded(w, precision: str):
    """The walk ``w`` scoring with its queries, summaries and keys rounded to ``precision``."""
    pyramid = [(round_to_precision(s, precision), c) for s, c in w.pyramid]
    qg, kb = round_to_precision(w.qg, precision), round_to_precision(w.kblocks, precision)
    return w._replace(qg=qg, kblocks=kb, pyramid=pyramid, cdt=torch.float32)


def walk_trace(
    q: torch.Tensor,
    k: torch.Tensor,
    config: Optional[PISAConfig] = None,
    *,
    key_padding_mask: Optional[torch.Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    precision: Optional[str] = None,
    **fields,
) -> List[torch.Tensor]:
    """The reference walk's trace (module docstring), leaves first, root last; ``[]`` when there
    is nothing to select. ``precision``: the walk scores with ``q``, the summaries and the keys
    rounded to it and fp32 accumulation (an emulated fast walk); None: the reference itself."""
    cfg = backend_config(PISAConfig, config, fields)
    with torch.no_grad():
        w = _walk_of(q, k, cfg, key_padding_mask, is_causal, scale)
        if w is None:
            return []
        trace: List[torch.Tensor] = []
        ref._walk_levels(w if precision is None else _rounded(w, precision), trace)
    return trace[::-1]


def _sorted_ids(ids: torch.Tensor, width: int) -> torch.Tensor:
    """``ids [.., W]`` (``-1`` = none) ascending, the none entries last, cut or ``-1`` padded to
    ``width``: the layout of a kept set inside the reference walk."""
    ids = ids.long()
    srt = torch.where(ids >= 0, ids, torch.full_like(ids, _NONE)).sort(-1).values
    srt = torch.where(srt == _NONE, torch.full_like(srt, -1), srt)
    if srt.shape[-1] >= width:
        return srt[..., :width]
    return torch.nn.functional.pad(srt, (0, width - srt.shape[-1]), value=-1)


class _Level(NamedTuple):
    """One level's findings per row ``[B, Hkv, Nq]``: the broken rule's index in RULES (len(RULES):
    none), its node, the near-tie margin (inf where not scored), and the kept ids for the next
    level (valid candidates only, the walk's layout)."""

    rule: torch.Tensor
    node: torch.Tensor
    margin: torch.Tensor
    kept: torch.Tensor


def _first(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per row, the value at the first True of ``mask [.., W]`` (-1 where none)."""
    if mask.shape[-1] == 0:
        return torch.full(mask.shape[:-1], -1, dtype=values.dtype, device=values.device)
    pos = torch.where(mask, torch.arange(mask.shape[-1], device=mask.device), mask.shape[-1]).amin(-1)
    picked = values.gather(-1, pos.clamp_max(mask.shape[-1] - 1)[..., None])[..., 0]
    return torch.where(mask.any(-1), picked, torch.full_like(picked, -1))


def _near_ties(scores, cand, valid, forced, kept_c, delta):
    """Rule 4 per row: (broken, worst kept id, margin), the margin ``inf`` where the row keeps no
    scored node or leaves none out."""
    big = torch.finfo(scores.dtype).max
    key = torch.nan_to_num(scores, nan=-big, posinf=big, neginf=-big).clamp(-big, big).double()
    mine, out = kept_c & ~forced, valid & ~kept_c & ~forced
    lifted = key + 2 * delta[..., None]
    vmin = torch.where(mine, lifted, math.inf).amin(-1)
    worst = torch.where(mine & (lifted == vmin[..., None]), cand, -1).amax(-1)
    umax = torch.where(out, key, -math.inf).amax(-1)
    best = torch.where(out & (key == umax[..., None]), cand, _NONE).amin(-1)
    both = mine.any(-1) & out.any(-1)
    broken = both & ((umax > vmin) | ((umax == vmin) & (best < worst)))
    return broken, worst, torch.where(both, vmin - umax, math.inf)


def _check_level(w, level: int, kept, ok, given: torch.Tensor, delta) -> _Level:
    """Replays level ``level`` from the kept nodes one level up and checks ``given``'s rows."""
    cand, valid, forced, width = ref._level_candidates(w, level, kept, ok)
    need = (valid.sum(-1) > width).any(1).any(0)  # the walk's own test: same chunks, same scores
    scores = ref._level_scores(w, level, cand, need) if bool(need.any()) else None
    return _check_rows(given, cand, valid, forced, width, scores, delta)


def _check_root(w, given: torch.Tensor) -> _Level:
    """The root level: its one candidate, node 0, is kept exactly where it holds a visible key."""
    b, hkv, n_q = given.shape[:3]
    top = len(w.pyramid) - 1
    valid = (w.fvl[top][:, :1] <= w.horizons.view(1, n_q)).view(b, 1, n_q, 1).expand(b, hkv, n_q, 1)
    cand = torch.zeros(valid.shape, dtype=torch.long, device=valid.device)
    return _check_rows(given, cand, valid, torch.zeros_like(valid), 1, None, None)


def _check_rows(given, cand, valid, forced, width: int, scores, delta) -> _Level:
    """Rules 1-4 on each row of ``given [B, Hkv, Nq, W]`` against the level's candidates."""
    ids = _sorted_ids(given.to(cand.device), max(given.shape[-1], 1))
    gok = ids >= 0
    match = (ids[..., :, None] == cand[..., None, :]) & valid[..., None, :] & gok[..., None]
    is_cand, kept_c = match.any(-1), match.any(-2)
    n_valid = valid.sum(-1)
    tie = torch.zeros_like(n_valid, dtype=torch.bool)
    worst = torch.full_like(n_valid, -1)
    margin = torch.full(n_valid.shape, math.inf, dtype=torch.float64, device=cand.device)
    if scores is not None:
        scored = n_valid > width  # rows that keep by score; the others keep every candidate
        tie, worst, margin = _near_ties(scores, cand, valid, forced, kept_c, delta)
        tie, margin = tie & scored, torch.where(scored, margin, math.inf)
    broken = [
        gok & ~is_cand,
        gok[..., 1:] & (ids[..., 1:] == ids[..., :-1]),
        (gok.sum(-1) != n_valid.clamp_max(width))[..., None],
        forced & ~kept_c,
        tie[..., None],
    ]
    nodes = [ids, ids[..., 1:], torch.full_like(ids[..., :1], -1), cand, worst[..., None]]
    rule = torch.full_like(n_valid, len(RULES))
    node = torch.full_like(n_valid, -1)
    for i in range(len(RULES) - 1, -1, -1):  # the first rule a row breaks is the one reported
        hit = broken[i].any(-1)
        rule = torch.where(hit, i, rule)
        node = torch.where(hit, _first(broken[i], nodes[i]), node)
    nxt = _sorted_ids(torch.where(gok & is_cand, ids, -1), min(width, cand.shape[-1]))
    return _Level(rule, node, margin, nxt)


def _leaf_agreement(given: torch.Tensor, want: torch.Tensor) -> float:
    """Share of ``want``'s kept ids (``-1`` = none) that ``given`` keeps too (1.0 when none)."""
    both = (given[..., :, None] == want[..., None, :]) & (want >= 0)[..., None, :]
    total = int((want >= 0).sum())
    return float(both.any(-2).sum()) / total if total else 1.0


def _delta(w, k, precision: str, delta) -> torch.Tensor:
    """``[B, Hkv, Nq]`` fp64: the given tolerance, or ``score_tolerance``'s from the walk's own
    queries and pyramid."""
    b, hkv, _, n_q, _ = w.qg.shape
    if delta is not None:
        return torch.as_tensor(delta, dtype=torch.float64, device=w.qg.device).expand(b, hkv, n_q)
    keys = key_bounds(w.pyramid, k.to(w.cdt), w.kpm)
    kw = dict(score=w.score, scale=w.sc, block_size=w.block_size, branching=w.g)
    fast = grouped_score_error_bound(w.qg, keys, precision=precision, **kw)
    return fast + grouped_score_error_bound(w.qg, keys, precision="fp32", **kw)


def selection_within_tolerance(
    q: torch.Tensor,
    k: torch.Tensor,
    trace: Sequence[torch.Tensor],
    config: Optional[PISAConfig] = None,
    *,
    key_padding_mask: Optional[torch.Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    precision: str = "bf16",
    delta=None,
    **fields,
) -> ToleranceReport:
    """Checks a walk's ``trace`` (leaves first, root last; see :func:`walk_trace`) against the
    contract (module docstring) for the call ``(q, k, config or fields, key_padding_mask,
    is_causal, scale)``. ``delta``: the tolerance per row (a number or ``[B, Hkv, Nq]``; 0 asks
    for the reference's selection); None: ``tolerance.score_tolerance`` of ``precision``, the
    precision the walk scores in."""
    cfg = backend_config(PISAConfig, config, fields)
    with torch.no_grad():
        w = _walk_of(q, k, cfg, key_padding_mask, is_causal, scale)
        if w is None:
            return ToleranceReport(True, "", -1, -1, -1, -1, -1, math.nan, math.inf, 1.0)
        top = len(w.pyramid) - 1
        _check_shapes(trace, top, tuple(w.qg.shape[:2]) + (w.horizons.shape[0],))
        tol = _delta(w, k, precision, delta)
        found = _check_root(w, trace[top])
        first = (top, found) if bool((found.rule < len(RULES)).any()) else None
        min_margin = math.inf
        for level in range(top - 1, -1, -1):
            kept, ok = found.kept, found.kept >= 0
            found = _check_level(w, level, torch.where(ok, kept, 0), ok, trace[level], tol)
            min_margin = min(min_margin, float(found.margin.min()))
            if first is None and bool((found.rule < len(RULES)).any()):
                first = (level, found)
        kept, ok = ref._walk_levels(w)
        agreement = _leaf_agreement(trace[0].to(kept.device).long(), torch.where(ok, kept, -1))
    return _report(first, min_margin, agreement)


def _check_shapes(trace: Sequence[torch.Tensor], top: int, rows: tuple) -> None:
    """A ValueError unless ``trace`` holds ``top + 1`` levels of shape ``[*rows, W]``."""
    if len(trace) != top + 1:
        raise ValueError(f"the trace must hold {top + 1} levels (leaves first, root last), got {len(trace)}")
    for lv in trace:
        if lv.dim() != 4 or tuple(lv.shape[:3]) != rows:
            raise ValueError(f"each trace level must be [B, Hkv, Nq, W] with {rows}, got {tuple(lv.shape)}")


def _report(first, min_margin: float, agreement: float) -> ToleranceReport:
    if first is None:
        return ToleranceReport(True, "", -1, -1, -1, -1, -1, math.nan, min_margin, agreement)
    level, found = first
    row = int(torch.nonzero((found.rule < len(RULES)).flatten())[0])
    b, h, i = torch.unravel_index(torch.tensor(row), found.rule.shape)
    rule = RULES[int(found.rule[b, h, i])]
    margin = float(found.margin[b, h, i]) if rule == "near_tie" else math.nan
    node = int(found.node[b, h, i])
    return ToleranceReport(False, rule, level, int(b), int(h), int(i), node, margin, min_margin, agreement)


def check_selection(q, k, trace=None, config=None, *, tuning=None, **kw) -> ToleranceReport:
    """Raise AssertionError unless a PISA walk's ``trace`` (its kept nodes per level, leaves first;
    :func:`walk_trace` gives the reference's) keeps what the fp32 reference walk keeps, up to
    near-ties within the tolerance of the precision it scores in (``precision=``, default "bf16";
    ``delta=0`` asks for the reference's selection); else return the report. ``tuning``: a
    :class:`sparseflow.Tuning` whose Triton walk (``pisa_walk``, scoring in ``pisa_scores``) is
    checked: without a ``trace`` its trace is taken from that walk
    (``triton_trace.walk_trace_triton``; needs Triton, and a call the walk covers), and
    ``precision`` defaults to its ``pisa_scores``. ``kw``: the call's ``key_padding_mask``,
    ``is_causal``, ``scale`` and config fields. (The registry's ``selection_check``.)"""
    if tuning is not None:
        kw.setdefault("precision", tuning.pisa_scores)
        if trace is None:
            from .triton_trace import walk_trace_triton

            call = {name: kw[name] for name in ("key_padding_mask", "is_causal", "scale") if name in kw}
            fields = {name: v for name, v in kw.items() if name not in ("precision", "delta", *call)}
            trace = walk_trace_triton(q, k, config, tuning=tuning, **call, **fields)
    if trace is None:
        raise TypeError("check_pisa_selection needs a trace, or a tuning whose Triton walk gives one")
    rep = selection_within_tolerance(q, k, trace, config, **kw)
    if not rep.ok:
        where = f"level {rep.level}, batch {rep.batch}, KV head {rep.kv_head}, query {rep.query}, node {rep.node}"
        raise AssertionError(f"pisa selection breaks the {rep.rule!r} rule at {where} (margin {rep.margin:.3g})")
    return rep
