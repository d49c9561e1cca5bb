"""PISA's selection contract with a tolerance (issue 49): the score error bound ``delta`` against
fp64 scoring, and the level-by-level checker of a walk's trace (CPU, small shapes)."""

from __future__ import annotations

import math

import pytest
import torch

from sparseflow.methods.pisa import reference as ref
from sparseflow.methods.pisa import tolerance as tol
from sparseflow.methods.pisa import tolerance_check as tc
from sparseflow.methods.pisa.config import PISAConfig
from sparseflow.testing import check_pisa_selection

SCORES = ("lse", "mean", "mean_var")
PRECISIONS = ("bf16", "fp16", "tf32", "fp32")
KINDS = ("random", "large_norm", "ties", "flat", "near", "tiny")


def _inputs(kind: str, hq: int, hkv: int, n: int = 61, d: int = 16, seed: int = 0):
    """``(q, k, key_padding_mask)`` fp32: random, or one of the adversarial kinds."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, hq, n, d, generator=gen)
    k = torch.randn(2, hkv, n, d, generator=gen)
    kpm = None
    if kind == "random":
        kpm = torch.ones(2, n, dtype=torch.bool)
        kpm[0, :5], kpm[1, n - 9 :] = False, False
    elif kind == "large_norm":  # a few huge keys and long queries: large logits
        k[:, :, ::7] *= 300.0
        q *= 30.0
    elif kind == "ties":  # every block of 4 keys repeats the first one: many exact ties
        k = k[:, :, ::4].repeat_interleave(4, 2)[:, :, :n].contiguous()
    elif kind == "flat":  # a long run of one key, then random ones
        k[:, :, 3 : 2 * n // 3] = k[:, :, 2:3]
    elif kind == "near":  # blocks a rounding apart: copies of block 0 moved by an fp32 ulp or two
        base = k[:, :, :4]
        k = base.repeat(1, 1, -(-n // 4), 1)[:, :, :n].clone()
        k = k + torch.randint(0, 3, k.shape[:3] + (1,), generator=gen) * k.abs() * 2.0**-23
    elif kind == "tiny":  # fp16 subnormals: the underflow floor matters
        q, k = q * 1e-3, k * 1e-5
    return q, k, kpm


def _walk(q, k, kpm, **fields):
    cfg = PISAConfig(**{"block_size": 4, "top_k": 5, "branching": 2, **fields})
    return tc._walk_of(q, k, cfg, kpm, True, None)


def _as(w, dtype):
    """The walk ``w`` scoring its own (fp32) operands in ``dtype``: fp64 is the exact scoring."""
    pyr = [(s.to(dtype), c) for s, c in w.pyramid]
    return w._replace(qg=w.qg.to(dtype), kblocks=w.kblocks.to(dtype), pyramid=pyr, cdt=dtype)


def _all_scores(w, level: int):
    """``(scores, valid)`` ``[B, Hkv, Nq, n_l]``: every node of a level scored for every query,
    ``valid`` where the node holds a visible key (a node the walk may score)."""
    b, hkv, n_q = w.qg.shape[0], w.qg.shape[1], w.horizons.shape[0]
    n_l = w.fvl[level].shape[-1]
    cand = torch.arange(n_l).expand(b, hkv, n_q, n_l)
    scores = ref._level_scores(w, level, cand, torch.ones(n_q, dtype=torch.bool))
    valid = (w.fvl[level][:, None, None, :] <= w.horizons.view(1, 1, n_q, 1)).expand(b, hkv, n_q, n_l)
    return scores.double(), valid


def _worst_ratio(q, k, kpm, score: str, precision: str, bound_precision: str = None, **fields):
    """max over nodes of ``|score with operands rounded to precision - fp64 score| / delta``
    (``delta`` of ``bound_precision``, default the same precision) at every level."""
    w = _walk(q, k, kpm, score=score, **fields)
    delta = tol.score_error_bound(
        q, k, precision=bound_precision or precision, score=score, block_size=4, branching=2, key_padding_mask=kpm
    )
    worst = 0.0
    for level in range(len(w.pyramid)):
        exact, valid = _all_scores(_as(w, torch.float64), level)
        got, _ = _all_scores(tc._rounded(w, precision), level)
        err = torch.where(valid, (got - exact).abs(), 0.0)
        worst = max(worst, float((err / delta[..., None]).max()))
    return worst


# --------------------------------------------------------------------------- the bound


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("group", [1, 4])
def test_the_bound_holds_against_fp64_scoring(kind, score, group):
    q, k, kpm = _inputs(kind, hq=2 * group, hkv=2)
    for precision in PRECISIONS:
        assert _worst_ratio(q, k, kpm, score, precision) <= 1.0, precision


def _aligned(precision: str, d: int = 16):
    """q all ``x`` and keys ``+-x`` (alternating), where ``x`` rounds down by almost ``u`` in
    ``precision``: every product's rounding errors add up (the case Cauchy-Schwarz's bound is
    built for), and for ``"mean_var"`` they also grow the spread of the logits."""
    u = tol.unit_roundoff(precision)
    x = 1.0 + u * (1 - 2.0**-6)
    sign = 1.0 - 2.0 * (torch.arange(13) % 2)
    return torch.full((1, 1, 13, d), x), x * sign.view(1, 1, 13, 1).expand(1, 1, 13, d).contiguous()


@pytest.mark.parametrize("precision", ["bf16", "fp16", "tf32"])
def test_the_bound_is_tight_enough_to_fail(precision):
    q, k = _aligned(precision)
    assert tol.round_to_precision(q, precision).eq(1.0).all()
    for score in SCORES:
        ratio = _worst_ratio(q, k, None, score, precision)
        assert 0.5 < ratio <= 1.0, (score, ratio)  # delta / 2 would fail here
    finer = {"bf16": "fp16", "fp16": "fp32", "tf32": "fp32"}[precision]
    assert _worst_ratio(q, k, None, "lse", precision, bound_precision=finer) > 4.0  # a smaller u is broken


def test_the_underflow_floor_covers_fp16_subnormals(monkeypatch):
    q = torch.ones(1, 1, 13, 16)
    k = torch.full((1, 1, 13, 16), 1.49 * 2.0**-24)  # an fp16 subnormal that rounds off a third
    for score in SCORES:
        assert _worst_ratio(q, k, None, score, "fp16") <= 1.0, score
    no_floor = tol.PRECISIONS["fp16"]._replace(eta=0.0)
    monkeypatch.setitem(tol.PRECISIONS, "fp16", no_floor)
    assert _worst_ratio(q, k, None, "mean", "fp16") > 8.0  # relative rounding alone is broken


def test_unit_roundoff_and_rounding():
    assert [tol.unit_roundoff(p) for p in ("bf16", "fp16", "tf32", "fp32")] == [2**-8, 2**-11, 2**-11, 2**-24]
    with pytest.raises(ValueError, match="precision must be one of"):
        tol.unit_roundoff("fp8")
    x = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-11 + 2**-20, -(1 + 2**-12), math.inf, 3e38])
    got = tol.round_to_precision(x, "tf32")
    assert got[:4].tolist() == [1.0, 1 + 4 * 2**-11, 1 + 2**-10, -1.0]  # ties to even, else nearest
    assert got[4] == math.inf and abs(got[5] / 3e38 - 1) < 2**-11


def test_an_operand_out_of_range_gives_no_guarantee():
    q, k, _ = _inputs("random", 2, 2)
    k[0, 0, 5] = 1e5  # beyond fp16's range, within bf16's
    kw = dict(score="lse", block_size=4, branching=2)
    fp16 = tol.score_error_bound(q, k, precision="fp16", **kw)
    assert torch.isinf(fp16[0, 0]).all() and torch.isfinite(fp16[1]).all()
    assert torch.isfinite(tol.score_error_bound(q, k, precision="bf16", **kw)).all()


# --------------------------------------------------------------------------- the checker

CONFIGS = [
    dict(score="lse"),
    dict(score="mean", branching=3, beam=2),
    dict(score="mean_var", beam=2),
    dict(score="lse", sliding_window=19),
    dict(score="lse", chunk_size=24, beam=3),
    dict(score="mean_var", is_causal=False),
]


def _check(q, k, kpm, trace, is_causal=True, **kw):
    fields = {"block_size": 4, "top_k": 5, "branching": 2, **kw}
    return tc.selection_within_tolerance(q, k, trace, key_padding_mask=kpm, is_causal=is_causal, **fields)


def _trace(q, k, kpm, precision=None, is_causal=True, **kw):
    fields = {"block_size": 4, "top_k": 5, "branching": 2, **kw}
    return tc.walk_trace(q, k, key_padding_mask=kpm, is_causal=is_causal, precision=precision, **fields)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{v}" for v in c.values()))
@pytest.mark.parametrize("kind", ["random", "ties", "near"])
def test_the_reference_and_emulated_fast_walks_pass(cfg, kind):
    q, k, kpm = _inputs(kind, hq=4, hkv=2)
    want = ref.pisa_select(q, k, key_padding_mask=kpm, block_size=4, top_k=5, **{"branching": 2, **cfg})
    trace = _trace(q, k, kpm, **cfg)
    assert torch.equal(trace[0], want[..., : trace[0].shape[-1]])
    for delta in (0.0, None):
        rep = _check(q, k, kpm, trace, delta=delta, **cfg)
        assert rep.ok and rep.leaf_agreement == 1.0, rep
    differs = False
    for precision in ("bf16", "fp16", "tf32"):
        fast = _trace(q, k, kpm, precision, **cfg)
        rep = _check(q, k, kpm, fast, precision=precision, **cfg)
        assert rep.ok, (precision, rep)
        differs |= any(not torch.equal(a, b) for a, b in zip(fast, trace))
    assert differs or kind != "near"  # blocks a rounding apart: the fast walks choose otherwise


def test_a_bf16_walk_that_differs_passes_only_with_its_tolerance():
    q, k, kpm = _inputs("random", hq=8, hkv=2, n=157)
    cfg = dict(beam=2)
    fast = _trace(q, k, kpm, "bf16", **cfg)
    assert any(not torch.equal(a, b) for a, b in zip(fast, _trace(q, k, kpm, **cfg)))
    rep = _check(q, k, kpm, fast, precision="bf16", **cfg)
    assert rep.ok and 0.9 < rep.leaf_agreement < 1.0, rep
    strict = _check(q, k, kpm, fast, delta=0.0, **cfg)
    assert not strict.ok and strict.rule == "near_tie" and strict.margin < 0, strict


def test_any_walk_on_scores_moved_by_at_most_delta_passes(monkeypatch):
    q, k, kpm = _inputs("random", hq=4, hkv=2, n=97)
    scores = ref._level_scores
    gen = torch.Generator().manual_seed(3)

    def moved(w, level, cand, need):  # every score moved by up to 0.999 * delta
        s = scores(w, level, cand, need)
        return s + (torch.rand(s.shape, generator=gen) * 2 - 1) * 0.999 * 0.3

    monkeypatch.setattr(ref, "_level_scores", moved)
    trace = _trace(q, k, kpm, beam=2)
    monkeypatch.setattr(ref, "_level_scores", scores)
    assert _check(q, k, kpm, trace, delta=0.3, beam=2).ok
    rep = _check(q, k, kpm, trace, delta=0.03, beam=2)
    assert not rep.ok and rep.rule == "near_tie", rep


def _candidates(q, k, kpm, trace, level: int, **cfg):
    """``(cand, valid, forced, scores)`` of ``level`` replayed from ``trace``'s level above."""
    w = _walk(q, k, kpm, **cfg)
    above = trace[level + 1]
    cand, valid, forced, _ = ref._level_candidates(w, level, above.clamp_min(0), above >= 0)
    scores = ref._level_scores(w, level, cand, torch.ones(cand.shape[2], dtype=torch.bool))
    return cand, valid, forced, scores


