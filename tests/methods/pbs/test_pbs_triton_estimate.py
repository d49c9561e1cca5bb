"""PBS strided block estimates in Triton (``scoring="sampled_rows"|"antidiagonal"``,
sparseflow/methods/pbs/triton_estimate.py) against the reference.

On a machine without CUDA the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set
before the Triton modules are imported; tiny shapes). fp32: block probabilities to 1e-5 relative
and selections identical. bf16/fp16: the reference runs on the same low-precision inputs (it
upcasts them, so both compute exact products with fp32 sums in different orders); the
probabilities agree to 1e-5 and a selection may differ only at a block whose place in the
threshold rule is a near-tie (its prefix mass within 1e-4 of the threshold, or a probability
within 1e-5 of another candidate's) -- see ``_assert_same_up_to_near_ties``.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from sparseflow.methods.pbs import block_selection  # noqa: E402
from sparseflow.methods.pbs.block_selection import candidate_blocks, forced_blocks, select_blocks  # noqa: E402
from sparseflow.methods.pbs.estimate import block_probabilities  # noqa: E402
from sparseflow.methods.pbs.permutation import key_scores, segment_permutation  # noqa: E402
from sparseflow.methods.pbs.reference import pbs_attention  # noqa: E402
from sparseflow.methods.pbs import triton_attention as TA  # noqa: E402
from sparseflow.methods.pbs import triton_estimate as E  # noqa: E402
from sparseflow.methods.pbs import triton_impl as TI  # noqa: E402
from sparseflow.methods.pbs import triton_gather as TG  # noqa: E402
from sparseflow.methods.pbs import triton_select as S  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _qkv(b, hq, hkv, n, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, d, generator=g)
    k = torch.randn(b, hkv, n, d, generator=g)
    v = torch.randn(b, hkv, n, d, generator=g)
    k[:, :, ::7] *= 2.0  # a few strong keys: the distributions are not uniform
    return q.to(DEV, dtype), k.to(DEV, dtype), v.to(DEV, dtype)


def _padding(kind, b, n):
    """``None`` or ``[B, N]`` bool: row 0 right-padded, row 1 left-padded with holes, and for
    ``"empty"`` a last row with no valid token."""
    if kind == "none":
        return None
    kpm = torch.ones(b, n, dtype=torch.bool, device=DEV)
    kpm[0, n - n // 3 :] = False
    if b > 1:
        kpm[1, :5] = False
        kpm[1, n // 2 : n // 2 + 9] = False
    if kind == "empty":
        kpm[-1] = False
    return kpm


def _perm(q, k, kpm, bs, seg, gqa):
    sc = key_scores(q, k, key_padding_mask=kpm, block_size=bs, segment_size=seg, gqa_permutation=gqa)
    return segment_permutation(sc, segment_size=seg, key_padding_mask=kpm)


# scoring, stride, n, hq, hkv, gqa, padding, causal, block, segment, b
PROB_CASES = [
    ("sampled_rows", 1, 100, 4, 2, "query_head", "none", True, 16, 32, 1),
    ("sampled_rows", 2, 96, 4, 2, "kv_head", "holes", True, 16, 32, 2),
    ("sampled_rows", 3, 100, 2, 1, "query_head", "empty", False, 16, 32, 3),
    ("sampled_rows", 4, 70, 4, 2, "kv_head", "none", False, 8, 16, 1),
    ("sampled_rows", 8, 130, 4, 1, "query_head", "holes", True, 16, 64, 2),
    ("antidiagonal", 1, 90, 4, 2, "query_head", "holes", True, 16, 32, 2),
    ("antidiagonal", 2, 96, 4, 2, "kv_head", "none", True, 16, 32, 1),
    ("antidiagonal", 4, 100, 2, 1, "query_head", "empty", False, 16, 32, 3),
    ("antidiagonal", 8, 128, 4, 2, "kv_head", "none", False, 16, 32, 1),
    ("antidiagonal", 8, 110, 4, 2, "query_head", "holes", True, 32, 64, 2),
    ("antidiagonal", 4, 70, 4, 1, "kv_head", "holes", False, 8, 16, 2),
    # a block size that is no power of two: columns per block padded to one
    ("sampled_rows", 5, 100, 2, 1, "kv_head", "none", True, 24, 48, 1),
    ("antidiagonal", 3, 100, 2, 1, "query_head", "holes", True, 24, 48, 2),
]


def _pid(c):
    sc, s, n, hq, hkv, gqa, pad, causal, bs, seg, b = c
    return f"{sc}-s{s}-n{n}-h{hq}.{hkv}-{gqa}-{pad}-{'causal' if causal else 'full'}-b{bs}"


@pytest.mark.parametrize("case", PROB_CASES, ids=[_pid(c) for c in PROB_CASES])
def test_block_probabilities_match_reference(case, poisoned):
    scoring, s, n, hq, hkv, gqa, pad, causal, bs, seg, b = case
    d = 80 if bs % 16 else 32  # with the odd block size, a head dim that is no power of two too
    q, k, _ = _qkv(b, hq, hkv, n, d, torch.float32, seed=n + s)
    kpm = _padding(pad, b, n)
    perm = _perm(q, k, kpm, bs, seg, gqa)
    cand = candidate_blocks(perm, hq, key_padding_mask=kpm, is_causal=causal, block_size=bs, segment_size=seg)
    ref = block_probabilities(
        q, k, perm, cand, key_padding_mask=kpm, block_size=bs, scoring=scoring, antidiagonal_stride=s
    )
    got = poisoned(
        E.block_probabilities,
        q,
        k,
        perm,
        key_padding_mask=kpm,
        is_causal=causal,
        block_size=bs,
        segment_size=seg,
        scoring=scoring,
        antidiagonal_stride=s,
    )
    assert not got.isnan().any()
    assert ref.sum() > 0  # the case has candidates to score
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_tiles_spanning_query_blocks(poisoned):
    # 16 rows per tile, 6 sampled rows per query block (bs 16, stride 3): tiles start mid-block
    q, k, _ = _qkv(2, 2, 1, 100, 32, torch.float32, seed=3)
    kpm = _padding("holes", 2, 100)
    perm = _perm(q, k, kpm, 16, 32, "query_head")
    ref = E.block_probabilities(
        q, k, perm, key_padding_mask=kpm, block_size=16, segment_size=32, scoring="sampled_rows", antidiagonal_stride=3
    )
    got = poisoned(
        E.block_probabilities,
        q,
        k,
        perm,
        key_padding_mask=kpm,
        block_size=16,
        segment_size=32,
        scoring="sampled_rows",
        antidiagonal_stride=3,
        block_m=16,
    )
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)


def test_estimate_writes_every_row(poisoned):
    q, k, _ = _qkv(2, 4, 2, 100, 32, torch.float32, seed=5)
    kpm = _padding("empty", 2, 100)
    perm = _perm(q, k, kpm, 16, 32, "kv_head")
    kpos, lens, qvalid = E.padding_inputs(kpm, perm, 16)
    for scoring in ("sampled_rows", "antidiagonal"):
        lbm, lse = poisoned(
            E.strided_estimate,
            q,
            TG.permute_kv(k, perm),
            kpos,
            lens,
            qvalid,
            scoring=scoring,
            stride=4,
            hp=2,
            block_size=16,
            segment_size=32,
            is_causal=False,
        )
        assert not lse.isnan().any()
        # every key block is a candidate of some row in every tile (non-causal): all written
        assert not lbm.isnan().any()
        # the all-padded row has no candidate: no mass
        assert torch.isneginf(lse.view(2, 4, -1)[1]).all()


@pytest.mark.parametrize("scoring", ["sampled_rows", "antidiagonal"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("pad", [False, True], ids=["nopad", "pad"])
@pytest.mark.parametrize("splits", [2, 3, 50], ids=lambda s: f"splits{s}")
def test_key_splits_equal_one_pass(poisoned, scoring, causal, pad, splits):
    """Splitting each row tile's keys over programs changes no block's mass and sums the rows'
    mass over the spans (splits=50: more spans than key blocks, clamped to one block each)."""
    q, k, _ = _qkv(2, 4, 2, 100, 32, torch.float32, seed=8)
    kpm = _padding("holes", 2, 100) if pad else None
    perm = _perm(q, k, kpm, 16, 32, "kv_head")
    kpos, lens, qvalid = E.padding_inputs(kpm, perm, 16)
    kw = dict(scoring=scoring, stride=4, hp=2, block_size=16, segment_size=32, is_causal=causal, block_m=16, block_n=16)
    args = (q, TG.permute_kv(k, perm), kpos, lens, qvalid)
    lbm1, lse1 = poisoned(E.strided_estimate, *args, key_splits=1, **kw)
    lbm, lse = poisoned(E.strided_estimate, *args, key_splits=splits, **kw)
    assert not lbm.isnan().any() and not lse.isnan().any()
    assert torch.equal(lbm, lbm1)
    torch.testing.assert_close(lse, lse1, rtol=1e-6, atol=1e-6)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse1))


@pytest.mark.parametrize(
    "programs, steps, sms, want",
    [(144, 64, 132, 4), (288, 128, 132, 2), (576, 256, 132, 1), (9, 3, 132, 2), (1, 1000, 132, 8), (72, 64, 1, 1)],
    ids=["8k-smollm2", "16k", "32k-enough", "few-steps", "cap", "one-sm"],
)
def test_default_key_splits(programs, steps, sms, want):
    """Splits aim at _SPLIT_PROGRAMS_PER_SM programs per SM, in powers of two, capped by the
    key steps and _MAX_KEY_SPLITS."""
    assert E.splits_for(programs, steps, sms) == want


def test_default_key_splits_is_one_off_the_gpu():
    q = torch.zeros(1, 9, 8192, 64)
    assert E.default_key_splits(q, "sampled_rows", 8, 9, 128, 64, 1) == 1


def test_key_splits_rejects_bad_values():
    q, k, _ = _qkv(1, 2, 1, 40, 16, torch.float32, seed=1)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="key_splits"):
            E.strided_estimate(
                q,
                k,
                None,
                None,
                None,
                scoring="sampled_rows",
                stride=4,
                hp=1,
                block_size=16,
                segment_size=32,
                key_splits=bad,
            )


@pytest.mark.parametrize("pad", [False, True], ids=["nopad", "pad"])
def test_causal_estimate_defines_every_block(poisoned, pad):
    # causal tiles stream keys only up to their last candidate: the blocks after it must still be
    # written (-inf, no mass), or the op's output holds uninitialised memory (compile/opcheck
    # compare it)
    q, k, _ = _qkv(2, 4, 2, 100, 32, torch.float32, seed=6)
    kpm = _padding("holes", 2, 100) if pad else None
    perm = _perm(q, k, kpm, 16, 32, "kv_head")
    kpos, lens, qvalid = E.padding_inputs(kpm, perm, 16)
    for scoring in ("sampled_rows", "antidiagonal"):
        lbm, lse = poisoned(
            E.strided_estimate,
            q,
            TG.permute_kv(k, perm),
            kpos,
            lens,
            qvalid,
            scoring=scoring,
            stride=4,
            hp=2,
            block_size=16,
            segment_size=32,
            is_causal=True,
            block_m=16,
            block_n=16,
        )
        assert not lbm.isnan().any() and not lse.isnan().any()
        rows_per_block = E.rows_per_block(scoring, 16, 4)
        qblock = torch.arange(lbm.shape[1]) // rows_per_block
        future = torch.arange(lbm.shape[2])[None, :] >= (qblock[:, None] * 16 // 32 * 32) // 16
        assert torch.isneginf(lbm[:, future]).all()  # no key block at or after a row's own region has mass


def _block_lists(q, k, perm, kpm, **kw):
    return S.select_block_lists(q, TG.permute_kv(k, perm), perm, key_padding_mask=kpm, **kw)


def _assert_lists_match(kv_num, kv_full, kv_idx, ref_bm, n, bs, seg, causal, kpm):
    has_pad = kpm is not None and not bool(kpm.all())
    r_num, r_full, r_idx = TA.block_mask_to_indices(
        ref_bm, num_keys=n, block_size=bs, segment_size=seg, is_causal=causal, has_padding=has_pad
    )
    assert torch.equal(kv_num, r_num) and torch.equal(kv_full, r_full)
    width = torch.arange(kv_idx.shape[-1], device=DEV) < kv_num[..., None]
    assert torch.equal(torch.where(width, kv_idx, 0), torch.where(width, r_idx, 0))
    assert not (kv_idx == -7).any()  # written past kv_num too (the poison value)


# scoring, stride, n, hq, hkv, gqa, padding, causal, block, segment, thresholds, sink
SELECT_CASES = [
    ("sampled_rows", 2, 100, 4, 2, "query_head", "none", True, 16, 32, (0.5, 0.9, 0.95), True),
    ("sampled_rows", 3, 90, 4, 2, "kv_head", "holes", False, 16, 32, (0.9, 1.0), False),
    ("sampled_rows", 8, 130, 2, 1, "query_head", "empty", True, 16, 32, (0.95,), True),
    ("antidiagonal", 4, 100, 4, 2, "kv_head", "holes", True, 16, 32, (0.5, 0.9, 0.95), True),
    ("antidiagonal", 8, 96, 4, 2, "query_head", "none", False, 16, 32, (0.5, 1.0), True),
    ("antidiagonal", 2, 70, 2, 1, "query_head", "empty", True, 8, 16, (0.9,), False),
]


@pytest.mark.parametrize("case", SELECT_CASES, ids=[_pid(c[:10] + (2,)) for c in SELECT_CASES])
def test_selection_identical_to_reference(case, poisoned):
    scoring, s, n, hq, hkv, gqa, pad, causal, bs, seg, thresholds, sink = case
    b = 3 if pad == "empty" else 2
    q, k, _ = _qkv(b, hq, hkv, n, 32, torch.float32, seed=n * s)
    kpm = _padding(pad, b, n)
    perm = _perm(q, k, kpm, bs, seg, gqa)
    for thr in thresholds:
        geo = dict(is_causal=causal, block_size=bs, segment_size=seg, threshold=thr, force_sink=sink)
        ref_bm = select_blocks(q, k, perm, key_padding_mask=kpm, scoring=scoring, antidiagonal_stride=s, **geo)
        kv_num, kv_full, kv_idx, bm = poisoned(
            _block_lists, q, k, perm, kpm, scoring=scoring, antidiagonal_stride=s, **geo
        )
        assert torch.equal(bm, ref_bm), f"threshold {thr}: {(bm != ref_bm).sum().item()} blocks differ"
        _assert_lists_match(kv_num, kv_full, kv_idx, ref_bm, n, bs, seg, causal, kpm)
        if thr < 1.0:  # the cut is not trivial: some candidate is dropped, some is kept
            cand = candidate_blocks(perm, hq, key_padding_mask=kpm, is_causal=causal, block_size=bs, segment_size=seg)
            assert (cand & ~ref_bm).any() and (cand & ref_bm).any()


def test_head_chunks_give_the_same_selection():
    q, k, _ = _qkv(2, 4, 2, 100, 32, torch.float32, seed=8)
    kpm = _padding("holes", 2, 100)
    perm = _perm(q, k, kpm, 16, 32, "query_head")
    kw = dict(block_size=16, segment_size=32, threshold=0.9, scoring="antidiagonal", antidiagonal_stride=4)
    whole = _block_lists(q, k, perm, kpm, **kw)
    chunked = _block_lists(q, k, perm, kpm, max_logit_bytes=1, **kw)  # one head per launch
    for a, c in zip(whole, chunked):
        assert torch.equal(a, c)


def _assert_same_up_to_near_ties(bm, ref_bm, probs, cand, thr, tol_mass=1e-4, tol_prob=1e-5):
    """``bm == ref_bm`` except at blocks whose threshold decision is a near-tie under ``probs``."""
    diff = bm != ref_bm
    if not diff.any():
        return
    key = torch.where(cand, probs, torch.full_like(probs, -1.0))
    sp, order = torch.sort(key, dim=-1, descending=True, stable=True)
    mass = torch.where(sp >= 0, sp, torch.zeros_like(sp))
    before = torch.zeros_like(probs).scatter_(-1, order, torch.cumsum(mass, -1) - mass)
    near_cut = (before - thr).abs() < tol_mass
    gap = (probs[..., :, None] - probs[..., None, :]).abs()
    others = cand[..., None, :] & ~torch.eye(probs.shape[-1], dtype=torch.bool, device=probs.device)
    near_twin = ((gap < tol_prob) & others).any(-1)
    bad = diff & ~((near_cut | near_twin) & cand)
    assert not bad.any(), f"{int(bad.sum())} blocks differ without a near-tie"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("scoring,s", [("sampled_rows", 4), ("antidiagonal", 4)])
def test_low_precision_matches_reference_on_same_inputs(dtype, scoring, s):
    n, bs, seg = 100, 16, 32
    q, k, _ = _qkv(2, 4, 2, n, 32, dtype, seed=11)
    kpm = _padding("holes", 2, n)
    perm = _perm(q, k, kpm, bs, seg, "kv_head")
    cand = candidate_blocks(perm, 4, key_padding_mask=kpm, block_size=bs, segment_size=seg)
    ref_p = block_probabilities(
        q, k, perm, cand, key_padding_mask=kpm, block_size=bs, scoring=scoring, antidiagonal_stride=s
    )
    got_p = E.block_probabilities(
        q, k, perm, key_padding_mask=kpm, block_size=bs, segment_size=seg, scoring=scoring, antidiagonal_stride=s
    )
    torch.testing.assert_close(got_p, ref_p, rtol=1e-5, atol=1e-6)
    for thr in (0.9,):
        geo = dict(block_size=bs, segment_size=seg, threshold=thr, scoring=scoring, antidiagonal_stride=s)
        ref_bm = select_blocks(q, k, perm, key_padding_mask=kpm, **geo)
        bm = _block_lists(q, k, perm, kpm, **geo)[3]
        forced = forced_blocks(perm, 4, key_padding_mask=kpm, block_size=bs, segment_size=seg)
        _assert_same_up_to_near_ties(bm & ~forced, ref_bm & ~forced, ref_p, cand, thr)


def test_near_tie_check_can_fail():
    probs = torch.tensor([[0.5, 0.3, 0.2]])
    cand = torch.ones(1, 3, dtype=torch.bool)
    ref = torch.tensor([[True, True, False]])
    with pytest.raises(AssertionError):
        _assert_same_up_to_near_ties(torch.tensor([[True, False, True]]), ref, probs, cand, 0.7)


@pytest.mark.parametrize("scoring,s,layout", [("sampled_rows", 2, "permuted"), ("antidiagonal", 4, "gather")])
def test_op_through_triton_backend_uses_the_estimate(monkeypatch, scoring, s, layout):
    import sparseflow
    from sparseflow import PBSConfig

    tuning = sparseflow.Tuning(pbs_select="triton", pbs_kv_layout=layout)
    n = 80
    q, k, v = _qkv(2, 4, 2, n, 32, torch.float32, seed=21)
    kpm = _padding("holes", 2, n)
    mask = kpm[:, None, None, :] & torch.ones(n, n, dtype=torch.bool, device=DEV).tril()
    cfg = PBSConfig(
        block_size=16, segment_size=32, threshold=0.8, scoring=scoring, antidiagonal_stride=s, gqa_permutation="kv_head"
    )
    ref = sparseflow.pbs_attention(q, k, v, config=cfg, backend="reference", attn_mask=mask, is_causal=False)
    # the triton backend must not fall back to the torch selection for the strided scorings (patched
    # where each name is looked up: the backend's selection call, and the selection's estimate)
    monkeypatch.setattr(TI, "select_blocks", lambda *a, **kw: pytest.fail("reference selection called"))
    monkeypatch.setattr(
        block_selection, "block_probabilities", lambda *a, **kw: pytest.fail("reference estimate called")
    )
    out = sparseflow.pbs_attention(
        q, k, v, config=cfg, backend="triton", attn_mask=mask, is_causal=False, tuning=tuning
    )
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_selection_through_pbs_attention():
    from sparseflow import Tuning

    q, k, v = _qkv(2, 4, 2, 70, 32, torch.float32, seed=22)
    kpm = _padding("holes", 2, 70)
    kw = dict(
        key_padding_mask=kpm,
        block_size=16,
        segment_size=32,
        threshold=0.9,
        scoring="sampled_rows",
        antidiagonal_stride=4,
        return_selection=True,
    )
    out, sel = TI.pbs_attention(q, k, v, tuning=Tuning(pbs_select="triton"), **kw)
    ref_out, ref_sel = pbs_attention(q, k, v, **kw)
    assert torch.equal(sel.block_mask, ref_sel.block_mask)
    assert torch.equal(sel.permutation, ref_sel.permutation)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)


def test_bad_stride_and_scoring_are_value_errors():
    q, k, _ = _qkv(1, 2, 1, 64, 32, torch.float32, seed=1)
    perm = torch.arange(64, device=DEV).expand(1, 2, 64).contiguous()
    with pytest.raises(ValueError, match="antidiagonal_stride must divide block_size"):
        _block_lists(q, k, perm, None, block_size=16, segment_size=32, scoring="antidiagonal", antidiagonal_stride=3)
    with pytest.raises(ValueError, match="antidiagonal_stride must be an int >= 1"):
        _block_lists(q, k, perm, None, block_size=16, segment_size=32, scoring="sampled_rows", antidiagonal_stride=0)
    with pytest.raises(ValueError, match="scoring must be"):
        _block_lists(q, k, perm, None, block_size=16, segment_size=32, scoring="rows")


@pytest.mark.parametrize("n", [1, 20])
@pytest.mark.parametrize("causal", [True, False])
def test_short_sequences(n, causal, poisoned):
    # fewer tokens than a segment (no candidate anywhere) or one partial block
    q, k, _ = _qkv(1, 2, 1, n, 32, torch.float32, seed=n)
    perm = _perm(q, k, None, 16, 32, "query_head")
    for scoring in ("sampled_rows", "antidiagonal"):
        geo = dict(
            is_causal=causal, block_size=16, segment_size=32, threshold=0.9, scoring=scoring, antidiagonal_stride=4
        )
        ref_bm = select_blocks(q, k, perm, **geo)
        kv_num, kv_full, kv_idx, bm = poisoned(_block_lists, q, k, perm, None, **geo)
        assert torch.equal(bm, ref_bm)
        _assert_lists_match(kv_num, kv_full, kv_idx, ref_bm, n, 16, 32, causal, None)


@pytest.mark.parametrize("scoring,s", [("sampled_rows", 4), ("antidiagonal", 2), ("antidiagonal", 8)])
@pytest.mark.parametrize("causal", [True, False])
def test_interior_steps_without_masks(scoring, s, causal, poisoned):
    # small tiles, no padding, N a multiple of the block: most tiles start with key steps that
    # every row sees whole (the unmasked loop), then the masked steps around the own region
    n, bs, seg = 256, 16, 32
    q, k, _ = _qkv(1, 2, 1, n, 32, torch.float32, seed=s)
    perm = _perm(q, k, None, bs, seg, "query_head")
    cand = candidate_blocks(perm, 2, is_causal=causal, block_size=bs, segment_size=seg)
    ref = block_probabilities(q, k, perm, cand, block_size=bs, scoring=scoring, antidiagonal_stride=s)
    got = poisoned(
        E.block_probabilities,
        q,
        k,
        perm,
        is_causal=causal,
        block_size=bs,
        segment_size=seg,
        scoring=scoring,
        antidiagonal_stride=s,
        block_m=16,
        block_n=16,
    )
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- the custom ops

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _est_op_args(scoring, pad, dtype=torch.float32):
    """Arguments of ``sparseflow::pbs_strided_estimate`` (as ``strided_estimate`` resolves them)
    for a small GQA problem, heads 1..3 of 4 (a head chunk)."""
    n, bs, seg, s = 70, 16, 32, 4
    q, k, _ = _qkv(2, 4, 2, n, 32, dtype, seed=31)
    kpm = _padding("holes", 2, n) if pad else None
    perm = _perm(q, k, kpm, bs, seg, "kv_head")
    kpos, lens, qvalid = E.padding_inputs(kpm, perm, bs)
    plan = E.estimate_plan(scoring, bs, s, 16, 16)
    return (
        q,
        TG.permute_kv(k, perm),
        kpos,
        lens,
        qvalid,
        scoring,
        s,
        2,
        1,
        3,
        True,
        32**-0.5,
        bs,
        seg,
        16,
        16,
        plan["num_warps"],
        plan["num_stages"],
    )


def _probs_op_args(est_args):
    lbm, lse = torch.ops.sparseflow.pbs_strided_estimate(*est_args)
    q, _, _, lens, qvalid, scoring, s, _, _, hc, causal, _, bs, seg = est_args[:14]
    return (lbm, lse, qvalid, lens, scoring, s, hc, q.shape[2], causal, bs, seg)


def _opcheck(op, args):
    if INTERPRET:
        # as for sparseflow::pbs_block_sparse_fwd (tests/methods/pbs/test_pbs_triton.py): under the interpreter
        # wrap_triton hands back the raw kernel, which cannot run on fake or functional tensors, so
        # the AOT-dispatch checks cannot trace it; all of opcheck runs on CUDA
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    else:
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("scoring", ["sampled_rows", "antidiagonal"])
@pytest.mark.parametrize("pad", [False, True], ids=["nopad", "pad"])
def test_opcheck_estimate_ops(scoring, pad):
    args = _est_op_args(scoring, pad)
    _opcheck(torch.ops.sparseflow.pbs_strided_estimate.default, args)
    _opcheck(torch.ops.sparseflow.pbs_strided_estimate.default, (*args, 3))  # key blocks over 3 programs
    _opcheck(torch.ops.sparseflow.pbs_strided_probs.default, _probs_op_args(args))


@pytest.mark.parametrize("pad", [False, True], ids=["nopad", "pad"])
def test_estimate_fake_impl_shapes(pad):
    from torch._subclasses.fake_tensor import FakeTensorMode

    args = _est_op_args("sampled_rows", pad)
    lbm, lse = torch.ops.sparseflow.pbs_strided_estimate(*args)
    pargs = _probs_op_args(args)
    probs = torch.ops.sparseflow.pbs_strided_probs(*pargs)
    assert lbm.shape == (2 * 3, 5 * 4, 5) and lse.shape == (2 * 3, 5 * 4)  # B*HC, nB*RPB rows, nB blocks
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:

        def fake(a):
            return mode.from_tensor(a) if isinstance(a, torch.Tensor) else a

        f_lbm, f_lse = torch.ops.sparseflow.pbs_strided_estimate(*map(fake, args))
        f_probs = torch.ops.sparseflow.pbs_strided_probs(*map(fake, pargs))
    for got, real in ((f_lbm, lbm), (f_lse, lse), (f_probs, probs)):
        assert got.shape == real.shape and got.dtype == real.dtype == torch.float32


def test_selection_launches_through_the_op():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(str(func))
            return func(*args, **(kwargs or {}))

    q, k, _ = _qkv(1, 2, 1, 64, 32, torch.float32, seed=4)
    perm = _perm(q, k, None, 16, 32, "query_head")
    with Record() as rec:
        _block_lists(
            q,
            k,
            perm,
            None,
            block_size=16,
            segment_size=32,
            threshold=0.9,
            scoring="antidiagonal",
            antidiagonal_stride=4,
        )
    assert "sparseflow.pbs_strided_estimate.default" in rec.ops


def _estimate_then_probs(static):
    """The two estimate ops as a model's graph holds them: tensors flow in, the launch settings are
    constants of the graph (a config's fields), not inputs Dynamo could turn into symbols."""
    scoring, s, hp, h0, hc, causal, scale, bs, seg, bm, bn, warps, stages = static

    def f(q, k_perm):
        lbm, lse = torch.ops.sparseflow.pbs_strided_estimate(
            q, k_perm, None, None, None, scoring, s, hp, h0, hc, causal, scale, bs, seg, bm, bn, warps, stages
        )
        probs = torch.ops.sparseflow.pbs_strided_probs(
            lbm, lse, None, None, scoring, s, hc, q.shape[2], causal, bs, seg
        )
        return lse * 2, probs

    return f


@gpu
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("scoring", ["sampled_rows", "antidiagonal"])
def test_cuda_compile_fullgraph_estimate(scoring, dynamic):
    # Inductor compiles its own copies of the kernels and types the Python-float scale fp64 (cast
    # to fp32 in the kernel); with dynamic=True the sequence length is a symbol (a second length
    # reuses the graph)
    torch._dynamo.reset()
    args = _est_op_args(scoring, False, torch.bfloat16)
    f = _estimate_then_probs(args[5:])
    compiled = torch.compile(f, fullgraph=True, dynamic=dynamic)
    for n in (70, 96):
        q, k_perm = args[0][:, :, :n].contiguous(), args[1][:, :, :n].contiguous()
        torch.testing.assert_close(compiled(q, k_perm), f(q, k_perm))
