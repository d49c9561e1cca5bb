"""PISA and BSA Triton kernels against their references, on the CPU through Triton's interpreter
(TRITON_INTERPRET=1, set in conftest.py) on small, odd shapes; the same tests run compiled on CUDA.

Selections must equal the reference's exactly; outputs and gradients must stay within the
2x-PyTorch-error rule against an fp64 oracle (the reference attention over the same blocks).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from _pisa_walk_inputs import qkv_inputs

import sparseflow
from sparseflow.kernels import token_blocks as tb
from sparseflow.methods.bsa import reference as bsa_ref
from sparseflow.methods.pisa import reference as pisa_ref

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# id: (B, Hq, Hkv, Nq, Nk, D, C, K, g, score, causal, pad, dtype)
PISA_CASES = {
    # the last 50 queries of 150 keys (mean_var-g3-pad-b2-n97 keeps a causal square)
    "lse-gqa2-nq50-nk150-causal": (1, 4, 2, 50, 150, 32, 16, 4, 2, "lse", True, False, torch.float32),
    "mean_var-g3-pad-b2-n97": (2, 3, 1, 97, 97, 24, 8, 5, 3, "mean_var", True, True, torch.float32),
    # not causal, every query walks the same visible keys: 25 of 77 queries take the same paths
    "mean-noncausal-pad-nq25-nk77": (1, 2, 2, 25, 77, 16, 8, 3, 2, "mean", False, True, torch.float32),
    "lse-bf16-nq40-nk133": (1, 2, 1, 40, 133, 32, 16, 3, 2, "lse", True, False, torch.bfloat16),
}


@pytest.mark.parametrize("case", PISA_CASES.values(), ids=PISA_CASES.keys())
def test_pisa_selection_equals_reference(case):
    from sparseflow.methods.pisa import triton_select

    b, hq, hkv, nq, nk, d, c, kk, g, score, causal, pad, dtype = case
    q, k, _, kpm = qkv_inputs(b, hq, hkv, nq, nk, d, dtype, pad)
    kw = dict(key_padding_mask=kpm, is_causal=causal, block_size=c, top_k=kk, branching=g, score=score)
    want = pisa_ref.pisa_select(q, k, **kw)
    got = triton_select.pisa_select(q, k, **kw)
    assert got.dtype == torch.long and got.shape == want.shape
    n_levels = len(triton_select.level_sizes(-(-nk // c), g))
    assert n_levels >= 3, "the case must exercise scored intermediate levels"
    assert ((want >= 0).sum(-1) < -(-nk // c)).any(), "the case must be sparse somewhere"
    assert torch.equal(got, want)


# id: (B, Hq, Hkv, Nq, Nk, D, C, K, g, score, causal, pad, dtype, beam); beam * K not a power of two
# in two of them (the kept-node registers are padded), last queries only (the interpreter is slow)
PISA_BEAM_CASES = {
    "lse-beam2-gqa2-nq40-nk150": (1, 4, 2, 40, 150, 16, 8, 5, 2, "lse", True, False, torch.float32, 2),
    "mean_var-beam3-g3-pad-b2-nq24-nk97": (2, 3, 1, 24, 97, 16, 4, 4, 3, "mean_var", True, True, torch.float32, 3),
    "mean-beam2-noncausal-pad-nq30-nk77": (1, 2, 2, 30, 77, 16, 4, 4, 2, "mean", False, True, torch.float32, 2),
}


@pytest.mark.parametrize("case", PISA_BEAM_CASES.values(), ids=PISA_BEAM_CASES.keys())
def test_pisa_beam_selection_equals_reference(case):
    """The walk with ``beam``: ``beam * top_k`` kept nodes above the leaves, ``top_k`` leaves."""
    from sparseflow.methods.pisa import triton_select

    b, hq, hkv, nq, nk, d, c, kk, g, score, causal, pad, dtype, beam = case
    q, k, _, kpm = qkv_inputs(b, hq, hkv, nq, nk, d, dtype, pad, seed=beam)
    kw = dict(key_padding_mask=kpm, is_causal=causal, block_size=c, top_k=kk, branching=g, score=score)
    want = pisa_ref.pisa_select(q, k, beam=beam, **kw)
    got = triton_select.pisa_select(q, k, beam=beam, **kw)
    assert got.shape == want.shape == (b, hkv, nq, kk)
    assert not torch.equal(want, pisa_ref.pisa_select(q, k, **kw)), "the beam must change some selection"
    assert torch.equal(got, want)


# Far views: (B, Hq, Nq, Nk, D, [(shape, strides, offset) of k, q]); the offsets a 32-bit product
# wraps (2**31 and past, less than 2**32) land before ``_FAR_START``, outside every view
_FAR_START = 2**31
_R = 3 * 2**29  # batch row stride: batch 2 starts 2**31 + 2**30 into the view
FAR_LAYOUTS = {
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


def _far_views(specs, dtype):
    """Strided views into one reserved-but-unwritten CPU buffer (only the pages written are
    touched), or a skip where that address space cannot be reserved."""
    if DEVICE != "cpu":
        pytest.skip("the strided views rely on untouched CPU pages staying unallocated")
    end = max(off + sum((n - 1) * st for n, st in zip(shape, strides)) for shape, strides, off in specs)
    try:
        big = torch.empty(_FAR_START + end + 1, dtype=dtype)
    except RuntimeError:
        pytest.skip(f"cannot reserve {_FAR_START + end + 1} {dtype} elements of address space")
    return [big.as_strided(shape, strides, _FAR_START + off) for shape, strides, off in specs]


@pytest.mark.parametrize("layout", FAR_LAYOUTS.values(), ids=FAR_LAYOUTS.keys())
def test_pisa_walk_reads_queries_and_keys_past_int32_elements(layout):
    """The walk's q / raw-key offsets are 64-bit: a batch row or a key / query position 2**31
    elements or more into its tensor (long contexts) is read in place, not wrapped elsewhere."""
    from sparseflow.methods.pisa import triton_select as ts
    from sparseflow.methods.pisa import triton_select_per_token as per_token

    b, hq, nq, nk, d, specs = layout
    k_far, q_far = _far_views(specs, torch.float16)
    q, k, _, _ = qkv_inputs(b, hq, 1, nq, nk, d, torch.float16, pad=False, seed=3)
    k_far.copy_(k)
    q_far.copy_(q)
    c, g, kk = 4, 2, 3
    summ, nfv, _, lvl_off, lvl_span = ts.build_pyramid(k, block_size=c, branching=g)

    def walk(qq, kk_):
        return per_token._pisa_select_fwd(
            qq, kk_, None, summ, nfv, lvl_off, lvl_span, d**-0.5, False, 0, c, g, kk, False, False, 1
        )

    want = walk(q, k)
    assert (want >= 0).all() and kk < nk // c, "the leaves must be scored from the raw keys"
    assert torch.equal(walk(q_far, k_far), want)


# id: (B, Hq, Hkv, Nq, Nk, D, C, K, causal, pad, dtype)
BSA_CASES = {
    "gqa2-n300-k4": (1, 4, 2, 300, 300, 32, 16, 4, True, False, torch.float32),
    "g3-pad-b2-nq100-nk257": (2, 3, 1, 100, 257, 24, 16, 5, True, True, torch.float32),
    "noncausal-pad-bf16-k6": (1, 2, 2, 200, 200, 16, 8, 6, False, True, torch.bfloat16),
    "k1": (1, 2, 1, 130, 130, 16, 16, 1, True, False, torch.float32),
}


@pytest.mark.parametrize("case", BSA_CASES.values(), ids=BSA_CASES.keys())
def test_bsa_selection_equals_reference(case):
    from sparseflow.methods.bsa import triton_select

    b, hq, hkv, nq, nk, d, c, kk, causal, pad, dtype = case
    q, k, _, kpm = qkv_inputs(b, hq, hkv, nq, nk, d, dtype, pad)
    kw = dict(key_padding_mask=kpm, is_causal=causal, block_size=c, top_k=kk)
    want = bsa_ref.bsa_select(q, k, **kw)
    got = triton_select.bsa_select(q, k, **kw)
    assert ((want >= 0).sum(-1) < -(-nk // c)).any(), "the case must be sparse somewhere"
    assert torch.equal(got, want)


BSA_MERGES = ("packed", "bitonic", "rounds")


def triton_select_default_merge() -> str:
    from sparseflow.methods.bsa import triton_select

    return triton_select._SELECT_LAUNCH["merge"]


@pytest.mark.parametrize("ties", ["equal-blocks", "zero-query"])
@pytest.mark.parametrize("merge", BSA_MERGES)
def test_bsa_selection_breaks_ties_like_the_reference(ties, merge, monkeypatch):
    """Exactly tied scores go to the lower block id, and +0.0 ties -0.0 (a zero query scores
    every block +-0), in every merge of the fused scan. The equal blocks hold small integers:
    every dot is exact in any summation order (on some CPUs the interpreter's matmul sums edge
    columns in another order, which parts ties of random floats by an ulp)."""
    from sparseflow.methods.bsa import triton_select

    monkeypatch.setitem(triton_select._SELECT_LAUNCH, "merge", merge)
    q, k, _, _ = qkv_inputs(1, 2, 1, 150, 150, 16, torch.float32, pad=False, seed=5)
    if ties == "equal-blocks":
        q, k = (2 * q).round(), (2 * k[:, :, :8]).round()
        k = k.repeat(1, 1, -(-150 // 8), 1)[:, :, :150].contiguous()  # every full block alike
    else:
        q = torch.zeros_like(q)
    kw = dict(block_size=8, top_k=5)
    want = bsa_ref.bsa_select(q, k, **kw)
    got = triton_select.bsa_select(q, k, **kw)
    assert torch.equal(got, want)


def _other_merge_runs():
    """(case, merge, block_n), pairwise covering of the cases x other merges x block_n cross
    product: every case with each other merge and each block_n, and every merge with each
    block_n, at half the interpreter's time of all of them."""
    merges = [m for m in BSA_MERGES if m != triton_select_default_merge()]
    assert len(merges) == 2, merges  # the pairing below covers two
    runs = []
    for i, (name, case) in enumerate(BSA_CASES.items()):
        for j, merge in enumerate(merges):
            block_n = (16, 64)[(i // 2 + j) % 2]
            runs.append(pytest.param(case, merge, block_n, id=f"{block_n}-{merge}-{name}"))
    return runs


@pytest.mark.parametrize("case, merge, block_n", _other_merge_runs())
def test_bsa_other_merges_equal_reference(case, merge, block_n, monkeypatch):
    """Every merge of a chunk into the running top-K, at one chunk or many per row, selects what
    the reference selects (the default merge is checked above)."""
    from sparseflow.methods.bsa import triton_select

    monkeypatch.setitem(triton_select._SELECT_LAUNCH, "merge", merge)
    monkeypatch.setitem(triton_select._SELECT_LAUNCH, "block_n", block_n)
    b, hq, hkv, nq, nk, d, c, kk, causal, pad, dtype = case
    q, k, _, kpm = qkv_inputs(b, hq, hkv, nq, nk, d, dtype, pad)
    kw = dict(key_padding_mask=kpm, is_causal=causal, block_size=c, top_k=kk)
    assert torch.equal(triton_select.bsa_select(q, k, **kw), bsa_ref.bsa_select(q, k, **kw))


def test_bsa_selector_rejects_unknown_precision():
    from sparseflow.methods.bsa import triton_select

    q, k, _, _ = qkv_inputs(1, 2, 1, 20, 20, 16, torch.float32, False)
    with pytest.raises(ValueError, match="precision"):
        triton_select.bsa_select(q, k, block_size=8, top_k=2, precision="fp8")


# id: (B, Hq, Hkv, Nq, Nk, D, C, K, causal, pad, dtype)
ATTN_CASES = {
    "gqa2-n70-causal": (1, 2, 1, 70, 70, 16, 16, 3, True, False, torch.float32),
    "g3-pad-b2-nq40-nk90": (2, 3, 1, 40, 90, 24, 16, 4, True, True, torch.float32),
    "noncausal-pad-c8": (1, 2, 2, 50, 50, 16, 8, 3, False, True, torch.float32),
    "bf16-n83": (1, 4, 2, 83, 83, 32, 16, 3, True, True, torch.bfloat16),
    "g5-n37-causal": (1, 5, 1, 37, 37, 16, 8, 3, True, False, torch.float32),
    # no padding, a partial last block: the blocks a tile sees whole take a row mask only
    "noncausal-n45-c8": (1, 2, 1, 45, 45, 16, 8, 3, False, False, torch.float32),
    "g3-nq30-nk75-causal": (1, 3, 1, 30, 75, 16, 16, 3, True, False, torch.float32),
}


def _err(x, ref64):
    return (x.double() - ref64).abs().max().item()


@pytest.mark.parametrize("case", ATTN_CASES.values(), ids=ATTN_CASES.keys())
def test_token_sparse_attention_forward_backward(case):
    from sparseflow.kernels.token_sparse_triton import token_sparse_attention

    b, hq, hkv, nq, nk, d, c, kk, causal, pad, dtype = case
    q, k, v, kpm = qkv_inputs(b, hq, hkv, nq, nk, d, dtype, pad, seed=1)
    idx = pisa_ref.pisa_select(q, k, key_padding_mask=kpm, is_causal=causal, block_size=c, top_k=kk)
    kw = dict(key_padding_mask=kpm, is_causal=causal, block_size=c)

    def run(fn, dt):
        qq, kk_, vv = (t.detach().to(dt).requires_grad_(True) for t in (q, k, v))
        out = fn(qq, kk_, vv, idx, **kw)
        go = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(device=out.device, dtype=dt)
        grads = torch.autograd.grad(out, (qq, kk_, vv), go)
        return (out,) + grads

    oracle = run(tb.attend_selected_blocks, torch.float64)
    plain = run(tb.attend_selected_blocks, dtype)  # plain PyTorch in the same dtype
    got = run(token_sparse_attention, dtype)
    nan_free = all(torch.isfinite(t).all() for t in got)
    assert nan_free
    for name, g_, p_, o_ in zip(("out", "dq", "dk", "dv"), got, plain, oracle):
        tol = 2 * _err(p_, o_) + (1e-6 if dtype == torch.float32 else 1e-3) * o_.abs().max().item()
        assert _err(g_, o_) <= tol, f"{name}: {_err(g_, o_):.3g} > {tol:.3g}"


@pytest.mark.parametrize("method", ["pisa", "bsa"])
def test_op_triton_backend_matches_reference_and_reports_selection(method):
    # 45 tokens in blocks of 8 (six blocks, the last partial, three kept): the walk runs a program
    # per token and KV head under the interpreter, forward and again in the backward's recompute
    cfg = (
        sparseflow.PISAConfig(block_size=8, top_k=3)
        if method == "pisa"
        else sparseflow.BSAConfig(block_size=8, top_k=3)
    )
    q, k, v, _ = qkv_inputs(1, 4, 2, 45, 45, 16, torch.float32, False, seed=3)
    q.requires_grad_(True)
    with sparseflow.capture(keep_selections=True) as cap:
        out = sparseflow.attention(q, k, v, config=cfg, backend="triton")
    ref_out = sparseflow.attention(q, k, v, config=cfg, backend="reference")
    rec = cap.calls[-1]
    assert rec.backend == "triton" and rec.sparse
    assert 0 < float(rec.selection.density.mean()) < 1
    torch.testing.assert_close(out, ref_out, atol=2e-6, rtol=2e-6)
    # gradients flow through the Triton backward and match the reference's
    (g_tri,) = torch.autograd.grad(out.square().sum(), q)
    (g_ref,) = torch.autograd.grad(ref_out.square().sum(), q)
    torch.testing.assert_close(g_tri, g_ref, atol=2e-5, rtol=2e-5)


def test_decode_pyramid_cache_matches_reference_selection_and_attention():
    from sparseflow.methods.pisa.pyramid_cache import PyramidCache

    c, kk, n0, steps = 8, 3, 37, 6
    q, k, v, _ = qkv_inputs(1, 4, 2, n0 + steps, n0 + steps, 16, torch.float32, False, seed=5)
    cache = PyramidCache(k[:, :, :n0], capacity=n0 + steps + 30, block_size=c, branching=2)
    for t in range(n0, n0 + steps):
        n = t + 1
        qt = q[:, :, t : t + 1]
        out, _ = cache.decode_step(qt, k[:, :, :n], v[:, :, :n], top_k=kk)
        want_idx = pisa_ref.pisa_select(qt, k[:, :, :n], block_size=c, top_k=kk)
        got_idx = cache.select(qt, k[:, :, :n], top_k=kk).long()
        assert torch.equal(got_idx, want_idx), f"step {t}"
        want = tb.attend_selected_blocks(qt, k[:, :, :n], v[:, :, :n], want_idx, block_size=c)
        torch.testing.assert_close(out, want, atol=2e-6, rtol=2e-6)
    assert cache.length == n0 + steps
    assert ((want_idx >= 0).sum(-1) < -(-(n0 + steps) // c)).all(), "decode selection must be sparse"


def test_decode_pyramid_cache_beam_matches_reference_selection():
    from sparseflow.methods.pisa.pyramid_cache import PyramidCache

    c, kk, n0, steps, beam = 4, 4, 61, 3, 2
    q, k, _, _ = qkv_inputs(1, 4, 2, n0 + steps, n0 + steps, 16, torch.float32, False, seed=6)
    cache = PyramidCache(k[:, :, :n0], capacity=n0 + steps + 20, block_size=c, branching=2)
    differs = False
    for t in range(n0, n0 + steps):
        cache.append(k[:, :, t : t + 1])
        qt, kt = q[:, :, t : t + 1], k[:, :, : t + 1]
        want = pisa_ref.pisa_select(qt, kt, block_size=c, top_k=kk, beam=beam)
        assert torch.equal(cache.select(qt, kt, top_k=kk, beam=beam).long(), want), f"step {t}"
        differs |= not torch.equal(want, pisa_ref.pisa_select(qt, kt, block_size=c, top_k=kk))
    assert differs, "the beam must change some selection"


@pytest.mark.usefixtures("fresh_dynamo")
def test_generate_on_pisa_model_uses_the_cached_pyramid(tiny):
    from sparseflow.model_marks import DECODE_STATE_ATTR

    cfg = sparseflow.PISAConfig(block_size=8, top_k=3, min_seq_len=0)
    prompt = torch.randint(0, 128, (1, 37), generator=torch.Generator().manual_seed(0))  # five blocks
    outs = {}
    for backend in ("triton", "reference"):
        model = tiny("llama", layers=2, seed=0).to(DEVICE)
        sparseflow.compile(model, "pisa", cfg, backend=backend, inner_backend="eager")
        with torch.no_grad():
            outs[backend] = model.generate(prompt.to(DEVICE), max_new_tokens=6, do_sample=False, min_new_tokens=6)
        state = getattr(model, DECODE_STATE_ATTR)
        if backend == "triton":
            # first decode step builds each layer's pyramid, every later step appends one key
            assert state.rebuilt == 2 and state.appended == 2 * 4, (state.rebuilt, state.appended)
        else:
            assert state.rebuilt == 0 and state.appended == 0  # the reference rebuilds per call
    assert torch.equal(outs["triton"], outs["reference"])


@pytest.mark.parametrize("n_leaves", [1, 2, 7, 64, 100, 4097, 2**20 + 3])
@pytest.mark.parametrize("branching", [2, 3, 8, 1000])
def test_pyramid_tables_on_device_match_level_sizes(n_leaves, branching, poisoned):
    """The level tables from the Triton program (GPU / interpreter) and from torch ops: the host's
    level sizes and offsets, spans ``g**i`` clamped to 2**30. The program's fresh buffers are
    poisoned with -7, so an entry it fails to write shows."""
    from sparseflow.methods.pisa import triton_select as ts

    sizes, offs, dev_offs, dev_spans = poisoned(ts.pyramid_tables, n_leaves, branching, DEVICE)
    assert sizes == ts.level_sizes(n_leaves, branching)
    spans = [min(branching**i, 2**30) for i in range(len(sizes))]
    torch_offs, torch_spans = ts._device_tables_torch(n_leaves, branching, len(sizes), "cpu")
    for got_offs, got_spans in ((dev_offs, dev_spans), (torch_offs, torch_spans)):
        assert got_offs.dtype == got_spans.dtype == torch.int32
        assert got_offs.tolist() == offs
        assert got_spans.tolist() == spans


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_level_tables_opcheck():
    torch.library.opcheck(torch.ops.sparseflow.pisa_level_tables.default, (100, 2, 8, torch.device("cuda")))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", ["pisa", "bsa"])
def test_cuda_selection_has_no_host_sync(method):
    # a host sync stalls the launch queue and forbids CUDA-graph capture
    q, k, v = (torch.randn(1, 4, 1000, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    run = getattr(sparseflow, f"{method}_attention")
    run(q, k, v, is_causal=True, backend="triton")  # compile and autotune outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run(q, k, v, is_causal=True, backend="triton")
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("keep", [False, True])
def test_generate_records_the_cached_decode_steps(tiny, keep):
    """Each decode step served by the cached pyramid is recorded as a sparse PISA call on triton,
    with its selection's density (and its block tensors only under keep_selections)."""
    cfg = sparseflow.PISAConfig(block_size=16, top_k=3, min_seq_len=0)
    prompt = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    model = tiny("llama", layers=1, seed=0).to(DEVICE)
    sparseflow.compile(model, "pisa", cfg, backend="triton", inner_backend="eager")
    with torch.no_grad(), sparseflow.capture(keep_selections=keep) as cap:
        model.generate(prompt.to(DEVICE), max_new_tokens=3, do_sample=False, min_new_tokens=3)
    steps = [c for c in cap.calls if c.q_shape[2] == 1]
    assert len(steps) == 2  # the first new token comes from the prefill
    for c in steps:
        assert (c.method, c.backend, c.sparse, c.reason) == ("pisa", "triton", True, "")
        assert c.k_shape[2] > 40 and 0 < c.density <= 1
        assert (c.selection.block_indices is not None) == keep


@pytest.mark.parametrize("method", ["pisa", "bsa"])
def test_selectors_return_int32_ids_on_request(method):
    """``index_dtype=torch.int32`` (what the attention kernel reads) returns the same ids; any other
    dtype is rejected by name."""
    from sparseflow.methods.bsa import triton_select as bsa_sel
    from sparseflow.methods.pisa import triton_select as pisa_sel

    select = pisa_sel.pisa_select if method == "pisa" else bsa_sel.bsa_select
    # the last 12 queries of 150 keys: the id dtype is the store's, whatever the queries
    q, k, _, _ = qkv_inputs(1, 4, 2, 12, 150, 16, torch.float32, pad=False, seed=9)
    want = select(q, k, block_size=16, top_k=4)
    got = select(q, k, block_size=16, top_k=4, index_dtype=torch.int32)
    assert want.dtype == torch.long and got.dtype == torch.int32
    assert torch.equal(got.long(), want)
    with pytest.raises(ValueError, match="index_dtype"):
        select(q, k, block_size=16, top_k=4, index_dtype=torch.int16)


@pytest.mark.parametrize("precision", ["tf32x3", "ieee", "bf16"])
def test_bsa_selector_takes_each_precision(precision):
    """Each precision reaches the kernel (on the GPU bf16 may pick another block where two nearly
    tie; the interpreter's dots are fp32 whatever the precision, so the selection is exact there)."""
    from sparseflow.methods.bsa import triton_select

    assert precision in triton_select.PRECISIONS
    q, k, _, _ = qkv_inputs(1, 4, 2, 150, 150, 16, torch.float32, False, seed=3)
    got = triton_select.bsa_select(q, k, block_size=16, top_k=4, precision=precision)
    want = bsa_ref.bsa_select(q, k, block_size=16, top_k=4)
    if precision == "bf16" and q.is_cuda:
        assert (got == want).float().mean() > 0.9
    else:
        assert torch.equal(got, want)
