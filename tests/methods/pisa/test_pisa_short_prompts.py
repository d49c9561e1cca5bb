"""PISA's Triton backend on prompts of a few tokens (a pyramid of one or two leaves), every walk,
through Triton's interpreter: the selection equals the reference's and the output equals dense
causal attention (a prompt within one block sees every earlier key). That the same launch shapes
compile for sm_90 is checked by tests/sm90_compile.py's ``short`` entry."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

import sparseflow
from sparseflow.methods.pisa import reference as pisa_ref

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

WALKS = ("per_token", "tiled", "scan")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("walk", WALKS)
@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 33])
def test_short_prompt_selection_and_output(walk, n):
    from sparseflow.methods.pisa import triton_select

    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(1, h, n, 32, generator=g).to(DEVICE) for h in (6, 2, 2))
    kw = dict(is_causal=True, block_size=16, top_k=3)
    want = pisa_ref.pisa_select(q, k, **kw)
    got = triton_select.pisa_select(q, k, tuning=sparseflow.Tuning(pisa_walk=walk), **kw)
    assert torch.equal(got, want)
    out = sparseflow.attention(
        q,
        k,
        v,
        config=sparseflow.PISAConfig(block_size=16, top_k=3),
        is_causal=True,
        backend="triton",
        tuning=sparseflow.Tuning(pisa_walk=walk),
    )
    dense = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    # at most 3 blocks of 16: every length here is exact (the sink, previous and current blocks)
    torch.testing.assert_close(out, dense, atol=2e-6, rtol=2e-6)
