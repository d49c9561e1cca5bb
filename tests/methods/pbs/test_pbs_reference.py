"""Properties of the plain-PyTorch PBS-Attn reference.

Small CPU shapes, odd lengths, GQA group sizes 1-3, head dims 32-256. The oracles here are
written independently of sparseflow: an fp64 masked softmax over (repeated, test-only) K/V.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparseflow.methods.pbs.block_selection import candidate_blocks, select_blocks, threshold_blocks
from sparseflow.methods.pbs.estimate import block_probabilities
from sparseflow.methods.pbs.permutation import key_scores, segment_permutation
from sparseflow.methods.pbs.permuted_attention import permuted_block_attention
from sparseflow.methods.pbs.reference import pbs_attention
from sparseflow.selection import Selection

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------- oracles and data


def dense64(q, k, v, *, is_causal=True, key_padding_mask=None, key_mask=None, scale=None):
    """fp64 masked-softmax attention; rows with no visible key give 0."""
    b, hq, n, d = q.shape
    g = hq // k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    kd = k.double().repeat_interleave(g, dim=1)
    vd = v.double().repeat_interleave(g, dim=1)
    logits = q.double() @ kd.transpose(-1, -2) * scale
    vis = torch.ones(n, n, dtype=torch.bool)
    if is_causal:
        vis = vis.tril()
    vis = vis.expand(b, hq, n, n)
    if key_padding_mask is not None:
        vis = vis & key_padding_mask[:, None, None, :]
    if key_mask is not None:
        vis = vis & key_mask
    logits = logits.masked_fill(~vis, float("-inf"))
    p = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    return p @ vd


@st.composite
def problems(draw, max_n=150, dtypes=(torch.float32,), padding=True):
    hkv, g = draw(st.sampled_from([(1, 1), (1, 3), (2, 3), (2, 1), (3, 2)]))
    bs = draw(st.sampled_from([4, 8, 16]))
    seg = bs * draw(st.sampled_from([1, 2, 3]))
    n = draw(st.integers(1, max_n))
    d = draw(st.sampled_from([32, 48, 64, 96, 128, 256]))
    b = draw(st.integers(1, 2))
    dtype = draw(st.sampled_from(dtypes))
    seed = draw(st.integers(0, 2**31 - 1))
    pad = draw(st.sampled_from(["none", "right", "left", "holes"])) if padding else "none"
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hkv * g, n, d, generator=gen)
    k = torch.randn(b, hkv, n, d, generator=gen)
    v = torch.randn(b, hkv, n, d, generator=gen)
    # heavy hitters so selections are non-trivial
    k[:, :, torch.randperm(n, generator=gen)[: max(1, n // 10)]] *= 2.5
    kpm = None
    if pad != "none":
        kpm = torch.ones(b, n, dtype=torch.bool)
        for r in range(b):
            cut = int(torch.randint(0, n + 1, (1,), generator=gen))
            if pad == "right":
                kpm[r, cut:] = False
            elif pad == "left":
                kpm[r, :cut] = False
            else:
                kpm[r] = torch.rand(n, generator=gen) > 0.3
    return dict(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), kpm=kpm, bs=bs, seg=seg)


opts = st.fixed_dictionaries(
    dict(
        is_causal=st.booleans(),
        gqa_permutation=st.sampled_from(["query_head", "kv_head"]),
        scoring=st.sampled_from(["mean", "antidiagonal", "sampled_rows"]),
        causal_proxy=st.booleans(),
        force_sink=st.booleans(),
        permute=st.booleans(),
    )
)


def run(p, threshold, o, **extra):
    stride = min(4, p["bs"])
    return pbs_attention(
        p["q"],
        p["k"],
        p["v"],
        key_padding_mask=p["kpm"],
        block_size=p["bs"],
        segment_size=p["seg"],
        threshold=threshold,
        antidiagonal_stride=stride,
        return_selection=True,
        **o,
        **extra,
    )


def sdpa_error(p, is_causal, ref):
    """Max error of plain SDPA in the inputs' dtype vs the fp64 reference, over rows that see a key."""
    q, k, v, kpm = p["q"], p["k"], p["v"], p["kpm"]
    b, hq, n, _ = q.shape
    vis = torch.ones(n, n, dtype=torch.bool)
    if is_causal:
        vis = vis.tril()
    vis = vis.expand(b, 1, n, n)
    if kpm is not None:
        vis = vis & kpm[:, None, None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=vis, enable_gqa=hq != k.shape[1])
    rows = vis.any(dim=-1, keepdim=True).expand(b, hq, n, 1)
    err = (out.double() - ref).abs().masked_fill(~rows, 0.0).nan_to_num(0.0)
    return float(err.max()) if err.numel() else 0.0


