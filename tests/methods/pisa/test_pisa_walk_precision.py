"""The Triton selection walks scoring in bf16 / tf32 (``Tuning.pisa_scores``, issue 49): each walk's
own trace (``triton_trace``) keeps PISA's selection contract with that precision's tolerance, on
random and adversarial inputs; fp32 is the reference's selection exactly; and the lower
precisions really score lower (a "near" input breaks the contract with ``delta = 0``). CPU
(Triton's interpreter), small shapes: a few query rows at the end of odd-length prompts."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from test_pisa_tolerance import _inputs  # noqa: E402

from sparseflow.methods.pisa import reference as ref  # noqa: E402
from sparseflow.methods.pisa import tolerance_check as tc  # noqa: E402
from sparseflow.methods.pisa import triton_select as ts  # noqa: E402
from sparseflow.methods.pisa.triton_trace import walk_that_runs, walk_trace_triton  # noqa: E402
from sparseflow.methods.pisa.config import PISAConfig  # noqa: E402
from sparseflow.testing import check_pisa_selection  # noqa: E402
from sparseflow.methods.pisa.tuning import SCORES as PISA_SCORES  # noqa: E402
from sparseflow.tuning import Tuning  # noqa: E402
from sparseflow.methods.pisa.tolerance import round_to_precision  # noqa: E402
from sparseflow.methods.pisa.triton_select_common import _exp2_fma, _lse2_scaled, _round_bits  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU tensors run the kernels interpreted only
WALKS = ("per_token", "tiled", "scan")
LOWER = ("bf16", "tf32")
N, ROWS = 53, 4  # an odd prompt length; the walk runs its last ROWS queries (bottom-right aligned)
# per score: 27 leaves of 2 keys, top_k 3; levels 1 and up are scored (branching 2: 14, 7, 4 nodes
# against widths 3 or 6; branching 3: 9 nodes against 6)
CONFIGS = {
    "lse": dict(score="lse", block_size=2, top_k=3, branching=2),
    "mean": dict(score="mean", block_size=2, top_k=3, branching=3, beam=2),
    "mean_var": dict(score="mean_var", block_size=2, top_k=3, branching=2, beam=2, sliding_window=40),
}
# (group, input kind): each case walks all four; the random kind has key padding in both batch rows
CASES = ((1, "random"), (1, "ties"), (3, "near"), (3, "flat"))


@pytest.fixture(scope="module", autouse=True)
def _shared_pyramids():
    """The walks' pyramid (``ts.build_pyramid``, two interpreted kernels: a third of a trace's
    time) depends on the keys, the padding, the block size and the branching only, not on the
    walk or the scores' precision: each is built once in this module by the real kernels, and
    every call gets fresh copies of it (no walk sees another's writes)."""
    real = ts.build_pyramid
    built = {}

    def _bytes(t):
        if t is None:
            return None
        raw = t.detach().cpu().contiguous().view(-1).view(torch.uint8)
        return tuple(t.shape), t.dtype, raw.numpy().tobytes()

    def shared(k, *, block_size, branching, key_padding_mask=None):
        key = (_bytes(k), _bytes(key_padding_mask), block_size, branching)
        if key not in built:
            built[key] = real(k, block_size=block_size, branching=branching, key_padding_mask=key_padding_mask)
        summ, nfv, sizes, lvl_off, lvl_span = built[key]
        return summ.clone(), nfv.clone(), list(sizes), lvl_off.clone(), lvl_span.clone()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ts, "build_pyramid", shared)
        yield


def _call(kind: str, group: int, seed: int = 0):
    """``(q, k, key_padding_mask)``: ``_inputs``' kind with ``group`` query heads a KV head, the
    queries cut to the last ``ROWS``."""
    q, k, kpm = _inputs(kind, hq=group, hkv=1, n=N, seed=seed)
    return q[:, :, -ROWS:].contiguous().to(DEVICE), k.to(DEVICE), None if kpm is None else kpm.to(DEVICE)


def _trace(q, k, kpm, cfg, walk: str, scores: str):
    tuning = Tuning(pisa_walk=walk, pisa_scores=scores)
    assert walk_that_runs(q, k, PISAConfig(**cfg), tuning) == walk  # the asked walk covers the call
    return walk_trace_triton(q, k, key_padding_mask=kpm, tuning=tuning, **cfg)


def _check(q, k, kpm, trace, cfg, **kw):
    return tc.selection_within_tolerance(q, k, trace, key_padding_mask=kpm, **cfg, **kw)


