"""The tiled token-sparse attention kernel (``token_sparse_triton``) on q / k / v rows that start
2**31 elements or more into their tensors (long contexts): its offsets are 64-bit, so it reads
and writes those rows in place. Strided views into one reserved-but-unwritten CPU buffer keep the
memory touched to a few pages (the Triton interpreter on the CPU).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

DEV = "cuda" if torch.cuda.is_available() else "cpu"

# The offsets a 32-bit product wraps (2**31 and past, less than 2**32) land before _FAR_START,
# outside every view, in pages never written
_FAR_START = 2**31
_R = 3 * 2**29  # batch row stride: batch 2 starts 2**31 + 2**30 into the view
# (B, Hq, Nq, Nk, D, [(shape, strides, offset) of q, k, v])
FAR_LAYOUTS = {
    "batch-rows": (
        3,
        2,
        3,
        32,
        16,
        [
            ((3, 2, 3, 16), (_R, 48, 16, 1), 1024),
            ((3, 1, 32, 16), (_R, 512, 16, 1), 0),
            ((3, 1, 32, 16), (_R, 512, 16, 1), 512),
        ],
    ),
    # keys 16.. and query 2 start 2**31 elements or more into one head (a key-major layout)
    "key-positions": (
        1,
        2,
        3,
        32,
        16,
        [
            ((1, 2, 3, 16), (0, 16, 2**30, 1), 2**26),
            ((1, 1, 32, 16), (0, 0, 2**27, 1), 0),
            ((1, 1, 32, 16), (0, 0, 2**27, 1), 16),
        ],
    ),
}


def _far_views(specs, dtype):
    """Strided views into one reserved-but-unwritten CPU buffer (only the pages written are
    touched), or a skip where that address space cannot be reserved."""
    if DEV != "cpu":
        pytest.skip("the strided views rely on untouched CPU pages staying unallocated")
    end = max(off + sum((n - 1) * st for n, st in zip(shape, strides)) for shape, strides, off in specs)
    try:
        big = torch.empty(_FAR_START + end + 1, dtype=dtype)
    except RuntimeError:
        pytest.skip(f"cannot reserve {_FAR_START + end + 1} {dtype} elements of address space")
    return [big.as_strided(shape, strides, _FAR_START + off) for shape, strides, off in specs]


@pytest.mark.parametrize("layout", FAR_LAYOUTS.values(), ids=FAR_LAYOUTS.keys())
def test_forward_reads_rows_past_int32_elements_in_place(layout):
    from sparseflow.kernels.token_sparse_triton import BLOCK_M, tile_block_lists, token_sparse_fwd

    b, hq, nq, nk, d, specs = layout
    far = _far_views(specs, torch.float16)
    g = torch.Generator().manual_seed(7)
    near = [torch.randn(t.shape, generator=g).to(torch.float16) for t in far]
    for f, n in zip(far, near):
        f.copy_(n)
    c = 4
    # blocks 5 and 7 hold keys 20.. (past 2**31 elements in the key-major layout)
    sel = torch.tensor([1, 5, 7], dtype=torch.int32).expand(b, 1, nq, 3).contiguous()
    num, lists = tile_block_lists(sel, BLOCK_M, nk // c)

    def fwd(q, k, v):
        return token_sparse_fwd(q, k, v, sel, num, lists, None, d**-0.5, c, False)

    want_out, want_lse = fwd(*near)
    got_out, got_lse = fwd(*far)
    assert torch.isfinite(want_out).all()
    assert torch.equal(got_out, want_out) and torch.equal(got_lse, want_lse)


@pytest.mark.parametrize("layout", FAR_LAYOUTS.values(), ids=FAR_LAYOUTS.keys())
def test_backward_reads_and_writes_key_rows_past_int32_elements_in_place(layout, monkeypatch):
    """Both backward kernels on k / v rows past 2**31 elements (q small). The kernels index dk / dv
    with k's strides (``token_sparse_attention`` passes a contiguous k, where ``empty_like`` gives
    those), so here dk / dv get k's far layout too: virtual, only the pages written are touched."""
    from sparseflow.kernels import token_sparse_triton as ts

    b, hq, nq, nk, d, specs = layout
    k_far, v_far = _far_views(specs[1:], torch.float16)
    g = torch.Generator().manual_seed(8)
    q, k, v, go = (
        torch.randn(t, generator=g).to(torch.float16)
        for t in ((b, hq, nq, d), k_far.shape, v_far.shape, (b, hq, nq, d))
    )
    k_far.copy_(k)
    v_far.copy_(v)
    c = 4
    sel = torch.tensor([1, 5, 7], dtype=torch.int32).expand(b, 1, nq, 3).contiguous()
    num, lists = ts.tile_block_lists(sel, ts.BLOCK_M, nk // c)
    start, tiles = ts.transpose_lists(num, lists, nk // c)
    empty_like = torch.empty_like

    def like_far(t, **kw):
        if t.is_contiguous():
            return empty_like(t, **kw)
        return _far_views([(t.shape, t.stride(), 0)], t.dtype)[0]

    out, lse = ts.token_sparse_fwd(q, k, v, sel, num, lists, None, d**-0.5, c, False)

    def grads(kk, vv):
        return ts.token_sparse_bwd(go, q, kk, vv, out, lse, sel, num, lists, start, tiles, None, d**-0.5, c, False)

    want = grads(k, v)
    monkeypatch.setattr(torch, "empty_like", like_far)
    got = grads(k_far, v_far)
    assert all(torch.isfinite(w).all() and w.abs().max() > 0 for w in want)
    for name, g_, w in zip(("dq", "dk", "dv"), got, want):
        assert torch.equal(g_, w), name