FLOOR = {torch.float32: 1e-6, torch.float16: 1e-4, torch.bfloat16: 1e-3}


# --------------------------------------------------------------------------- (a) exact mode


@SETTINGS
@given(p=problems(dtypes=(torch.float32, torch.float16, torch.bfloat16)), o=opts)
def test_exact_mode_equals_dense(p, o):
    out, sel = run(p, 1.0, o)
    ref = dense64(p["q"], p["k"], p["v"], is_causal=o["is_causal"], key_padding_mask=p["kpm"])
    assert out.dtype == p["q"].dtype and out.shape == p["q"].shape
    err = float((out.double() - ref).abs().max())
    tol = 2.0 * sdpa_error(p, o["is_causal"], ref) + FLOOR[p["q"].dtype]
    assert err <= tol, f"error {err:.3g} > tolerance {tol:.3g}"
    assert torch.equal(sel.density, torch.ones_like(sel.density))


# --------------------------------------------------------------------------- (b) sparse == masked dense


def brute_density(sel: Selection, hq: int) -> torch.Tensor:
    """Selected / visible block pairs in the permuted layout, by brute force."""
    bm, perm = sel.block_mask, sel.permutation
    b, _, nb, _ = bm.shape
    n, bs = sel.num_keys, sel.block_size
    hp = perm.shape[1]
    vis = torch.ones(n, n, dtype=torch.bool)
    if sel.is_causal:
        vis = vis.tril()
    out = torch.zeros(b, hq)
    for bi in range(b):
        kv = vis if sel.key_padding_mask is None else vis & sel.key_padding_mask[bi][None, :]
        for h in range(hq):
            pv = kv[:, perm[bi, h // (hq // hp)]]  # [Nq, slot]
            pv = F.pad(pv, (0, nb * bs - n, 0, nb * bs - n)).view(nb, bs, nb, bs).any(dim=3).any(dim=1)
            den = int(pv.sum())
            out[bi, h] = 1.0 if den == 0 else int((pv & bm[bi, h]).sum()) / den
    return out


@SETTINGS
@given(p=problems(), o=opts, threshold=st.floats(0.2, 0.97))
def test_sparse_mode_equals_masked_dense_on_reported_selection(p, o, threshold):
    out, sel = run(p, threshold, o)
    hq = p["q"].shape[1]
    ref = dense64(p["q"], p["k"], p["v"], is_causal=o["is_causal"], key_mask=sel.key_mask(hq))
    assert float((out.double() - ref).abs().max()) <= 2e-5
    b, _, n, _ = p["q"].shape
    nb = -(-n // p["bs"])
    hp = hq if o["gqa_permutation"] == "query_head" else p["k"].shape[1]
    assert sel.method == "pbs" and sel.num_keys == n and sel.block_size == p["bs"]
    assert sel.block_mask.shape == (b, hq, nb, nb) and sel.block_mask.dtype == torch.bool
    assert sel.permutation.shape == (b, hp, n) and sel.permutation.dtype == torch.int64
    assert sel.density.shape == (b, hq) and sel.density.dtype == torch.float32
    torch.testing.assert_close(sel.density, brute_density(sel, hq), rtol=0, atol=1e-6)
    assert bool(((sel.density > 0) & (sel.density <= 1)).all())


# --------------------------------------------------------------------------- (c), (d) permutation


@SETTINGS
@given(p=problems(max_n=120), causal_proxy=st.booleans(), gqa=st.sampled_from(["query_head", "kv_head"]))
def test_permutation_is_sorted_per_segment_tail_fixed(p, causal_proxy, gqa):
    q, k, kpm, bs, seg = p["q"], p["k"], p["kpm"], p["bs"], p["seg"]
    scores = key_scores(
        q, k, key_padding_mask=kpm, block_size=bs, segment_size=seg, causal_proxy=causal_proxy, gqa_permutation=gqa
    )
    perm = segment_permutation(scores, segment_size=seg, key_padding_mask=kpm)
    b, hp, n = perm.shape
    assert hp == (q.shape[1] if gqa == "query_head" else k.shape[1])
    for bi in range(b):
        valid = torch.ones(n, dtype=torch.bool) if kpm is None else kpm[bi]
        length = int(valid.nonzero().max()) + 1 if bool(valid.any()) else 0
        lc = (length // seg) * seg
        for h in range(hp):
            pr, sc = perm[bi, h], scores[bi, h]
            assert torch.equal(pr[lc:], torch.arange(lc, n)), "tail must stay in place"
            assert bool((sc[lc:] == 0).all())
            for s0 in range(0, lc, seg):
                part = pr[s0 : s0 + seg]
                assert torch.equal(part.sort().values, torch.arange(s0, s0 + seg))
                ps = sc[part]
                assert bool((ps[:-1] >= ps[1:]).all()), "descending scores"
                ties = ps[:-1] == ps[1:]
                assert bool((part[:-1][ties] < part[1:][ties]).all()), "stable on ties"
            # the scores are a distribution over the valid complete-segment keys
            if lc and bool(valid[:lc].any()):
                assert bool((sc[:lc][~valid[:lc]] == 0).all())
                if causal_proxy:
                    for s0 in range(0, lc, seg):
                        if bool(valid[s0 : s0 + seg].any()):
                            assert abs(float(sc[s0 : s0 + seg].sum()) - 1.0) < 1e-4
                else:
                    assert abs(float(sc[:lc].sum()) - 1.0) < 1e-4


def test_permutation_stable_ties_exact():
    scores = torch.tensor([[[0.1, 0.3, 0.3, 0.0, 0.2, 0.2, 0.2, 0.2, 9.0, 8.0]]])
    perm = segment_permutation(scores, segment_size=4)
    assert perm[0, 0].tolist() == [1, 2, 0, 3, 4, 5, 6, 7, 8, 9]


@SETTINGS
@given(p=problems(), o=opts, threshold=st.floats(0.3, 0.95))
def test_permute_false_is_identity(p, o, threshold):
    o = dict(o, permute=False)
    out, sel = run(p, threshold, o)
    b, _, n, _ = p["q"].shape
    assert torch.equal(sel.permutation, torch.arange(n).expand_as(sel.permutation))
    again = permuted_block_attention(
        p["q"],
        p["k"],
        p["v"],
        torch.arange(n).expand_as(sel.permutation),
        sel.block_mask,
        key_padding_mask=p["kpm"],
        is_causal=o["is_causal"],
        block_size=p["bs"],
    )
    torch.testing.assert_close(out, again, rtol=0, atol=0)


# --------------------------------------------------------------------------- (e) block selection rule


def test_threshold_rule_by_hand():
    probs = torch.tensor([[0.1, 0.5, 0.15, 0.25]])
    cand = torch.ones(1, 4, dtype=torch.bool)
    assert threshold_blocks(probs, cand, 0.7).tolist() == [[False, True, False, True]]  # crosses at 0.75
    assert threshold_blocks(probs, cand, 0.8).tolist() == [[False, True, True, True]]
    assert threshold_blocks(probs, cand, 0.4).tolist() == [[False, True, False, False]]
    assert threshold_blocks(probs, cand, 1.0).tolist() == [[True] * 4]
    # ties go to the lower block index
    flat = torch.full((1, 4), 0.25)
    assert threshold_blocks(flat, cand, 0.5).tolist() == [[True, True, False, False]]
    # non-candidates are never kept, even at threshold 1; underflowed candidates kept at 1
    c2 = torch.tensor([[True, False, True, True]])
    p2 = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    assert threshold_blocks(p2, c2, 1.0).tolist() == [[True, False, True, True]]
    assert threshold_blocks(p2, c2, 0.999).tolist() == [[True, False, False, False]]
    none = torch.zeros(1, 4, dtype=torch.bool)
    assert threshold_blocks(torch.zeros(1, 4), none, 0.9).tolist() == [[False] * 4]


def _hand_example(n):
    """bs=2, S=4; q = 1, D = 1, scale = 1: the logit of key block J is its key value."""
    p = torch.tensor([0.1, 0.5, 0.15, 0.25])
    q = torch.ones(1, 1, n, 1)
    k = torch.zeros(1, 1, n, 1)
    for j in range(4):
        k[0, 0, 2 * j : 2 * j + 2, 0] = math.log(float(p[j]))
    return q, k


@pytest.mark.parametrize("n", [12, 10, 11], ids=["three-segments", "two-segments+tail", "tail-partial-block"])
@pytest.mark.parametrize("force_sink", [True, False], ids=["sink", "no-sink"])
def test_block_selection_by_hand(n, force_sink):
    q, k = _hand_example(n)
    perm = torch.arange(n).view(1, 1, n)
    nb = -(-n // 2)

    def rows(threshold, causal=True):
        bm = select_blocks(
            q,
            k,
            perm,
            is_causal=causal,
            scale=1.0,
            block_size=2,
            segment_size=4,
            threshold=threshold,
            force_sink=force_sink,
        )
        assert bm.shape == (1, 1, nb, nb)
        return [set(bm[0, 0, i].nonzero().squeeze(1).tolist()) for i in range(nb)]

    sink = {0} if force_sink else set()
    own2 = {4, 5} if n == 12 else set(range(4, nb))  # segment 2 or the tail region
    r = rows(0.7)
    assert r[0] == r[1] == {0, 1}  # first segment: no candidates, own segment only
    assert r[2] == r[3] == {1, 2, 3} | sink  # candidates {0, 1}: 5/6 on block 1 crosses at once
    assert r[4] == {1, 3} | own2 | sink  # 0.5 then 0.75 >= 0.7: the crossing block is kept
    assert rows(0.8)[4] == {1, 3, 2} | own2 | sink
    assert rows(0.4)[4] == {1} | own2 | sink
    assert rows(1.0)[4] == {0, 1, 2, 3} | own2
    # non-causal: every other region is a candidate
    rn = rows(1.0, causal=False)
    assert rn[0] == set(range(nb))
    probs = block_probabilities(
        q, k, perm, candidate_blocks(perm, 1, is_causal=True, block_size=2, segment_size=4), scale=1.0, block_size=2
    )
    torch.testing.assert_close(probs[0, 0, 4, :4], torch.tensor([0.1, 0.5, 0.15, 0.25]))
    torch.testing.assert_close(probs[0, 0, 2, :2], torch.tensor([1 / 6, 5 / 6]))
    assert float(probs[0, 0, 0].abs().sum()) == 0.0


def test_sink_follows_permutation():
    """The sink is the permuted block holding original token 0, wherever the sort put it."""
    n, bs, seg = 16, 2, 8
    q = torch.ones(1, 1, n, 1)
    k = torch.zeros(1, 1, n, 1)
    perm = torch.tensor([[[3, 4, 5, 6, 7, 0, 1, 2, 8, 9, 10, 11, 12, 13, 14, 15]]])
    bm = select_blocks(q, k, perm, scale=1.0, block_size=bs, segment_size=seg, threshold=0.01, force_sink=True)
    # query block 4 (segment 1): candidates are blocks 0-3 (flat probs: block 0 alone reaches
    # 0.01); the sink lives in permuted block 2
    assert set(bm[0, 0, 4].nonzero().squeeze(1).tolist()) == {0, 2, 4, 5, 6, 7}


def test_antidiagonal_scores_by_brute_force():
    gen = torch.Generator().manual_seed(3)
    n, bs, seg, s, d = 21, 4, 8, 2, 5
    q = torch.randn(1, 2, n, d, generator=gen)
    k = torch.randn(1, 1, n, d, generator=gen)
    kpm = torch.ones(1, n, dtype=torch.bool)
    kpm[0, [3, 9, 10]] = False
    scores = key_scores(q, k, key_padding_mask=kpm, block_size=bs, segment_size=seg)
    perm = segment_permutation(scores, segment_size=seg, key_padding_mask=kpm)
    cand = candidate_blocks(perm, 2, key_padding_mask=kpm, block_size=bs, segment_size=seg)
    got = block_probabilities(
        q, k, perm, cand, key_padding_mask=kpm, scale=0.7, block_size=bs, scoring="antidiagonal", antidiagonal_stride=s
    )
    nb = -(-n // bs)
    for h in range(2):
        pr = perm[0, h]
        for bi in range(nb):
            cands = cand[0, h, bi].nonzero().squeeze(1).tolist()
            if not cands:
                assert float(got[0, h, bi].abs().sum()) == 0
                continue
            qvalid = [i for i in range(bi * bs, min(n, bi * bs + bs)) if kpm[0, i]]
            if not qvalid:
                qvalid = list(range(bi * bs, min(n, bi * bs + bs)))
            mass = torch.zeros(nb, dtype=torch.float64)
            rows_used = 0
            for r in range(bs // s):
                logits = {}
                for kb in cands:
                    for c in range(bs // s):
                        vals = []
                        for t in range(s):
                            i = bi * bs + r * s + (s - 1 - t)
                            j = kb * bs + c * s + t
                            if i in qvalid and j < n and kpm[0, int(pr[j])]:
                                vals.append(float(q[0, h, i] @ k[0, 0, int(pr[j])]) * 0.7)
                        if vals:
                            logits[(kb, c)] = sum(vals) / len(vals)
                if not logits:
                    continue
                rows_used += 1
                m = max(logits.values())
                z = sum(math.exp(x - m) for x in logits.values())
                for (kb, _), x in logits.items():
                    mass[kb] += math.exp(x - m) / z
            want = mass / max(rows_used, 1)
            torch.testing.assert_close(got[0, h, bi].double(), want, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- (f) key padding


@SETTINGS
@given(p=problems(), o=opts, threshold=st.floats(0.3, 1.0))
def test_padded_keys_never_matter(p, o, threshold):
    if p["kpm"] is None:
        p["kpm"] = torch.rand(p["q"].shape[0], p["q"].shape[2]) > 0.4
    out, sel = run(p, threshold, o)
    assert bool(torch.isfinite(out).all())
    pad = ~p["kpm"]
    hq = p["q"].shape[1]
    assert not bool((sel.key_mask(hq) & pad[:, None, None, :]).any())
    k2, v2 = p["k"].clone(), p["v"].clone()
    k2.masked_fill_(pad[:, None, :, None], 7.0)
    v2.masked_fill_(pad[:, None, :, None], -9.0)
    out2, sel2 = run(dict(p, k=k2, v=v2), threshold, o)
    assert torch.equal(sel.block_mask, sel2.block_mask) and torch.equal(sel.permutation, sel2.permutation)
    torch.testing.assert_close(out, out2, rtol=0, atol=1e-6)


def test_fully_padded_rows_are_finite_zero():
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 37, 32, generator=gen)
    k = torch.randn(2, 1, 37, 32, generator=gen)
    v = torch.randn(2, 1, 37, 32, generator=gen)
    kpm = torch.ones(2, 37, dtype=torch.bool)
    kpm[0] = False  # every key padded
    kpm[1, :20] = False  # left padding: early queries see nothing (causal)
    for causal in (True, False):
        for thr in (0.5, 1.0):
            out, sel = pbs_attention(
                q,
                k,
                v,
                key_padding_mask=kpm,
                is_causal=causal,
                block_size=4,
                segment_size=8,
                threshold=thr,
                return_selection=True,
            )
            assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(sel.density).all())
            assert float(out[0].abs().max()) == 0.0
            if causal:
                assert float(out[1, :, :20].abs().max()) == 0.0
    # gradients stay finite through rows that see no key
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    pbs_attention(qg, kg, vg, key_padding_mask=kpm, block_size=4, segment_size=8, threshold=0.6).sum().backward()
    assert all(bool(torch.isfinite(t.grad).all()) for t in (qg, kg, vg))


@SETTINGS
@given(p=problems(padding=False), o=opts, threshold=st.floats(0.3, 0.97), data=st.data())
def test_right_padding_equals_truncated_sequence(p, o, threshold, data):
    q, k, v = p["q"], p["k"], p["v"]
    n = q.shape[2]
    length = data.draw(st.integers(1, n), label="valid length")
    kpm = torch.ones(q.shape[0], n, dtype=torch.bool)
    kpm[-1, length:] = False
    out, sel = run(dict(p, kpm=kpm), threshold, o)
    t, st_ = run(dict(p, q=q[-1:, :, :length], k=k[-1:, :, :length], v=v[-1:, :, :length], kpm=None), threshold, o)
    torch.testing.assert_close(out[-1:, :, :length], t, rtol=0, atol=1e-5)
    nb_t = st_.block_mask.shape[-1]
    assert torch.equal(sel.block_mask[-1:, :, :nb_t, :nb_t], st_.block_mask)


# --------------------------------------------------------------------------- (g) causality


@SETTINGS
@given(p=problems(), o=opts, threshold=st.floats(0.2, 0.97), data=st.data())
def test_causal_proxy_future_keys_change_nothing_before(p, o, threshold, data):
    o = dict(o, causal_proxy=True, is_causal=True)
    q, k, v = p["q"], p["k"], p["v"]
    n = q.shape[2]
    t = data.draw(st.integers(0, n - 1), label="t")
    gen = torch.Generator().manual_seed(t)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, t + 1 :] = torch.randn(k2[:, :, t + 1 :].shape, generator=gen).to(k.dtype) * 3
    v2[:, :, t + 1 :] = torch.randn(v2[:, :, t + 1 :].shape, generator=gen).to(v.dtype)
    out, _ = run(p, threshold, o)
    out2, _ = run(dict(p, k=k2, v=v2), threshold, o)
    torch.testing.assert_close(out[:, :, : t + 1], out2[:, :, : t + 1], rtol=0, atol=2e-6)


# --------------------------------------------------------------------------- (h) GQA kv_head


@SETTINGS
@given(p=problems(), causal_proxy=st.booleans(), threshold=st.floats(0.3, 0.97))
def test_kv_head_permutation_shared_by_group(p, causal_proxy, threshold):
    q, k, kpm, bs, seg = p["q"], p["k"], p["kpm"], p["bs"], p["seg"]
    b, hq, n, _ = q.shape
    hkv = k.shape[1]
    per_q = key_scores(q, k, key_padding_mask=kpm, block_size=bs, segment_size=seg, causal_proxy=causal_proxy)
    per_kv = key_scores(
        q,
        k,
        key_padding_mask=kpm,
        block_size=bs,
        segment_size=seg,
        causal_proxy=causal_proxy,
        gqa_permutation="kv_head",
    )
    assert per_kv.shape == (b, hkv, n)
    torch.testing.assert_close(per_kv, per_q.view(b, hkv, hq // hkv, n).mean(dim=2))
    o = dict(
        is_causal=True,
        gqa_permutation="kv_head",
        scoring="mean",
        causal_proxy=causal_proxy,
        force_sink=True,
        permute=True,
    )
    out, sel = run(p, threshold, o)
    assert sel.permutation.shape == (b, hkv, n)
    assert torch.equal(sel.permutation, segment_permutation(per_kv, segment_size=seg, key_padding_mask=kpm))
    # the block mask is still per query head; the dense key mask expands the shared permutation
    ref = dense64(q, k, p["v"], key_mask=sel.key_mask(hq))
    assert float((out.double() - ref).abs().max()) <= 2e-5


# --------------------------------------------------------------------------- (i) permutation invariance


@SETTINGS
@given(p=problems(), o=opts, threshold=st.floats(0.2, 0.97))
def test_permuted_layout_oracle_agrees(p, o, threshold):
    """Attention computed on explicitly permuted K/V rows with the element mask by original
    position equals the op: the permutation and the element mask agree."""
    out, sel = run(p, threshold, o)
    q, k, v, kpm, bs = p["q"], p["k"], p["v"], p["kpm"], p["bs"]
    b, hq, n, d = q.shape
    g = hq // k.shape[1]
    hp = sel.permutation.shape[1]
    nb = sel.block_mask.shape[-1]
    blk = torch.arange(n) // bs
    for bi in range(b):
        for h in range(hq):
            perm = sel.permutation[bi, h // (hq // hp)]
            kp, vp = k[bi, h // g, perm].double(), v[bi, h // g, perm].double()
            allowed = sel.block_mask[bi, h][blk][:, blk]  # [Nq, slot]
            if o["is_causal"]:
                allowed = allowed & (perm[None, :] <= torch.arange(n)[:, None])
            if kpm is not None:
                allowed = allowed & kpm[bi, perm][None, :]
            logits = (q[bi, h].double() @ kp.T / math.sqrt(d)).masked_fill(~allowed, float("-inf"))
            ref = torch.softmax(logits, -1).nan_to_num(0.0) @ vp
            assert float((out[bi, h].double() - ref).abs().max()) <= 2e-5
    assert nb == -(-n // bs)


@SETTINGS
@given(p=problems(padding=False), o=opts, threshold=st.floats(0.2, 0.97), data=st.data())
def test_shuffling_a_segment_changes_nothing_after_it(p, o, threshold, data):
    """Property 4: attention is invariant to the order of the keys of an earlier segment."""
    o = dict(o, permute=True)  # (without the sort, block contents follow the shuffle)
    q, k, v, seg = p["q"], p["k"], p["v"], p["seg"]
    n = q.shape[2]
    n_seg = n // seg
    if n_seg == 0:
        return
    s = data.draw(st.integers(0, n_seg - 1), label="segment")
    gen = torch.Generator().manual_seed(s)
    lo = s * seg + (1 if s == 0 else 0)  # keep token 0 (the sink) where it is
    sigma = torch.arange(n)
    sigma[lo : (s + 1) * seg] = lo + torch.randperm((s + 1) * seg - lo, generator=gen)
    out, _ = run(p, threshold, o)
    out2, _ = run(dict(p, k=k[:, :, sigma], v=v[:, :, sigma]), threshold, o)
    after = (s + 1) * seg if o["is_causal"] else 0
    torch.testing.assert_close(out[:, :, after:], out2[:, :, after:], rtol=0, atol=2e-6)


# --------------------------------------------------------------------------- (j) dtypes


@FEW
@given(p=problems(dtypes=(torch.float16, torch.bfloat16)), o=opts, threshold=st.floats(0.3, 0.97))
def test_half_precision_outputs(p, o, threshold):
    out, sel = run(p, threshold, o)
    assert out.dtype == p["q"].dtype
    assert not bool(torch.isnan(out).any()) and bool(torch.isfinite(out).all())
    ref = dense64(p["q"], p["k"], p["v"], is_causal=o["is_causal"], key_mask=sel.key_mask(p["q"].shape[1]))
    assert float((out.double() - ref).abs().max()) <= (2e-2 if p["q"].dtype == torch.bfloat16 else 3e-3)


# --------------------------------------------------------------------------- gradients


@FEW
@given(p=problems(max_n=60), threshold=st.sampled_from([0.5, 1.0]), causal=st.booleans())
def test_gradients_match_masked_dense(p, threshold, causal):
    q, k, v = (t.clone().requires_grad_(True) for t in (p["q"], p["k"], p["v"]))
    out, sel = pbs_attention(
        q,
        k,
        v,
        key_padding_mask=p["kpm"],
        is_causal=causal,
        block_size=p["bs"],
        segment_size=p["seg"],
        threshold=threshold,
        return_selection=True,
    )
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    q2, k2, v2 = (t.detach().double().requires_grad_(True) for t in (p["q"], p["k"], p["v"]))
    ref = dense64(q2, k2, v2, is_causal=causal, key_mask=sel.key_mask(q.shape[1]))
    ref_grads = torch.autograd.grad((ref * w.double()).sum(), (q2, k2, v2))
    for g_, r_ in zip(grads, ref_grads):
        assert float((g_.double() - r_).abs().max()) <= 1e-4


def test_pbs_selection_is_the_attentions_selection():
    """pbs_selection (the selection alone, as calibrate's costs use it) is what pbs_attention selects."""
    from sparseflow.config import PBSConfig
    from sparseflow.methods.pbs.block_selection import selection_density
    from sparseflow.methods.pbs.reference import pbs_attention, pbs_selection, pbs_selections

    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, h, 128, 16, generator=gen) * 3 for h in (4, 2, 2))  # peaked: not everything kept
    kpm = torch.ones(2, 128, dtype=torch.bool)
    kpm[1, 110:] = False
    for cfg in (
        PBSConfig(block_size=16, segment_size=32, threshold=0.3, scoring="sampled_rows"),
        PBSConfig(block_size=16, segment_size=32, threshold=0.5, permute=False, scoring="mean"),
        PBSConfig(block_size=16, segment_size=32, threshold=0.4, gqa_permutation="kv_head"),
    ):
        _, sel = pbs_attention(q, k, v, cfg, key_padding_mask=kpm, return_selection=True)
        perm, mask = pbs_selection(q, k, cfg, key_padding_mask=kpm)
        assert torch.equal(perm, sel.permutation) and torch.equal(mask, sel.block_mask)
        density = selection_density(mask, perm, key_padding_mask=kpm, block_size=16)
        assert torch.equal(density, sel.density) and 0 < float(density.mean()) < 1
        # several thresholds from one estimate: each the selection of its own config
        thresholds = (0.2, cfg.threshold, 0.95, 1.0)
        perm_all, masks = pbs_selections(q, k, cfg, thresholds, key_padding_mask=kpm)
        assert torch.equal(perm_all, perm) and len(masks) == 4
        for t, m in zip(thresholds, masks):
            assert torch.equal(m, pbs_selection(q, k, cfg.replace(threshold=t), key_padding_mask=kpm)[1])
        assert (
            masks[0].sum() <= masks[2].sum() <= masks[3].sum() and masks[0].sum() < masks[3].sum()
        )  # nested, and differ
    from types import SimpleNamespace  # a config PBSConfig itself would refuse

    with pytest.raises(ValueError, match="gqa_permutation must be"):
        pbs_selection(q, k, SimpleNamespace(gqa_permutation="x", threshold=0.5))
