"""Selection.row_keys: one query's attended keys, equal to that row of the quadratic key_mask."""

import pytest
import torch

from sparseflow.methods.bsa.reference import bsa_attention
from sparseflow.methods.pbs.reference import pbs_attention
from sparseflow.methods.pisa.reference import pisa_attention
from sparseflow.selection import visible_key_mask


def _qkv(n, hq=4, hkv=2, d=16, b=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=g) for h in (hq, hkv, hkv))


def _padding(n):
    pad = torch.ones(2, n, dtype=torch.bool)
    pad[1, : n // 3] = False  # left padding in the second row
    return pad


CASES = {
    "pbs-permuted-query-head": (pbs_attention, dict(block_size=16, segment_size=32, threshold=0.3)),
    "pbs-kv-head-permutation": (
        pbs_attention,
        dict(block_size=16, segment_size=32, threshold=0.3, gqa_permutation="kv_head"),
    ),
    "pbs-unpermuted": (pbs_attention, dict(block_size=16, segment_size=32, threshold=0.3, permute=False)),
    "pisa": (pisa_attention, dict(block_size=8, top_k=3)),
    "bsa": (bsa_attention, dict(block_size=8, top_k=3)),
}


@pytest.mark.parametrize("padded", [False, True], ids=["no-padding", "padding"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("n", [61, 96], ids=["n61", "n96"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_row_keys_is_the_key_mask_row(case, n, causal, padded):
    fn, kw = CASES[case]
    q, k, v = _qkv(n)
    pad = _padding(n) if padded else None
    _, sel = fn(q, k, v, key_padding_mask=pad, is_causal=causal, return_selection=True, **kw)
    full = sel.key_mask(q.shape[1])
    visible = visible_key_mask(n, n, is_causal=causal, key_padding_mask=pad, batch=2)[:, None].expand_as(full)
    assert bool(full.any()) and not torch.equal(full, visible)  # sparse: some visible key is dropped
    for t in range(n):
        assert torch.equal(sel.row_keys(t, q.shape[1]), full[:, :, t]), f"row {t}"


def test_row_keys_rejects_a_query_outside_the_prompt():
    q, k, v = _qkv(40)
    _, sel = pbs_attention(q, k, v, block_size=16, segment_size=32, return_selection=True)
    for bad in (-1, 40):
        with pytest.raises(ValueError, match=r"query must be in \[0, 40\)"):
            sel.row_keys(bad, 4)