def _same_leaves(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal leaf sets per row (both ``-1`` padded; any order, any width)."""
    width = max(a.shape[-1], b.shape[-1])
    pad = [torch.nn.functional.pad(x.long(), (0, width - x.shape[-1]), value=-1) for x in (a, b)]
    big = torch.iinfo(torch.long).max
    srt = [torch.where(x >= 0, x, big).sort(-1).values for x in pad]
    return torch.equal(srt[0], srt[1])


# (walk, precision, score): a pairwise covering set of the 3 x 2 x 3 cross product, every walk
# with every score, and each of them with both precisions (half the interpreter's time)
LOWER_RUNS = [
    pytest.param(walk, LOWER[(i + j) % 2], score, id=f"{walk}-{LOWER[(i + j) % 2]}-{score}")
    for i, walk in enumerate(WALKS)
    for j, score in enumerate(CONFIGS)
]


@pytest.mark.parametrize("walk, precision, score", LOWER_RUNS)
def test_lower_precision_walks_keep_the_contract(walk, precision, score):
    cfg = CONFIGS[score]
    for group, kind in CASES:
        q, k, kpm = _call(kind, group)
        trace = _trace(q, k, kpm, cfg, walk, precision)
        rep = _check(q, k, kpm, trace, cfg, precision=precision)
        assert rep.ok, (group, kind, rep)
        if kind == "near":  # blocks a rounding apart: the rounded scores tie where fp32's do not
            strict = _check(q, k, kpm, trace, cfg, delta=0.0)
            assert not strict.ok and strict.rule == "near_tie", (group, strict)


@pytest.mark.parametrize("score", list(CONFIGS))
@pytest.mark.parametrize("walk", WALKS)
def test_fp32_walks_are_the_reference(walk, score):
    cfg = CONFIGS[score]
    for group, kind in ((3, "random"), (1, "ties")):  # exact ties included
        q, k, kpm = _call(kind, group, seed=1)
        trace = _trace(q, k, kpm, cfg, walk, "fp32")
        want = ref.pisa_select(q, k, key_padding_mask=kpm, **cfg)
        assert _same_leaves(trace[0], want), (group, kind)
        rep = _check(q, k, kpm, trace, cfg, delta=0.0)
        assert rep.ok and rep.leaf_agreement == 1.0, (group, kind, rep)
    # blocks an fp32 ulp apart: the walk's fp32 dots sum in another order than torch's, so only
    # fp32's own tolerance holds there (as before pisa_scores: these are the walks' fp32 dots)
    q, k, kpm = _call("near", 3, seed=1)
    rep = _check(q, k, kpm, _trace(q, k, kpm, cfg, walk, "fp32"), cfg, precision="fp32")
    assert rep.ok, rep


@pytest.mark.parametrize("precision", LOWER)
@pytest.mark.parametrize("walk", WALKS)
def test_the_trace_is_the_selection_the_op_returns(walk, precision):
    cfg = CONFIGS["lse"]
    q, k, kpm = _call("near", 3)
    tuning = Tuning(pisa_walk=walk, pisa_scores=precision)
    got = ts.pisa_select(q, k, key_padding_mask=kpm, tuning=tuning, **cfg)
    trace = walk_trace_triton(q, k, key_padding_mask=kpm, tuning=tuning, **cfg)
    assert _same_leaves(got, trace[0])
    want = tc.walk_trace(q, k, key_padding_mask=kpm, **cfg)
    assert not all(_same_leaves(a, b) for a, b in zip(trace, want))  # it scored in lower precision


def test_a_walk_that_does_not_cover_the_call_is_named():
    q, k, _ = _call("random", 1)
    cfg = dict(CONFIGS["lse"], top_k=30)  # 27 leaves <= top_k: the scan scores no leaf
    with pytest.raises(ValueError, match="per_token walk would run"):
        walk_trace_triton(q, k, tuning=Tuning(pisa_walk="scan", pisa_scores="bf16"), **cfg)


def test_check_pisa_selection_takes_the_walks_tuning():
    cfg = CONFIGS["lse"]
    q, k, kpm = _call("near", 3)
    rep = check_pisa_selection(q, k, key_padding_mask=kpm, tuning=Tuning(pisa_walk="tiled", pisa_scores="bf16"), **cfg)
    assert rep.ok
    with pytest.raises(AssertionError, match="near_tie"):
        check_pisa_selection(
            q, k, key_padding_mask=kpm, tuning=Tuning(pisa_walk="tiled", pisa_scores="bf16"), delta=0.0, **cfg
        )


def test_decoding_passes_the_precision_on(monkeypatch):
    from sparseflow.methods.pisa import triton_select_per_token as per_token
    from sparseflow.methods.pisa.pyramid_cache import PyramidCache

    seen = []
    real = per_token.scores_mode

    def spy(scores):
        seen.append(scores)
        return real(scores)

    monkeypatch.setattr(per_token, "scores_mode", spy)
    q, k, _ = _call("random", 2)
    cache = PyramidCache(k[:1], capacity=64, block_size=2)
    for scores in PISA_SCORES:
        cache.select(q[:1, :, -1:], k[:1], top_k=3, tuning=Tuning(pisa_scores=scores))
    assert seen == list(PISA_SCORES)


def test_tuning_refuses_an_unknown_precision():
    with pytest.raises(ValueError, match=r"Tuning.pisa_scores must be one of \['fp32', 'bf16', 'tf32'\]"):
        Tuning(pisa_scores="fp16")
    with pytest.raises(TypeError, match="pisa_scores"):
        Tuning(pisa_scores=16)


@triton.jit
def _rounded(x_ptr, out_ptr, DROP: tl.constexpr):
    ar = tl.arange(0, 64)
    tl.store(out_ptr + ar, _round_bits(tl.load(x_ptr + ar), DROP))


@pytest.mark.parametrize("precision", LOWER)
def test_the_kernels_round_as_the_tolerance_does(precision):
    u = 2.0 ** -(8 if precision == "bf16" else 11)
    ties = [1 + u, 1 + 3 * u, -(1 + u), 1 + u + u / 64, 3e38, 2.0**-140, -(2.0**-145), float("inf"), 0.0, -0.0]
    x = torch.cat([torch.tensor(ties), torch.randn(54, generator=torch.Generator().manual_seed(0)) * 1e3]).to(DEVICE)
    out = torch.empty_like(x)
    _rounded[(1,)](x, out, DROP=16 if precision == "bf16" else 13)
    want = round_to_precision(x, precision)
    assert torch.equal(out.view(torch.int32), want.view(torch.int32))


@triton.jit
def _exp2_by_fma(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    ar = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + ar, _exp2_fma(tl.load(x_ptr + ar, mask=ar < n)), mask=ar < n)


def test_the_fma_exponential_is_within_the_tolerance_s_ulps():
    """The leaf pairs' polynomial ``2**x`` (an eighth of their exponentials in bf16 / tf32) errs
    relatively by at most ``2**-22``, as the special function unit's ``ex2`` does (the
    tolerance's step 5 allows 4 ulp), from 0 down to -125 (the interpreter's fused multiply-add
    rounds twice, so this bound is looser than the GPU needs); exact at the integers; below -125,
    and at -inf, ``2**-125``, which the LSE's sum of at least 1 absorbs."""
    grid = torch.linspace(-125.0, 0.0, 200_001)
    edges = torch.tensor([0.0, -0.5, -0.5 + 2.0**-24, 0.5 - 2.0**-24, -1.0, -3.0, -124.5, -125.0, -1e-30])
    below = torch.tensor([-125.5, -200.0, float("-inf")])
    x = torch.cat([grid, edges, below]).to(DEVICE)
    out = torch.empty_like(x)
    _exp2_by_fma[(triton.cdiv(x.numel(), 8192),)](x, out, x.numel(), BLOCK=8192)
    want = torch.exp2(x.double())
    ok = x >= -125.0
    assert ((out.double() - want).abs()[ok] <= 2.0**-22 * want[ok]).all()
    integers = ok & (x == x.round())
    assert torch.equal(out[integers], want[integers].float())
    assert (out[~ok] == 2.0**-125).all()
    nan = torch.full((4,), float("nan"), device=DEVICE)
    _exp2_by_fma[(1,)](nan, out, 4, BLOCK=8192)
    assert out[:4].isnan().all(), "NaN gives NaN, as tl.exp2 does"


