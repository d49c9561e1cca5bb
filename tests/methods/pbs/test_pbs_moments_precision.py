"""The moments scoring's precision contract (sparseflow/methods/pbs/moments.py): every block logit the
Triton selection computes is within ``logit_tolerance`` of its exact (fp64) value, in IEEE fp32 and
on TF32 tensor cores (emulated on the CPU by truncating each product's operands to TF32's 10
mantissa bits, the worse of the two roundings hardware uses; measured on a GPU where there is one);
a selection from those logits differs from the reference's only among near-ties of the threshold rule.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

from sparseflow.methods.pbs import estimate as E  # noqa: E402
from sparseflow.methods.pbs import moments as M  # noqa: E402
from sparseflow.methods.pbs import triton_gather as TG  # noqa: E402
from sparseflow.methods.pbs import triton_select as S  # noqa: E402
from sparseflow.methods.pbs.block_selection import candidate_blocks, forced_blocks, select_blocks  # noqa: E402
from sparseflow.methods.pbs.permutation import key_scores, segment_permutation  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CUDA = DEV == "cuda"


def _tf32(t: torch.Tensor) -> torch.Tensor:
    """fp32 values truncated to TF32 (the low 13 of 23 mantissa bits cleared)."""
    bits = t.float().contiguous().view(torch.int32)
    return (bits & ~0x1FFF).view(torch.float32)


def _tf32_mm(a, b, product):
    """moments._mm with TF32 emulated where ``product`` asks for it (the Triton path's products;
    the reference's stay IEEE)."""
    return torch.matmul(_tf32(a), _tf32(b)) if product == "tf32" else torch.matmul(a, b)


def _inputs(kind: str, seed: int, b=2, hq=4, hkv=2, n=96, d=32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, d, generator=g)
    k = torch.randn(b, hkv, n, d, generator=g)
    if kind == "alike":  # every vector a large common one plus a small difference: var << mu^2
        q = 8.0 * torch.randn(1, hq, 1, d, generator=g) + 1e-2 * q
        k = 8.0 * torch.randn(1, hkv, 1, d, generator=g) + 1e-2 * k
    elif kind == "scales":  # heads and dimensions of very different magnitudes
        q = q * torch.logspace(-3, 3, d)[None, None, None] * torch.tensor([1e-2, 1.0, 1e2, 1.0])[None, :, None, None]
        k = k * torch.logspace(3, -3, d)[None, None, None]
    elif kind == "aligned":  # a few keys aligned with the queries: spread, not mean
        k[:, :, ::11] += 2.0 * q[:, :1, ::11]
    elif kind == "one_dim":  # positive vectors that differ in one dimension only: every term of the
        # variance positive, so the products' roundings (truncated toward zero) all go one way
        q = 1.0 + torch.rand(1, hq, 1, d, generator=g).expand(b, hq, n, d).clone()
        k = 1.0 + torch.rand(1, hkv, 1, d, generator=g).expand(b, hkv, n, d).clone()
        q[..., 0] = 3.0 * torch.rand(b, hq, n, generator=g)
        k[..., 0] = 3.0 * torch.rand(b, hkv, n, generator=g)
    return q.to(DEV), k.to(DEV)


def _holes(b, n):
    kpm = torch.ones(b, n, dtype=torch.bool, device=DEV)
    kpm[0, n - n // 3 :] = False
    kpm[1, n // 2 : n // 2 + 9] = False
    return kpm


def _setup(kind, seed, pad, gqa="query_head", bs=16, seg=32, sds=0.5, scale=None):
    q, k = _inputs(kind, seed)
    n, d = q.shape[2], q.shape[3]
    kpm = _holes(q.shape[0], n) if pad else None
    sc = 1.0 / math.sqrt(d) if scale is None else scale
    sco = key_scores(q, k, key_padding_mask=kpm, block_size=bs, segment_size=seg, gqa_permutation=gqa)
    perm = segment_permutation(sco, segment_size=seg, key_padding_mask=kpm)
    return q, k, kpm, perm, sc


def _logits(q, k, kpm, perm, bs, sds, sc, product):
    """The Triton selection's raw logits ``[B, Hq, nB, nB]`` (``q̄·k̄`` from the fp32 pooled means,
    plus the spread in ``product``'s arithmetic), the exact fp64 ones, and the tolerance."""
    bsz, hq, n, d = q.shape
    hp = perm.shape[1]
    g = hq // hp
    k_perm = TG.permute_kv(k, perm)
    spread = S._moments_spread(None, k_perm, perm, kpm, q, sds, sc, product)
    valid = spread.valid
    kblocks, kuse = S._key_blocks(spread, 0, hp, bs)
    qblocks, quse = E.query_blocks(q, valid, bs)
    qbar = E.query_block_means(q, valid, bs)
    cnt = kuse.sum(-1, keepdim=True).clamp_min(1)
    kbar = torch.where(kuse[..., None], kblocks, 0.0).sum(-2) / cnt
    mu = S.block_logits(qbar.contiguous(), kbar.contiguous())
    got = S._add_spread(spread, q, 0, hp, bs, mu) if sds else mu
    nb = mu.shape[-1]
    # exact: the definition, every (query, key) pair of the block pair in fp64, independent of
    # the module (whose products a test may have patched)
    qb6 = qblocks.double().view(bsz, hp, g, nb, bs, d)
    qu6 = quse.view(bsz, 1, 1, nb, bs)
    kb6, ku6 = kblocks.double()[:, :, None], kuse[:, :, None]
    s = torch.einsum("...isd,...jtd->...ijst", qb6, kb6)
    w = (qu6[..., :, None, :, None] & ku6[..., None, :, None, :]).double()
    cnt = w.sum((-1, -2)).clamp_min(1.0)
    mean = (w * s).sum((-1, -2)) / cnt
    var = (w * (s - mean[..., None, None]) ** 2).sum((-1, -2)) / cnt
    exact = (mean + math.copysign(sds, sc) * var.sqrt()).view(bsz, hq, nb, nb)
    tol = M.logit_tolerance(qb6, qu6, kb6, ku6, sds=sds, product=product).view(bsz, hq, nb, nb)
    keyed = kuse.any(-1)[:, :, None, None, :].expand(bsz, hp, g, nb, nb).reshape(bsz, hq, nb, nb)
    return got, exact, tol, keyed


CASES = [
    ("random", False, "query_head"),
    ("aligned", True, "kv_head"),
    ("alike", False, "query_head"),
    ("alike", True, "kv_head"),
    ("scales", True, "query_head"),
    ("one_dim", True, "kv_head"),
]


@pytest.mark.parametrize("product", ["ieee", "tf32"])
@pytest.mark.parametrize("kind,pad,gqa", CASES, ids=[f"{c[0]}-pad{int(c[1])}-{c[2]}" for c in CASES])
def test_every_logit_is_within_the_tolerance(monkeypatch, product, kind, pad, gqa):
    if product == "tf32" and not CUDA:
        monkeypatch.setattr(M, "_mm", _tf32_mm)
    q, k, kpm, perm, sc = _setup(kind, seed=len(kind) + pad, pad=pad, gqa=gqa)
    got, exact, tol, keyed = _logits(q, k, kpm, perm, 16, 2.0, sc, product)
    err = (got.double() - exact).abs()
    assert bool((err <= tol)[keyed].all()), f"worst excess {float(((err - tol)[keyed]).max()):.3g}"
    # a worst-case bound (every rounding the same way), yet no blanket: on vectors of ordinary
    # magnitudes a fraction of a nat (the scaled logits)
    if kind != "scales":
        assert float(tol[keyed].max()) * abs(sc) < 0.25


def test_the_tf32_terms_of_the_bound_are_needed(monkeypatch):
    # where the roundings go one way the error reaches a good part of the bound, and the bound
    # without TF32's operand rounding and accumulation (IEEE's) is broken by truncated operands
    # (emulated: the worst case by construction; a GPU's round-to-nearest stays inside IEEE's
    # loose accumulation term on these inputs, measured on an H100)
    monkeypatch.setattr(M, "_mm", _tf32_mm)
    q, k, kpm, perm, sc = _setup("one_dim", seed=1, pad=False, gqa="kv_head")
    got, exact, tol, keyed = _logits(q, k, kpm, perm, 16, 2.0, sc, "tf32")
    ratio = ((got.double() - exact).abs() / tol)[keyed]
    assert 0.05 < float(ratio.max()) <= 1.0
    monkeypatch.setitem(M._UNIT, "tf32", M._UNIT["ieee"])
    monkeypatch.setitem(M._ACC, "tf32", M._ACC["ieee"])
    _, _, ieee_tol, _ = _logits(q, k, kpm, perm, 16, 2.0, sc, "tf32")
    assert bool(((got.double() - exact).abs() > ieee_tol)[keyed].any())


def test_the_uncentred_form_breaks_the_tf32_bound_where_vectors_are_alike(monkeypatch):
    # why the centred form: E[qq^T].E[kk^T] - mu^2 in TF32 loses the variance to mu^2's rounding
    monkeypatch.setattr(M, "_mm", _tf32_mm)
    q, k, kpm, perm, sc = _setup("alike", seed=5, pad=False)
    _, exact, tol, keyed = _logits(q, k, kpm, perm, 16, 2.0, sc, "tf32")
    bsz, hq, n, d = q.shape
    bs = 16
    qb, qu = E.query_blocks(q, torch.ones(bsz, n, dtype=torch.bool, device=DEV), bs)
    kblocks, kuse = S._key_blocks(
        S._moments_spread(None, TG.permute_kv(k, perm), perm, None, q, 2.0, sc, "tf32"), 0, hq, bs
    )

    def second(x, use):
        x = torch.where(use[..., None], x, 0.0)
        return (_tf32_mm(x.transpose(-1, -2), x, "tf32") / use.sum(-1).clamp_min(1)[..., None, None]).flatten(-2)

    qm = E.query_block_means(q, torch.ones(bsz, n, dtype=torch.bool, device=DEV), bs)
    km = torch.where(kuse[..., None], kblocks, 0.0).sum(-2) / kuse.sum(-1, keepdim=True).clamp_min(1)
    mu = qm @ km.transpose(-1, -2)
    var = _tf32_mm(second(qb, qu), second(kblocks, kuse).transpose(-1, -2), "tf32") - mu * mu
    uncentred = mu + 2.0 * var.clamp_min(0.0).sqrt()
    assert bool(((uncentred.double() - exact).abs() > tol)[keyed].any())


def _near_tie_rows(sel, ref, exact_logits, tol, cand, forced, thr, sc):
    """Whether every block where ``sel`` and ``ref`` differ is a near-tie of the threshold rule on
    the exact logits: its logit within twice the row's tolerance of the last kept one, or the mass
    ranked before it within what that tolerance can move of the threshold."""
    dif = (sel != ref) & ~forced
    if not bool(dif.any()):
        return True
    rows = dif.any(-1).nonzero(as_tuple=True)
    lg = torch.where(cand[rows], exact_logits[rows] * abs(sc), torch.full_like(exact_logits[rows], -math.inf))
    dl = 2.0 * abs(sc) * torch.where(cand[rows], tol[rows], 0.0).amax(-1, keepdim=True)
    pr = torch.softmax(lg, -1)
    sp, order = torch.sort(pr, dim=-1, descending=True, stable=True)
    before = torch.empty_like(pr).scatter_(-1, order, sp.cumsum(-1) - sp)
    kept = cand[rows] & (before < thr)
    cut = torch.where(kept, lg, torch.full_like(lg, math.inf)).amin(-1, keepdim=True)
    near_logit = (lg - cut).abs() <= dl
    near_mass = (before - thr).abs() <= torch.expm1(2 * dl)
    return bool((near_logit | near_mass | ~dif[rows]).all())


@pytest.mark.parametrize("kind,pad", [("aligned", True), ("random", False), ("alike", True)])
def test_a_tf32_selection_differs_from_the_reference_only_among_near_ties(monkeypatch, kind, pad):
    if not CUDA:
        monkeypatch.setattr(M, "_mm", _tf32_mm)
    bs, seg, sds = 16, 32, 2.0
    q, k, kpm, perm, sc = _setup(kind, seed=11, pad=pad)
    _, exact, tol, _ = _logits(q, k, kpm, perm, bs, sds, sc, "tf32")
    hq = q.shape[1]
    cand = candidate_blocks(perm, hq, key_padding_mask=kpm, block_size=bs, segment_size=seg)
    forced = forced_blocks(perm, hq, key_padding_mask=kpm, block_size=bs, segment_size=seg)
    for thr in (0.5, 0.9, 0.95):
        geo = dict(block_size=bs, segment_size=seg, threshold=thr, scoring="moments", moments_sd=sds)
        ref = select_blocks(q, k, perm, key_padding_mask=kpm, **geo)
        got = S.select_block_lists(
            q, TG.permute_kv(k, perm), perm, key_padding_mask=kpm, moments_product="tf32", **geo
        )[3]
        assert _near_tie_rows(got, ref, exact, tol, cand, forced, thr, sc)
        assert float((got != ref).float().mean()) <= 0.02


def test_a_tf32_flip_between_two_blocks_a_rounding_apart_is_a_near_tie(monkeypatch):
    # key blocks 1 and 2 a factor 1 + 2**-16 apart (block 2's spread the larger in fp32), blocks 0
    # and 3 all zeros; queries and keys in +- pairs (means exactly 0: the logits are the spreads). TF32
    # rounds the factor away: blocks 1 and 2 tie, the lower index wins; the reference keeps block 2
    if not CUDA:
        monkeypatch.setattr(M, "_mm", _tf32_mm)
    n, d, bs, seg, sds, thr = 96, 8, 16, 32, 2.0, 0.4
    g = torch.Generator().manual_seed(0)
    half_q = torch.randint(-8, 9, (n // 2, d), generator=g) / 4.0
    q = torch.stack([half_q, -half_q], 1).reshape(1, 1, n, d)
    half_k = torch.randint(-8, 9, (bs // 2, d), generator=g) / 4.0
    k1 = torch.stack([half_k, -half_k], 1).reshape(bs, d)
    k = torch.randn(1, 1, n, d, generator=g)
    k[0, 0, :bs], k[0, 0, 3 * bs : 4 * bs] = 0.0, 0.0
    k[0, 0, bs : 2 * bs], k[0, 0, 2 * bs : 3 * bs] = k1, k1 * (1 + 2.0**-16)
    q, k = q.to(DEV), k.to(DEV)
    perm = torch.arange(n, device=DEV).view(1, 1, n)
    sc = d**-0.5
    geo = dict(block_size=bs, segment_size=seg, threshold=thr, scoring="moments", moments_sd=sds)
    ref = select_blocks(q, k, perm, **geo)
    got = S.select_block_lists(q, TG.permute_kv(k, perm), perm, moments_product="tf32", **geo)[3]
    assert ref[0, 0, 5, 1:4].tolist() == [False, True, False]
    assert got[0, 0, 5, 1:4].tolist() == [True, False, False]
    _, exact, tol, _ = _logits(q, k, None, perm, bs, sds, sc, "tf32")
    cand = candidate_blocks(perm, 1, block_size=bs, segment_size=seg)
    forced = forced_blocks(perm, 1, block_size=bs, segment_size=seg)
    assert _near_tie_rows(got, ref, exact, tol, cand, forced, thr, sc)
    wrong = ref.clone()
    wrong[0, 0, 5, 2], wrong[0, 0, 5, 3] = False, True  # the zero block for the spread one: no near-tie
    assert not _near_tie_rows(wrong, ref, exact, tol, cand, forced, thr, sc)


def test_the_ieee_product_selects_as_the_reference_on_any_device():
    bs, seg, sds = 16, 32, 2.0
    q, k, kpm, perm, _ = _setup("aligned", seed=3, pad=True)
    geo = dict(block_size=bs, segment_size=seg, threshold=0.9, scoring="moments", moments_sd=sds)
    ref = select_blocks(q, k, perm, key_padding_mask=kpm, **geo)
    got = S.select_block_lists(q, TG.permute_kv(k, perm), perm, key_padding_mask=kpm, moments_product="ieee", **geo)[3]
    assert torch.equal(got, ref)


def test_the_products_context_restores_the_global_setting_and_rejects_unknown_names():
    with pytest.raises(ValueError, match="moments product must be one of"):
        with M.products("bf16", CUDA):
            pass
    matmul = torch.backends.cuda.matmul  # the flags exist on a CPU build too
    before = matmul.fp32_precision
    try:
        matmul.fp32_precision = "tf32"  # a user's own setting, by the new API
        with M.products("ieee", True):
            assert matmul.fp32_precision == "ieee"
        assert matmul.fp32_precision == "tf32"
        with M.products("tf32", True):
            assert matmul.fp32_precision == "tf32"
        with pytest.raises(RuntimeError, match="inside"):
            with M.products("ieee", True):
                raise RuntimeError("inside")
        assert matmul.fp32_precision == "tf32"
    finally:
        matmul.fp32_precision = before


def test_the_tuning_reaches_the_spread(monkeypatch):
    import sparseflow
    from sparseflow import PBSConfig
    from sparseflow.methods.pbs import triton_impl as TI

    seen = []
    real = M.products

    def record(product, cuda):
        seen.append(product)
        return real(product, cuda)

    monkeypatch.setattr(M, "products", record)
    q, k = _inputs("aligned", seed=2)
    v = torch.randn_like(k)
    cfg = PBSConfig(block_size=16, segment_size=32, threshold=0.8, scoring="moments", moments_sd=2.0)
    for product in ("ieee", "tf32"):
        seen.clear()
        TI.pbs_attention(
            q, k, v, config=cfg, tuning=sparseflow.Tuning(pbs_select="triton", pbs_moments_product=product)
        )
        assert product in seen and set(seen) <= {product, "ieee"}  # the mean logits' products stay IEEE
