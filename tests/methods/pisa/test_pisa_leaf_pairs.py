"""The leaf-pairs PISA walk (``Tuning.pisa_walk="leaf_pairs"``: the scan walk without its node
table) against the reference, on the CPU through Triton's interpreter on small, odd shapes; the
same tests run compiled on CUDA. In fp32 (with bf16 queries: three bf16 parts of each summary,
near fp32's accuracy) its selection equals the reference's on these cases; in bf16 /
tf32 its trace keeps PISA's selection contract."""

from __future__ import annotations

import logging

import pytest
import torch
from _pisa_walk_inputs import walk_inputs
from test_pisa_tolerance import _inputs

import sparseflow
from sparseflow import Tuning
from sparseflow.methods.pisa import reference as pisa_ref

pytest.importorskip("triton")
from sparseflow.methods.pisa import tolerance_check as tc  # noqa: E402
from sparseflow.methods.pisa import triton_select  # noqa: E402
from sparseflow.methods.pisa import triton_select_pairs as pairs  # noqa: E402
from sparseflow.methods.pisa import triton_select_scan as scan  # noqa: E402
from sparseflow.methods.pisa.config import PISAConfig  # noqa: E402
from sparseflow.methods.pisa.triton_trace import walk_that_runs, walk_trace_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAIRS = Tuning(pisa_walk="leaf_pairs")
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.fixture
def walk_calls(monkeypatch):
    """Counts the leaf-pairs walk's launches."""
    calls = []
    real = pairs.pisa_select_pairs_fwd

    def op(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(pairs, "pisa_select_pairs_fwd", op)
    return calls


# id: (B, Hq, Hkv, Nq, Nk, D, C, K, branching, score, causal, pad, dtype, beam, sliding window),
# each under one pair layout (LAUNCH["pair_unit"], LAUNCH["heads"])
CASES = {
    "lse-bf16-g2-nq40-nk133": ((1, 2, 1, 40, 133, 32, 16, 3, 2, "lse", True, False, BF16, 1, 0), ("leaf", "packed")),
    "lse-fp16-g3-hq9-pad-nq29-nk83": (
        (1, 9, 3, 29, 83, 16, 8, 3, 2, "lse", True, True, F16, 1, 0),
        ("siblings", "loop"),
    ),
    "mean_var-br3-pad-b2-nq30-nk97": (
        (2, 3, 1, 30, 97, 24, 8, 5, 3, "mean_var", True, True, F32, 1, 0),
        ("leaf", "loop"),
    ),
    "mean-beam2-noncausal-nq21-nk101": (
        (1, 8, 2, 21, 101, 16, 8, 3, 2, "mean", False, False, F32, 2, 0),
        ("siblings", "packed"),
    ),
    "lse-beam2-window40-nq40-nk150": (
        (1, 4, 2, 40, 150, 16, 8, 5, 2, "lse", True, False, F32, 2, 40),
        ("leaf", "packed"),
    ),
}


@pytest.mark.parametrize("case, layout", list(CASES.values()), ids=list(CASES))
def test_leaf_pairs_selection_equals_reference(case, layout, walk_calls, monkeypatch, poisoned):
    """Fresh buffers come poisoned (floats NaN): a pair left unscored cannot pass for a scored one."""
    monkeypatch.setitem(scan.LAUNCH, "pair_unit", layout[0])
    monkeypatch.setitem(scan.LAUNCH, "heads", layout[1])
    b, hq, hkv, nq, nk, d, c, kk, g, score, causal, pad, dtype, beam, window = case
    q, k, kpm = walk_inputs(b, hq, hkv, nq, nk, d, dtype, pad, seed=nq)
    kw = dict(key_padding_mask=kpm, is_causal=causal, block_size=c, top_k=kk, branching=g, score=score, beam=beam)
    kw["sliding_window"] = window
    want = pisa_ref.pisa_select(q, k, **kw)
    got = poisoned(triton_select.pisa_select, q, k, tuning=PAIRS, **kw)
    assert len(walk_calls) == 1, "the leaf-pairs walk must have run"
    assert len(triton_select.level_sizes(-(-nk // c), g)) >= 3, "the case must exercise scored intermediate levels"
    assert ((want >= 0).sum(-1) < -(-nk // c)).any(), "the case must be sparse somewhere"
    assert torch.equal(got, want)


@pytest.mark.parametrize("precision", ["bf16", "tf32"])
def test_lower_precision_trace_keeps_the_contract(precision):
    """The walk's nodes above the leaves scored in bf16 / tf32 (its own arithmetic, not a table's):
    its trace keeps the selection contract at that precision's tolerance, and it really scored
    lower than fp32 somewhere (the same trace fails the contract with ``delta = 0``)."""
    cfg = dict(score="lse", block_size=2, top_k=3, branching=2)  # 27 leaves, levels 1 and up scored
    q, k, _ = _inputs("near", hq=3, hkv=1, n=53, seed=0)  # blocks a rounding apart
    q, k = q[:, :, -4:].contiguous().to(DEVICE), k.to(DEVICE)
    tuning = Tuning(pisa_walk="leaf_pairs", pisa_scores=precision)
    assert walk_that_runs(q, k, PISAConfig(**cfg), tuning) == "leaf_pairs"
    trace = walk_trace_triton(q, k, tuning=tuning, **cfg)
    assert tc.selection_within_tolerance(q, k, trace, **cfg, precision=precision).ok
    assert torch.equal(triton_select.pisa_select(q, k, tuning=tuning, **cfg), trace[0][..., : cfg["top_k"]])
    exact = walk_trace_triton(q, k, tuning=Tuning(pisa_walk="leaf_pairs"), **cfg)
    # fp32: the reference's walk, up to the summation order of its dots (fp32's own tolerance)
    assert tc.selection_within_tolerance(q, k, exact, **cfg, precision="fp32").ok
    assert any(not torch.equal(a, b) for a, b in zip(trace, exact)), "the lower precision must score differently"


def test_pisa_1_walks_to_the_leaves_itself(walk_calls):
    """``score="mean"`` scores its leaves by their summaries: the walk writes the selection."""
    q, k, _ = walk_inputs(1, 4, 2, 20, 90, 16, F32, False, seed=2)
    kw = dict(block_size=8, top_k=3, score="mean")
    got = triton_select.pisa_select(q, k, tuning=PAIRS, **kw)
    assert len(walk_calls) == 1
    assert torch.equal(got, pisa_ref.pisa_select(q, k, **kw))


def test_nothing_to_score_runs_per_token_and_says_why(walk_calls, caplog):
    q, k, _ = walk_inputs(1, 2, 1, 12, 40, 16, F32, False)
    kw = dict(block_size=8, top_k=8)
    with caplog.at_level(logging.INFO, logger="sparseflow"):
        got = triton_select.pisa_select(q, k, tuning=PAIRS, **kw)
    assert walk_calls == []
    assert "per-token walk" in caplog.text and "5 leaf blocks <= top_k=5" in caplog.text
    assert torch.equal(got, pisa_ref.pisa_select(q, k, **kw))


def test_covers_names_each_reason():
    assert pairs.pairs_covers(20, 8, 1000) is None
    assert "int32" in pairs.pairs_covers(20, 8, 2**31)
    assert "top_k=8" in pairs.pairs_covers(8, 8, 1000)


def test_op_carries_the_walk_to_the_kernel(walk_calls):
    """Through sparseflow.attention (the op's flattened tuning arguments), eager: the same output."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 40, 16, generator=g).to(DEVICE) for h in (2, 1, 1))
    cfg = sparseflow.PISAConfig(block_size=4, top_k=3)
    want = sparseflow.attention(q, k, v, config=cfg, backend="triton", tuning=Tuning(pisa_walk="per_token"))
    assert walk_calls == []
    got = sparseflow.attention(q, k, v, config=cfg, backend="triton", tuning=PAIRS)
    assert len(walk_calls) == 1
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_walk_choice_lists_leaf_pairs():
    with pytest.raises(ValueError) as info:
        Tuning(pisa_walk="pairs")
    assert "'leaf_pairs'" in str(info.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_leaf_pairs_opcheck_and_compile():
    q, k, _ = walk_inputs(1, 4, 2, 300, 300, 64, BF16, False)
    kw = dict(block_size=16, top_k=4)
    want = pisa_ref.pisa_select(q, k, **kw)
    compiled = torch.compile(lambda q, k: triton_select.pisa_select(q, k, tuning=PAIRS, **kw), fullgraph=True)
    assert torch.equal(compiled(q, k), want)


def test_auto_takes_the_leaf_pairs_where_the_scan_table_does_not_fit_on_cuda(walk_calls, monkeypatch):
    """``"auto"``: past the scan's table budget, the leaf pairs on CUDA (timed there), the
    per-token walk under the interpreter; the reference's selection either way."""
    monkeypatch.setattr(scan, "MAX_TABLE_BYTES", 1000)
    q, k, _ = walk_inputs(1, 2, 1, 30, 120, 16, F32, False, seed=3)
    kw = dict(block_size=8, top_k=3)
    got = triton_select.pisa_select(q, k, tuning=Tuning(), **kw)
    assert len(walk_calls) == (1 if DEVICE == "cuda" else 0)
    assert torch.equal(got, pisa_ref.pisa_select(q, k, **kw))


def test_the_walk_refuses_a_call_with_no_leaf_to_score():
    """With no more leaf blocks than top_k the walk keeps them all and writes no candidate: the
    op refuses the call (``pisa_select`` sends it per token)."""
    from sparseflow.methods.pisa.triton_select_common import SCORE_CODES

    q, k, _ = walk_inputs(1, 2, 1, 12, 40, 16, F32, False)
    summ, nfv, _, lvl_off, lvl_span = triton_select.build_pyramid(k, block_size=8, branching=2)
    with pytest.raises(ValueError, match="5 leaf blocks <= top_k=5"):
        pairs.pairs_walk(
            q, k, None, summ, nfv, lvl_off, lvl_span, 0.25, True, SCORE_CODES["lse"], 8, 2, 5, True, True, 1
        )


def test_fp32_walk_on_three_bf16_parts_keeps_the_reference(monkeypatch, walk_calls):
    """With fp32 scores and bf16 queries the leaf-pairs walk reads the summaries as three bf16
    parts a row (``summary_parts``: one table, split once a call) and dots each with the queries
    (bf16 tensor-core dots on a GPU, IEEE fp32 ones in the interpreter): the parts hold each
    summary to fp32's rounding, and the selection is the reference's."""
    from sparseflow.methods.pisa import triton_select_common as common

    summ = torch.randn(2, 3, 40, 24, generator=torch.Generator().manual_seed(3)) * 7
    parts = common.summary_parts(summ)
    assert parts.dtype == BF16 and parts.shape == (2, 3, 40, 72)
    total = parts[..., :24].double() + parts[..., 24:48].double() + parts[..., 48:].double()
    assert ((total - summ.double()).abs() <= summ.double().abs() * 2.0**-24).all()
    table, mode = common.prefill_walk_table(summ, "fp32", BF16)
    assert mode == ("bf16x3_ieee" if common.interpreting() else "bf16x3") and torch.equal(table, parts)
    assert common.prefill_walk_table(summ, "fp32", F16)[1] == "fp32", "fp16 queries are not exact in bf16"
    with monkeypatch.context() as gpu:
        gpu.setattr(common, "interpreting", lambda: False)
        assert common.prefill_walk_table(summ, "fp32", BF16)[1] == "bf16x3"
    q, k, _ = walk_inputs(1, 4, 2, 37, 301, 16, BF16, False, seed=8)
    kw = dict(block_size=8, top_k=7, branching=2, score="lse", is_causal=True)  # 4 kept beside the forced 3
    spied = []
    real = common.summary_parts
    monkeypatch.setattr(common, "summary_parts", lambda s: spied.append(s.shape) or real(s))
    got = triton_select.pisa_select(q, k, tuning=PAIRS, **kw)
    assert len(walk_calls) == 1 and len(spied) == 1, "the walk must have read the three parts"
    assert torch.equal(got, pisa_ref.pisa_select(q, k, **kw))


def test_an_eighth_of_the_leaf_exponentials_on_the_fma_units_selects_the_same(monkeypatch, walk_calls):
    """In bf16 / tf32 with 16-bit queries the leaf pairs take the first eighth of each leaf's keys'
    exponentials by a polynomial (``_exp2_fma``), the rest by the special function unit. Each leaf
    has its largest key at column 40 and eight keys 0.375 below it (85% of its LSE's sum), in
    the polynomial's columns in the odd leaves and in others in the even ones; every logit is
    exact in bf16. The last free pick, odd leaf 9, lies 1/32 above even leaf 8: a polynomial off by
    4% at those keys' shift (its linear part alone), one that dropped the fraction's terms, or
    scaled them, trades it for leaf 8. The selection is the one without the polynomial and the
    reference's."""
    from sparseflow.methods.pisa import triton_select_common as common

    assert common.fma_exps(64, "bf16", BF16) == 8 and common.fma_exps(128, "tf32", F16) == 16
    assert (
        common.fma_exps(64, "fp32", BF16) == common.fma_exps(64, "bf16", F32) == common.fma_exps(32, "bf16", BF16) == 0
    )
    c, n_leaves, d = 64, 12, 16
    k = torch.zeros(1, 1, c * n_leaves, d)  # logit = k[..., 0]: queries 4 e_0, scale 1/4
    heights = {4: 7.0, 9: 6.03125, 8: 6.0, 7: 5.0, 6: 4.5, 5: 4.0, 3: 3.5, 2: 3.0, 1: 2.5}
    for leaf, height in heights.items():  # forced: the sink (0), the queries' leaf (11), the one before
        first = leaf * c + (0 if leaf % 2 else 16)
        k[0, 0, first : first + 8, 0] = height - 0.375
        k[0, 0, leaf * c + 40, 0] = height
    q32 = torch.zeros(1, 2, 4, d)  # 2 heads, the prompt's last 4 queries
    q32[..., 0] = 4.0
    k32 = k
    q, k = q32.to(BF16), k32.to(BF16)
    assert torch.equal(k.float(), k32) and torch.equal(q.float(), q32), "every logit exact in bf16"
    cfg = dict(score="lse", block_size=c, top_k=5, branching=2)
    seen = []
    real = scan.fma_exps
    monkeypatch.setattr(scan, "fma_exps", lambda *a: seen.append(real(*a)) or seen[-1])
    tuning = Tuning(pisa_walk="leaf_pairs", pisa_scores="bf16")
    got = triton_select.pisa_select(q, k, tuning=tuning, **cfg)
    assert len(walk_calls) == 1 and seen == [8], "the leaf pairs must have run with the polynomial"
    monkeypatch.setattr(scan, "fma_exps", lambda *a: 0)
    assert torch.equal(got, triton_select.pisa_select(q, k, tuning=tuning, **cfg))
    assert torch.equal(got, pisa_ref.pisa_select(q, k, **cfg))
    assert set(got[0, 0, -1].tolist()) == {0, 10, 11, 4, 9}, "the last free pick: odd leaf 9 over even 8"
