"""The op properties on the reference backend, random shapes that break kernels (hypothesis).

The same checks are exported in ``sparseflow.testing`` for users' own CI.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparseflow import BSAConfig, PBSConfig, PISAConfig
from sparseflow.kernels.masked_attention import masked_attention
from sparseflow.testing import (
    check_causality,
    check_exact_mode,
    check_finite,
    check_matches_own_selection,
    run_with_selection,
)
from sparseflow.testing.strategies import attention_problems

SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


def _small_config(method, data, n):
    bs = data.draw(st.sampled_from((4, 8, 16)), label="block_size")
    if method == "pbs":
        return PBSConfig(
            block_size=bs,
            segment_size=bs * data.draw(st.sampled_from((1, 2, 3)), label="blocks_per_segment"),
            threshold=data.draw(st.sampled_from((0.5, 0.8, 0.95)), label="threshold"),
            gqa_permutation=data.draw(st.sampled_from(("query_head", "kv_head")), label="gqa_permutation"),
            scoring=data.draw(st.sampled_from(("mean", "antidiagonal", "sampled_rows")), label="scoring"),
            antidiagonal_stride=4 if bs % 4 == 0 else 1,
            force_sink=data.draw(st.booleans(), label="force_sink"),
        )
    cls = PISAConfig if method == "pisa" else BSAConfig
    kw = dict(block_size=bs, top_k=data.draw(st.integers(3, 6), label="top_k"))
    if method == "pisa":
        kw["score"] = data.draw(st.sampled_from(("lse", "mean", "mean_var")), label="score")
        kw["branching"] = data.draw(st.sampled_from((2, 3)), label="branching")
    return cls(**kw)


@pytest.mark.parametrize("method", ["pbs", "pisa", "bsa"])
@SETTINGS
@given(problem=attention_problems(max_n=200))
def test_p1_exact_mode_equals_dense(method, problem):
    q, k, v = problem.tensors()
    base = PBSConfig(block_size=8, segment_size=16) if method == "pbs" else None
    if method in ("pisa", "bsa"):
        base = (PISAConfig if method == "pisa" else BSAConfig)(block_size=8)
    check_exact_mode(q, k, v, method, base=base, key_padding_mask=problem.key_padding_mask())


@pytest.mark.parametrize("method", ["pbs", "pisa", "bsa"])
@SETTINGS
@given(problem=attention_problems(min_n=20, max_n=260), data=st.data())
def test_p2_sparse_equals_masked_dense_over_own_selection(method, problem, data):
    q, k, v = problem.tensors()
    cfg = _small_config(method, data, problem.n)
    if method == "pbs" and problem.n < cfg.segment_size:
        cfg = cfg.replace(segment_size=cfg.block_size)
    check_matches_own_selection(q, k, v, cfg, key_padding_mask=problem.key_padding_mask())


@pytest.mark.parametrize("method", ["pbs", "pisa", "bsa"])
@SETTINGS
@given(problem=attention_problems(min_n=24, max_n=200, padding=False, dtypes=("float32",)), data=st.data())
def test_p3_causality(method, problem, data):
    q, k, v = problem.tensors()
    cfg = _small_config(method, data, problem.n)
    if method == "pbs":
        # The paper's proxy normalises over every complete segment, so a later key can reorder an
        # earlier segment; causal_proxy=True is the strictly causal variant this property holds for.
        cfg = cfg.replace(causal_proxy=True, segment_size=cfg.block_size * 2)
    t = data.draw(st.integers(0, problem.n - 2), label="t")
    check_causality(q, k, v, cfg, t)


@SETTINGS
@given(problem=attention_problems(min_n=40, max_n=200, padding=False, dtypes=("float32",)), data=st.data())
def test_p3_pbs_default_proxy_can_see_later_keys_only_through_selection(problem, data):
    """With the paper's proxy, outputs before t may change when later keys change, but only
    because the selection changed: under the old selection the new keys change nothing."""
    q, k, v = problem.tensors()
    cfg = PBSConfig(block_size=8, segment_size=16, threshold=0.8)
    t = data.draw(st.integers(0, problem.n - 2), label="t")
    _, sel, _ = run_with_selection(q, k, v, cfg)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, t + 1 :] += 5.0
    v2[:, :, t + 1 :] -= 5.0
    mask = sel.key_mask(q.shape[1])
    a = masked_attention(q, k, v, key_mask=mask)
    b = masked_attention(q, k2, v2, key_mask=mask)
    torch.testing.assert_close(a[:, :, : t + 1], b[:, :, : t + 1], rtol=0, atol=0)


@SETTINGS
@given(problem=attention_problems(min_n=16, max_n=200), data=st.data())
def test_p4_pbs_permutation_and_element_mask_agree(problem, data):
    """Permuting keys inside segments is invisible in exact mode: permute=True and permute=False
    compute the same attention, and the permuted selection maps back to original positions."""
    q, k, v = problem.tensors()
    bs = data.draw(st.sampled_from((4, 8)), label="block_size")
    cfg = PBSConfig(block_size=bs, segment_size=2 * bs, threshold=1.0)
    kpm = problem.key_padding_mask()
    a = check_finite(q, k, v, cfg, attn_mask=_kp(kpm, problem.n), is_causal=kpm is None)
    b = check_finite(q, k, v, cfg.replace(permute=False), attn_mask=_kp(kpm, problem.n), is_causal=kpm is None)
    tol = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}[q.dtype]
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    if problem.n >= cfg.segment_size:
        _, sel, _ = run_with_selection(q, k, v, cfg.replace(threshold=0.7))
        perm = sel.permutation
        n_full = (problem.n // cfg.segment_size) * cfg.segment_size
        seg = torch.arange(problem.n) // cfg.segment_size
        assert torch.equal(seg[perm[..., :n_full]], seg[:n_full].expand_as(perm[..., :n_full]))
        assert torch.equal(perm[..., n_full:], torch.arange(n_full, problem.n).expand_as(perm[..., n_full:]))


def _kp(kpm, n):
    if kpm is None:
        return None
    return (torch.ones(n, n, dtype=torch.bool).tril()[None] & kpm[:, None, :])[:, None]


@pytest.mark.parametrize("method", ["pisa", "bsa"])
@SETTINGS
@given(problem=attention_problems(min_n=10, max_n=260), data=st.data())
def test_p5_topk_selection_shape(method, problem, data):
    """min(K, visible) distinct visible blocks per token, forced ones included."""
    q, k, v = problem.tensors()
    cfg = _small_config(method, data, problem.n)
    kpm = problem.key_padding_mask()
    _, sel, rec = run_with_selection(q, k, v, cfg, attn_mask=_kp(kpm, problem.n), is_causal=kpm is None)
    assert rec.sparse, rec.reason
    idx = sel.block_indices  # [B, Hkv, N, K]
    c = cfg.block_size
    pos = torch.arange(problem.n)
    nb = -(-problem.n // c)
    valid = torch.ones(problem.batch, problem.n, dtype=torch.bool) if kpm is None else kpm
    for b in range(problem.batch):
        # visible blocks of token t: blocks <= t//c holding a valid key at or before t
        vis_key = (pos[None, :] <= pos[:, None]) & valid[b][None, :]
        vis_blk = torch.zeros(problem.n, nb, dtype=torch.bool)
        vis_blk.index_reduce_(1, pos // c, vis_key.to(torch.bool).float().bool(), "amax") if False else None
        vis_blk = torch.stack([vis_key[:, j * c : (j + 1) * c].any(-1) for j in range(nb)], -1)
        want = vis_blk.sum(-1).clamp(max=cfg.top_k)
        for h in range(idx.shape[1]):
            rows = idx[b, h]
            got = (rows >= 0).sum(-1)
            assert torch.equal(got, want), (b, h)
            for t in range(problem.n):
                chosen = rows[t][rows[t] >= 0]
                assert chosen.unique().numel() == chosen.numel()
                assert vis_blk[t, chosen].all()
                for forced in (t // c, t // c - 1, 0):
                    if forced >= 0 and vis_blk[t, forced]:
                        assert forced in chosen.tolist(), (t, forced)


@pytest.mark.parametrize("method", ["pbs", "pisa", "bsa"])
@SETTINGS
@given(problem=attention_problems(min_n=1, max_n=120), data=st.data())
def test_p7_finite_on_valid_input_including_fully_padded_rows(method, problem, data):
    q, k, v = problem.tensors()
    cfg = _small_config(method, data, problem.n)
    if method == "pbs":
        cfg = cfg.replace(segment_size=cfg.block_size)
    kpm = torch.ones(problem.batch, problem.n, dtype=torch.bool)
    kpm[0] = False  # a fully padded batch row
    kpm[-1, : problem.n // 2] = False  # left padding: early queries see no key
    out = check_finite(q, k, v, cfg, attn_mask=_kp(kpm, problem.n), is_causal=False)
    assert (out[0] == 0).all()
