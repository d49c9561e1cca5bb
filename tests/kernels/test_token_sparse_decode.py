"""The split-K decode attention (``token_sparse_decode_triton``) against an fp64 oracle (the
reference attention over the same blocks) under the 2x-PyTorch-error rule, and against the tiled
kernel it replaces at decode time; on small, odd shapes (the Triton interpreter on the CPU).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from sparseflow.kernels import token_blocks as tb

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(b, hq, hkv, nq, nk, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g) for h, n in ((hq, nq), (hkv, nk), (hkv, nk)))
    return q.to(DEV, dtype), k.to(DEV, dtype), v.to(DEV, dtype)


def _ids(b, hkv, nq, n_blocks, kk, seed, holes=()):
    """Distinct block ids per row in random order, ``-1`` in the slots ``holes`` (any slot)."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(n_blocks, generator=g)[:kk] for _ in range(b * hkv * nq)]
    idx = torch.stack(rows).view(b, hkv, nq, kk).to(torch.int32)
    for slot in holes:
        idx[..., slot] = -1
    return idx.to(DEV)


def _err(x, ref64):
    return (x.double() - ref64).abs().max().item()


def _rounding_slack(dtype, ref64) -> float:
    """Triton's CPU interpreter truncates fp32 -> bf16 where the GPU rounds to nearest: one bf16
    ulp of the largest output more there."""
    from sparseflow.kernels._triton_env import interpreting

    if dtype != torch.bfloat16 or not interpreting():
        return 0.0
    return torch.finfo(dtype).eps * ref64.abs().max().item()


def _padding(b, nk):
    kpm = torch.ones(b, nk, dtype=torch.bool)
    kpm[0, :5] = False
    kpm[-1, nk - 9 :] = False
    return kpm.to(DEV)


