"""The tiled PISA selection walk (``Tuning.pisa_walk="tiled"``) against the reference, on the CPU
through Triton's interpreter (TRITON_INTERPRET=1, set in conftest.py) on small, odd shapes; the
same tests run compiled on CUDA. Selections must equal the reference's exactly.
"""

from __future__ import annotations

import logging

import pytest
import torch
from _pisa_walk_inputs import walk_inputs

import sparseflow
from sparseflow import Tuning
from sparseflow.methods.pisa import reference as pisa_ref

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from sparseflow.methods.pisa import triton_select_tiled as tiled  # noqa: E402  (imports triton)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TILED = Tuning(pisa_walk="tiled")
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _spy_walks(monkeypatch, block_q=None):
    """Counts the launches of the tiled walk, with ``block_q`` queries per tile (None: the launcher's pick)."""
    calls = []
    real_op, real_rows = tiled.pisa_select_tiled_fwd, tiled.tile_rows

    def op(*args):
        calls.append(args)
        return real_op(*args)

    monkeypatch.setattr(tiled, "pisa_select_tiled_fwd", op)
    monkeypatch.setattr(tiled, "tile_rows", lambda group, _=None, cw=16: real_rows(group, block_q, cw))
    return calls


# id: (B, Hq, Hkv, Nq, Nk, D, C, K, g, score, causal, pad, dtype, beam, block_q)
CASES = {
    "lse-g2-n150": (1, 4, 2, 150, 150, 32, 16, 4, 2, "lse", True, False, F32, 1, None),
    "mean_var-g3-br3-pad-b2-n97": (2, 3, 1, 97, 97, 24, 8, 5, 3, "mean_var", True, True, F32, 1, None),
    "mean-g1-noncausal-pad-n77": (1, 2, 2, 77, 77, 16, 8, 3, 2, "mean", False, True, F32, 1, None),
    "lse-bf16-g2-nq40-nk133": (1, 2, 1, 40, 133, 32, 16, 3, 2, "lse", True, False, BF16, 1, None),
    "lse-fp16-g3-hq9-pad-nq61-nk83": (1, 9, 3, 61, 83, 16, 8, 3, 2, "lse", True, True, F16, 1, None),
    "mean_var-fp16-g4-c12-nq45-nk101": (1, 4, 1, 45, 101, 16, 12, 3, 2, "mean_var", True, False, F16, 1, None),
    "lse-beam2-g2-nq40-nk150": (1, 4, 2, 40, 150, 16, 8, 5, 2, "lse", True, False, F32, 2, None),
    "mean_var-beam2-g4-noncausal-nq45-nk101": (1, 8, 2, 45, 101, 16, 8, 3, 2, "mean_var", False, False, F32, 2, None),
    "mean-beam2-g3-bf16-pad-nq33-nk90": (1, 3, 1, 33, 90, 16, 8, 3, 2, "mean", True, True, BF16, 2, None),
    "lse-beam3-g1-tile16-nq29-nk99": (1, 1, 1, 29, 99, 16, 4, 4, 2, "lse", True, False, F32, 3, 16),
    "lse-g4-tile4-pad-nq37-nk120": (1, 4, 1, 37, 120, 16, 8, 3, 2, "lse", True, True, F32, 1, 4),
    "mean_var-g2-tile8-br4-k2-b2-nq50-nk130": (2, 2, 1, 50, 130, 16, 8, 2, 4, "mean_var", True, True, F32, 1, 8),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_tiled_selection_equals_reference(case, monkeypatch):
    from sparseflow.methods.pisa import triton_select

    b, hq, hkv, nq, nk, d, c, kk, g, score, causal, pad, dtype, beam, block_q = case
    calls = _spy_walks(monkeypatch, block_q)
    q, k, kpm = walk_inputs(b, hq, hkv, nq, nk, d, dtype, pad, seed=nq)
    kw = dict(key_padding_mask=kpm, is_causal=causal, block_size=c, top_k=kk, branching=g, score=score, beam=beam)
    want = pisa_ref.pisa_select(q, k, **kw)
    got = triton_select.pisa_select(q, k, tuning=TILED, **kw)
    assert len(calls) == 1, "the tiled walk must have run"
    assert got.dtype == torch.long and got.shape == want.shape
    assert len(triton_select.level_sizes(-(-nk // c), g)) >= 3, "the case must exercise scored intermediate levels"
    assert ((want >= 0).sum(-1) < -(-nk // c)).any(), "the case must be sparse somewhere"
    assert torch.equal(got, want)


def test_queries_before_every_key_select_nothing(monkeypatch):
    """Causal with more queries than keys: the first queries see no key (all -1), the tile spans both."""
    from sparseflow.methods.pisa import triton_select

    calls = _spy_walks(monkeypatch)
    q, k, _ = walk_inputs(1, 2, 1, 90, 40, 16, F32, False)
    kw = dict(is_causal=True, block_size=4, top_k=3)
    want = pisa_ref.pisa_select(q, k, **kw)
    got = triton_select.pisa_select(q, k, tuning=TILED, **kw)
    assert len(calls) == 1 and (want[..., :50, :] == -1).all()
    assert torch.equal(got, want)


@pytest.mark.parametrize("score", ["lse", "mean_var"])
def test_ties_go_to_the_lower_block(score, monkeypatch):
    """Every leaf block holds the same keys: all scores tie, at every level, and each row keeps
    the lowest ids (the reference's order). Small integers: every dot is exact in any summation
    order (on some CPUs the interpreter's matmul sums edge columns in another order)."""
    from sparseflow.methods.pisa import triton_select

    calls = _spy_walks(monkeypatch)
    g = torch.Generator().manual_seed(5)
    q = torch.randint(-3, 4, (1, 2, 44, 16), generator=g).float().to(DEVICE)
    k = (
        torch.randint(-3, 4, (1, 1, 8, 16), generator=g).float().repeat(1, 1, 12, 1)[:, :, :93].to(DEVICE)
    )  # 12 blocks, the last short
    kw = dict(is_causal=True, block_size=8, top_k=3, score=score, force_sink=False, force_previous=False)
    want = pisa_ref.pisa_select(q, k, **kw)
    got = triton_select.pisa_select(q, k, tuning=TILED, **kw)
    assert len(calls) == 1 and (want[..., -1, :2] == torch.tensor([0, 1], device=DEVICE)).all()
    assert torch.equal(got, want)


def test_auto_and_per_token_keep_the_per_token_walk(monkeypatch):
    from sparseflow.methods.pisa import triton_select

    calls = _spy_walks(monkeypatch)
    q, k, _ = walk_inputs(1, 2, 1, 20, 70, 16, F32, False)
    kw = dict(block_size=8, top_k=3)
    want = pisa_ref.pisa_select(q, k, **kw)
    for tuning in (Tuning(), Tuning(pisa_walk="per_token")):
        assert torch.equal(triton_select.pisa_select(q, k, tuning=tuning, **kw), want)
    assert calls == []


def test_uncovered_shape_runs_per_token_and_says_why(monkeypatch, caplog):
    from sparseflow.methods.pisa import triton_select

    calls = _spy_walks(monkeypatch)
    q, k, _ = walk_inputs(1, 2, 1, 6, 300, 16, F32, False)
    kw = dict(block_size=4, top_k=24, beam=2)  # 64 kept nodes x 2 children: 128 candidates per row
    with caplog.at_level(logging.INFO, logger="sparseflow"):
        got = triton_select.pisa_select(q, k, tuning=TILED, **kw)
    assert calls == []
    assert "per-token walk" in caplog.text and "128 candidates per row" in caplog.text
    assert torch.equal(got, pisa_ref.pisa_select(q, k, **kw))


def test_op_carries_the_walk_to_the_kernel(monkeypatch):
    """Through sparseflow.attention (the op's flattened tuning arguments), eager and compiled."""
    calls = _spy_walks(monkeypatch)
    q, k, v = (t.to(DEVICE) for t in (torch.randn(1, 4, 40, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)))
    cfg = sparseflow.PISAConfig(block_size=8, top_k=3)
    want = sparseflow.attention(q, k, v, config=cfg, backend="triton")
    assert calls == []
    got = sparseflow.attention(q, k, v, config=cfg, backend="triton", tuning=TILED)
    assert len(calls) == 1
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize(
    "value,exc,words",
    [
        ("tile", ValueError, ["pisa_walk", "'auto'", "'per_token'", "'tiled'"]),
        (None, TypeError, ["pisa_walk", "str"]),
    ],
)
def test_walk_choice_is_validated(value, exc, words):
    with pytest.raises(exc) as info:
        Tuning(pisa_walk=value)
    assert "\n" not in str(info.value) and all(w in str(info.value) for w in words)


@pytest.mark.parametrize("block_q,exc", [(3, ValueError), (0, ValueError), (2.0, TypeError), (True, TypeError)])
def test_tile_rows_refuses_a_bad_block_q(block_q, exc):
    with pytest.raises(exc, match="block_q must be None or"):
        tiled.tile_rows(2, block_q)


def test_tile_rows_fill_a_dot():
    # (group, block_q) -> queries per tile: >= 16 dot rows, about 128 where the group allows
    assert [tiled.tile_rows(g) for g in (1, 2, 3, 16, 64)] == [16, 16, 16, 8, 2]
    assert tiled.tile_rows(1, 2) == 16 and tiled.tile_rows(4, 2) == 4 and tiled.tile_rows(4, 32) == 32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tiled_selection_has_no_host_sync():
    q, k, v = (torch.randn(1, 4, 1000, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    run = lambda: sparseflow.pisa_attention(q, k, v, is_causal=True, backend="triton", tuning=TILED)  # noqa: E731
    run()  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@triton.jit
def _union_kernel(cand_ptr, want_ptr, score_ptr, n_ptr, BQ: tl.constexpr, CW: tl.constexpr, U: tl.constexpr):
    """Runs the union's bookkeeping alone; a node's score is its id."""
    at = tl.arange(0, BQ)[:, None] * CW + tl.arange(0, CW)[None, :]
    cand = tl.load(cand_ptr + at)
    want = tl.load(want_ptr + at) != 0
    flat, first, slot, n_u = tiled._union(cand, want, BQ, CW)
    score = tl.full([BQ, CW], float("-inf"), dtype=tl.float32)
    c0 = 0
    while c0 < n_u:
        ids, ok = tiled._union_chunk(flat, first, slot, n_u, c0, U)
        s_u = tl.zeros([BQ, U], dtype=tl.float32) + ids[None, :].to(tl.float32)
        score = tiled._take_matches(score, cand, ids, ok, s_u)
        c0 += U
    tl.store(score_ptr + at, score)
    tl.store(n_ptr, n_u)


def test_union_holds_every_wanted_candidate_and_gives_each_its_score():
    """The union's bookkeeping on its own: ids wanted by non-adjacent rows only (scored twice),
    rows that want nothing, and chunks of 4: every wanted candidate gets its own id's score."""
    g = torch.Generator().manual_seed(3)
    bq, cw = 8, 16
    cand = torch.stack([torch.randperm(40, generator=g)[:cw] for _ in range(bq)]).to(torch.int32)
    cand[2] = cand[0]  # row 2 repeats row 0, row 1 in between differs
    want = torch.rand(bq, cw, generator=g) < 0.7
    want[1] = False
    want[5] = False
    score, n_u = torch.empty(bq, cw), torch.zeros(1, dtype=torch.int32)
    score, n_u = score.to(DEVICE), n_u.to(DEVICE)
    _union_kernel[(1,)](cand.to(DEVICE), want.to(DEVICE).to(torch.int8), score, n_u, BQ=bq, CW=cw, U=4)
    score, n_u = score.cpu(), int(n_u.cpu())
    assert torch.equal(score[want], cand[want].float())
    prev = torch.zeros_like(want)
    prev[1:] = (cand[1:, :, None] == cand[:-1, None, :]).logical_and(want[:-1, None, :]).any(-1)
    assert n_u == int((want & ~prev).sum()) and n_u > len(set(cand[want].tolist()))  # some ids scored twice
