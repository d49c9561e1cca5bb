"""The dense method with a local window (``DenseConfig(sliding_window=..)`` / ``chunk_size``): exact
causal attention within the window on every backend, against SDPA with the window's mask; a
window handed over as an ``attn_mask`` is recognised by value and runs the same way."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

import sparseflow
from sparseflow import DenseConfig, PBSConfig, PISAConfig
from sparseflow.masks import window_mask

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

WINDOWS = {"sliding-5": (5, 0), "sliding-70": (70, 0), "chunk-32": (0, 32), "chunk-50": (0, 50)}


def _qkv(n=150, hq=6, hkv=2, d=32, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, h, n, d, generator=g).to(DEVICE, dtype) for h in (hq, hkv, hkv))


def _want(q, k, v, window, kpm=None):
    m = window_mask(q.shape[2], k.shape[2], *window, q.device)[None, None]
    if kpm is not None:
        m = m & kpm[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)


def _run(q, k, v, cfg, backend, **kw):
    with sparseflow.capture() as cap:
        out = sparseflow.attention(q, k, v, config=cfg, backend=backend, **kw)
    (call,) = cap.calls
    return out, call


@pytest.mark.parametrize("window", list(WINDOWS))
@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=TRITON), "flex"])
def test_windowed_dense_equals_masked_sdpa(backend, window):
    q, k, v = _qkv()
    w = WINDOWS[window]
    cfg = DenseConfig(sliding_window=w[0], chunk_size=w[1])
    out, call = _run(q, k, v, cfg, backend, is_causal=True)
    assert call.sparse and call.backend == backend, call.reason
    torch.testing.assert_close(out, _want(q, k, v, w), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=TRITON), "flex"])
def test_windowed_dense_keeps_key_padding(backend):
    q, k, v = _qkv(n=130)
    kpm = torch.ones(2, 130, dtype=torch.bool, device=DEVICE)
    kpm[1, 100:] = False
    kpm[0, :7] = False
    cfg = DenseConfig(sliding_window=20)
    out, call = _run(q, k, v, cfg, backend, is_causal=True, attn_mask=kpm[:, None, None, :])
    assert call.sparse, call.reason
    want = _want(q, k, v, (20, 0), kpm)
    seen = (window_mask(130, 130, 20, 0, DEVICE)[None] & kpm[:, None, :]).any(-1)  # rows with a visible key
    torch.testing.assert_close(out.transpose(1, 2)[seen], want.transpose(1, 2)[seen], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window", list(WINDOWS))
def test_window_mask_handed_over_runs_as_a_window(window):
    # what transformers hands a sliding layer at run time: the [B, 1, N, N] bool mask
    q, k, v = _qkv()
    w = WINDOWS[window]
    m = window_mask(150, 150, *w, DEVICE)[None, None].expand(2, 1, 150, 150)
    out, call = _run(q, k, v, DenseConfig(), "reference", attn_mask=m)
    assert not call.sparse  # the dense method with no window of its own: SDPA with the mask
    # PISA runs the mask's window itself: with a top-K holding every block (10 of 16 keys), exactly
    out_pisa, call_pisa = _run(q, k, v, PISAConfig(block_size=16, top_k=16), "reference", attn_mask=m)
    assert call_pisa.sparse and call_pisa.method == "pisa", call_pisa.reason
    torch.testing.assert_close(out_pisa, _want(q, k, v, w), atol=2e-5, rtol=2e-5)
    # PBS runs the mask's window itself: at threshold 1, exactly
    exact_pbs = PBSConfig(block_size=16, segment_size=32, threshold=1.0)
    out_pbs, call_pbs = _run(q, k, v, exact_pbs, "reference", attn_mask=m)
    assert call_pbs.sparse and call_pbs.method == "pbs", call_pbs.reason
    torch.testing.assert_close(out_pbs, _want(q, k, v, w), atol=2e-5, rtol=2e-5)
    out_w, call_w = _run(q, k, v, DenseConfig(sliding_window=w[0], chunk_size=w[1]), "reference", attn_mask=m)
    assert call_w.sparse
    torch.testing.assert_close(out_w, _want(q, k, v, w), atol=2e-5, rtol=2e-5)


def test_window_needs_causality():
    q, k, v = _qkv(n=40)
    with pytest.raises(ValueError, match="causal attention only"):
        sparseflow.attention(q, k, v, config=DenseConfig(sliding_window=8), is_causal=False, backend="reference")


def test_conflicting_windows_run_dense_with_both():
    q, k, v = _qkv(n=100)
    m = window_mask(100, 100, 0, 32, DEVICE)
    out, call = _run(q, k, v, DenseConfig(chunk_size=20), "reference", attn_mask=m)
    assert not call.sparse and "not one window" in call.reason
    both = m & window_mask(100, 100, 0, 20, DEVICE)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=both, enable_gqa=True)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)


def test_a_windows_dense_mask_is_built_on_the_queries_device():
    # without an attn_mask, the dense fallback's window mask must follow q (on a GPU a CPU mask
    # made auto's dense candidate fail); meta stands in for another device here
    from sparseflow import op_windows

    q = torch.empty(1, 2, 50, 8, device="meta")
    assert op_windows.with_window_mask(None, q, 50, (8, 0)).device.type == "meta"


def test_merging_keeps_the_mask_analysis_when_there_is_no_window_to_merge():
    from sparseflow import op_windows
    from sparseflow.masks import analyse_mask

    causal = analyse_mask(None, True, 1, 64, 64)
    assert op_windows.merged_window(causal, PBSConfig())[0] is causal
    windowed = analyse_mask(window_mask(64, 64, 8, 0, "cpu"), False, 1, 64, 64)
    assert windowed.sliding_window == 8
    assert op_windows.merged_window(windowed, DenseConfig(sliding_window=8))[0] is windowed
    narrower, reason = op_windows.merged_window(windowed, DenseConfig(sliding_window=4))
    assert reason == "" and (narrower.sliding_window, windowed.sliding_window) == (4, 8)
    _, conflict = op_windows.merged_window(windowed, DenseConfig(chunk_size=16))
    assert "not one window" in conflict
