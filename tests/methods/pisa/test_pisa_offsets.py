"""The PISA pyramid's node kernel and both selection walks (per-token and tiled) on tensors whose
rows start 2**31 elements or more into them (long contexts): their offsets are 64-bit, so they
read and write those rows in place. The Triton interpreter on the CPU; strided views into
reserved-but-unwritten buffers keep the memory touched to a few pages (``_far_views``).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from _far_views import allocate_as, blinded, far_views

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# fp32 leaf sums / node summaries: 4-byte elements, so each view's buffer holds about 2**32
# elements (16 GiB of address space); an op's output gets a buffer of its own (it may not alias
# an input)
_RB = 2**30 + 2**12  # batch row stride: batch 2 starts 2**31 + 2**13 into the view
# (B, Hkv, Nk, C, g, D, [(shape, strides, offset) of the leaf sums, the node summaries])
NODE_LAYOUTS = {
    "batch-rows": (
        3,
        2,
        32,
        4,
        2,
        16,
        [((3, 2, 8, 16), (_RB, 128, 16, 1), 0), ((3, 2, 15, 16), (_RB, 240, 16, 1), 0)],
    ),
    # leaf 7 and node 14 (the root) start 2**31 elements or more into their head
    "node-positions": (
        1,
        2,
        32,
        4,
        2,
        16,
        [((1, 2, 8, 16), (0, 16, 2**31 // 7 + 1, 1), 0), ((1, 2, 15, 16), (0, 16, 2**31 // 14 + 1, 1), 0)],
    ),
}


@pytest.mark.parametrize("layout", NODE_LAYOUTS.values(), ids=NODE_LAYOUTS.keys())
def test_pyramid_nodes_read_sums_and_write_summaries_past_int32_elements(layout, monkeypatch):
    from sparseflow.kernels.block_summaries_triton import leaf_sums
    from sparseflow.methods.pisa import triton_select as ts

    b, hkv, nk, c, g, d, specs = layout
    (sums_far,) = far_views(specs[:1], torch.float32, DEVICE)
    (summ_far,) = far_views(specs[1:], torch.float32, DEVICE)
    k = torch.randn(b, hkv, nk, d, generator=torch.Generator().manual_seed(6))
    sums, cnt, lfv = leaf_sums(k, None, c)
    sizes, _, lvl_off, lvl_span = ts.pyramid_tables(sums.shape[2], g, DEVICE)
    assert sum(sizes) == summ_far.shape[2]
    sums_far.copy_(sums)
    summ_far.fill_(-7.0)  # what stays unwritten shows

    def nodes(s):
        return ts._pisa_nodes(s, cnt, lfv, lvl_off, lvl_span, nk, sum(sizes))

    want = nodes(sums)
    allocate_as(monkeypatch, summ_far.shape, torch.float32, summ_far)
    got = nodes(sums_far)
    assert got[0].data_ptr() == summ_far.data_ptr(), "the summaries must be written into the far view"
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# fp16 q / k as in the per-token walk's test (tests/methods/test_pisa_bsa_triton.py): the offsets a
# 32-bit product wraps land before the views, outside every view
_R = 3 * 2**29  # batch row stride: batch 2 starts 2**31 + 2**30 into the view
# (B, Hq, Nq, Nk, D, [(shape, strides, offset) of k, q])
QK_LAYOUTS = {
    "batch-rows": (3, 2, 3, 32, 16, [((3, 1, 32, 16), (_R, 512, 16, 1), 0), ((3, 2, 3, 16), (_R, 48, 16, 1), 512)]),
    # keys 16.. and query 2 start 2**31 elements or more into one head (a key-major layout)
    "key-positions": (
        1,
        2,
        3,
        32,
        16,
        [((1, 1, 32, 16), (0, 0, 2**27, 1), 0), ((1, 2, 3, 16), (0, 16, 2**30, 1), 2**26)],
    ),
}


def _qk(b, hq, nq, nk, d, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, nq, d, generator=g)
    k = torch.randn(b, 1, nk, d, generator=g)
    return q.to(torch.float16), k.to(torch.float16)


def _qk_walk_op(name):
    from sparseflow.methods.pisa.triton_select_pairs import pisa_select_pairs_fwd
    from sparseflow.methods.pisa.triton_select_scan import pisa_select_scan_fwd
    from sparseflow.methods.pisa.triton_select_tiled import pisa_select_tiled_fwd

    return {"tiled": pisa_select_tiled_fwd, "scan": pisa_select_scan_fwd, "leaf-pairs": pisa_select_pairs_fwd}[name]


@pytest.mark.parametrize("walk_name", ["tiled", "scan", "leaf-pairs"])
@pytest.mark.parametrize("layout", QK_LAYOUTS.values(), ids=QK_LAYOUTS.keys())
def test_walks_read_queries_and_keys_past_int32_elements(layout, walk_name):
    """The tiled walk, and the scan's node scores, walk and leaf pairs, take a row's offset in 32
    bits only where the tensors' (batch, head) slices stay under 2**31 elements (``I64_ROWS``):
    the key-major layout passes it inside one head, the batch layout only across batches."""
    from sparseflow.methods.pisa import triton_select as ts
    from sparseflow.methods.pisa.triton_select_common import walk_meta

    b, hq, nq, nk, d, specs = layout
    k_far, q_far = far_views(specs, torch.float16, DEVICE)
    q, k = _qk(b, hq, nq, nk, d, seed=4)
    k_far.copy_(k)
    q_far.copy_(q)
    c, g, kk = 4, 2, 3
    summ, nfv, _, lvl_off, lvl_span = ts.build_pyramid(k, block_size=c, branching=g)
    wide = walk_meta(q_far, k_far, None, summ, lvl_span, False, 0, False, False, c, g, kk, 1)["I64_ROWS"]
    assert wide == (layout is QK_LAYOUTS["key-positions"])
    op = _qk_walk_op(walk_name)

    def walk(qq, kk_):
        return op(qq, kk_, None, summ, nfv, lvl_off, lvl_span, d**-0.5, False, 0, c, g, kk, False, False, 1)

    want = walk(q, k)
    assert (want >= 0).all() and kk < nk // c, "the leaves must be scored from the raw keys"
    assert not torch.equal(walk(blinded(q, q_far), k), want), "the selection must depend on the far queries"
    assert not torch.equal(walk(q, blinded(k, k_far)), want), "the selection must depend on the far keys"
    assert torch.equal(walk(q_far, k_far), want)


# Node summaries and selections far: 128 keys in 64 leaves of 2 (levels of 64, 32, 16, 8, 4, 2 and
# 1 nodes: 127), top_k 2, non-causal. Every query keeps both children of the root and its current
# block's ancestors; the other node it keeps among nodes 120-123 is picked by their summaries
# ("mean") or by those of their children (nodes 112-119, "lse"). Nodes 112.. start 2**31 elements
# or more into the table, selection row 2 2**31 elements or more into the output.
_B, _HQ, _NQ, _NK, _D, _C, _G, _TOPK = 1, 2, 3, 128, 16, 2, 2, 2
_FAR_NODE = 112
_SUMM_FAR = ((1, 1, 127, 16), (0, 0, 2**31 // _FAR_NODE + 1, 1), 0)
_OUT_FAR = ((1, 1, _NQ, _TOPK), (0, 0, 2**30 + 2**20, 1), 0)


def _walk_op(name):
    from sparseflow.methods.pisa import triton_select_per_token as per_token
    from sparseflow.methods.pisa import triton_select_tiled as tiled

    return {"per-token": per_token._pisa_select_fwd, "tiled": tiled.pisa_select_tiled_fwd}[name]


@pytest.mark.parametrize("score", ["lse", "mean"])
@pytest.mark.parametrize("walk_name", ["per-token", "tiled"])
def test_walk_reads_summaries_and_writes_selections_past_int32_elements(walk_name, score, monkeypatch):
    from sparseflow.methods.pisa import triton_select as ts
    from sparseflow.methods.pisa.triton_select_common import SCORE_CODES

    (summ_far,) = far_views([_SUMM_FAR], torch.float32, DEVICE)
    (out_far,) = far_views([_OUT_FAR], torch.float32, DEVICE)
    out_far = out_far.view(torch.int32)
    g = torch.Generator().manual_seed(11)
    q = torch.randn(_B, _HQ, _NQ, _D, generator=g)
    k = torch.randn(_B, 1, _NK, _D, generator=g)
    summ, nfv, _, lvl_off, lvl_span = ts.build_pyramid(k, block_size=_C, branching=_G)
    assert summ.shape == summ_far.shape
    summ_far.copy_(summ)
    out_far.fill_(-7)  # what stays unwritten shows
    op = _walk_op(walk_name)
    rules = (_D**-0.5, False, SCORE_CODES[score], _C, _G, _TOPK, False, False, 1)

    def walk(s):
        return op(q, k, None, s, nfv, lvl_off, lvl_span, *rules)

    want = walk(summ)
    assert not torch.equal(walk(blinded(summ, summ_far)), want), "the selection must depend on the far nodes"
    allocate_as(monkeypatch, out_far.shape, torch.int32, out_far)
    got = walk(summ_far)
    assert got.data_ptr() == out_far.data_ptr(), "the selections must be written into the far view"
    assert torch.equal(got, want)
