"""PISA's beam option (``PISAConfig.beam``): the walk keeps ``beam * top_k`` nodes at every level
above the leaves and ``top_k`` leaves. Checked here on the reference (against an independent,
loop-per-query walk written from the paper, and against a flat exact-LSE scan), on the config,
on the op, and on the Recall@K selector names. The Triton walk's beam is checked against the
reference in test_pisa_bsa_triton.py.
"""

from __future__ import annotations

import math

import pytest
import torch

import sparseflow
from sparseflow.eval.attention_mass import TOPK_SELECTORS, check_selectors, parse_selector, topk_recall
from sparseflow.config import PISAConfig, config_from_dict
from sparseflow.methods.pisa import reference as R


def _inputs(b, hq, hkv, n, d, pad, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, d, generator=g, dtype=dtype) * 1.5
    k = torch.randn(b, hkv, n, d, generator=g, dtype=dtype)
    kpm = None
    if pad:
        kpm = torch.ones(b, n, dtype=torch.bool)
        kpm[0, :5] = False
        kpm[-1, n - 7 :] = False
        kpm[-1, 20] = False
    return q, k, kpm


def _naive_walk(q, k, kpm, *, causal, c, top_k, g, score, beam, force_sink=True, force_previous=True):
    """One query at a time, with Python lists: the plain walk with the level width
    ``top_k`` at the leaves and ``beam * top_k`` above (fp64 inputs: no near ties)."""
    b_, hq, n, d = q.shape
    hkv = k.shape[1]
    grp = hq // hkv
    scale = 1.0 / math.sqrt(d)
    sizes = [-(-n // c)]
    while sizes[-1] > 1:
        sizes.append(-(-sizes[-1] // g))
    top = len(sizes) - 1
    out = torch.full((b_, hkv, n, min(top_k, sizes[0])), -1, dtype=torch.long)
    for b in range(b_):
        ok_key = [kpm is None or bool(kpm[b, j]) for j in range(n)]

        def keys(lv, u):
            lo, hi = u * g**lv * c, min(n, (u + 1) * g**lv * c)
            return [j for j in range(lo, hi) if ok_key[j]]

        for h in range(hkv):
            summ = {}

            def mean_key(lv, u):
                if (lv, u) not in summ:
                    js = keys(lv, u)
                    summ[lv, u] = k[b, h, js].mean(0) if js else torch.zeros(d, dtype=k.dtype)
                return summ[lv, u]

            for i in range(n):
                hz = i if causal else n - 1

                def vis(lv, u):
                    return any(j <= hz for j in keys(lv, u))

                def node_score(lv, u):
                    qs = q[b, h * grp : (h + 1) * grp, i]  # [G, D]
                    if score == "mean":
                        return float((qs @ mean_key(lv, u)).sum() * scale)
                    if lv == 0:
                        rows = [j for j in keys(0, u) if j <= hz]
                        x = qs @ k[b, h, rows].T * scale  # [G, m]
                    else:
                        ch = [cc for cc in range(u * g, u * g + g) if cc < sizes[lv - 1] and vis(lv - 1, cc)]
                        x = qs @ torch.stack([mean_key(lv - 1, cc) for cc in ch]).T * scale
                    if score == "lse":
                        return float(torch.logsumexp(x, -1).sum())
                    return float((x.mean(-1) + 0.5 * x.var(-1, unbiased=False)).sum())

                cur = i // c
                forced_leaves = {cur}
                if force_previous and cur >= 1:
                    forced_leaves.add(cur - 1)
                if force_sink:
                    forced_leaves.add(0)
                forced_leaves = {f for f in forced_leaves if vis(0, f)} | {cur}  # + the node holding i
                kept = [0] if vis(top, 0) else []
                for lv in range(top - 1, -1, -1):
                    cands = [cc for u in kept for cc in range(u * g, u * g + g) if cc < sizes[lv] and vis(lv, cc)]
                    width = top_k if lv == 0 else beam * top_k
                    if len(cands) > width:
                        anc = {f // g**lv for f in forced_leaves}
                        forced = [cc for cc in cands if cc in anc]
                        rest = sorted((cc for cc in cands if cc not in anc), key=lambda cc: (-node_score(lv, cc), cc))
                        cands = sorted(forced + rest[: width - len(forced)])
                    kept = cands
                out[b, h, i, : len(kept)] = torch.tensor(kept, dtype=torch.long)
    return out


# (B, Hq, Hkv, N, D, C, K, g, score, causal, pad)
WALK_CASES = {
    "lse-gqa2-n90": (1, 4, 2, 90, 8, 4, 5, 2, "lse", True, False),
    "mean_var-g3-pad-b2-n75": (2, 2, 1, 75, 8, 4, 4, 3, "mean_var", True, True),
    "mean-noncausal-n61": (1, 2, 2, 61, 8, 4, 4, 2, "mean", False, False),
}


@pytest.mark.parametrize("beam", [1, 2, 3])
@pytest.mark.parametrize("case", WALK_CASES.values(), ids=WALK_CASES.keys())
def test_reference_walk_equals_a_naive_walk(case, beam):
    b, hq, hkv, n, d, c, kk, g, score, causal, pad = case
    q, k, kpm = _inputs(b, hq, hkv, n, d, pad, seed=n)
    kw = dict(is_causal=causal, block_size=c, top_k=kk, branching=g, score=score)
    got = R.pisa_select(q, k, key_padding_mask=kpm, beam=beam, **kw)
    want = _naive_walk(q, k, kpm, causal=causal, c=c, top_k=kk, g=g, score=score, beam=beam)
    assert torch.equal(got, want)
    if beam == 1:  # the default is the plain walk, bit for bit
        assert torch.equal(R.pisa_select(q, k, key_padding_mask=kpm, **kw), got)
    else:  # not vacuous: the beam changes some selections on these inputs
        assert not torch.equal(got, R.pisa_select(q, k, key_padding_mask=kpm, beam=1, **kw))


def _flat_lse_top_k(q, k, kpm, *, c, top_k):
    """Forced blocks (current, previous, sink) plus the best others by the group-summed exact
    LSE over each visible block's raw keys, ``top_k`` in total (causal), ties to the lower id."""
    b_, hq, n, d = q.shape
    hkv = k.shape[1]
    grp = hq // hkv
    nb = -(-n // c)
    logits = torch.einsum("bhgqd,bhkd->bhgqk", q.view(b_, hkv, grp, n, d), k) / math.sqrt(d)
    ok = torch.ones(n, n, dtype=torch.bool).tril()[None, None, None]
    if kpm is not None:
        ok = ok & kpm[:, None, None, None, :]
    pad = nb * c - n
    x = torch.nn.functional.pad(logits.masked_fill(~ok, -math.inf), (0, pad), value=-math.inf)
    lse = torch.logsumexp(x.view(b_, hkv, grp, n, nb, c), -1)  # [B, Hkv, G, N, nB]
    visible = torch.isfinite(lse[:, :, 0])  # [B, Hkv, N, nB]
    score = torch.where(visible, lse.sum(2), torch.full_like(lse[:, :, 0], -math.inf))
    blk = torch.arange(nb)
    cur = (torch.arange(n) // c)[:, None]
    forced = ((blk == cur) | (blk == cur - 1) | (blk == 0))[None, None] & visible
    key = torch.where(forced, torch.full_like(score, math.inf), score)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :top_k]
    ids = torch.where(visible.gather(-1, order), order, torch.full_like(order, nb)).sort(-1).values
    return torch.where(ids == nb, torch.full_like(ids, -1), ids)


@pytest.mark.parametrize("g", [2, 3])
def test_a_beam_covering_every_node_is_the_flat_exact_lse_top_k(g):
    b, hq, hkv, n, d, c, kk = 2, 4, 2, 90, 8, 4, 4
    q, k, kpm = _inputs(b, hq, hkv, n, d, True, seed=g)
    nb = -(-n // c)
    beam = -(-nb // kk)  # beam * top_k >= every leaf: nothing is dropped above the leaves
    got = R.pisa_select(q, k, key_padding_mask=kpm, block_size=c, top_k=kk, branching=g, beam=beam)
    want = _flat_lse_top_k(q, k, kpm, c=c, top_k=kk)
    assert torch.equal(got, want)
    assert not torch.equal(R.pisa_select(q, k, key_padding_mask=kpm, block_size=c, top_k=kk, branching=g), want)


def test_reference_rejects_bad_beams():
    q, k, _ = _inputs(1, 2, 1, 20, 8, False, seed=0)
    with pytest.raises(ValueError, match="beam must be >= 1, got 0"):
        R.pisa_select(q, k, block_size=4, top_k=3, beam=0)
    with pytest.raises(TypeError, match="beam must be an int"):
        R.pisa_select(q, k, block_size=4, top_k=3, beam=2.0)


def test_config_beam_field():
    assert PISAConfig().beam == 1
    cfg = PISAConfig(block_size=16, top_k=4, beam=3)
    assert cfg.to_dict()["beam"] == 3
    assert config_from_dict(cfg.to_json()) == cfg
    old = {k: v for k, v in PISAConfig().to_dict().items() if k != "beam"}  # a config saved before the field
    assert config_from_dict(old).beam == 1
    with pytest.raises(ValueError, match="beam must be >= 1, got 0"):
        PISAConfig(beam=0)
    for bad in (2.0, True, "2"):
        with pytest.raises(TypeError, match="beam must be an int"):
            PISAConfig(beam=bad)
    with pytest.raises(dataclass_frozen_error()):
        cfg.beam = 2


def dataclass_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_op_passes_the_beam_to_the_selection():
    q, k, _ = _inputs(1, 4, 2, 96, 8, False, seed=7, dtype=torch.float32)
    v = torch.randn_like(k)
    cfg = PISAConfig(block_size=4, top_k=4, beam=2)
    with sparseflow.capture(keep_selections=True) as cap:
        sparseflow.attention(q, k, v, config=cfg, backend="reference")
    got = cap.calls[-1].selection.block_indices
    want = R.pisa_select(q, k, block_size=4, top_k=4, beam=2)
    assert torch.equal(got.long(), want)
    assert not torch.equal(want, R.pisa_select(q, k, block_size=4, top_k=4))


def test_recall_selector_names():
    assert parse_selector("pisa_lse") == ("pisa", "lse", 1)
    assert parse_selector("pisa_lse_beam4") == ("pisa", "lse", 4)
    assert parse_selector("pisa_mean_var_beam2") == ("pisa", "mean_var", 2)
    assert parse_selector("pisa_mean_beam12") == ("pisa", "mean", 12)
    assert parse_selector("flat_lse") == ("flat_lse", None, 1)
    assert parse_selector("bsa") == ("bsa", None, 1)
    assert [parse_selector(s)[0] for s in TOPK_SELECTORS] == ["pisa", "pisa", "pisa", "bsa", "flat_lse"]
    for bad in (
        "pisa_lse_beam0",
        "pisa_lse_beam",
        "pisa_lse_beam02",
        "pisa_max",
        "pisa_lse_beam2x",
        "bsa_beam2",
        "",
        3,
    ):
        with pytest.raises(ValueError, match="selector must be one of"):
            parse_selector(bad)
    with pytest.raises(ValueError, match="distinct"):
        check_selectors(["pisa_lse", "pisa_lse"])
    with pytest.raises(ValueError, match="non-empty"):
        check_selectors([])


def test_recall_of_beam_selectors():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 384, 16, generator=g) * 2.0
    k = torch.randn(1, 2, 384, 16, generator=g)
    sel = ["pisa_lse", "pisa_lse_beam2", "pisa_lse_beam8", "flat_lse"]
    r = topk_recall(q, k, selectors=sel, block_size=16, top_k=6, q_start=128)
    # beam 8 * K 6 = 48 >= 24 leaves: the walk is the flat exact scan
    assert r["pisa_lse_beam8"] == pytest.approx(r["flat_lse"])
    assert r["pisa_lse_beam2"]["recall"] != r["pisa_lse"]["recall"]
    with pytest.raises(ValueError, match="selector must be one of"):
        topk_recall(q, k, selectors=["pisa_lse_beam0"], block_size=16, top_k=6, q_start=128)
