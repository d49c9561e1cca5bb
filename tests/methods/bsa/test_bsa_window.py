"""BSA inside a local window: the top-K is chosen among the visible blocks from each query's
window's first block on (forced blocks too), and attention applies the window's key bound.
The reference against a brute-force oracle; the Triton selector (Triton's interpreter on the CPU)
and the flex backend against the reference; a window narrower than the top-K is exact."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from _window_oracle import cpu_qkv_inputs, one_sparse_call

import sparseflow
from sparseflow.kernels import token_blocks as tb
from sparseflow.methods.bsa import reference as bsa_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

# id: (B, Hq, Hkv, N, D, C, K, sliding_window, chunk_size, pad)
CASES = {
    "sliding-40-gqa2": (1, 4, 2, 150, 16, 8, 3, 40, 0, False),
    "sliding-23-pad-b2": (2, 3, 1, 97, 16, 8, 4, 23, 0, True),
    "chunk-32": (1, 2, 1, 133, 16, 8, 3, 0, 32, False),
    "sliding-9-tiny": (1, 2, 2, 64, 8, 4, 3, 9, 0, True),
}


def _oracle_select(q, k, kpm, c, top_k, sliding_window, chunk_size):
    """Per query, by loops: forced (current, previous, sink) blocks inside the window first, then
    the best group-summed mean scores among the other visible blocks inside it (ties: lower id)."""
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    nb = -(-n // c)
    valid = torch.ones(b, n, dtype=torch.bool) if kpm is None else kpm.bool()
    lo = tb.window_lower_bounds(torch.arange(n), sliding_window, chunk_size)
    width = tb.selection_width(top_k, n, c)
    out = torch.full((b, hkv, n, width), -1, dtype=torch.long)
    for bi in range(b):
        for h in range(hkv):
            means = []
            for j in range(nb):
                keys = [t for t in range(j * c, min(n, (j + 1) * c)) if valid[bi, t]]
                means.append(k[bi, h, keys].double().mean(0) if keys else None)
            for i in range(n):
                first = int(lo[i]) // c
                vis = [
                    j
                    for j in range(first, i // c + 1)
                    if any(valid[bi, t] for t in range(j * c, min(i + 1, (j + 1) * c)))
                ]
                forced = [j for j in (i // c, i // c - 1, 0) if j in vis]
                qs = q[bi, h * g : (h + 1) * g, i].double().sum(0) / d**0.5
                rest = sorted((j for j in vis if j not in forced), key=lambda j: (-float(qs @ means[j]), j))
                kept = sorted((list(dict.fromkeys(forced)) + rest)[:width])
                out[bi, h, i, : len(kept)] = torch.tensor(kept)
    return out


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_reference_selection_is_the_top_k_inside_the_window(case):
    b, hq, hkv, n, d, c, kk, sw, cs, pad = case
    q, k, _, kpm = cpu_qkv_inputs(b, hq, hkv, n, n, d, torch.float32, pad)
    got = bsa_ref.bsa_select(q, k, key_padding_mask=kpm, block_size=c, top_k=kk, sliding_window=sw, chunk_size=cs)
    want = _oracle_select(q, k, kpm, c, kk, sw, cs)
    assert torch.equal(got, want)
    first = tb.window_first_blocks(torch.arange(n), c, sw, cs)
    assert ((got < 0) | (got >= first.view(1, 1, n, 1))).all()
    outside = bsa_ref.bsa_select(q, k, key_padding_mask=kpm, block_size=c, top_k=kk)
    assert not torch.equal(got, outside), "the window must change the selection somewhere"


@needs_triton
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_triton_selection_equals_reference(case):
    from sparseflow.methods.bsa import triton_select

    b, hq, hkv, n, d, c, kk, sw, cs, pad = case
    q, k, _, kpm = cpu_qkv_inputs(b, hq, hkv, n, n, d, torch.float32, pad)
    kw = dict(block_size=c, top_k=kk, sliding_window=sw, chunk_size=cs)
    want = bsa_ref.bsa_select(q, k, key_padding_mask=kpm, **kw)
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    got = triton_select.bsa_select(dev(q), dev(k), key_padding_mask=dev(kpm), **kw)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_triton), "flex"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_backends_equal_the_reference(case, backend):
    """The op runs BSA inside the window on every backend (no dense fallback): the same output as
    the reference backend, whose attention is the oracle's over the same blocks."""
    b, hq, hkv, n, d, c, kk, sw, cs, pad = case
    q, k, v, kpm = cpu_qkv_inputs(b, hq, hkv, n, n, d, torch.float32, pad)
    cfg = sparseflow.BSAConfig(block_size=c, top_k=kk, sliding_window=sw, chunk_size=cs)
    want, _ = one_sparse_call(q, k, v, kpm, cfg, "reference")
    dev = DEVICE if backend == "triton" else "cpu"
    to = lambda t: None if t is None else t.to(dev)  # noqa: E731
    got, call = one_sparse_call(to(q), to(k), to(v), to(kpm), cfg, backend)
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)
    assert call.backend == backend


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_wide_top_k_is_the_exact_window(case):
    """A top-K at least the window's block count keeps every block of the window: BSA equals the
    dense method's exact window."""
    b, hq, hkv, n, d, c, kk, sw, cs, pad = case
    q, k, v, kpm = cpu_qkv_inputs(b, hq, hkv, n, n, d, torch.float32, pad)
    cfg = sparseflow.BSAConfig(block_size=c, top_k=-(-n // c), sliding_window=sw, chunk_size=cs)
    got, call = one_sparse_call(q, k, v, kpm, cfg, "reference")
    exact, _ = one_sparse_call(q, k, v, kpm, sparseflow.DenseConfig(sliding_window=sw, chunk_size=cs), "reference")
    torch.testing.assert_close(got, exact, atol=1e-5, rtol=1e-5)
    assert call.density == pytest.approx(1.0)


def test_a_windowed_layer_runs_bsa_inside_a_wide_window_only():
    """``registry.windowed``: a window wider than BSA's top-K blocks keeps BSA (its selection inside
    the window); a narrower one runs the dense method's exact window (the top-K would keep every
    block anyway)."""
    from sparseflow.methods import windowed

    bsa = sparseflow.BSAConfig(block_size=64, top_k=8)
    cfg, note = windowed(bsa, 4096)
    assert cfg == bsa.replace(sliding_window=4096) and note == ""
    cfg, note = windowed(bsa, 512)  # 9 blocks at most > 8: still BSA
    assert cfg.method == "bsa"
    cfg, note = windowed(bsa, 449)  # 8 blocks at most
    assert cfg == sparseflow.DenseConfig(sliding_window=449) and "top_k=8" in note
    cfg, note = windowed(bsa, 0, 448)
    assert cfg == sparseflow.DenseConfig(chunk_size=448)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_the_selection_carries_the_window(case):
    """The op's Selection holds the call's window: its key mask is the selected blocks' keys cut
    to each query's window (the first block's keys before the bound are not attended)."""
    b, hq, hkv, n, d, c, kk, sw, cs, pad = case
    q, k, v, kpm = cpu_qkv_inputs(b, hq, hkv, n, n, d, torch.float32, pad)
    _, call = one_sparse_call(
        q, k, v, kpm, sparseflow.BSAConfig(block_size=c, top_k=kk, sliding_window=sw, chunk_size=cs), "reference"
    )
    sel = call.selection
    assert (sel.sliding_window, sel.chunk_size) == (sw, cs)
    pos = torch.arange(n, device=q.device)
    inside = pos[None, :] >= tb.window_lower_bounds(pos, sw, cs)[:, None]
    blocks = dataclasses.replace(sel, sliding_window=0, chunk_size=0).key_mask(hq)
    assert torch.equal(sel.key_mask(hq), blocks & inside)
    if sw or cs % c:  # (a chunk of whole blocks cuts none)
        assert (blocks & ~inside).any(), "the window must cut some selected block"