def _swap(trace, level, row, old, new):
    """A copy of ``trace`` with node ``old`` replaced by ``new`` in ``row`` of ``level``."""
    out = [t.clone() for t in trace]
    ids = out[level][row]
    ids[ids == old] = new
    return out


def _far_below(q, k, kpm, trace, level, **cfg):
    """(row, a kept non-forced node, the lowest candidate left out, the gap of their scores) of
    the row where that candidate lies furthest below the kept ones."""
    cand, valid, forced, scores = _candidates(q, k, kpm, trace, level, **cfg)
    kept = (cand[..., :, None] == trace[level][..., None, :]).any(-1) & valid
    out = valid & ~kept & ~forced
    low = torch.where(out, scores, math.inf).amin(-1)
    high = torch.where(kept & ~forced, scores, -math.inf).amax(-1)
    gap = torch.where(out.any(-1) & (kept & ~forced).any(-1), high - low, -math.inf)
    row = tuple(int(i) for i in torch.unravel_index(gap.argmax(), gap.shape))
    mine = cand[row][(kept & ~forced)[row]][0]
    return row, int(mine), int(cand[row][torch.where(out[row], scores[row], math.inf).argmin()]), float(gap.max())


@pytest.mark.parametrize("level", [0, 1])
def test_a_block_far_below_the_kth_score_is_rejected(level):
    q, k, kpm = _inputs("random", hq=4, hkv=2, n=97)
    trace = _trace(q, k, kpm, beam=2)
    row, mine, low, gap = _far_below(q, k, kpm, trace, level, beam=2)
    bad = _swap(trace, level, row, mine, low)
    delta = tol.score_tolerance(q, k, precision="bf16", score="lse", block_size=4, branching=2, key_padding_mask=kpm)
    assert gap > 2 * float(delta[row[:3]])  # the swap is beyond any rounding
    rep = _check(q, k, kpm, bad, beam=2)
    assert not rep.ok and rep.rule == "near_tie" and rep.level == level and rep.margin < 0, rep
    assert (rep.batch, rep.kv_head, rep.query) == row
    with pytest.raises(AssertionError, match="near_tie"):
        check_pisa_selection(q, k, bad, key_padding_mask=kpm, block_size=4, top_k=5, beam=2)


