"""Edge cases of the ops and the reference / Triton implementations that must never give a wrong
answer: double backward, strictness of PBS's causal proxy, NaN keys, a config of another method,
empty batches, huge top_k, fp64 on Triton.

Triton pieces run on the GPU where there is one, else in the CPU interpreter (TRITON_INTERPRET=1,
set before Triton is imported): their tests build tensors on ``DEV``.
"""

import importlib.util
import math
import os
import time

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import sparseflow  # noqa: E402
from sparseflow import op_backends, ops  # noqa: E402
from sparseflow.config import BSAConfig, PBSConfig, PISAConfig  # noqa: E402

_TRITON = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None
    or (not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="needs triton, and CUDA or the Triton interpreter",
)
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # where the Triton backend runs (the CPU: interpreted)

EXACT = {
    "pbs": PBSConfig(block_size=4, segment_size=8, threshold=1.0),
    "pisa": PISAConfig(block_size=4, top_k=100),
    "bsa": BSAConfig(block_size=4, top_k=100),
}


def _qkv(b=1, hq=2, hkv=1, n=16, d=4, dtype=torch.float64, seed=0, requires_grad=False, device="cpu"):
    g = torch.Generator().manual_seed(seed)  # drawn on the CPU: the same values on every device
    q = torch.randn(b, hq, n, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, n, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, n, d, generator=g, dtype=dtype)
    return tuple(t.to(device).requires_grad_(requires_grad) for t in (q, k, v))


def _device(backend):
    """The device of a test's tensors: the Triton backend's (CUDA, or the CPU's interpreter), else the CPU."""
    return DEV if backend == "triton" else "cpu"


