"""Local windows (``sliding_window``, ``chunk_size``) in the token-sparse Triton attention,
forward and backward, on the CPU through Triton's interpreter (the same tests run compiled on
CUDA): outputs and dq, dk, dv against an fp64 masked-dense oracle (tests/_window_oracle.py, the
mask built from the definitions) within the 2x-PyTorch-error rule, and the bound exact to the key.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from _pisa_walk_inputs import qkv_inputs
from _window_oracle import dense_window_attention

from sparseflow.kernels import token_blocks as tb

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


def _err(x, ref64):
    return (x.double() - ref64).abs().max().item()


def _selection(kind, b, hkv, n_q, n_k, c, w, chunk, seed=0):
    """``[B, Hkv, Nq, K]``: the window's own blocks (``window``), random blocks of each query's
    causal past that ignore the window (``random``: the kernel must drop the keys outside it), or
    those restricted to the window (``restricted``)."""
    if kind == "window":
        return tb.window_block_indices(n_q, n_k, c, w, chunk).expand(b, hkv, -1, -1)
    n_blocks = -(-n_k // c)
    g = torch.Generator().manual_seed(seed)
    keys = torch.rand(b, hkv, n_q, n_blocks, generator=g)
    cur = (torch.arange(n_q) + n_k - n_q).clamp_min(0) // c
    keys = torch.where(torch.arange(n_blocks) <= cur[:, None], keys, torch.full_like(keys, 2.0))
    # the current block and 3 random earlier ones (fewer near the start), ascending, -1 padded
    keys = torch.where(torch.arange(n_blocks) == cur[:, None], torch.full_like(keys, -1.0), keys)
    top = keys.topk(min(4, n_blocks), -1, largest=False)
    ids = torch.where(top.values <= 1.0, top.indices, torch.full_like(top.indices, n_blocks)).sort(-1).values
    sel = torch.where(ids < n_blocks, ids, torch.full_like(ids, -1))
    return tb.restrict_to_window(sel, n_k, c, w, chunk) if kind == "restricted" else sel


def _grads(fn, q, k, v, dt, seed=2):
    """``(out, dq, dk, dv)`` of ``fn(q, k, v)`` in dtype ``dt`` against a fixed output gradient."""
    qq, kk, vv = (t.detach().to(dt).requires_grad_(True) for t in (q, k, v))
    out = fn(qq, kk, vv)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(device=out.device, dtype=dt)
    return (out,) + torch.autograd.grad(out, (qq, kk, vv), go)


# id: (B, Hq, Hkv, Nq, Nk, D, C, W, chunk, pad, dtype, selection)
CASES = {
    # W below the block size: every block the window touches is partial
    "w3-lt-block-c8-gqa2": (1, 4, 2, 45, 45, 16, 8, 3, 0, False, torch.float32, "window"),
    # W not a multiple of C, Nq < Nk, padding in two batch rows
    "w13-c4-pad-b2-nq30-nk61": (2, 3, 1, 30, 61, 16, 4, 13, 0, True, torch.float32, "window"),
    # W above the block size and the tile's rows (group 2: 32 tokens a tile): whole blocks between
    # partial ones, a selection that ignores the window
    "w40-c4-gqa2-random": (1, 4, 2, 70, 70, 16, 4, 40, 0, False, torch.float32, "random"),
    "w40-c4-gqa2-window": (1, 4, 2, 70, 70, 16, 4, 40, 0, True, torch.float32, "window"),
    # chunks not aligned to the blocks, aligned, and both bounds together
    "chunk10-c4-g3-pad": (1, 3, 1, 41, 41, 16, 4, 0, 10, True, torch.float32, "window"),
    "chunk16-c8-nq20-nk70-random": (1, 2, 1, 20, 70, 16, 8, 0, 16, False, torch.float32, "random"),
    "w9-chunk20-c4-gqa2-restricted": (1, 4, 2, 60, 60, 16, 4, 9, 20, False, torch.float32, "restricted"),
    # a chunk far longer than a tile (group 4: 16 tokens), starting mid-block: whole blocks after a
    # partial one under both bounds
    "w30-chunk50-c4-g4-restricted": (1, 8, 2, 90, 90, 16, 4, 30, 50, False, torch.float32, "restricted"),
    # bf16 (its own tolerance), a group of 5
    "bf16-w17-c8-g5-pad": (1, 5, 1, 50, 50, 32, 8, 17, 0, True, torch.bfloat16, "window"),
    "bf16-w11-chunk24-c4-random": (1, 4, 2, 55, 55, 16, 4, 11, 24, False, torch.bfloat16, "random"),
    # head dim 256 (Gemma 3's): the wide forward launch, 32 tokens x 4 heads a tile
    "bf16-d256-w40-c8-g4": (1, 4, 1, 75, 75, 256, 8, 40, 0, False, torch.bfloat16, "window"),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_window_forward_backward_against_masked_dense(case):
    from sparseflow.kernels.token_sparse_triton import token_sparse_attention

    b, hq, hkv, nq, nk, d, c, w, chunk, pad, dtype, kind = case
    q, k, v, kpm = qkv_inputs(b, hq, hkv, nq, nk, d, dtype, pad, seed=nq + w + chunk)
    sel = _selection(kind, b, hkv, nq, nk, c, w, chunk, seed=3).to(q.device)
    win = dict(sliding_window=w, chunk_size=chunk)

    def dense(qq, kk, vv):
        return dense_window_attention(qq, kk, vv, w, chunk, kpm, sel, c)

    def kernel(qq, kk, vv):
        return token_sparse_attention(qq, kk, vv, sel, key_padding_mask=kpm, block_size=c, **win)

    oracle = _grads(dense, q, k, v, torch.float64)
    plain = _grads(dense, q, k, v, dtype)  # plain PyTorch in the same dtype
    got = _grads(kernel, q, k, v, dtype)
    assert all(torch.isfinite(t).all() for t in got)
    for name, g_, p_, o_ in zip(("out", "dq", "dk", "dv"), got, plain, oracle):
        tol = 2 * _err(p_, o_) + (1e-6 if dtype == torch.float32 else 1e-3) * o_.abs().max().item()
        assert _err(g_, o_) <= tol, f"{name}: {_err(g_, o_):.3g} > {tol:.3g}"
    # the torch oracle of the selection attention applies the same window
    ref = tb.attend_selected_blocks(q.double(), k.double(), v.double(), sel, key_padding_mask=kpm, block_size=c, **win)
    torch.testing.assert_close(ref, oracle[0], rtol=1e-10, atol=1e-10)


def _tiles_with_a_window_run(n_q, n_k, c, w, chunk, tile):
    """Forward tiles (``tile`` tokens) whose window lists hold blocks below the last row's window
    start and, after them, blocks every row sees whole: where the whole-block run does not lead."""
    lo = tb.window_lower_bounds(tb.query_positions(n_q, n_k), w, chunk)
    hits = 0
    for t0 in range(0, n_q, tile):
        first_p, last_lo = t0 + n_k - n_q, int(lo[min(t0 + tile, n_q) - 1])
        blocks = set(tb.window_block_indices(n_q, n_k, c, w, chunk)[0, 0, t0 : t0 + tile].flatten().tolist()) - {-1}
        whole = [x for x in blocks if x * c >= last_lo and (x + 1) * c - 1 <= min(first_p, n_k - 1)]
        hits += bool(whole) and any(x * c < last_lo for x in blocks)
    return hits


def test_the_cases_run_whole_blocks_after_partial_window_blocks():
    from sparseflow.kernels.token_sparse_triton import forward_token_tile

    for key in ("w40-c4-gqa2-random", "w40-c4-gqa2-window", "w30-chunk50-c4-g4-restricted"):
        _, hq, hkv, nq, nk, _, c, w, chunk, *_ = CASES[key]
        tile = forward_token_tile(hq // hkv, CASES[key][5], c, 4)  # fp32
        assert _tiles_with_a_window_run(nq, nk, c, w, chunk, tile) > 0, key


# id: (Nq, Nk, C, W, chunk)
OFF_BY_ONE = {
    "w6-c4": (33, 33, 4, 6, 0),
    "w8-eq-block-c8-nq20-nk45": (20, 45, 8, 8, 0),
    "chunk7-c4": (33, 33, 4, 0, 7),
}


@pytest.mark.parametrize("case", OFF_BY_ONE.values(), ids=OFF_BY_ONE.keys())
def test_the_window_bound_is_exact_to_the_key(case):
    """The kernel matches the exact mask and differs, far beyond its error, from the masks whose
    lower bound is one key lower or higher (each row then gains or loses a key)."""
    from sparseflow.kernels.token_sparse_triton import token_sparse_attention

    nq, nk, c, w, chunk = case
    q, k, v, _ = qkv_inputs(1, 2, 1, nq, nk, 16, torch.float32, False, seed=11)
    # every block of each query's causal past: the element-wise bound alone decides
    sel = tb.window_block_indices(nq, nk, c, 0, 0, q.device).expand(1, 1, -1, -1)

    def kernel(qq, kk, vv):
        return token_sparse_attention(qq, kk, vv, sel, block_size=c, sliding_window=w, chunk_size=chunk)

    got = _grads(kernel, q, k, v, torch.float32)
    for shift in (0, -1, 1):

        def dense(qq, kk, vv, shift=shift):
            return dense_window_attention(qq, kk, vv, w, chunk, None, sel, c, shift=shift)

        want = _grads(dense, q, k, v, torch.float64)
        for name, g_, o_ in zip(("out", "dq", "dk", "dv"), got, want):
            err = _err(g_, o_)
            if shift == 0:
                assert err <= 1e-5, f"{name}: {err:.3g}"
            elif name in ("out", "dk"):
                assert err > 1e-2, f"{name} matches the mask shifted by {shift}: {err:.3g}"


def test_a_window_past_every_key_changes_nothing():
    from sparseflow.kernels.token_sparse_triton import token_sparse_attention

    q, k, v, kpm = qkv_inputs(1, 4, 2, 37, 37, 16, torch.float32, True, seed=4)
    sel = _selection("random", 1, 2, 37, 37, 8, 0, 0, seed=5)
    kw = dict(key_padding_mask=kpm, block_size=8)
    plain = token_sparse_attention(q, k, v, sel, **kw)
    assert torch.equal(token_sparse_attention(q, k, v, sel, sliding_window=0, chunk_size=0, **kw), plain)
    torch.testing.assert_close(token_sparse_attention(q, k, v, sel, sliding_window=37, **kw), plain)
    torch.testing.assert_close(token_sparse_attention(q, k, v, sel, chunk_size=64, **kw), plain)


def test_a_query_whose_window_holds_only_padding_outputs_zero():
    from sparseflow.kernels.token_sparse_triton import token_sparse_attention

    q, k, v, _ = qkv_inputs(1, 2, 1, 24, 24, 16, torch.float32, False, seed=6)
    kpm = torch.ones(1, 24, dtype=torch.bool, device=q.device)
    kpm[0, 8:16] = False  # chunk 1 of 3 is all padding
    sel = tb.window_block_indices(24, 24, 4, 0, 8).expand(1, 1, -1, -1)
    got = _grads(
        lambda qq, kk, vv: token_sparse_attention(qq, kk, vv, sel, key_padding_mask=kpm, block_size=4, chunk_size=8),
        q,
        k,
        v,
        torch.float32,
    )
    assert all(torch.isfinite(t).all() for t in got)
    assert got[0][:, :, 8:16].abs().max() == 0 and got[1][:, :, 8:16].abs().max() == 0
    assert got[0][:, :, :8].abs().max() > 0 and got[0][:, :, 16:].abs().max() > 0


@pytest.mark.parametrize("arg", ["sliding_window", "chunk_size"])
def test_windows_need_causal_attention(arg):
    from sparseflow.kernels.token_sparse_triton import token_sparse_attention

    q, k, v, _ = qkv_inputs(1, 2, 1, 8, 8, 16, torch.float32, False)
    sel = torch.zeros(1, 1, 8, 1, dtype=torch.int32, device=q.device)
    with pytest.raises(ValueError, match=arg):
        token_sparse_attention(q, k, v, sel, block_size=8, is_causal=False, **{arg: 4})
    with pytest.raises(ValueError, match=arg):
        token_sparse_attention(q, k, v, sel, block_size=8, **{arg: -1})


def test_the_forward_tile_widens_from_head_dim_256():
    from sparseflow.kernels import token_sparse_triton as ts

    assert ts.forward_token_tile(3, 64, 64, 2) == 21 and ts.forward_token_tile(4, 128, 64, 2) == 16
    assert ts.forward_token_tile(4, 256, 64, 2) == 32 and ts.forward_token_tile(1, 200, 64, 2) == 128
    # past a Hopper program's shared memory with 128 rows: fp32 blocks, or 128-key blocks
    assert ts.forward_token_tile(4, 256, 64, 4) == 16 and ts.forward_token_tile(4, 256, 128, 2) == 16
    k64, k256 = torch.empty(1, 1, 1, 64, dtype=torch.bfloat16), torch.empty(1, 1, 1, 256, dtype=torch.bfloat16)
    assert ts._fwd_launch(k64, 64) == dict(num_warps=4, num_stages=3)
    assert ts._fwd_launch(k256, 64) == dict(num_warps=8, num_stages=2)  # 64 keys x 256 dims: 2 stages fit
    assert ts._fwd_launch(k256.float(), 64) == dict(num_warps=4, num_stages=1)
    assert ts._fwd_launch(k256, 128) == dict(num_warps=4, num_stages=1)


def test_lists_of_another_tile_are_refused():
    """Block lists built for another tile than the forward's would attend the wrong blocks."""
    from sparseflow.kernels import token_sparse_triton as ts

    q, k, v, _ = qkv_inputs(1, 3, 1, 60, 60, 16, torch.float32, False)
    sel = tb.window_block_indices(60, 60, 4, 12, 0).expand(1, 1, -1, -1).contiguous()
    num, lists = ts.tile_block_lists(sel, 7, 15)  # the forward tiles 21 tokens
    with pytest.raises(ValueError, match="query tiles"):
        ts.token_sparse_fwd(q, k, v, sel, num, lists, None, 0.25, 4, True, False, 12, 0)
