"""PBS proxy_blocks (issue 8): P query blocks spread over the sequence score the keys.

Conventions under test (sparseflow/methods/pbs/permutation.py, module docstring): proxy j = 1..P is
the valid query block ending the first j/P of the valid query blocks; the last is the paper's
proxy (last block_size valid queries, every complete segment); an earlier proxy sees only the
complete segments strictly before its own; a key's score is the mean of the probabilities of
the proxies that see it; proxy_blocks=1 is bit-identical to the single proxy.
"""

import math
import os
from typing import Optional

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import sparseflow  # noqa: E402
from sparseflow import PBSConfig  # noqa: E402
from sparseflow.config import config_from_dict  # noqa: E402
from sparseflow.methods.pbs.permutation import key_scores, proxy_queries, segment_permutation  # noqa: E402
from sparseflow.methods.pbs.reference_common import effective_lengths, safe_softmax  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


# --------------------------------------------------------------------------- the single proxy before issue 8
# A frozen copy of the reference's key_scores as it was before proxy_blocks existed (commit
# 792ba16): proxy_blocks=1 must reproduce it bit for bit.


@torch.no_grad()
def _key_scores_before(
    q,
    k,
    *,
    key_padding_mask=None,
    scale=None,
    block_size=128,
    segment_size=256,
    causal_proxy=False,
    gqa_permutation="query_head",
):
    bsz, hq, n, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    sc = 1.0 / math.sqrt(d) if scale is None else float(scale)
    lengths = effective_lengths(key_padding_mask, bsz, n, q.device).tolist()
    out = torch.zeros(bsz, hq, n, dtype=torch.float32, device=q.device)
    for b in range(bsz):
        n_seg = lengths[b] // segment_size
        lc = n_seg * segment_size
        if lc == 0:
            continue
        if key_padding_mask is None:
            proxy = torch.arange(max(0, n - block_size), n, device=q.device)
            key_ok = None
        else:
            proxy = key_padding_mask[b].bool().nonzero().squeeze(1)[-block_size:]
            key_ok = key_padding_mask[b, :lc].bool()
        p = proxy.numel()
        if p == 0:
            continue
        for kvh in range(hkv):
            kc = k[b, kvh, :lc].float()
            for h in range(kvh * g, (kvh + 1) * g):
                qp = q[b, h].index_select(0, proxy).float()
                logits = torch.matmul(qp, kc.t()) * sc
                if key_ok is not None:
                    logits.masked_fill_(~key_ok, float("-inf"))
                if causal_proxy:
                    probs = safe_softmax(logits.view(p, n_seg, segment_size)).view(p, lc)
                else:
                    probs = safe_softmax(logits)
                out[b, h, :lc] = probs.mean(dim=0)
    if gqa_permutation == "kv_head":
        out = out.view(bsz, hkv, g, n).mean(dim=2)
    return out


