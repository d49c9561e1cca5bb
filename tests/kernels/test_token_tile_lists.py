"""Each query tile's distinct selected blocks (``token_sparse_triton.tile_block_lists``): the
Triton kernel (interpreter on the CPU) against the torch version, element for element, on
poisoned outputs."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _selection(b, hkv, n_q, k, n_blocks, unused, seed):
    """Per-row distinct block ids (a selector's output), ``unused`` of each row's slots -1."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(n_blocks, generator=g)[:k] for _ in range(b * hkv * n_q)]).view(b, hkv, n_q, k)
    if unused:
        drop = torch.rand(b, hkv, n_q, k, generator=g) < unused
        ids = torch.where(drop, torch.full_like(ids, -1), ids)
    return ids.to(torch.int32).to(DEV)


# id: (B, Hkv, Nq, K, block_m, n_blocks, share of unused slots)
CASES = {
    "k8-tile16": (1, 3, 64, 8, 16, 128, 0.0),
    "k8-tile21-packed-group-of-3": (1, 3, 100, 8, 21, 128, 0.1),
    "k5-ragged-tail": (2, 2, 37, 5, 16, 9, 0.3),
    "k16-tile64-many-blocks": (1, 1, 130, 16, 64, 300, 0.1),
    "k1": (1, 2, 20, 1, 8, 4, 0.0),
    "all-unused": (1, 1, 17, 4, 16, 8, 1.0),
    "decode-one-row": (2, 3, 1, 6, 16, 40, 0.2),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_kernel_lists_equal_torch(case, poisoned):
    from sparseflow.kernels import token_sparse_triton as ts

    b, hkv, n_q, k, block_m, n_blocks, unused = case
    sel = _selection(b, hkv, n_q, k, n_blocks, unused, seed=n_q + k)
    want_num, want_lists = ts.tile_block_lists_torch(sel, block_m, n_blocks)
    num, lists = poisoned(ts.tile_block_lists, sel, block_m, n_blocks)
    assert torch.equal(num, want_num)
    assert torch.equal(lists, want_lists)
    if unused < 1:
        assert int(num.max()) > 1  # some tile has several blocks


def test_lists_kernel_is_what_runs_and_opchecks():
    from sparseflow.kernels import token_sparse_triton as ts

    sel = _selection(1, 2, 40, 4, 50, 0.2, seed=3)
    args = (sel, 16, 50)
    # schema and fake implementation (under the interpreter the kernel cannot run on fake tensors)
    tests = ("test_schema", "test_faketensor") if DEV == "cpu" else None
    if tests is None:
        torch.library.opcheck(torch.ops.sparseflow.token_tile_lists.default, args)
    else:
        torch.library.opcheck(torch.ops.sparseflow.token_tile_lists.default, args, test_utils=tests)
    num, lists = torch.ops.sparseflow.token_tile_lists(*args)
    want = ts.tile_block_lists_torch(*args)
    assert torch.equal(num, want[0]) and torch.equal(lists, want[1])
