"""``PyramidCache.decode_step_static``: the decoding step on preallocated KV buffers whose length
lives in a device tensor (CUDA-graph capturable). Checked step by step against the eager
``decode_step`` and the reference on small, odd shapes (the Triton interpreter on the CPU, the
compiled kernels on CUDA, where a captured graph is replayed too).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sparseflow.kernels import token_blocks as tb
from sparseflow.methods.pisa import reference as pisa_ref

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _qkv(b, hq, hkv, n, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g) for h in (hq, hkv, hkv))
    k = k + 1.5 * torch.randn(b, hkv, n // 4 + 1, d, generator=g).repeat_interleave(4, dim=2)[:, :, :n]
    return q.to(DEV, dtype), k.to(DEV, dtype), v.to(DEV, dtype)


def _caches(k, v, n0, capacity, c):
    """An eager cache and a static one (its buffers past the prompt NaN-poisoned)."""
    from sparseflow.methods.pisa.pyramid_cache import PyramidCache

    eager = PyramidCache(k[:, :, :n0], capacity=capacity, block_size=c)
    static = PyramidCache(k[:, :, :n0], capacity=capacity, block_size=c)
    k_buf, v_buf, length = static.static_buffers(k[:, :, :n0], v[:, :, :n0])
    k_buf[:, :, n0:] = float("nan")
    v_buf[:, :, n0:] = float("nan")
    return eager, static, k_buf, v_buf, length


def _block_attention(q, k, v, idx, c, dtype):
    """Plain attention of the last ``Nq`` positions over their selected key blocks, every
    operation in ``dtype``: scores, softmax, weighted sum (GQA by repeating K/V)."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1).to(dtype) for t in (k, v))
    n_k, n_q = k.shape[2], q.shape[2]
    pos = torch.arange(n_k, device=q.device)
    chosen = ((pos // c)[:, None] == idx.long().repeat_interleave(group, dim=1)[..., None, :]).any(-1)
    visible = pos[None, :] <= torch.arange(n_k - n_q, n_k, device=q.device)[:, None]
    s = (q.to(dtype) @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    p = torch.softmax(s.masked_fill(~(chosen & visible), float("-inf")), dim=-1)
    return p @ v


def _assert_as_close_as_plain(outs, qt, kt, vt, idx, c):
    """Each of ``outs`` within twice plain PyTorch's error (:func:`_block_attention` in the
    inputs' dtype) of the fp64 result over the same blocks: the static step's split-K decode
    kernel and the eager step's tiled kernel round differently."""
    exact = _block_attention(qt, kt, vt, idx, c, torch.float64)
    plain = _block_attention(qt, kt, vt, idx, c, qt.dtype)
    bound = 2 * (plain.double() - exact).abs().max().item() + 1e-6
    for out in outs:
        err = (out.double() - exact).abs().max().item()
        assert err <= bound, (err, bound)


@pytest.mark.parametrize(
    "b, n0, steps, c, top_k, beam, dtype",
    [
        (1, 37, 6, 8, 3, 1, torch.float32),  # crosses a block boundary (40)
        (2, 3, 10, 4, 3, 1, torch.float32),  # 1 block -> 4: the capacity's width, -1 past the filled blocks
        (1, 29, 4, 4, 4, 2, torch.float32),  # beam 2
        (1, 21, 4, 8, 3, 1, torch.bfloat16),
    ],
)
def test_static_step_matches_eager_step_and_reference(b, n0, steps, c, top_k, beam, dtype):
    n = n0 + steps
    q, k, v = _qkv(b, 4, 2, n, 16, dtype, seed=n0)
    eager, static, k_buf, v_buf, length = _caches(k, v, n0, n + 13, c)
    tables = (static.sums.data_ptr(), static.summ.data_ptr(), k_buf.data_ptr(), length.data_ptr())
    width = tb.selection_width(top_k, n + 13, c)  # fixed by the capacity, not the length
    for t in range(n0, n):
        qt, kt, vt = q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1]
        want_out, want_idx = eager.decode_step(qt, kt, vt, top_k=top_k, beam=beam)
        length += 1  # the caller advances the device length (in the graph, as one more captured op)
        out, idx = static.decode_step_static(
            qt, k[:, :, t : t + 1], v[:, :, t : t + 1], k_buf, v_buf, length, top_k=top_k, beam=beam
        )
        w = want_idx.shape[-1]
        assert idx.shape[-1] == width and torch.equal(idx[..., :w], want_idx), f"step {t}"
        assert (idx[..., w:] == -1).all(), f"step {t}: unfilled blocks selected"
        assert torch.isfinite(out).all(), f"step {t}: a NaN-poisoned slot leaked"
        if dtype == torch.bfloat16:
            _assert_as_close_as_plain((out, want_out), qt, kt, vt, want_idx, c)
        else:  # the same blocks in the same order, fp32: equal up to the compilers' reordering
            torch.testing.assert_close(out, want_out, atol=1e-6, rtol=1e-6)
        assert torch.equal(k_buf[:, :, t], k[:, :, t]) and torch.equal(v_buf[:, :, t], v[:, :, t])
        if dtype == torch.float32:
            ref_idx = pisa_ref.pisa_select(qt, kt, block_size=c, top_k=top_k, beam=beam)
            assert torch.equal(idx[..., :w].long(), ref_idx), f"step {t}"
            ref = tb.attend_selected_blocks(qt, kt, vt, ref_idx, block_size=c)
            torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-6)
    assert int(length) == n and torch.isnan(k_buf[:, :, n:]).all()
    assert (static.sums.data_ptr(), static.summ.data_ptr(), k_buf.data_ptr(), length.data_ptr()) == tables


def test_static_step_out_of_range_length_is_nan_and_writes_nothing():
    n0, cap, c = 10, 16, 8
    q, k, v = _qkv(1, 4, 2, n0 + 1, 16, torch.float32, seed=1)
    _, static, k_buf, v_buf, length = _caches(k, v, n0, cap, c)

    def state():  # NaN == NaN here: the poisoned buffer slots compare equal to themselves
        return [
            t.nan_to_num(7.0)
            for t in (static.sums, static.summ, static.count, static.first_valid, static._held, k_buf, v_buf)
        ]

    before = state()
    q1, k1, v1 = q[:, :, -1:], k[:, :, -1:], v[:, :, -1:]
    for bad in (cap + 1, 0):
        length.fill_(bad)
        out, _ = static.decode_step_static(q1, k1, v1, k_buf, v_buf, length, top_k=2)
        assert torch.isnan(out).all(), f"length {bad}"
        assert all(torch.equal(x, y) for x, y in zip(before, state())), f"length {bad} wrote into the cache"
    length.fill_(n0 + 1)  # back in range: a finite answer again (the flag is rewritten every step)
    out, _ = static.decode_step_static(q1, k1, v1, k_buf, v_buf, length, top_k=2)
    assert torch.isfinite(out).all() and not all(torch.equal(x, y) for x, y in zip(before, state()))


def test_static_step_rejects_bad_arguments():
    n0, cap = 10, 16
    q, k, v = _qkv(1, 4, 2, n0 + 1, 16, torch.float32, seed=2)
    eager, static, k_buf, v_buf, length = _caches(k, v, n0, cap, 8)
    q1, k1, v1 = q[:, :, -1:], k[:, :, -1:], v[:, :, -1:]
    step = static.decode_step_static
    with pytest.raises(TypeError, match="length must be an int32 tensor"):
        step(q1, k1, v1, k_buf, v_buf, length.long())
    with pytest.raises(TypeError, match="length must be an int32 tensor"):
        step(q1, k1, v1, k_buf, v_buf, n0 + 1)
    with pytest.raises(ValueError, match=r"k_buf must be \[1, 2, 16, 16\]"):
        step(q1, k1, v1, k_buf[:, :, :-1].contiguous(), v_buf, length)
    with pytest.raises(ValueError, match="must be contiguous"):
        step(q1, k1, v1, k_buf.transpose(2, 3).contiguous().transpose(2, 3), v_buf, length)
    with pytest.raises(TypeError, match="must share one dtype"):
        step(q1, k1.double(), v1, k_buf, v_buf, length)
    with pytest.raises(ValueError, match=r"v_new must be \[1, 2, 1, 16\]"):
        step(q1, k1, v1[..., :8], k_buf, v_buf, length)
    with pytest.raises(ValueError, match="q must be"):
        step(q[:, :, -2:], k1, v1, k_buf, v_buf, length)
    with pytest.raises(ValueError, match="must hold the cache's 10 keys"):
        static.static_buffers(k, v)
    assert not static._static, "a refused call must leave the cache eager-usable"


def test_eager_calls_after_a_static_step_are_refused():
    n0 = 10
    q, k, v = _qkv(1, 4, 2, n0 + 2, 16, torch.float32, seed=3)
    _, static, k_buf, v_buf, length = _caches(k, v, n0, 16, 8)
    length += 1
    static.decode_step_static(q[:, :, n0 : n0 + 1], k[:, :, n0 : n0 + 1], v[:, :, n0 : n0 + 1], k_buf, v_buf, length)
    with pytest.raises(ValueError, match="driven by decode_step_static"):
        static.append(k[:, :, n0 + 1 :])
    with pytest.raises(ValueError, match="driven by decode_step_static"):
        static.select(q[:, :, -1:], k)
    with pytest.raises(ValueError, match="driven by decode_step_static"):  # its host length is stale
        static.static_buffers(k[:, :, :n0], v[:, :, :n0])


class _Ops(TorchDispatchMode):
    """Every op dispatched, with the shapes it returned."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        shapes = [
            tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)
        ]
        self.ops.append((str(func), shapes))
        return out


# what reading a device value on the host dispatches (.item(), int() / bool() of a tensor,
# torch.equal, nonzero / masked_select with their data-dependent shapes)
_HOST_READS = (
    "_local_scalar_dense",
    "aten.item",
    "aten.equal",
    "aten.is_nonzero",
    "aten.nonzero",
    "aten.masked_select",
)


@pytest.mark.parametrize(
    "walk, select_op", [("per_token", "pisa_select_fwd"), ("leaf_pairs", "pisa_select_leaf_split_fwd")]
)
def test_static_step_dispatches_the_same_ops_at_every_length_and_reads_nothing_back(walk, select_op):
    """What a CUDA graph needs, checked on the CPU: one recorded op sequence (names and shapes)
    serves every length, and no op hands a device value to the host."""
    from sparseflow import Tuning

    n0, steps = 13, 4
    q, k, v = _qkv(1, 4, 2, n0 + steps, 16, torch.float32, seed=5)
    _, static, k_buf, v_buf, length = _caches(k, v, n0, 40, 8)
    seen = []
    for t in range(n0, n0 + steps):
        length += 1
        with _Ops() as rec:
            static.decode_step_static(
                q[:, :, t : t + 1],
                k[:, :, t : t + 1],
                v[:, :, t : t + 1],
                k_buf,
                v_buf,
                length,
                top_k=3,  # of 5 leaf blocks: the split walk has leaves to score
                tuning=Tuning(pisa_walk=walk),
            )
        seen.append(rec.ops)
    names = {name for name, _ in seen[0]}
    assert f"sparseflow.{select_op}.default" in names and "sparseflow.token_sparse_decode_fwd.default" in names
    assert not [name for name in names if any(r in name for r in _HOST_READS)], sorted(names)
    assert all(ops == seen[0] for ops in seen[1:]), "the step's ops or shapes depend on the length"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("walk", ["per_token", "leaf_pairs"])
def test_static_step_replays_in_a_cuda_graph(walk):
    from sparseflow import Tuning

    tuning = Tuning(pisa_walk=walk)
    b, n0, steps, c, top_k = 1, 300, 70, 64, 3
    n = n0 + steps
    q, k, v = _qkv(b, 8, 2, n, 64, torch.bfloat16, seed=4)
    eager, static, k_buf, v_buf, length = _caches(k, v, n0, n + 5, c)
    q_in, k_in, v_in = q[:, :, n0 : n0 + 1].clone(), k[:, :, n0 : n0 + 1].clone(), v[:, :, n0 : n0 + 1].clone()
    state = (static.sums, static.summ, static.count, static.first_valid, static._held, k_buf, v_buf, length)
    warm = [t.clone() for t in state]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile the kernels outside the capture, then undo the warm-up steps
        length += 1
        static.decode_step_static(q_in, k_in, v_in, k_buf, v_buf, length, top_k=top_k, tuning=tuning)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # a host sync in the step raises here
        try:
            static.decode_step_static(q_in, k_in, v_in, k_buf, v_buf, length, top_k=top_k, tuning=tuning)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream().wait_stream(side)
    for t, w in zip(state, warm):
        t.copy_(w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        length += 1
        out, idx = static.decode_step_static(q_in, k_in, v_in, k_buf, v_buf, length, top_k=top_k, tuning=tuning)
    for t in range(n0, n):
        for dst, src in ((q_in, q), (k_in, k), (v_in, v)):
            dst.copy_(src[:, :, t : t + 1])
        graph.replay()
        want_out, want_idx = eager.decode_step(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], top_k=top_k)
        assert torch.equal(idx[..., : want_idx.shape[-1]], want_idx), f"step {t}"
        _assert_as_close_as_plain((out, want_out), q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], want_idx, c)
    assert int(length) == n


def test_static_buffers_after_eager_steps_attend_to_the_eagerly_appended_keys():
    """Eager steps before ``static_buffers`` grow the cache past its prompt: the static step must
    attend to those keys too (they are in the buffers it was handed), as the eager step does."""
    n0, eager_steps, c = 9, 5, 4
    n = n0 + eager_steps + 1
    q, k, v = _qkv(1, 4, 2, n, 16, torch.float32, seed=4)
    from sparseflow.methods.pisa.pyramid_cache import PyramidCache

    eager = PyramidCache(k[:, :, :n0], capacity=n + 3, block_size=c)
    for t in range(n0, n - 1):
        eager.append(k[:, :, t : t + 1])
    static = PyramidCache(k[:, :, :n0], capacity=n + 3, block_size=c)
    for t in range(n0, n - 1):
        static.append(k[:, :, t : t + 1])
    k_buf, v_buf, length = static.static_buffers(k[:, :, : n - 1], v[:, :, : n - 1])
    length += 1
    qt = q[:, :, -1:]
    want, want_idx = eager.decode_step(qt, k, v, top_k=8)
    out, idx = static.decode_step_static(qt, k[:, :, -1:], v[:, :, -1:], k_buf, v_buf, length, top_k=8)
    assert torch.equal(idx[..., : want_idx.shape[-1]], want_idx)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)


def test_static_append_writes_slots_past_int32_elements_in_place():
    """The static append's K/V write at a batch row 2**31 elements or more into the buffers (long
    contexts: batch x KV heads x capacity x dims) lands in that row, not wrapped into another.
    The buffers are views into one virtual 8 GiB allocation; only the pages written are touched."""
    from sparseflow.methods.pisa.pyramid_cache import PyramidCache

    if DEV != "cpu":
        pytest.skip("the strided 8 GiB view relies on untouched CPU pages staying unallocated")
    b, n0, cap, d = 3, 5, 16, 16
    row, start = 3 * 2**29, 2**30  # row 2 starts 2**31 + 2**30 past the view: wrapped, it writes near element 0
    try:
        big = torch.empty(start + (b - 1) * row + 2 * cap * d, dtype=torch.float16)
    except RuntimeError:
        pytest.skip("no 8 GiB of address space")
    k_buf, v_buf = (big.as_strided((b, 1, cap, d), (row, cap * d, d, 1), start + off) for off in (0, cap * d))
    for t in (k_buf, v_buf):
        t.zero_()
    _, k, v = _qkv(b, 1, 1, n0 + 1, d, torch.float16, seed=5)
    cache = PyramidCache(k[:, :, :n0], capacity=cap, block_size=4)
    length = torch.full((1,), n0 + 1, dtype=torch.int32)
    cache._append_static(k[:, :, n0:], v[:, :, n0:], k_buf, v_buf, length)
    assert torch.equal(k_buf[:, :, n0], k[:, :, n0]) and torch.equal(v_buf[:, :, n0], v[:, :, n0])