def _random(b, hq, hkv, n, d, seed, pad: bool):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, d, generator=g)
    k = torch.randn(b, hkv, n, d, generator=g)
    v = torch.randn(b, hkv, n, d, generator=g)
    kpm: Optional[torch.Tensor] = None
    if pad:
        kpm = torch.rand(b, n, generator=g) > 0.25  # holes everywhere
        kpm[0, n - n // 3 :] = False  # right padding
        if b > 1:
            kpm[1, :5] = False  # left padding
        if b > 2:
            kpm[2] = False  # an all-padded row
    return q, k, v, kpm


@pytest.mark.parametrize("seed", range(6))
def test_default_is_bit_identical_to_the_single_proxy(seed):
    g = torch.Generator().manual_seed(100 + seed)
    n = int(torch.randint(9, 140, (1,), generator=g))
    bs, seg = [(4, 8), (8, 16), (4, 16), (8, 8)][seed % 4]
    q, k, _, kpm = _random(3, 6, 2, n, 8, seed, pad=seed % 2 == 1)
    for cp in (False, True):
        for gqa in ("query_head", "kv_head"):
            kw = dict(key_padding_mask=kpm, block_size=bs, segment_size=seg, causal_proxy=cp, gqa_permutation=gqa)
            before = _key_scores_before(q, k, **kw)
            assert torch.equal(key_scores(q, k, **kw), before)
            assert torch.equal(key_scores(q, k, proxy_blocks=1, **kw), before)
    assert PBSConfig().proxy_blocks == 1


def _far_back_case():
    """bs 4, segment 8, N 64 (16 blocks, 8 segments). Key 2 (segment 0) is what the queries of
    block 7 (positions 28..31, the middle proxy for P=2) look at; key 5 (segment 0) is what the
    last block's queries look at, mildly. Every other key is small noise."""
    g = torch.Generator().manual_seed(0)
    n, d = 64, 8
    q = 0.01 * torch.randn(1, 1, n, d, generator=g)
    k = 0.01 * torch.randn(1, 1, n, d, generator=g)
    e = torch.eye(d)
    k[0, 0, 2] = 6.0 * e[0]
    k[0, 0, 5] = 1.0 * e[1]
    q[0, 0, 28:32] = 6.0 * e[0]
    q[0, 0, 60:64] = 3.0 * e[1]
    return q, k, torch.randn(1, 1, n, d, generator=g)


def test_early_proxy_promotes_a_far_back_key():
    q, k, v = _far_back_case()
    kw = dict(block_size=4, segment_size=8)
    assert [r.tolist() for r, _ in proxy_queries(None, 1, 64, proxy_blocks=2, **kw)[0]] == [
        [28, 29, 30, 31],
        [60, 61, 62, 63],
    ]
    s1 = key_scores(q, k, **kw)
    s2 = key_scores(q, k, proxy_blocks=2, **kw)
    p1 = segment_permutation(s1, segment_size=8)
    p2 = segment_permutation(s2, segment_size=8)
    assert p1[0, 0, 0].item() == 5  # the last block alone ranks key 5 first in segment 0
    assert p2[0, 0, 0].item() == 2  # the middle proxy brings key 2 to the front
    assert p2[0, 0, 1].item() == 5
    # the whole op carries the option: its permutation is the one above
    for backend in ("reference", "triton"):
        qkv = [t.to(DEV if backend == "triton" else "cpu") for t in (q, k, v)]
        with sparseflow.capture() as cap:
            sparseflow.attention(*qkv, config=PBSConfig(block_size=4, segment_size=8, proxy_blocks=2), backend=backend)
        assert cap.calls[0].selection.permutation[0, 0, 0].item() == 2, backend
        with sparseflow.capture() as cap:
            sparseflow.attention(*qkv, config=PBSConfig(block_size=4, segment_size=8), backend=backend)
        assert cap.calls[0].selection.permutation[0, 0, 0].item() == 5, backend


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("causal_proxy", [False, True])
def test_proxies_never_see_their_own_or_later_segments(pad, causal_proxy):
    """For each earlier proxy: zero the queries of every other proxy (their probabilities become
    uniform, independent of the keys), poison every key from the start of the tested proxy's
    segment on with huge values: no score may change (not even the poisoned keys': only the
    uniform proxies see them). A proxy that saw its own segment would put its mass on the poison."""
    bs, seg, n = 4, 8, 70
    q, k, _, kpm = _random(2, 2, 1, n, 8, seed=3, pad=pad)
    kw = dict(key_padding_mask=kpm, block_size=bs, segment_size=seg, causal_proxy=causal_proxy, proxy_blocks=4)
    plan = proxy_queries(kpm, 2, n, block_size=bs, segment_size=seg, proxy_blocks=4)
    tested = 0
    for b in range(2):
        assert len(plan[b]) >= 3
        for j, (rows, seen) in enumerate(plan[b][:-1]):
            start = (int(rows.min()) // seg) * seg  # first position of the proxy's own segment
            assert seen * seg <= start
            qz = q.clone()
            for i, (other, _) in enumerate(plan[b]):
                if i != j:
                    qz[b, :, other] = 0.0
            qz[b, :, rows] = q[b, :, rows]  # (the last proxy may overlap the tested block)
            base = key_scores(qz, k, **kw)[b]
            kp = k.clone()
            kp[b, :, start:] = 1e4 * torch.randn(kp[b, :, start:].shape, generator=torch.Generator().manual_seed(j))
            kp[b, :, start:, 0] = 1e4  # and aligned with the proxy's queries somewhere
            poisoned = key_scores(qz, kp, **kw)[b]
            # every other proxy is uniform over what it sees, so even the poisoned keys' scores stay
            torch.testing.assert_close(poisoned, base, rtol=1e-5, atol=1e-7)
            tested += 1
    assert tested >= 4


def test_proxies_are_spread_and_deduplicated():
    kw = dict(block_size=4, segment_size=8)
    plan = proxy_queries(None, 1, 64, proxy_blocks=4, **kw)[0]
    assert [(r.tolist()[0], s) for r, s in plan] == [(12, 1), (28, 3), (44, 5), (60, 8)]
    # more proxies than blocks that can see anything: duplicates and blind ones are dropped
    plan = proxy_queries(None, 1, 20, proxy_blocks=50, **kw)[0]
    assert [(r.tolist(), s) for r, s in plan] == [([8, 9, 10, 11], 1), ([12, 13, 14, 15], 1), ([16, 17, 18, 19], 2)]
    # padded rows: valid query blocks only, valid rows only; all padded / too short: no proxy
    kpm = torch.ones(3, 40, dtype=torch.bool)
    kpm[0, 20:] = False
    kpm[0, 13] = False
    kpm[1] = False
    kpm[2, 7:] = False
    plan = proxy_queries(kpm, 3, 40, proxy_blocks=3, **kw)
    assert [(r.tolist(), s) for r, s in plan[0]] == [([12, 14, 15], 1), ([16, 17, 18, 19], 2)]
    assert plan[1] == [] and plan[2] == []


def test_right_padding_equals_the_truncated_sequence():
    q, k, _, _ = _random(1, 4, 2, 90, 8, seed=5, pad=False)
    kpm = torch.ones(1, 90, dtype=torch.bool)
    kpm[0, 61:] = False
    for cp in (False, True):
        kw = dict(block_size=4, segment_size=8, causal_proxy=cp, proxy_blocks=3)
        padded = key_scores(q, k, key_padding_mask=kpm, **kw)
        short = key_scores(q[:, :, :61], k[:, :, :61], **kw)
        assert torch.equal(padded[:, :, :61], short)
        assert (padded[:, :, 61:] == 0).all()


def test_kv_head_is_the_group_mean_and_scores_are_distributions():
    q, k, _, kpm = _random(3, 6, 2, 77, 8, seed=6, pad=True)
    kw = dict(key_padding_mask=kpm, block_size=4, segment_size=8, proxy_blocks=3)
    per_q = key_scores(q, k, **kw)
    per_kv = key_scores(q, k, gqa_permutation="kv_head", **kw)
    torch.testing.assert_close(per_kv, per_q.view(3, 2, 3, 77).mean(2), rtol=0, atol=0)
    # without causal_proxy each proxy is a distribution over what it sees: the last proxy's mass
    # (1) plus each earlier proxy's (1, spread over fewer segments) -> sum of score*seen_by = P_eff
    lengths = effective_lengths(kpm, 3, 77).tolist()
    plan = proxy_queries(kpm, 3, 77, block_size=4, segment_size=8, proxy_blocks=3)
    for b in range(3):
        lc = (lengths[b] // 8) * 8
        seen_by = torch.zeros(77)
        for _, s in plan[b]:
            seen_by[: s * 8] += 1
        assert (per_q[b, :, lc:] == 0).all()
        if plan[b]:
            torch.testing.assert_close((per_q[b] * seen_by).sum(-1), torch.full((6,), float(len(plan[b]))))
    assert (per_q[2] == 0).all()  # the all-padded row


def test_config_validation_and_serialisation():
    for bad in (0, -2):
        with pytest.raises(ValueError, match="proxy_blocks"):
            PBSConfig(proxy_blocks=bad)
    for bad in (2.0, True, "4"):
        with pytest.raises(TypeError, match="proxy_blocks"):
            PBSConfig(proxy_blocks=bad)
    cfg = PBSConfig(proxy_blocks=4, causal_proxy=True)
    assert config_from_dict(cfg.to_json()) == cfg
    assert config_from_dict(cfg.to_dict()).proxy_blocks == 4
    old = PBSConfig().to_dict()
    del old["proxy_blocks"]  # a config written before the option existed
    assert config_from_dict(old) == PBSConfig()
    with pytest.raises(ValueError, match="proxy_blocks"):
        key_scores(torch.zeros(1, 1, 16, 4), torch.zeros(1, 1, 16, 4), block_size=4, segment_size=8, proxy_blocks=0)


@pytest.mark.parametrize(
    "gqa,pad,causal_proxy", [("query_head", True, False), ("kv_head", True, True), ("query_head", False, True)]
)
def test_triton_scores_match_reference(gqa, pad, causal_proxy):
    pytest.importorskip("triton")
    from sparseflow.methods.pbs import triton_select as S

    q, k, _, kpm = _random(3 if pad else 1, 6, 2, 93, 40, seed=7, pad=pad)
    q, k = q.to(DEV), k.to(DEV)
    kpm = kpm.to(DEV) if kpm is not None else None
    kw = dict(
        key_padding_mask=kpm,
        block_size=8,
        segment_size=16,
        causal_proxy=causal_proxy,
        gqa_permutation=gqa,
        proxy_blocks=3,
    )
    ref = key_scores(q, k, **kw)
    got = S.key_scores(q, k, **kw)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-8)
    assert not torch.equal(ref, key_scores(q, k, **dict(kw, proxy_blocks=1)))
    assert torch.equal(
        S.segment_permutation(got, segment_size=16, key_padding_mask=kpm),
        segment_permutation(ref, segment_size=16, key_padding_mask=kpm),
    )


@pytest.mark.parametrize("backend", ["triton", "flex"])
@pytest.mark.parametrize("gqa", ["query_head", "kv_head"])
def test_op_backends_match_reference_p3_odd_shape(backend, gqa):
    if backend == "triton":
        pytest.importorskip("triton")
    if backend == "flex" and DEV == "cpu":
        from torch._inductor.kernel.flex.flex_cpu import check_cpu_supported

        if not check_cpu_supported():
            pytest.skip("compiled FlexAttention is not supported on this CPU")
    # blocks of 8 at head dim 16: the CPU kernel's tile tail that 8-float (AVX2) vectors got wrong
    q, k, v, kpm = _random(2, 6, 2, 93, 16, seed=8, pad=True)
    cfg = PBSConfig(block_size=8, segment_size=16, threshold=0.5, proxy_blocks=3, gqa_permutation=gqa)
    outs, sels = {}, {}
    for be in ("reference", backend):
        with sparseflow.capture() as cap:
            outs[be] = sparseflow.attention(
                q.to(DEV), k.to(DEV), v.to(DEV), config=cfg, attn_mask=kpm[:, None, None, :].to(DEV), backend=be
            ).cpu()
        (call,) = cap.calls
        assert call.sparse, call.reason
        sels[be] = call.selection
    assert torch.equal(sels[backend].permutation.cpu(), sels["reference"].permutation.cpu())
    assert torch.equal(sels[backend].block_mask.cpu(), sels["reference"].block_mask.cpu())
    assert sels["reference"].mean_density < 0.95
    valid = kpm[:, None, :, None]
    torch.testing.assert_close(outs[backend] * valid, outs["reference"] * valid, rtol=2e-4, atol=2e-5)
    # and the option matters here: P=1 permutes differently
    with sparseflow.capture() as cap:
        sparseflow.attention(
            q.to(DEV),
            k.to(DEV),
            v.to(DEV),
            config=cfg.replace(proxy_blocks=1),
            attn_mask=kpm[:, None, None, :].to(DEV),
            backend="reference",
        )
    assert not torch.equal(cap.calls[0].selection.permutation, sels["reference"].permutation)


def test_retained_mass_uses_the_option():
    from sparseflow.eval.attention_mass import pbs_retained_mass

    q, k, _, _ = _random(1, 6, 2, 96, 16, seed=9, pad=False)
    cfg = PBSConfig(block_size=8, segment_size=16, threshold=0.6)
    a = pbs_retained_mass(q, k, cfg, last=64)
    b = pbs_retained_mass(q, k, cfg.replace(proxy_blocks=4), last=64)
    assert a["retained_mass"] != b["retained_mass"]


@pytest.mark.parametrize("t", [17, 40, 66])
def test_causal_proxy_with_several_proxies_stays_causal_in_keys(t):
    """causal_proxy=True with P > 1: every proxy normalises per segment, so (as with P = 1) no
    key after position t changes an output at or before t."""
    from sparseflow.testing import check_causality

    q, k, v, _ = _random(1, 4, 2, 83, 8, seed=10 + t, pad=False)
    check_causality(
        q,
        k,
        v,
        PBSConfig(block_size=4, segment_size=8, threshold=0.6, causal_proxy=True, proxy_blocks=3),
        t,
        backend="reference",
    )
