"""The leaf-block sums kernel (``block_summaries_triton``) on keys and sums that start 2**31
elements or more into their tensors (long contexts): its offsets are 64-bit, so it reads and
writes them in place (the Triton interpreter on the CPU; strided views keep the memory touched
to a few pages)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from _far_views import allocate_as, far_views

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

DEV = "cuda" if torch.cuda.is_available() else "cpu"

# 4-byte elements: each view's buffer holds about 2**32 elements (16 GiB of address space); the
# sums get a buffer of their own (an op's output may not alias its input)
_RB = 2**30 + 2**12  # batch row stride: batch 2 starts 2**31 + 2**13 into the view
# (B, Hkv, Nk, D, C, [(shape, strides, offset) of k, sums])
FAR_LAYOUTS = {
    "batch-rows": (
        3,
        2,
        32,
        16,
        4,
        [((3, 2, 32, 16), (_RB, 512, 16, 1), 0), ((3, 2, 8, 16), (_RB, 128, 16, 1), 0)],
    ),
    # key 31 and leaf 7 start 2**31 elements or more into their head (key- / leaf-major layouts)
    "positions": (
        1,
        2,
        32,
        16,
        4,
        [((1, 2, 32, 16), (0, 16, 2**31 // 31 + 1, 1), 0), ((1, 2, 8, 16), (0, 16, 2**31 // 7 + 1, 1), 0)],
    ),
}


@pytest.mark.parametrize("layout", FAR_LAYOUTS.values(), ids=FAR_LAYOUTS.keys())
def test_leaf_sums_read_keys_and_write_sums_past_int32_elements(layout, monkeypatch):
    from sparseflow.kernels.block_summaries_triton import leaf_sums

    b, hkv, nk, d, c, specs = layout
    (k_far,) = far_views(specs[:1], torch.float32, DEV)
    (sums_far,) = far_views(specs[1:], torch.float32, DEV)
    k = torch.randn(b, hkv, nk, d, generator=torch.Generator().manual_seed(5))
    k_far.copy_(k)
    sums_far.fill_(-7.0)  # what stays unwritten shows
    want = leaf_sums(k, None, c)
    allocate_as(monkeypatch, sums_far.shape, torch.float32, sums_far)
    got = leaf_sums(k_far, None, c)
    assert got[0].data_ptr() == sums_far.data_ptr(), "the sums must be written into the far view"
    for name, g, w in zip(("sums", "counts", "first valid"), got, want):
        assert torch.equal(g, w), name
