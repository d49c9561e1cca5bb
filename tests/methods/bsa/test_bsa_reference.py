"""Properties of the plain-PyTorch BSA (full-scan block selection) reference.

Oracles: brute-force top-K over per-block mean scores in fp64 (Python loops), and masked dense
attention in fp64 built from the op's own reported selection (``Selection.key_mask``).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparseflow.methods.bsa.reference import bsa_attention, bsa_select
from sparseflow.methods.pisa.reference import pisa_select

SETTINGS = dict(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
LENGTHS = [1, 2, 5, 13, 31, 47, 64, 77, 97, 111, 127, 149, 160, 211]
NEAR_TIE = 1e-4


# --------------------------------------------------------------------------- helpers


def make_qkv(seed, b, hq, hkv, nq, nk, d, dtype):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, nq, d, generator=gen).to(dtype)
    k = torch.randn(b, hkv, nk, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, nk, d, generator=gen).to(dtype)
    return q, k, v


def make_padding(kind, b, nk, seed):
    if kind == "none":
        return None
    gen = torch.Generator().manual_seed(seed + 7)
    lengths = torch.randint(0, nk + 1, (b,), generator=gen)
    lengths[-1] = nk
    j = torch.arange(nk)
    if kind == "right":
        return j[None, :] < lengths[:, None]
    if kind == "left":
        return j[None, :] >= (nk - lengths)[:, None]
    return torch.rand(b, nk, generator=gen) < 0.7


def visible(nq, nk, causal, kpm, b):
    p = torch.arange(nq)[:, None] + (nk - nq)
    j = torch.arange(nk)[None, :]
    vis = (j <= p) if causal else torch.ones(nq, nk, dtype=torch.bool)
    vis = vis[None].expand(b, nq, nk)
    if kpm is not None:
        vis = vis & kpm[:, None, :]
    return vis


def masked_dense(q, k, v, mask, scale=None):
    b, hq, nq, d = q.shape
    g = hq // k.shape[1]
    scale = 1 / math.sqrt(d) if scale is None else scale
    kk = k.double().repeat_interleave(g, 1)
    vv = v.double().repeat_interleave(g, 1)
    logits = (q.double() @ kk.transpose(-1, -2)) * scale
    w = torch.softmax(logits.masked_fill(~mask, -math.inf), -1).nan_to_num(0.0)
    w = torch.where(mask.any(-1, keepdim=True), w, torch.zeros_like(w))
    return w @ vv


def forced_blocks_oracle(p, nk, C, force_sink, force_previous, vis_blocks):
    if not 0 <= p < nk:
        return {0} if force_sink and 0 in vis_blocks else set()
    cur = p // C
    cand = [cur] + ([cur - 1] if force_previous and cur >= 1 else []) + ([0] if force_sink else [])
    return {c for c in cand if c in vis_blocks}


def rows(idx):
    return [c for c in idx.tolist() if c >= 0]


def brute_force(q, k, kpm, *, C, K, causal, force_sink, force_previous, i, bi, hi, scale=None):
    """Selection of query ``i`` by a plain loop over every visible block, fp64; also returns the
    per-block scores and the forced set."""
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    g = hq // hkv
    scale = 1 / math.sqrt(d) if scale is None else scale
    vis = visible(nq, nk, causal, kpm, b)[bi, i]
    js = torch.nonzero(vis).flatten()
    blocks = sorted(set((js // C).tolist()))
    forced = forced_blocks_oracle(i + nk - nq, nk, C, force_sink, force_previous, set(blocks))
    qh = q[bi, hi * g : (hi + 1) * g, i].double()
    scores = {}
    for blk in blocks:
        if blk in forced:
            continue
        keys = [j for j in range(blk * C, min((blk + 1) * C, nk)) if kpm is None or bool(kpm[bi, j])]
        kbar = k[bi, hi, keys].double().mean(0)
        scores[blk] = float((qh @ kbar).sum() * scale)
    rest = sorted(scores, key=lambda c: (-scores[c], c))
    free = max(0, K - len(forced))
    return sorted(list(forced) + rest[:free]), scores, forced, blocks


# --------------------------------------------------------------------------- strategies


@st.composite
def cases(draw, *, causal=None, max_n=211, padding=True):
    hkv = draw(st.sampled_from([1, 2]))
    g_heads = draw(st.sampled_from([1, 3]))
    b = draw(st.sampled_from([1, 2]))
    is_causal = draw(st.booleans()) if causal is None else causal
    nk = draw(st.sampled_from([n for n in LENGTHS if n <= max_n]) | st.integers(1, max_n))
    nq = nk if is_causal else draw(st.sampled_from([1, max(1, nk // 3), nk]))
    d = draw(st.sampled_from([32, 48, 64, 96] if nk > 64 else [32, 64, 80, 128, 256]))
    C = draw(st.sampled_from([3, 4, 7, 8, 16]))
    force_sink = draw(st.booleans())
    force_previous = draw(st.booleans())
    K = draw(st.integers(1 + force_sink + force_previous, 6))
    pad = draw(st.sampled_from(["none", "right", "left", "random"])) if padding else "none"
    return dict(
        b=b,
        hq=hkv * g_heads,
        hkv=hkv,
        nq=nq,
        nk=nk,
        d=d,
        C=C,
        K=K,
        is_causal=is_causal,
        force_sink=force_sink,
        force_previous=force_previous,
        pad=pad,
        seed=draw(st.integers(0, 2**16)),
        dtype=draw(st.sampled_from(DTYPES)),
    )


def kwargs_of(c, **over):
    kw = dict(
        is_causal=c["is_causal"],
        block_size=c["C"],
        top_k=c["K"],
        force_sink=c["force_sink"],
        force_previous=c["force_previous"],
    )
    kw.update(over)
    return kw


def inputs_of(c):
    q, k, v = make_qkv(c["seed"], c["b"], c["hq"], c["hkv"], c["nq"], c["nk"], c["d"], c["dtype"])
    return q, k, v, make_padding(c["pad"], c["b"], c["nk"], c["seed"])


# --------------------------------------------------------------------------- (1) exact mode


@settings(**SETTINGS)
@given(c=cases(padding=False))
def test_exact_mode_matches_dense_sdpa(c):
    q, k, v, _ = inputs_of(c)
    nb = -(-c["nk"] // c["C"])
    out = bsa_attention(q, k, v, **kwargs_of(c, top_k=max(nb, c["K"])))
    assert out.dtype == q.dtype and out.shape == q.shape
    g = c["hq"] // c["hkv"]
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=c["is_causal"], enable_gqa=g > 1)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=c["is_causal"], enable_gqa=g > 1)
    err = (out.double() - ref).abs().max().item()
    err_sdpa = (sdpa.double() - ref).abs().max().item()
    floor = 2 * torch.finfo(c["dtype"]).eps * max(1.0, ref.abs().max().item())  # ~1 ulp of the output
    assert err <= 2 * err_sdpa + floor, (err, err_sdpa)


# --------------------------------------------------------------------------- (2) masked-dense oracle


@settings(**SETTINGS)
@given(c=cases())
def test_sparse_output_equals_masked_dense_on_own_selection(c):
    q, k, v, kpm = inputs_of(c)
    out, sel = bsa_attention(q, k, v, key_padding_mask=kpm, return_selection=True, **kwargs_of(c))
    assert sel.method == "bsa" and sel.block_size == c["C"] and sel.num_keys == c["nk"]
    idx = sel.block_indices
    assert torch.equal(idx, bsa_select(q, k, key_padding_mask=kpm, **kwargs_of(c)))
    g = c["hq"] // c["hkv"]
    vis = visible(c["nq"], c["nk"], c["is_causal"], kpm, c["b"])
    block_of = torch.arange(c["nk"]) // c["C"]
    mine = torch.zeros(c["b"], c["hkv"], c["nq"], c["nk"], dtype=torch.bool)
    for bi in range(c["b"]):
        for hi in range(c["hkv"]):
            for i in range(c["nq"]):
                mine[bi, hi, i] = torch.isin(block_of, torch.tensor(rows(idx[bi, hi, i]), dtype=torch.long))
    mine = mine.repeat_interleave(g, 1) & vis[:, None]
    assert torch.equal(sel.key_mask(c["hq"]), mine)
    err = (out.double() - masked_dense(q, k, v, mine)).abs().max().item() if out.numel() else 0.0
    assert err <= TOL[c["dtype"]], err
    for bi in range(c["b"]):
        nvis = torch.tensor(
            [len(set((torch.nonzero(vis[bi, i]).flatten() // c["C"]).tolist())) for i in range(c["nq"])],
            dtype=torch.float64,
        )
        has = nvis > 0
        for h in range(c["hq"]):
            nsel = (idx[bi, h // g] >= 0).sum(-1).double()
            want = (nsel[has] / nvis[has]).mean().item() if bool(has.any()) else 0.0
            assert abs(sel.density[bi, h].item() - want) < 1e-5


# --------------------------------------------------------------------------- (3) causality


@settings(**SETTINGS)
@given(c=cases(causal=True), frac=st.floats(0.0, 1.0))
def test_causality_future_keys_change_nothing(c, frac):
    q, k, v, kpm = inputs_of(c)
    t = min(c["nk"] - 1, int(frac * c["nk"]))
    gen = torch.Generator().manual_seed(c["seed"] + 1)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, t + 1 :] = (torch.randn(k2[:, :, t + 1 :].shape, generator=gen) * 3).to(k.dtype)
    v2[:, :, t + 1 :] = torch.randn(v2[:, :, t + 1 :].shape, generator=gen).to(v.dtype)
    o1, s1 = bsa_attention(q, k, v, key_padding_mask=kpm, return_selection=True, **kwargs_of(c))
    o2, s2 = bsa_attention(q, k2, v2, key_padding_mask=kpm, return_selection=True, **kwargs_of(c))
    assert torch.equal(s1.block_indices[:, :, : t + 1], s2.block_indices[:, :, : t + 1])
    torch.testing.assert_close(o1[:, :, : t + 1], o2[:, :, : t + 1], rtol=0, atol=0)


def test_causality_with_padded_current_block():
    b, hq, hkv, n, d, C = 1, 3, 1, 203, 32, 4
    q, k, v = make_qkv(3, b, hq, hkv, n, n, d, torch.float32)
    gen = torch.Generator().manual_seed(1)
    kpm = torch.rand(b, n, generator=gen) < 0.5
    kw = dict(block_size=C, top_k=2, force_sink=False, force_previous=False)
    idx = bsa_select(q, k, key_padding_mask=kpm, **kw)
    ts = [t for t in range(n) if not bool(kpm[0, (t // C) * C : t + 1].any())]
    assert len(ts) > 20
    for t in ts[::3]:
        k2 = k.clone()
        k2[:, :, t + 1 :] = torch.randn(k2[:, :, t + 1 :].shape, generator=gen) * 10
        assert torch.equal(idx[:, :, : t + 1], bsa_select(q, k2, key_padding_mask=kpm, **kw)[:, :, : t + 1]), t
        assert t // C not in rows(idx[0, 0, t])


# --------------------------------------------------------------------------- (5) selection


@settings(**SETTINGS)
@given(c=cases(max_n=160), data=st.data())
def test_selection_equals_brute_force_top_k(c, data):
    """Exactly min(K, visible) distinct visible blocks, forced included, ascending, -1 padded,
    and equal to brute-force top-K over q.mean(K_block) summed over the group's heads."""
    q, k, v, kpm = inputs_of(c)
    idx = bsa_select(q, k, key_padding_mask=kpm, **kwargs_of(c))
    width = min(c["K"], -(-c["nk"] // c["C"]))  # never wider than the blocks that exist
    assert idx.shape == (c["b"], c["hkv"], c["nq"], width) and idx.dtype == torch.int64
    nq = c["nq"]
    queries = sorted(set(data.draw(st.lists(st.integers(0, nq - 1), min_size=1, max_size=8))) | {0, nq - 1})
    for bi in range(c["b"]):
        for hi in range(c["hkv"]):
            for i in queries:
                want, scores, forced, blocks = brute_force(
                    q,
                    k,
                    kpm,
                    C=c["C"],
                    K=c["K"],
                    causal=c["is_causal"],
                    force_sink=c["force_sink"],
                    force_previous=c["force_previous"],
                    i=i,
                    bi=bi,
                    hi=hi,
                )
                row = idx[bi, hi, i].tolist()
                got = rows(idx[bi, hi, i])
                assert row == got + [-1] * (width - len(got))
                assert got == sorted(set(got)) and set(got) <= set(blocks)
                assert len(got) == min(c["K"], len(blocks)) and forced <= set(got)
                if got != want:  # only a floating-point near-tie may separate them
                    free_got = [scores[x] for x in got if x not in forced]
                    free_out = [scores[x] for x in scores if x not in got]
                    assert min(free_got) >= max(free_out) - NEAR_TIE, (got, want)


@settings(**SETTINGS)
@given(c=cases(max_n=160))
def test_bsa_equals_unpruned_pisa_with_mean_score(c):
    """PISA-1 scores leaves by q.mean(K_block) too: when nothing is pruned above the leaves
    (g*K >= #blocks) the two selectors must agree."""
    q, k, v, kpm = inputs_of(c)
    nb = -(-c["nk"] // c["C"])
    g = max(2, -(-nb // c["K"]))
    a = bsa_select(q, k, key_padding_mask=kpm, **kwargs_of(c))
    p = pisa_select(q, k, key_padding_mask=kpm, branching=g, score="mean", **kwargs_of(c))
    diff = (a != p).any(-1).nonzero().tolist()
    for bi, hi, i in diff:  # only a floating-point near-tie may separate them
        _, scores, forced, _ = brute_force(
            q,
            k,
            kpm,
            C=c["C"],
            K=c["K"],
            causal=c["is_causal"],
            force_sink=c["force_sink"],
            force_previous=c["force_previous"],
            i=i,
            bi=bi,
            hi=hi,
        )
        for sel in (a, p):
            got = rows(sel[bi, hi, i])
            free_got = [scores[x] for x in got if x not in forced]
            free_out = [scores[x] for x in scores if x not in got]
            assert min(free_got) >= max(free_out) - NEAR_TIE
    assert len(diff) <= 2


def test_ties_go_to_the_lower_block_index():
    n, C = 64, 4
    k = torch.ones(1, 1, n, 8)
    q = torch.randn(1, 3, n, 8)
    idx = bsa_select(q, k, block_size=C, top_k=4)
    assert rows(idx[0, 0, n - 1]) == [0, 1, 14, 15]
    assert rows(idx[0, 0, 40]) == [0, 1, 9, 10]
    assert rows(idx[0, 0, 5]) == [0, 1]


def test_gqa_selection_uses_every_head_of_the_group():
    """Head 0 alone prefers block X, the group sum prefers block Y: the shared selection must
    follow the sum (a selector that scored one head, or averaged differently, fails)."""
    C, nb, d = 4, 6, 4
    k = torch.zeros(1, 1, nb * C, d)
    X, Y = 1, 2
    k[0, 0, X * C : (X + 1) * C, 0] = 2.0  # head 0: +2, head 1: 0, head 2: 0   -> sum 2
    k[0, 0, Y * C : (Y + 1) * C, 0] = 1.0  # head 0: +1, heads 1, 2: +1 each     -> sum 3
    k[0, 0, Y * C : (Y + 1) * C, 1] = 1.0
    n = nb * C
    q = torch.zeros(1, 3, n, d)
    q[:, 0, :, 0] = 1.0
    q[:, 1, :, 1] = 1.0
    q[:, 2, :, 1] = 1.0
    idx = bsa_select(q, k, block_size=C, top_k=4, scale=1.0)
    assert rows(idx[0, 0, n - 1]) == [0, Y, 4, 5]
    idx0 = bsa_select(q[:, :1], k, block_size=C, top_k=4, scale=1.0)
    assert rows(idx0[0, 0, n - 1]) == [0, X, 4, 5]


# --------------------------------------------------------------------------- (7) robustness


@settings(**SETTINGS)
@given(c=cases())
def test_no_nan_and_fully_padded_rows_output_zero(c):
    q, k, v, kpm = inputs_of(c)
    kpm = (torch.ones(c["b"], c["nk"], dtype=torch.bool) if kpm is None else kpm).clone()
    kpm[0] = False
    out, sel = bsa_attention(q, k, v, key_padding_mask=kpm, return_selection=True, **kwargs_of(c))
    assert torch.isfinite(out).all() and (out[0] == 0).all()
    assert (sel.block_indices[0] == -1).all() and torch.isfinite(sel.density).all()


@pytest.mark.parametrize("pad", ["none", "right", "random"])
def test_decode_matches_last_row_of_causal_prefill(pad):
    b, hq, hkv, n, d, C = 2, 6, 2, 301, 64, 8
    q, k, v = make_qkv(11, b, hq, hkv, n, n, d, torch.float32)
    kpm = make_padding(pad, b, n, 5)
    kw = dict(block_size=C, top_k=6)
    o_pre, s_pre = bsa_attention(q, k, v, key_padding_mask=kpm, is_causal=True, return_selection=True, **kw)
    o_dec, s_dec = bsa_attention(q[:, :, -1:], k, v, key_padding_mask=kpm, is_causal=False, return_selection=True, **kw)
    assert o_dec.shape == (b, hq, 1, d)
    assert torch.equal(s_dec.block_indices, s_pre.block_indices[:, :, -1:])
    torch.testing.assert_close(o_dec, o_pre[:, :, -1:], rtol=1e-5, atol=1e-6)


def test_decode_long_context_shape():
    q, k, v = make_qkv(2, 1, 9, 3, 1, 3001, 64, torch.float16)
    out, sel = bsa_attention(q, k, v, is_causal=False, block_size=64, top_k=8, return_selection=True)
    assert out.shape == (1, 9, 1, 64) and out.dtype == torch.float16 and torch.isfinite(out).all()
    got = rows(sel.block_indices[0, 1, 0])
    assert len(got) == 8 and {0, 45, 46} <= set(got)
    assert sel.density[0, 4].item() == pytest.approx(8 / 47)


def test_gradients_match_masked_dense_on_same_selection():
    q, k, v = make_qkv(4, 2, 6, 2, 41, 41, 32, torch.float32)
    kpm = make_padding("right", 2, 41, 3)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out, sel = bsa_attention(q, k, v, key_padding_mask=kpm, block_size=4, top_k=3, return_selection=True)
    out.square().sum().backward()
    qd, kd, vd = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    masked_dense(qd, kd, vd, sel.key_mask(6)).square().sum().backward()
    for t, td in ((q, qd), (k, kd), (v, vd)):
        assert t.grad is not None and torch.isfinite(t.grad).all()
        torch.testing.assert_close(t.grad.double(), td.grad, rtol=1e-4, atol=1e-5)
