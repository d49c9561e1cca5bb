"""The tiled token-sparse attention (BSA's and PISA's prefill kernel) on strided views: a model's
``[B, N, H, D]`` projections seen as ``[B, H, N, D]`` and a head-dim slice of a wider buffer are
read in place (no copy: the output follows q's memory order), equal bitwise to the same values
made contiguous, gradients included; a head dim that is not contiguous is copied first.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
B, HQ, HKV, N, D, C = 2, 4, 2, 40, 16, 8


def _tokens_major(h, g):
    """``[B, h, N, D]`` views of ``[B, N, h, D]`` memory (what a model's q/k/v projections give)."""
    return torch.randn(B, N, h, D, generator=g).to(DEV).transpose(1, 2)


def _sliced(h, g):
    """``[B, h, N, D]`` views of the first D of 2*D channels (rows strided past the head dim)."""
    return torch.randn(B, h, N, 2 * D, generator=g).to(DEV)[..., :D]


def _strided_dim(h, g):
    """A head dim with stride 2: the kernel cannot read it, so it is copied."""
    return torch.randn(B, h, N, D, 2, generator=g).to(DEV)[..., 0]


# name -> (make, whether the output keeps q's memory order: only a q read in place, with
# dense strides that empty_like keeps)
LAYOUTS = {
    "tokens-major": (_tokens_major, True),
    "head-dim-slice": (_sliced, False),
    "head-dim-stride-2": (_strided_dim, False),
}


@pytest.mark.parametrize("make, out_like_q", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_views_equal_contiguous_inputs(make, out_like_q):
    from sparseflow.kernels.token_sparse_triton import token_sparse_attention

    g = torch.Generator().manual_seed(3)
    q, k, v = make(HQ, g), make(HKV, g), make(HKV, g)
    sel = torch.randint(0, N // C, (B, HKV, N, 3), generator=g).to(DEV)
    views = [t.detach().requires_grad_() for t in (q, k, v)]
    dense = [t.detach().contiguous().requires_grad_() for t in (q, k, v)]
    got = token_sparse_attention(*views, sel, block_size=C, is_causal=True)
    want = token_sparse_attention(*dense, sel, block_size=C, is_causal=True)
    assert torch.isfinite(want).all() and want.abs().max() > 0
    assert torch.equal(got, want)
    # the output is allocated like q: a tokens-major q read in place gives a tokens-major output
    assert (got.stride() == q.stride()) == out_like_q
    grad = torch.randn(want.shape, generator=g).to(DEV)
    for a, b_, name in zip(torch.autograd.grad(got, views, grad), torch.autograd.grad(want, dense, grad), "qkv"):
        assert torch.isfinite(b_).all() and b_.abs().max() > 0, name
        assert torch.equal(a, b_), name
