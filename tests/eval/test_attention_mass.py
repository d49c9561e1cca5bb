"""sparseflow.eval.attention_mass: Recall@K / retained mass (PISA, BSA, flat LSE) and PBS retained
mass, checked against independent dense computations on small random inputs."""

from __future__ import annotations

import math

import pytest
import torch

from sparseflow.eval.attention_mass import TOPK_SELECTORS, pbs_retained_mass, topk_recall
from sparseflow.config import BSAConfig, PBSConfig, PISAConfig
from sparseflow.ops import attention
from sparseflow.recording import capture


def _qk(hq, hkv, n=384, d=16, seed=0, sharp=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, hq, n, d, generator=g) * sharp, torch.randn(1, hkv, n, d, generator=g)


def _probs(q, k):
    hq, hkv, n, d = q.shape[1], k.shape[1], q.shape[2], q.shape[3]
    logits = (q[0] @ k[0].repeat_interleave(hq // hkv, 0).transpose(1, 2)) / math.sqrt(d)
    return torch.softmax(
        logits.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf")), -1
    )  # [Hq, N, N]


def test_flat_lse_is_the_oracle_without_gqa():
    """With one query head per group, ranking blocks by the exact LSE of their logits is ranking
    them by attention mass, so the flat scan must reproduce the reference exactly."""
    q, k = _qk(2, 2)
    r = topk_recall(q, k, block_size=16, top_k=6, q_start=128)
    assert r["flat_lse"]["recall"] == pytest.approx(1.0) and r["flat_lse"]["recall_free"] == pytest.approx(1.0)
    assert r["flat_lse"]["retained_mass"] == pytest.approx(r["oracle"]["retained_mass"])
    for s in TOPK_SELECTORS:
        assert 0.0 < r[s]["recall_free"] <= 1.0 and r[s]["retained_mass"] <= r["oracle"]["retained_mass"] + 1e-9


@pytest.mark.parametrize(
    "cfg, name",
    [
        (PISAConfig(block_size=16, top_k=6), "pisa_lse"),
        (PISAConfig(block_size=16, top_k=6, score="mean"), "pisa_mean"),
        (BSAConfig(block_size=16, top_k=6), "bsa"),
    ],
)
def test_retained_mass_matches_the_op_selection(cfg, name):
    q, k = _qk(6, 2)
    r = topk_recall(q, k, selectors=[name], block_size=16, top_k=6, q_start=128)
    with capture() as cap:
        attention(q, k, torch.zeros_like(k), config=cfg, is_causal=True, backend="reference")
    keys = cap.calls[0].selection.key_mask(6)[0].float()  # [Hq, N, N] what the op attended
    want = (_probs(q, k) * keys).sum(-1)[:, 128:].mean()  # group-mean == mean over all heads
    assert r[name]["retained_mass"] == pytest.approx(float(want), rel=1e-5)
    assert r[name]["recall"] < 1.0  # not vacuous: K < visible blocks


def test_topk_recall_errors():
    q, k = _qk(6, 2)
    with pytest.raises(ValueError, match="q_start must be >= block_size\\*top_k=96"):
        topk_recall(q, k, block_size=16, top_k=6, q_start=64)
    with pytest.raises(ValueError, match="top_k must be >= 4"):
        topk_recall(q, k, block_size=16, top_k=3, q_start=128)
    with pytest.raises(ValueError, match="selector must be one of"):
        topk_recall(q, k, selectors=["nope"], block_size=16, top_k=6, q_start=128)
    with pytest.raises(ValueError, match="Hq a multiple of Hkv"):
        topk_recall(q[:, :5], k, block_size=16, top_k=6, q_start=128)


def test_pbs_retained_mass_matches_the_op_and_grows_with_threshold():
    q, k = _qk(6, 2)
    cfg = PBSConfig(block_size=16, segment_size=32, threshold=0.7)
    r = pbs_retained_mass(q, k, cfg, last=64)
    with capture() as cap:
        attention(q, k, torch.zeros_like(k), config=cfg, is_causal=True, backend="reference")
    sel = cap.calls[0].selection
    keys = sel.key_mask(6)[0].float()
    want = (_probs(q, k) * keys).sum(-1)[:, -64:].mean(-1)  # per head
    torch.testing.assert_close(
        torch.tensor(r["retained_mass"], dtype=torch.float64), want.double(), rtol=1e-5, atol=1e-6
    )
    assert r["density"] == pytest.approx(sel.mean_density)
    assert r["density_last"] == pytest.approx(
        float(keys[:, -64:].sum() / (6 * sum(384 - 64 + i + 1 for i in range(64))))
    )
    masses = [pbs_retained_mass(q, k, cfg.replace(threshold=t), last=64)["mean_retained_mass"] for t in (0.5, 0.9, 1.0)]
    assert masses[0] <= masses[1] <= masses[2] == pytest.approx(1.0) and masses[0] < 1.0
    nop = pbs_retained_mass(q, k, cfg.replace(permute=False, gqa_permutation="kv_head"), last=64)
    assert 0.0 < nop["mean_retained_mass"] < 1.0
    with pytest.raises(TypeError, match="config must be a PBSConfig"):
        pbs_retained_mass(q, k, BSAConfig())
    with pytest.raises(ValueError, match="last must be in"):
        pbs_retained_mass(q, k, cfg, last=0)


def test_capture_qkv_tiny_llama():
    pytest.importorskip("transformers")
    import conftest
    from sparseflow.eval.attention_mass import capture_qkv

    model = conftest.make_tiny("llama", layers=2)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    layers = capture_qkv(model, ids)
    assert len(layers) == 2
    for q, k, v in layers:
        assert q.shape == (1, 6, 40, 16) and k.shape == v.shape == (1, 2, 40, 16) and q.dtype == torch.float32
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, before)
    # layer 0's captured Q/K/V reproduce its attention output through o_proj
    attn = model.model.layers[0].self_attn
    q, k, v = layers[0]
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    got = attn.o_proj(out.transpose(1, 2).reshape(1, 40, -1))
    seen = {}
    h = attn.register_forward_hook(lambda m, a, o: seen.update(o=o[0]))  # returns None: output unchanged
    with torch.no_grad():
        model(input_ids=ids)
    h.remove()
    torch.testing.assert_close(got, seen["o"], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match=r"input_ids must be \[1, N\]"):
        capture_qkv(model, ids[0])


def test_pbs_retained_mass_counts_the_dense_tail():
    q, k = _qk(6, 2)
    cfg = PBSConfig(block_size=16, segment_size=32, threshold=0.5, dense_tail_blocks=1)
    r = pbs_retained_mass(q, k, cfg, last=16)  # the last block: the tail
    assert r["mean_retained_mass"] == pytest.approx(1.0)
    with capture() as cap:
        attention(q, k, torch.zeros_like(k), config=cfg, is_causal=True, backend="reference")
    assert r["density"] == pytest.approx(cap.calls[0].selection.mean_density)
    assert pbs_retained_mass(q, k, cfg.replace(dense_tail_blocks=0), last=16)["mean_retained_mass"] < 1.0


def test_pbs_retained_mass_at_spread_positions():
    from sparseflow.eval.attention_mass import spread_positions

    q, k = _qk(6, 2)
    pos = spread_positions(384, 3, start=64, width=16)
    assert pos.numel() == 48 and int(pos.min()) == 64 and int(pos.max()) == 383
    cfg = PBSConfig(block_size=16, segment_size=32, threshold=0.7)
    r = pbs_retained_mass(q, k, cfg, positions=pos)
    with capture() as cap:
        attention(q, k, torch.zeros_like(k), config=cfg, is_causal=True, backend="reference")
    keys = cap.calls[0].selection.key_mask(6)[0].float()
    want = (_probs(q, k) * keys).sum(-1)[:, pos].mean()
    assert r["mean_retained_mass"] == pytest.approx(float(want), rel=1e-5)
    with pytest.raises(ValueError, match="positions must be"):
        pbs_retained_mass(q, k, cfg, positions=torch.tensor([384]))
    with pytest.raises(ValueError, match="need 0 <= start < n"):
        spread_positions(10, 0)


def test_capture_qkv_runs_gqa_without_enable_gqa_and_the_same_model(monkeypatch):
    """enable_gqa sends fp32 on CUDA to SDPA's math kernel (N x N scores); the capture repeats the
    heads instead, and the model it runs stays the same: the last layer's V (made from every
    earlier layer's attention output) equals a plain forward's."""
    pytest.importorskip("transformers")
    import conftest
    from sparseflow.eval.attention_mass import capture_qkv

    model = conftest.make_tiny("llama", layers=3)
    ids = torch.randint(3, 128, (1, 48), generator=torch.Generator().manual_seed(1))
    last = model.model.layers[-1].self_attn
    seen = {}
    h = last.v_proj.register_forward_hook(lambda m, a, o: seen.update(v=o.detach()))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    h.remove()
    real_sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = []

    def spy(q, k, v, *a, **kw):
        calls.append((q.shape[1], k.shape[1], kw.get("enable_gqa", False)))
        return real_sdpa(q, k, v, *a, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    layers = capture_qkv(model, ids)
    assert calls == [(6, 6, False)] * 3
    want = seen["v"].view(1, 48, 2, 16).transpose(1, 2)
    torch.testing.assert_close(layers[-1][2], want.float(), rtol=1e-5, atol=1e-6)