def _leaf_row(trace, b=0, h=1, i=60):
    return (b, h, i), trace[0][b, h, i].tolist()


def test_exact_rules_are_exact():
    q, k, kpm = _inputs("random", hq=4, hkv=2)
    trace = _trace(q, k, kpm)
    row, kept = _leaf_row(trace, i=40)
    current = 40 // 4  # the query's own block, always forced
    assert current in kept and len(kept) == 5
    other = next(j for j in kept if j != current and j != 0 and j != current - 1)
    cand, valid, forced, _ = _candidates(q, k, kpm, trace, 0)
    spare = next(int(c) for c, v in zip(cand[row], valid[row]) if v and int(c) not in kept)
    cases = {
        "forced": _swap(trace, 0, row, current, spare),
        "candidate": _swap(trace, 0, row, other, current + 1),  # a block after the query: causality
        "duplicate": _swap(trace, 0, row, other, current),
        "count": _swap(trace, 0, row, other, -1),
    }
    for rule, bad in cases.items():
        rep = _check(q, k, kpm, bad, delta=math.inf)  # no score can excuse these
        assert not rep.ok and rep.rule == rule and rep.level == 0, (rule, rep)
        assert (rep.batch, rep.kv_head, rep.query) == row


def test_a_block_before_the_window_or_in_padding_is_no_candidate():
    q, k, kpm = _inputs("random", hq=4, hkv=2)
    trace = _trace(q, k, kpm, sliding_window=19)
    row, kept = _leaf_row(trace, b=0, i=60)  # window from key 42: blocks 10.. are in it
    bad = _swap(trace, 0, row, min(j for j in kept if j != 15), 9)
    rep = _check(q, k, kpm, bad, delta=math.inf, sliding_window=19)
    assert not rep.ok and rep.rule == "candidate" and rep.node == 9, rep
    trace = _trace(q, k, kpm)
    row, kept = _leaf_row(trace, b=0, i=60)  # batch 0 pads keys 0-4: block 0 holds none
    bad = _swap(trace, 0, row, [j for j in kept if j != 15][0], 0)
    rep = _check(q, k, kpm, bad, delta=math.inf)
    assert not rep.ok and rep.rule == "candidate" and rep.node == 0, rep


def test_malformed_traces_and_empty_calls():
    q, k, kpm = _inputs("random", hq=4, hkv=2)
    trace = _trace(q, k, kpm)
    with pytest.raises(ValueError, match="levels"):
        _check(q, k, kpm, trace[:1])
    with pytest.raises(ValueError, match=r"\[B, Hkv, Nq, W\]"):
        _check(q, k, kpm, [t[:, :1] for t in trace])
    assert _check(q[:, :, :0], k, kpm, []).ok
    one = _inputs("random", hq=4, hkv=2, n=3)[:2]  # one block: the root is the leaf
    assert _check(*one, None, _trace(*one, None), delta=0.0).ok
    assert not _check(*one, None, [torch.full((2, 2, 3, 1), -1)]).ok
