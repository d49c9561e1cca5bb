"""benchmarks/per_head_study.py: the per-head mix runs the planned config on exactly the planned
heads (dense SDPA's output elsewhere), and a per-head plan groups a layer's heads by choice."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import per_head_study  # noqa: E402
from conftest import make_tiny  # noqa: E402

import sparseflow  # noqa: E402
from sparseflow import calibrate as cal  # noqa: E402

pytest.importorskip("transformers")

N = 96
CFG = sparseflow.PBSConfig(block_size=16, segment_size=32, threshold=0.3, force_sink=False)


def _qkv(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 6, N, 16, generator=g)
    k = torch.randn(1, 2, N, 16, generator=g)
    v = torch.randn(1, 2, N, 16, generator=g)
    return q, k, v


@pytest.mark.parametrize("heads", [(4,), (0, 5), ()], ids=["head4", "heads0and5", "none"])
def test_mix_runs_the_config_on_the_planned_heads_only(heads):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model = make_tiny("llama", layers=2)
    module = model.model.layers[1].self_attn
    q, k, v = _qkv()
    mask = torch.zeros(6, dtype=torch.bool)
    mask[list(heads)] = True
    mix = per_head_study.HeadMix("reference")
    mix.layers = {1: [(CFG, mask)]}
    got, _ = mix.forward(module, q, k, v, None, scaling=module.scaling)
    dense, _ = sdpa_attention_forward(module, q, k, v, None, scaling=module.scaling)
    sparse = sparseflow.attention(q, k, v, config=CFG, is_causal=True, scale=module.scaling, backend="reference")
    sparse = sparse.transpose(1, 2)
    for h in range(6):
        want = sparse[:, :, h] if h in heads else dense[:, :, h]
        torch.testing.assert_close(got[:, :, h], want, rtol=0, atol=0)
        assert not torch.equal(sparse[:, :, h], dense[:, :, h]), "the config must be sparse on this input"
    dens = mix.densities[1]
    assert dens.shape == (6,)
    assert all(float(dens[h]) < 1.0 if h in heads else float(dens[h]) == 1.0 for h in range(6))


def test_layers_without_a_plan_run_dense_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model = make_tiny("llama", layers=2)
    module = model.model.layers[0].self_attn
    q, k, v = _qkv(1)
    mix = per_head_study.HeadMix("reference")
    mix.layers = {1: [(CFG, torch.ones(6, dtype=torch.bool))]}
    got, _ = mix.forward(module, q, k, v, None, scaling=module.scaling)
    dense, _ = sdpa_attention_forward(module, q, k, v, None, scaling=module.scaling)
    assert torch.equal(got, dense) and 0 not in mix.densities


def test_head_plan_groups_a_layers_heads_by_choice():
    lo = cal.Choice((("threshold", 0.5),))
    hi = cal.Choice((("threshold", 0.9),))
    heads = 3

    def m(kl, cost):
        return cal.Measurement(kl=kl, top1=1.0, density=cost * heads, cost=cost)

    dense = m(0.0, 1.0 / heads)
    table = {
        (0, 0): {cal.DENSE: dense, lo: m(0.001, 0.05), hi: m(0.0001, 0.2)},
        (0, 1): {cal.DENSE: dense, lo: m(0.5, 0.05), hi: m(0.4, 0.2)},  # costly in KL: goes dense
        (0, 2): {cal.DENSE: dense, lo: m(0.001, 0.05), hi: m(0.0001, 0.2)},
        (1, 0): {cal.DENSE: dense, lo: m(0.0005, 0.05), hi: m(0.0001, 0.2)},
        (1, 1): {cal.DENSE: dense, lo: m(0.0005, 0.05), hi: m(0.0001, 0.2)},
        (1, 2): {cal.DENSE: dense, lo: m(0.0005, 0.05), hi: m(0.0001, 0.2)},
    }
    s = type("S", (), {"base": sparseflow.PBSConfig()})()
    mix, pred = per_head_study.head_plan_mix(s, table, allowed=0.01, heads=heads)
    got = {layer: {cfg.threshold: mask.tolist() for cfg, mask in parts} for layer, parts in mix.items()}
    assert got == {0: {0.5: [True, False, True]}, 1: {0.5: [True, True, True]}}
    assert pred == pytest.approx(0.001 * 2 + 0.0005 * 3)
