"""PBS's ``scoring="moments"``: the block-mean logit plus ``moments_sd`` standard deviations of the
block pair's logits, from the blocks' second moments. The reference against the definition written out
pair by pair in fp64; the Triton selection (pooled logits with the spread, Triton's interpreter on
the CPU) against the reference's; the op through the triton backend.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

import sparseflow  # noqa: E402
from sparseflow import PBSConfig  # noqa: E402
from sparseflow.methods.pbs.block_selection import candidate_blocks, select_blocks  # noqa: E402
from sparseflow.methods.pbs.estimate import block_probabilities  # noqa: E402
from sparseflow.methods.pbs.permutation import key_scores, segment_permutation  # noqa: E402
from sparseflow.methods.pbs import triton_gather as TG  # noqa: E402
from sparseflow.methods.pbs import triton_impl as TI  # noqa: E402
from sparseflow.methods.pbs import triton_select as S  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(b, hq, hkv, n, d, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, d, generator=g)
    k = torch.randn(b, hkv, n, d, generator=g)
    v = torch.randn(b, hkv, n, d, generator=g)
    k[:, :, ::11] += 2.0 * q[:, :1, ::11]  # a few keys aligned with the queries: spread, not mean
    return q.to(DEV, dtype), k.to(DEV, dtype), v.to(DEV, dtype)


def _holes(b, n):
    kpm = torch.ones(b, n, dtype=torch.bool, device=DEV)
    kpm[0, n - n // 3 :] = False
    if b > 1:
        kpm[1, :5] = False
        kpm[1, n // 2 : n // 2 + 9] = False
    return kpm


def _perm(q, k, kpm, bs, seg, gqa):
    sc = key_scores(q, k, key_padding_mask=kpm, block_size=bs, segment_size=seg, gqa_permutation=gqa)
    return segment_permutation(sc, segment_size=seg, key_padding_mask=kpm)


def _pairwise_moments(q, k, perm, cand, kpm, bs, sds):
    """The definition, pair by pair in fp64: for every query block and candidate key block, the
    mean and variance of ``q_i . k_j * scale`` over the block's valid queries (all of its rows when
    it has none) and its valid keys; logit ``mean + sds * sd``; softmax over the candidates."""
    b, hq, n, d = q.shape
    hp, g = perm.shape[1], hq // k.shape[1]
    nb = -(-n // bs)
    valid = kpm if kpm is not None else torch.ones(b, n, dtype=torch.bool, device=q.device)
    out = torch.zeros(b, hq, nb, nb, dtype=torch.float64)
    for bi in range(b):
        for h in range(hq):
            p = h // (hq // hp)
            kp = k[bi, (p * (hq // hp)) // g].double()[perm[bi, p]]
            kv = valid[bi][perm[bi, p]]
            logits = torch.full((nb, nb), float("-inf"), dtype=torch.float64)
            for i in range(nb):
                rows = torch.arange(i * bs, min(n, (i + 1) * bs), device=q.device)
                use = valid[bi, rows] if valid[bi, rows].any() else torch.ones_like(rows, dtype=torch.bool)
                qi = q[bi, h].double()[rows[use]]
                for j in range(nb):
                    keys = torch.arange(j * bs, min(n, (j + 1) * bs), device=q.device)
                    if not cand[bi, h, i, j] or not kv[keys].any():
                        continue
                    s = (qi @ kp[keys[kv[keys]]].t()).flatten() * d**-0.5
                    mu, var = s.mean(), (s * s).mean() - s.mean() ** 2
                    logits[i, j] = mu + sds * var.clamp_min(0).sqrt()
            empty = torch.isneginf(logits).all(-1, keepdim=True)
            out[bi, h] = torch.softmax(logits, -1).masked_fill(empty, 0.0)
    return out


@pytest.mark.parametrize("gqa,pad,sds", [("query_head", False, 0.5), ("kv_head", True, 2.0)])
def test_reference_is_the_pairwise_definition(gqa, pad, sds):
    n, bs, seg = 90, 16, 32
    q, k, _ = _inputs(2, 4, 2, n, 16, seed=3)
    q, k = q.double(), k.double()
    kpm = _holes(2, n) if pad else None
    perm = _perm(q, k, kpm, bs, seg, gqa)
    cand = candidate_blocks(perm, 4, key_padding_mask=kpm, block_size=bs, segment_size=seg)
    kw = dict(key_padding_mask=kpm, block_size=bs, scoring="moments", moments_sd=sds)
    got = block_probabilities(q, k, perm, cand, **kw)
    want = _pairwise_moments(q, k, perm, cand, kpm, bs, sds)
    torch.testing.assert_close(got.double().cpu(), want.cpu(), rtol=1e-5, atol=1e-6)


def test_the_spread_changes_the_selection_where_one_key_dominates():
    # one key of an old block matches the last query block's queries (it holds most of their
    # attention); the rest of its block is noise: the mean averages that key away and prefers a
    # block of keys that are all a little aligned, the spread keeps the one key's block first
    n, bs, seg, d = 128, 16, 16, 16
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, n, d, generator=g) * 0.3
    k = torch.randn(1, 1, n, d, generator=g) * 0.3
    q[0, 0, -bs:] += 1.5 * torch.ones(d)
    k[0, 0, 20] = 3.0 * torch.ones(d)  # block 1: one key, the largest logit by far
    k[0, 0, 48:64] += 0.3  # block 3: every key a little aligned, the larger mean
    perm = torch.arange(n)[None, None]
    cand = candidate_blocks(perm, 1, block_size=bs, segment_size=seg)
    mean = block_probabilities(q, k, perm, cand, block_size=bs, scoring="mean")[0, 0, -1]
    spread = block_probabilities(q, k, perm, cand, block_size=bs, scoring="moments")[0, 0, -1]
    assert int(spread[:-1].argmax()) == 1 and int(mean[:-1].argmax()) == 3


# n, hq, hkv, gqa, padding, causal, block, segment, thresholds, sink, moments_sd
SELECT_CASES = [
    (100, 4, 2, "query_head", False, True, 16, 32, (0.5, 0.9, 0.95), True, 0.5),
    (90, 4, 2, "kv_head", True, False, 16, 32, (0.5, 0.9, 1.0), False, 2.0),
    (130, 2, 1, "query_head", True, True, 16, 32, (0.8, 0.95), True, 1.0),
    (70, 3, 1, "kv_head", False, True, 8, 16, (0.8,), True, 2.0),
]


@pytest.mark.parametrize(
    "case", SELECT_CASES, ids=[f"n{c[0]}-{c[3]}-pad{int(c[4])}-causal{int(c[5])}" for c in SELECT_CASES]
)
def test_triton_selection_equals_the_reference(case):
    n, hq, hkv, gqa, pad, causal, bs, seg, thresholds, sink, sds = case
    q, k, _ = _inputs(2, hq, hkv, n, 32, seed=n)
    kpm = _holes(2, n) if pad else None
    perm = _perm(q, k, kpm, bs, seg, gqa)
    differs = []
    for thr in thresholds:
        geo = dict(
            is_causal=causal,
            block_size=bs,
            segment_size=seg,
            threshold=thr,
            force_sink=sink,
            scoring="moments",
            moments_sd=sds,
        )
        ref = select_blocks(q, k, perm, key_padding_mask=kpm, **geo)
        k_perm = TG.permute_kv(k, perm)
        # the reference's fp32 products (TF32's near-ties: tests/methods/pbs/test_pbs_moments_precision.py)
        geo_ieee = dict(geo, moments_product="ieee")
        whole = S.select_block_lists(q, k_perm, perm, key_padding_mask=kpm, **geo_ieee)
        chunked = S.select_block_lists(q, k_perm, perm, key_padding_mask=kpm, max_logit_bytes=1, **geo_ieee)
        assert torch.equal(whole[3], ref), f"threshold {thr}: {(whole[3] != ref).sum().item()} blocks differ"
        assert all(torch.equal(a, c) for a, c in zip(whole, chunked))  # one permutation head at a time
        mean = select_blocks(q, k, perm, key_padding_mask=kpm, **{**geo, "scoring": "mean"})
        differs.append(not torch.equal(mean, ref))
    assert any(differs)  # the spread decided something the mean would not have


@pytest.mark.parametrize("layout", ["permuted", "gather"])
def test_every_backend_selects_with_the_configs_spread(monkeypatch, layout):
    # a moments_sd other than the default: a path that dropped it would select with 0.5
    from sparseflow.methods.pbs import flex
    from sparseflow.methods.pbs.reference import pbs_attention

    n = 80
    q, k, v = _inputs(2, 4, 2, n, 32, seed=21)
    kpm = _holes(2, n)
    cfg = PBSConfig(block_size=16, segment_size=32, threshold=0.8, scoring="moments", moments_sd=2.0)
    cfg = cfg.replace(gqa_permutation="kv_head")
    kw = dict(key_padding_mask=kpm, return_selection=True)
    ref_out, ref_sel = pbs_attention(q, k, v, config=cfg, **kw)
    _, default_sel = pbs_attention(q, k, v, config=cfg.replace(moments_sd=0.5), **kw)
    assert not torch.equal(ref_sel.block_mask, default_sel.block_mask)
    assert torch.equal(flex._select(q, k, cfg, kpm, True, None)[1], ref_sel.block_mask)
    monkeypatch.setattr(TI, "select_blocks", lambda *a, **kw: pytest.fail("reference selection called"))
    tuning = sparseflow.Tuning(pbs_select="triton", pbs_kv_layout=layout, pbs_moments_product="ieee")
    out, sel = TI.pbs_attention(q, k, v, config=cfg, tuning=tuning, **kw)
    assert torch.equal(sel.block_mask, ref_sel.block_mask) and not bool(sel.block_mask.all())
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)


def test_a_negative_scale_subtracts_no_spread():
    # the Triton selection adds the spread to raw logits the kernel then scales: signed as the scale
    n = 64
    q, k, _ = _inputs(1, 2, 1, n, 16, seed=9)
    perm = _perm(q, k, None, 8, 16, "query_head")
    geo = dict(block_size=8, segment_size=16, threshold=0.8, scoring="moments", moments_sd=2.0, scale=-0.3)
    ref = select_blocks(q, k, perm, **geo)
    got = S.select_block_lists(q, TG.permute_kv(k, perm), perm, moments_product="ieee", **geo)[3]
    assert torch.equal(got, ref)


def test_the_config_names_the_scoring_and_onnx_refuses_it():
    assert PBSConfig(scoring="moments").scoring == "moments"
    with pytest.raises(ValueError, match="scoring"):
        PBSConfig(scoring="moment")
    with pytest.raises(ValueError, match="moments_sd must be a finite float >= 0"):
        PBSConfig(scoring="moments", moments_sd=-1.0)
    with pytest.raises(TypeError, match="moments_sd"):
        PBSConfig(scoring="moments", moments_sd="2")
    from sparseflow.methods.pbs import onnx_refusal

    assert "scoring='moments'" in onnx_refusal(PBSConfig(scoring="moments"))


def test_no_spread_is_mean_scoring():
    q, k, _ = _inputs(1, 4, 2, 70, 16, seed=5)
    perm = _perm(q, k, None, 16, 32, "kv_head")
    cand = candidate_blocks(perm, 4, block_size=16, segment_size=32)
    mean = block_probabilities(q, k, perm, cand, block_size=16, scoring="mean")
    none = block_probabilities(q, k, perm, cand, block_size=16, scoring="moments", moments_sd=0.0)
    some = block_probabilities(q, k, perm, cand, block_size=16, scoring="moments", moments_sd=0.5)
    assert torch.equal(none, mean) and not torch.allclose(some, mean)