@triton.jit
def _unit_lse(
    logit_ptr, ok_ptr, out_ptr, scale, R: tl.constexpr, U: tl.constexpr, W: tl.constexpr, FMA_EXPS: tl.constexpr
):
    ar = tl.arange(0, R)[:, None, None] * (U * W) + tl.arange(0, U)[None, :, None] * W + tl.arange(0, W)[None, None, :]
    okk = tl.load(ok_ptr + tl.arange(0, U)[:, None] * W + tl.arange(0, W)[None, :]) != 0
    out = _lse2_scaled(tl.load(logit_ptr + ar), okk[None, :, :], scale, False, FMA_EXPS)
    tl.store(out_ptr + tl.arange(0, R)[:, None] * U + tl.arange(0, U)[None, :], out)


def test_the_lse_with_fma_exponentials_keeps_its_masks():
    """``_lse2_scaled`` with the first 8 of 64 columns' exponentials by the polynomial, on units
    masked in every way (all, none, only the polynomial's columns, only the others, scattered, the
    largest entry) and logits whose largest lies outside the polynomial's columns: the same LSE as
    without it and float64's (within 1e-6), -inf for a unit with no valid entry, NaN where a valid
    logit is NaN."""
    r, u, w = 2, 8, 64
    gen = torch.Generator().manual_seed(4)
    logit = torch.randn(r, u, w, generator=gen) * 3
    logit[:, :, 40] = 9.0  # each unit's largest: the polynomial's columns hold non-integer shifts
    ok = torch.ones(u, w, dtype=torch.int32)
    ok[0], ok[2, :8], ok[3, 8:], ok[4, 1::3], ok[6, 40] = 0, 0, 0, 0, 0  # units 1, 5 and 7 all valid
    logit[1, 5, 2] = float("nan")
    scale = 1.4426950408889634 * 0.25  # log2(e) times a softmax scale, as log2_scale gives
    outs = {}
    for fma in (0, 8):
        outs[fma] = torch.empty(r, u, device=DEVICE)
        _unit_lse[(1,)](logit.to(DEVICE), ok.to(DEVICE), outs[fma], scale, R=r, U=u, W=w, FMA_EXPS=fma)
    masked = torch.where(ok.bool(), logit.double() * 0.25, float("-inf"))
    want = torch.logsumexp(masked, dim=2)
    got = outs[8].cpu().double()
    assert (got[:, 0] == float("-inf")).all() and got[1, 5].isnan() and outs[0][1, 5].isnan()
    fine = torch.ones(r, u, dtype=torch.bool)
    fine[:, 0], fine[1, 5] = False, False
    assert ((got - want).abs()[fine] <= 1e-6 * want.abs()[fine].clamp_min(1.0)).all()
    assert ((got - outs[0].cpu().double()).abs()[fine] <= 1e-6 * want.abs()[fine].clamp_min(1.0)).all()