# id: (B, Hq, Hkv, Nq, Nk, D, C, K, holes, splits, pad, causal, dtype)
CASES = {
    "g1-k5-splits3-fp32": (1, 2, 2, 1, 61, 16, 8, 5, (), 3, False, True, torch.float32),
    "g3-k7-holes-splits5-pad": (2, 6, 2, 1, 83, 24, 6, 7, (1, 6), 5, True, True, torch.float32),
    "g4-k7-one-split-multiblock": (1, 8, 2, 1, 90, 16, 4, 7, (3,), 1, False, True, torch.float32),
    "g2-nq3-causal-splits-gt-k": (1, 4, 2, 3, 47, 16, 8, 5, (0,), 9, True, True, torch.float32),
    "g3-noncausal-auto-splits": (2, 3, 1, 2, 50, 32, 8, 6, (2,), None, False, False, torch.float32),
    "bf16-g4-k7-splits3": (1, 8, 2, 1, 120, 32, 16, 7, (5,), 3, True, True, torch.bfloat16),
    "fp16-g1-k5-splits2": (2, 2, 2, 1, 70, 16, 8, 5, (4,), 2, False, True, torch.float16),
    "fp16-g3-nq2-multiblock": (1, 6, 2, 2, 64, 24, 4, 9, (), 2, True, True, torch.float16),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_split_decode_matches_fp64_oracle_within_twice_plain_torch(case):
    from sparseflow.kernels.token_sparse_decode_triton import token_sparse_decode

    b, hq, hkv, nq, nk, d, c, kk, holes, splits, pad, causal, dtype = case
    q, k, v = _inputs(b, hq, hkv, nq, nk, d, dtype, seed=nk)
    idx = _ids(b, hkv, nq, -(-nk // c), kk, seed=kk, holes=holes)
    kw = dict(key_padding_mask=_padding(b, nk) if pad else None, is_causal=causal, block_size=c)
    oracle = tb.attend_selected_blocks(q.double(), k.double(), v.double(), idx, **kw)
    plain = tb.attend_selected_blocks(q, k, v, idx, **kw)
    got = token_sparse_decode(q, k, v, idx, splits=splits, **kw)
    assert got.dtype == dtype and got.shape == q.shape and torch.isfinite(got).all()
    assert oracle.abs().max() > 0, "the case must attend to something"
    tol = 2 * _err(plain, oracle) + (1e-6 if dtype == torch.float32 else 1e-3) * oracle.abs().max().item()
    tol += _rounding_slack(dtype, oracle)
    assert _err(got, oracle) <= tol, f"{_err(got, oracle):.3g} > {tol:.3g}"


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
def test_split_decode_equals_the_tiled_kernel_for_any_split(splits):
    """The merge is exact: every split count gives the tiled kernel's answer (fp32, up to rounding)."""
    from sparseflow.kernels.token_sparse_decode_triton import token_sparse_decode
    from sparseflow.kernels.token_sparse_triton import token_sparse_attention

    q, k, v = _inputs(1, 6, 2, 1, 75, 16, torch.float32, seed=3)
    idx = _ids(1, 2, 1, 10, 7, seed=4, holes=(2,))
    kpm = _padding(1, 75)
    want = token_sparse_attention(q, k, v, idx, key_padding_mask=kpm, block_size=8)
    got = token_sparse_decode(q, k, v, idx, key_padding_mask=kpm, block_size=8, splits=splits)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_hidden_keys_are_never_read_and_a_row_seeing_nothing_is_zero():
    """NaN in padded keys, in unselected blocks and past the causal horizon stays out; a query
    head group whose row selects nothing (all ``-1``) outputs 0, not NaN."""
    from sparseflow.kernels.token_sparse_decode_triton import token_sparse_decode

    nk, c = 40, 8
    q, k, v = _inputs(1, 4, 2, 2, nk, 16, torch.float32, seed=7)
    idx = torch.tensor([[[[0, 4, -1], [2, 3, -1]], [[-1, -1, -1], [1, -1, 3]]]], dtype=torch.int32, device=DEV)
    kpm = torch.ones(1, nk, dtype=torch.bool, device=DEV)
    kpm[0, 3] = False  # a padded key inside a selected block
    k_bad, v_bad = k.clone(), v.clone()
    for t in (k_bad, v_bad):
        t[:, :, 3] = float("nan")  # padded
        t[:, :, 40 - 1] = float("nan")  # past row 0's horizon (it sits at key 38)
        t[:, 0, 8:16] = float("nan")  # block 1: never selected by KV head 0
    got = token_sparse_decode(q, k_bad, v_bad, idx, key_padding_mask=kpm, block_size=c, splits=2)
    want = tb.attend_selected_blocks(q, k, v, idx, key_padding_mask=kpm, block_size=c)
    assert torch.isfinite(got).all()
    assert (got[:, 2:, 0] == 0).all(), "KV head 1's first row selects nothing: its query heads output 0"
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)


def test_nan_flag_turns_the_whole_output_nan():
    from sparseflow.kernels.token_sparse_decode_triton import token_sparse_decode_fwd

    q, k, v = _inputs(1, 4, 2, 1, 32, 16, torch.float32, seed=8)
    idx = _ids(1, 2, 1, 4, 3, seed=9)
    flag = torch.zeros(1, dtype=torch.uint8, device=DEV)
    ok = token_sparse_decode_fwd(q, k, v, idx, None, flag, 0.25, 8, True, 2)
    flag.fill_(1)
    bad = token_sparse_decode_fwd(q, k, v, idx, None, flag, 0.25, 8, True, 2)
    assert torch.isfinite(ok).all() and torch.isnan(bad).all()


def test_split_count_fills_the_device_and_leaves_no_split_empty():
    from sparseflow.kernels.token_sparse_decode_triton import decode_splits

    for groups, slots in ((8, 32), (1, 32), (64, 5), (3, 7), (200, 32)):
        s = decode_splits(groups, slots)
        per = -(-slots // s)
        assert 1 <= s <= slots and (s - 1) * per < slots, (groups, slots, s)
    assert decode_splits(8, 32) == 16 and decode_splits(1, 32) == 32 and decode_splits(200, 32) == 1
    assert decode_splits(4, 0) == 1


def test_split_decode_rejects_bad_arguments():
    from sparseflow.kernels.token_sparse_decode_triton import token_sparse_decode

    q, k, v = _inputs(1, 4, 2, 1, 32, 16, torch.float32, seed=10)
    idx = _ids(1, 2, 1, 4, 3, seed=11)
    with pytest.raises(ValueError, match="v's head dim"):
        token_sparse_decode(q, k, v[..., :8], idx, block_size=8)
    with pytest.raises(TypeError, match="one dtype"):
        token_sparse_decode(q, k.double(), v, idx, block_size=8)
    with pytest.raises(ValueError, match="multiple of the 2 KV heads"):
        token_sparse_decode(q[:, :3], k, v, idx, block_size=8)
    with pytest.raises(ValueError, match=r"block_indices must be \[1, 2, 1, K\]"):
        token_sparse_decode(q, k, v, idx[:, :1], block_size=8)
    with pytest.raises(ValueError, match="splits must be a positive int"):
        token_sparse_decode(q, k, v, idx, block_size=8, splits=0)
    with pytest.raises(ValueError, match=r"key_padding_mask must be \[1, 32\]"):
        token_sparse_decode(
            q, k, v, idx, key_padding_mask=torch.ones(1, 31, dtype=torch.bool, device=DEV), block_size=8
        )
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        token_sparse_decode(q, k, v, idx, block_size=0)


def test_offsets_past_int32_elements_reach_the_right_keys():
    """A batch row whose keys start 2**31 elements or more past the buffer's start (e.g. batch 3
    of 8 KV heads x 1M tokens x 128 dims): the offsets are 64-bit, not wrapped to another row's
    memory. The 8 GiB buffer is virtual; only the few pages written are touched."""
    from sparseflow.kernels.token_sparse_decode_triton import token_sparse_decode

    if DEV != "cpu":
        pytest.skip("the strided 8 GiB view relies on untouched CPU pages staying unallocated")
    b, nk, d, c = 3, 32, 16, 8
    row, start = 3 * 2**29, 2**30  # row 2 starts 2**31 + 2**30 past the view: wrapped, it reads element 0
    try:
        big = torch.empty(start + (b - 1) * row + 2 * nk * d, dtype=torch.float16)
    except RuntimeError:
        pytest.skip("no 8 GiB of address space")
    k, v = (big.as_strided((b, 1, nk, d), (row, nk * d, d, 1), start + off) for off in (0, nk * d))
    big[:start].as_strided((nk * d * 2,), (1,)).zero_()  # what a wrapped offset would read
    q, k_val, v_val = _inputs(b, 2, 1, 1, nk, d, torch.float16, seed=11)
    k.copy_(k_val)
    v.copy_(v_val)
    idx = _ids(b, 1, 1, nk // c, 3, seed=11)
    got = token_sparse_decode(q, k, v, idx, block_size=c, splits=2)
    want = tb.attend_selected_blocks(q, k_val, v_val, idx, block_size=c)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