def _sdpa(q, k, v):
    """Causal softmax attention in plain ops (SDPA's CPU flash backward is not differentiable)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    n = q.shape[2]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), -math.inf)
    return torch.softmax(s, -1) @ v


# --------------------------------------------------------------------------- double backward


@pytest.mark.parametrize("method", sorted(EXACT))
def test_second_derivatives_match_sdpa_in_exact_mode(method):
    q, k, v = _qkv(requires_grad=True)
    w = torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(1))

    def hessian_vector(fn):
        out = fn(q, k, v)
        gq, gk, gv = torch.autograd.grad((out * w).sum(), (q, k, v), create_graph=True)
        # a scalar of the first derivatives, differentiated again
        return torch.autograd.grad((gq**2).sum() + (gk * gv).sum(), (q, k, v))

    ours = hessian_vector(lambda *t: sparseflow.attention(*t, config=EXACT[method], backend="reference"))
    ref = hessian_vector(_sdpa)
    for a, b in zip(ours, ref):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("method", sorted(EXACT))
def test_gradgradcheck_exact_mode(method):
    q, k, v = _qkv(hq=1, n=4, d=2, requires_grad=True)
    cfg = EXACT[method].replace(block_size=2, **({"segment_size": 4} if method == "pbs" else {}))

    def fn(q, k, v):
        return sparseflow.attention(q, k, v, config=cfg, backend="reference")

    assert torch.autograd.gradcheck(fn, (q, k, v), fast_mode=True)
    assert torch.autograd.gradgradcheck(fn, (q, k, v), fast_mode=True)


def test_double_backward_with_only_some_inputs_requiring_grad():
    q, k, v = _qkv()
    q.requires_grad_(True)
    out = sparseflow.attention(q, k, v, config=EXACT["pisa"], backend="reference")
    (gq,) = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
    (hq,) = torch.autograd.grad(gq.sum(), q)
    out_ref = _sdpa(q, k, v)
    (gq_ref,) = torch.autograd.grad(out_ref.pow(2).sum(), q, create_graph=True)
    (hq_ref,) = torch.autograd.grad(gq_ref.sum(), q)
    torch.testing.assert_close(hq, hq_ref)


# --------------------------------------------------------------------------- config of another method


@pytest.mark.parametrize(
    "fn, wrong, expected",
    [
        (ops.pbs_attention, PISAConfig(), "PBSConfig"),
        (ops.pisa_attention, BSAConfig(), "PISAConfig"),
        (ops.bsa_attention, PBSConfig(), "BSAConfig"),
    ],
)
def test_method_function_rejects_another_methods_config(fn, wrong, expected):
    q, k, v = _qkv(dtype=torch.float32)
    with pytest.raises(TypeError, match=rf"config must be a {expected}.*got {type(wrong).__name__}"):
        fn(q, k, v, config=wrong)


# --------------------------------------------------------------------------- fp64 on Triton


@pytest.mark.parametrize("method", sorted(EXACT))
def test_triton_rejects_fp64_with_a_clear_type_error(method, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the dispatcher would accept the CPU tensors
    q, k, v = _qkv(n=64)
    with pytest.raises(TypeError, match=r"backend='triton'.*float64.*backend='reference'"):
        sparseflow.attention(q, k, v, config=EXACT[method], backend="triton")
    # the op itself (as the rewrite pass calls it) and its fake implementation say the same
    args = (q, k, v, None, True, None, *ops.op_args(EXACT[method]), "triton", "")
    with pytest.raises(TypeError, match="float64"):
        ops.op_for(method)(*args)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode, pytest.raises(TypeError, match="float64"):
        ops.op_for(method)(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))


@_TRITON
def test_triton_entry_points_reject_fp64_with_a_type_error():
    from sparseflow.methods.bsa.triton_impl import bsa_attention
    from sparseflow.methods.pbs.triton_impl import pbs_attention
    from sparseflow.methods.pisa.triton_impl import pisa_attention

    q, k, v = _qkv(n=32, d=16)
    for fn in (pbs_attention, pisa_attention, bsa_attention):
        with pytest.raises(TypeError, match="float64|torch.float64"):
            fn(q, k, v, block_size=16, **({"segment_size": 32} if fn is pbs_attention else {}))


def test_auto_never_measures_triton_for_fp64():
    assert "triton" not in op_backends.fast_backends("pbs", torch.device("cpu"), torch.float64)


# --------------------------------------------------------------------------- empty inputs


@pytest.mark.parametrize("method", sorted(EXACT))
@pytest.mark.parametrize("shape", [(0, 2, 16, 4), (1, 2, 0, 4)], ids=["batch0", "nq0"])
def test_empty_batch_or_sequence_returns_the_empty_result(method, shape):
    q = torch.randn(shape, requires_grad=True)
    k = torch.randn(shape[0], 1, shape[2], shape[3], requires_grad=True)
    v = torch.randn(k.shape, requires_grad=True)
    cfg = EXACT[method].replace(**({"threshold": 0.9} if method == "pbs" else {"top_k": 3}))
    with sparseflow.capture() as cap:
        out = sparseflow.attention(q, k, v, config=cfg, backend="reference")
    assert out.shape == shape and cap.calls[-1].sparse == (shape[2] > 0 or method != "pbs")
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    from torch._subclasses.fake_tensor import FakeTensorMode

    plain = [t.detach() for t in (q, k, v)]
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in plain)
        assert sparseflow.attention(fq, fk, fv, config=cfg, backend="reference").shape == shape


@_TRITON
@pytest.mark.parametrize("method", sorted(EXACT))
def test_empty_batch_on_triton_returns_the_empty_result(method):
    q = torch.randn(0, 2, 64, 16, device=DEV, requires_grad=True)
    k = torch.randn(0, 1, 64, 16, device=DEV, requires_grad=True)
    cfg = EXACT[method].replace(block_size=16, **({"segment_size": 32} if method == "pbs" else {}))
    out = sparseflow.attention(q, k, k, config=cfg, backend="triton")
    out.sum().backward()
    assert out.shape == q.shape and q.grad.shape == q.shape and k.grad.shape == k.shape


@pytest.mark.parametrize("hq, hkv", [(0, 0), (0, 1)])
def test_zero_heads_is_a_clear_error(hq, hkv):
    q, k, v = torch.randn(1, hq, 16, 4), torch.randn(1, hkv, 16, 4), torch.randn(1, hkv, 16, 4)
    with pytest.raises(ValueError, match="at least one head"):
        sparseflow.attention(q, k, v, config=EXACT["pisa"], backend="reference")


# --------------------------------------------------------------------------- huge top_k


@pytest.mark.parametrize("method", ["pisa", "bsa"])
def test_huge_top_k_costs_no_more_than_exact_mode(method):
    q, k, v = _qkv(b=1, hq=2, hkv=1, n=64, d=8, dtype=torch.float32)
    cfg = EXACT[method].replace(block_size=16)
    t0 = time.perf_counter()
    huge = sparseflow.attention(q, k, v, config=cfg.replace(top_k=10**6), backend="reference")
    assert time.perf_counter() - t0 < 1.0
    exact = sparseflow.attention(q, k, v, config=cfg.replace(top_k=4), backend="reference")
    torch.testing.assert_close(huge, exact, rtol=0, atol=0)
    torch.testing.assert_close(huge, _sdpa(q, k, v))


@pytest.mark.parametrize("method", ["pisa", "bsa"])
def test_selection_width_is_clamped_to_the_blocks(method):
    from sparseflow.methods.bsa.reference import bsa_select
    from sparseflow.methods.pisa.reference import pisa_select

    select = pisa_select if method == "pisa" else bsa_select
    q, k, _ = _qkv(n=64, d=8, dtype=torch.float32)
    idx = select(q, k, block_size=16, top_k=10**6)
    assert idx.shape == (1, 1, 64, 4)
    assert (idx[0, 0, -1] == torch.arange(4)).all()


@_TRITON
def test_triton_selection_width_is_clamped_to_the_blocks():
    from sparseflow.methods.bsa import triton_select as bsa_t
    from sparseflow.methods.bsa.reference import bsa_select
    from sparseflow.methods.pisa import triton_select as pisa_t
    from sparseflow.methods.pisa.reference import pisa_select

    q, k, _ = _qkv(n=32, d=16, dtype=torch.float32, device=DEV)
    for fast, ref in ((pisa_t.pisa_select, pisa_select), (bsa_t.bsa_select, bsa_select)):
        idx = fast(q, k, block_size=16, top_k=10**6)
        assert idx.shape == (1, 1, 32, 2)
        torch.testing.assert_close(idx, ref(q, k, block_size=16, top_k=10**6), rtol=0, atol=0)


@_TRITON
def test_decode_selection_width_is_clamped_to_the_cached_blocks():
    from sparseflow.methods.pisa.pyramid_cache import PyramidCache
    from sparseflow.methods.pisa.reference import pisa_select

    q, k, v = _qkv(hq=2, hkv=1, n=33, d=16, dtype=torch.float32, device=DEV)
    cache = PyramidCache(k[:, :, :32], capacity=64, block_size=8)
    out, idx = cache.decode_step(q[:, :, -1:], k, v, top_k=10**6)
    assert idx.shape == (1, 1, 1, 5)  # 33 keys in blocks of 8
    torch.testing.assert_close(idx.long(), pisa_select(q[:, :, -1:], k, block_size=8, top_k=10**6), rtol=0, atol=0)
    torch.testing.assert_close(out, _sdpa(q, k, v)[:, :, -1:])


# --------------------------------------------------------------------------- NaN keys


def _impl(method, backend):
    return op_backends.load(method, backend)


_NAN_CFG = {
    "pbs": dict(block_size=8, segment_size=16, threshold=0.5),
    "pisa": dict(block_size=8, top_k=3),
    "bsa": dict(block_size=8, top_k=3),
}


def _backends():
    return ["reference", pytest.param("triton", marks=_TRITON)]


def _selection_tensor(sel):
    return sel.block_mask if sel.block_mask is not None else sel.block_indices


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("method", sorted(_NAN_CFG))
def test_padded_nan_keys_and_values_influence_nothing(method, backend):
    q, k, v = _qkv(b=2, hq=2, hkv=1, n=64, d=16, dtype=torch.float32, seed=3, device=_device(backend))
    kpm = torch.ones(2, 64, dtype=torch.bool, device=q.device)
    kpm[0, 50:] = False  # right padding
    kpm[1, :5] = False  # left padding, and a hole inside a block of the pyramid
    kpm[1, 20:23] = False
    nan_k, nan_v = k.clone(), v.clone()
    for b, bad in enumerate((float("nan"), float("inf"))):
        nan_k[b, :, ~kpm[b]] = bad
        nan_v[b, :, ~kpm[b]] = float("nan")
    zero_k = torch.where(torch.isfinite(nan_k), nan_k, 0.0)
    zero_v = torch.where(torch.isfinite(nan_v), nan_v, 0.0)
    fn = _impl(method, backend)
    kw = dict(key_padding_mask=kpm, is_causal=True, return_selection=True, **_NAN_CFG[method])
    q.requires_grad_(method != "pbs" or backend == "reference")  # (PBS's Triton kernel is forward-only)
    out, sel = fn(q, nan_k, nan_v, **kw)
    want, want_sel = fn(q, zero_k, zero_v, **kw)
    assert torch.equal(_selection_tensor(sel), _selection_tensor(want_sel))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    if q.requires_grad:
        (got_dq,) = torch.autograd.grad(out.sum(), q)
        (want_dq,) = torch.autograd.grad(want.sum(), q)
        assert torch.isfinite(got_dq).all()
        torch.testing.assert_close(got_dq, want_dq, rtol=0, atol=0)


@_TRITON
def test_pbs_triton_blocks_narrower_than_a_kernel_tile_equal_the_reference():
    # block_size 8 < the kernel's 16-key tiles: a tile must not read the next, unselected block
    from sparseflow.methods.pbs import reference as R
    from sparseflow.methods.pbs import triton_impl as T

    q, k, v = _qkv(b=1, hq=2, hkv=1, n=64, d=16, dtype=torch.float32, seed=4, device=DEV)
    for kw in (dict(threshold=1.0, permute=False), dict(threshold=0.5)):
        kw = dict(is_causal=True, block_size=8, segment_size=16, **kw)
        torch.testing.assert_close(T.pbs_attention(q, k, v, **kw), R.pbs_attention(q, k, v, **kw))


@pytest.mark.parametrize("backend", _backends())
def test_pbs_nan_key_leaves_causally_earlier_queries_of_its_block_alone(backend):
    # like SDPA: a NaN key at position j affects queries >= j only
    q, k, v = _qkv(b=1, hq=2, hkv=1, n=64, d=16, dtype=torch.float32, seed=4, device=_device(backend))
    j = 44  # inside query block 5 (positions 40..47), segment 2
    bad = k.clone()
    bad[:, :, j] = float("nan")
    fn = _impl("pbs", backend)
    for cfg in (dict(threshold=1.0), dict(threshold=0.5, causal_proxy=True)):
        kw = dict(is_causal=True, block_size=8, segment_size=16, **cfg)
        out, want = fn(q, bad, v, **kw), fn(q, k, v, **kw)
        assert out[:, :, j].isnan().all()
        # (the permutation may differ, so the summation order: fp32 tolerance)
        torch.testing.assert_close(out[:, :, :j], want[:, :, :j], rtol=1e-5, atol=1e-6)
    exact = fn(q, bad, v, is_causal=True, block_size=8, segment_size=16, threshold=1.0)
    ref = F.scaled_dot_product_attention(q, bad.expand(-1, 2, -1, -1), v.expand(-1, 2, -1, -1), is_causal=True)
    torch.testing.assert_close(exact[:, :, :j], ref[:, :, :j])


# --------------------------------------------------------------------------- PBS causal_proxy: what it guarantees


def _pbs_ref(q, k, v, **kw):
    from sparseflow.methods.pbs.reference import pbs_attention

    return pbs_attention(q, k, v, is_causal=True, block_size=8, segment_size=16, threshold=0.5, **kw)


@pytest.mark.parametrize("proxy_blocks", [1, 3])
def test_causal_proxy_output_is_causal_in_keys_and_values(proxy_blocks):
    q, k, v = _qkv(b=1, hq=2, hkv=1, n=64, d=16, dtype=torch.float32, seed=5)
    base = _pbs_ref(q, k, v, causal_proxy=True, proxy_blocks=proxy_blocks)
    g = torch.Generator().manual_seed(6)
    for i in (5, 15, 16, 29, 40, 47):  # mid-block, segment ends / starts, inside later segments
        k2, v2 = k.clone(), v.clone()
        k2[:, :, i + 1 :] = 3 * torch.randn(k2[:, :, i + 1 :].shape, generator=g)
        v2[:, :, i + 1 :] = torch.randn(v2[:, :, i + 1 :].shape, generator=g)
        out = _pbs_ref(q, k2, v2, causal_proxy=True, proxy_blocks=proxy_blocks)
        # (a permutation of i's own segment may change the summation order only)
        torch.testing.assert_close(out[:, :, : i + 1], base[:, :, : i + 1], rtol=1e-5, atol=1e-6)


def test_causal_proxy_output_is_not_causal_in_queries():
    # the documented limit: the proxy queries are the last positions, so a later query changes
    # earlier outputs (in a model: a later token does); if this ever holds, update the docs
    q, k, v = _qkv(b=1, hq=2, hkv=1, n=64, d=16, dtype=torch.float32, seed=5)
    base = _pbs_ref(q, k, v, causal_proxy=True)
    q2 = q.clone()
    q2[:, :, 56:] = 4 * torch.randn(q2[:, :, 56:].shape, generator=torch.Generator().manual_seed(7))
    out = _pbs_ref(q2, k, v, causal_proxy=True)
    assert (out[:, :, :56] - base[:, :, :56]).abs().max() > 1e-2


def test_paper_proxy_is_not_causal_in_keys():
    q, k, v = _qkv(b=1, hq=2, hkv=1, n=64, d=16, dtype=torch.float32, seed=5)
    base = _pbs_ref(q, k, v, causal_proxy=False)
    k2 = k.clone()
    k2[:, :, 48:] = 4 * torch.randn(k2[:, :, 48:].shape, generator=torch.Generator().manual_seed(8))
    out = _pbs_ref(q, k2, v, causal_proxy=False)
    assert (out[:, :, :48] - base[:, :, :48]).abs().max() > 1e-2


def test_docs_state_the_causal_proxy_guarantee_not_strict_causality():
    from pathlib import Path

    from sparseflow.methods.pbs import reference

    methods_doc = Path(__file__).resolve().parents[1] / "docs" / "methods.md"
    texts = [PBSConfig.__doc__, reference.__doc__, methods_doc.read_text()]
    for text in texts:
        flat = " ".join(text.split())
        assert "strictly causal" not in flat
        assert "causal in keys" in flat and "KL" in flat


# --------------------------------------------------------------------------- meta tensors

_META_MASKS = {
    "causal": (None, True),
    "none": (None, False),
    "bool-4d": (torch.ones(2, 1, 70, 70, dtype=torch.bool), False),
    "key-padding": (torch.ones(2, 1, 1, 70, dtype=torch.bool), False),
    "float-4d": (torch.zeros(2, 1, 70, 70), False),
}


@pytest.mark.parametrize("mask", list(_META_MASKS))
@pytest.mark.parametrize("backend", ["auto", "reference", "triton", "flex"])
@pytest.mark.parametrize("method", ["pbs", "pisa", "bsa", "dense"])
def test_meta_inputs_give_sdpas_meta_output(method, backend, mask):
    # shape inference and models built on the meta device: no values, so no selection runs
    cfg = sparseflow.methods.spec_for(method).config_type()
    q = torch.empty(2, 6, 70, 32, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 2, 70, 32, device="meta", dtype=torch.bfloat16)
    v = torch.empty(2, 2, 70, 16, device="meta", dtype=torch.bfloat16)
    m, causal = _META_MASKS[mask]
    m = None if m is None else m.to("meta")
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=causal, enable_gqa=True)
    got = sparseflow.attention(q, k, v, config=cfg, attn_mask=m, is_causal=causal, backend=backend)
    assert got.device.type == "meta" and got.shape == want.shape and got.dtype == want.dtype
    via_op = ops.op_for(method)(q, k, v, m, causal, None, *ops.op_args(cfg), backend, "meta")
    assert via_op.device.type == "meta" and via_op.shape == want.shape


def test_meta_inputs_still_get_the_argument_checks():
    q = torch.empty(1, 6, 70, 32, device="meta")
    kv = torch.empty(1, 4, 70, 32, device="meta")
    with pytest.raises(ValueError, match="multiple"):
        sparseflow.attention(q, kv, kv, config=PBSConfig())
    with pytest.raises(ValueError, match="device"):
        sparseflow.attention(q, torch.empty(1, 2, 70, 32), torch.empty(1, 2, 70, 32), config=PBSConfig())