@pytest.mark.parametrize("walk", [*WALKS, "leaf_pairs"])
def test_bf16_walks_read_bf16_summaries_and_select_the_same(walk, monkeypatch):
    """``pisa_scores="bf16"`` walks read the summaries already rounded to bf16 (half the bytes):
    the same selection as rounding the fp32 summaries in the kernel, on blocks a rounding apart."""
    from sparseflow.methods.pisa import triton_select_common as common

    cfg = CONFIGS["lse"]
    q, k, kpm = _call("near", 3, seed=2)
    tuning = Tuning(pisa_walk=walk, pisa_scores="bf16")
    seen = []
    real = common.walk_summaries

    def spy(summ, scores):
        out = real(summ, scores)
        seen.append(out.dtype)
        return out

    monkeypatch.setattr(ts, "walk_summaries", spy)
    got = ts.pisa_select(q, k, key_padding_mask=kpm, tuning=tuning, **cfg)
    assert seen == [torch.bfloat16]
    monkeypatch.setattr(ts, "walk_summaries", lambda summ, scores: summ)  # fp32, rounded in the kernel
    assert torch.equal(got, ts.pisa_select(q, k, key_padding_mask=kpm, tuning=tuning, **cfg))


def test_tf32_walks_read_summaries_rounded_once(monkeypatch):
    """On the GPU a tf32 prefill walk reads its summaries rounded once before the launch
    (``rounded_summaries``, with ``SUMM_ROUNDED``) instead of rounding its tile at every level: the
    table is rounded as the kernels round, and the kernels' rounding of a rounded value is the
    identity, so the dots see the same operands. Under the interpreter (and for the other
    precisions) the table passes as it is."""
    from sparseflow.methods.pisa import triton_select_common as common

    summ = torch.randn(2, 3, 40, 16, generator=torch.Generator().manual_seed(3)) * 1e2
    summ[0, 0, 0, :4] = torch.tensor([1 + 2.0**-11, 1 + 3 * 2.0**-11, float("inf"), 3e38])  # ties, inf, large
    monkeypatch.setattr(common, "interpreting", lambda: True)
    assert common.rounded_summaries(summ, "tf32") is summ  # the interpreter rounds in the kernel
    monkeypatch.setattr(common, "interpreting", lambda: False)  # as on the GPU
    for scores in ("fp32", "bf16"):
        assert common.rounded_summaries(summ, scores) is summ
    table = common.rounded_summaries(summ, "tf32")
    assert table.shape == summ.shape and table.dtype == torch.float32 and not torch.equal(table, summ)
    raw = summ.flatten()[:64].contiguous().to(DEVICE)
    by_kernel = torch.empty_like(raw)
    _rounded[(1,)](raw, by_kernel, DROP=13)  # the kernels' own rounding of the raw summaries
    flat = table.flatten()[:64].contiguous().to(DEVICE)
    assert torch.equal(flat.view(torch.int32), by_kernel.view(torch.int32))
    again = torch.empty_like(flat)
    _rounded[(1,)](flat, again, DROP=13)  # and of the rounded table: the identity
    assert torch.equal(again.view(torch.int32), flat.view(torch.int32))
    half = common.rounded_summaries(summ.to(torch.bfloat16), "tf32")  # a 16-bit table: rounded as fp32
    assert half.dtype == torch.float32 and torch.equal(half, summ.to(torch.bfloat16).float())
