"""PBS inside a local window (issue 48): a query block's selection is made among the permuted key
blocks holding a valid key at or after its first row's window bound (forced blocks too; the
block probabilities are normalised over the candidates inside the window), and the attention
masks every key by its original position, ``lo(i) <= orig_pos <= i``.

The reference against a brute-force oracle (the selection and the masked attention by loops), the
exact mode against the dense method's exact window, the Triton backend (Triton's interpreter on
the CPU: both selection implementations, both K/V layouts, the strided scorings) and the flex
backend against the reference, the Triton kernel's error against PyTorch's own in bf16, and the
rule that decides which windowed layers keep PBS (``registry.windowed``)."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F
from _window_oracle import cpu_qkv_inputs, dense_window_attention, one_sparse_call

import sparseflow
from sparseflow import DenseConfig, PBSConfig, Tuning
from sparseflow.kernels.token_blocks import window_lower_bounds
from sparseflow.methods.pbs import reference as R

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

# id: (B, Hq, Hkv, N, D, block, segment, threshold, sliding_window, chunk_size, pad, gqa_permutation, permute)
CASES = {
    "sliding-50-gqa3": (1, 6, 2, 200, 16, 16, 32, 0.8, 50, 0, False, "query_head", True),
    "sliding-70-pad-b2-kvhead": (2, 4, 2, 181, 16, 16, 64, 0.7, 70, 0, True, "kv_head", True),
    "chunk-96-unpermuted": (1, 2, 1, 250, 16, 16, 32, 0.6, 0, 96, False, "query_head", False),
    "sliding-100-b32-pad": (1, 2, 1, 300, 16, 32, 64, 0.7, 100, 0, True, "query_head", True),
}


def _case(case):
    b, hq, hkv, n, d, bs, seg, thr, sw, cs, pad, gqa, permute = case
    q, k, v, kpm = cpu_qkv_inputs(b, hq, hkv, n, n, d, torch.float32, pad, seed=n)
    k[:, :, ::7] *= 2.0  # a few strong keys: the block probabilities are not flat
    cfg = PBSConfig(
        block_size=bs,
        segment_size=seg,
        threshold=thr,
        sliding_window=sw,
        chunk_size=cs,
        gqa_permutation=gqa,
        permute=permute,
    )
    return q, k, v, kpm, cfg


# --------------------------------------------------------------------------- the oracle


def _oracle_selection(q, k, perm, kpm, cfg):
    """``[B, Hq, nB, nB]`` by loops, from the definitions: per query block, the permuted key blocks
    holding a valid key at or after its first row's window bound are inside; candidates are those
    of an earlier region, forced those of its own region and the sink's block; the mean-scored
    softmax over the candidates inside (fp64), ranked by probability (ties: lower block), keeps
    each block whose predecessors' mass is below the threshold."""
    b, hq, n, d = q.shape
    hkv, hp = k.shape[1], perm.shape[1]
    bs, seg = cfg.block_size, cfg.segment_size
    nb = -(-n // bs)
    valid = torch.ones(b, n, dtype=torch.bool) if kpm is None else kpm.cpu()
    q, k, perm = q.cpu().double(), k.cpu().double(), perm.cpu()
    out = torch.zeros(b, hq, nb, nb, dtype=torch.bool)
    for bi in range(b):
        real = valid[bi].nonzero().flatten().tolist()
        n_seg = (real[-1] + 1 if real else 0) // seg
        region = [min(x * bs // seg, n_seg) for x in range(nb)]
        for h in range(hq):
            slots = perm[bi, h // (hq // hp)].tolist()
            keys = [[j for j in slots[x * bs : (x + 1) * bs] if valid[bi, j]] for x in range(nb)]
            sink = next((x for x in range(nb) if real and real[0] in slots[x * bs : (x + 1) * bs]), -1)
            kvh = h // (hq // hkv)
            for i in range(nb):
                lo = int(window_lower_bounds(torch.tensor(i * bs), cfg.sliding_window, cfg.chunk_size))
                inside = [any(j >= lo for j in keys[x]) for x in range(nb)]
                cand = [x for x in range(nb) if inside[x] and region[x] < region[i]]
                forced = [
                    x for x in range(nb) if inside[x] and (region[x] == region[i] or (cfg.force_sink and x == sink))
                ]
                rows = [t for t in range(i * bs, min(n, (i + 1) * bs)) if valid[bi, t]]
                qbar = q[bi, h, rows or list(range(i * bs, min(n, (i + 1) * bs)))].mean(0)
                logit = {x: float(qbar @ k[bi, kvh, keys[x]].mean(0)) / math.sqrt(d) for x in cand}
                top = max(logit.values(), default=0.0)
                total = sum(math.exp(v - top) for v in logit.values())
                prob = {x: math.exp(v - top) / total for x, v in logit.items()}
                mass = 0.0
                for x in sorted(cand, key=lambda x: (-prob[x], x)):
                    if mass >= cfg.threshold:
                        break
                    out[bi, h, i, x] = True
                    mass += prob[x]
                out[bi, h, i, forced] = True
    return out


def _oracle_key_mask(sel, perm, kpm, cfg):
    """``[B, Hq, N, N]`` over original key positions: the keys of each query's selected blocks,
    causal, inside its window, valid."""
    b, hq, nb, _ = sel.shape
    n, hp, bs = perm.shape[2], perm.shape[1], cfg.block_size
    mask = torch.zeros(b, hq, n, n, dtype=torch.bool)
    for bi, h, i, x in sel.nonzero().tolist():
        mask[bi, h, i * bs : (i + 1) * bs, perm[bi, h // (hq // hp), x * bs : (x + 1) * bs]] = True
    pos = torch.arange(n)
    lo = window_lower_bounds(pos, cfg.sliding_window, cfg.chunk_size)
    mask &= (pos[None, :] <= pos[:, None]) & (pos[None, :] >= lo[:, None])
    return mask if kpm is None else mask & kpm.cpu()[:, None, None, :]


def _masked_attention64(q, k, v, mask):
    """fp64 softmax attention under ``mask [B, Hq, N, N]``; a row that sees nothing outputs 0."""
    g = q.shape[1] // k.shape[1]
    kk, vv = (t.cpu().double().repeat_interleave(g, 1) for t in (k, v))
    logits = (q.cpu().double() @ kk.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    probs = torch.softmax(logits.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0)
    return probs @ vv


def _op(q, k, v, kpm, cfg, backend, tuning=None):
    out, call = one_sparse_call(q, k, v, kpm, cfg, backend, tuning)
    assert call.backend == backend, call.backend
    return out, call.selection


# --------------------------------------------------------------------------- reference


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_reference_is_the_oracle(case):
    """Selection, key mask, output and density of the reference against the brute-force oracle;
    the window changes the selection, and no block outside a query block's window is kept."""
    q, k, v, kpm, cfg = _case(case)
    out, sel = R.pbs_attention(q, k, v, cfg, key_padding_mask=kpm, return_selection=True)
    want_sel = _oracle_selection(q, k, sel.permutation, kpm, cfg)
    assert torch.equal(sel.block_mask.cpu(), want_sel)
    want_mask = _oracle_key_mask(want_sel, sel.permutation.cpu(), kpm, cfg)
    assert torch.equal(sel.key_mask(q.shape[1]).cpu(), want_mask)  # the Selection carries the window
    torch.testing.assert_close(out.cpu().double(), _masked_attention64(q, k, v, want_mask), atol=2e-5, rtol=2e-5)
    assert (sel.density < 1).any() and (sel.density > 0).all()
    unwindowed = R.pbs_selection(q, k, cfg.without_window(), key_padding_mask=kpm)
    assert torch.equal(unwindowed[0], sel.permutation)  # the permutation does not see the window
    assert not torch.equal(unwindowed[1], sel.block_mask), "the window must change the selection somewhere"


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_threshold_one_is_the_exact_window(case):
    """At threshold 1 PBS keeps every block inside the window: the dense method's exact window
    (and the mask-built oracle's), with density 1."""
    q, k, v, kpm, cfg = _case(case)
    cfg = cfg.replace(threshold=1.0)
    got, sel = _op(q, k, v, kpm, cfg, "reference")
    exact = sparseflow.attention(
        q,
        k,
        v,
        config=DenseConfig(sliding_window=cfg.sliding_window, chunk_size=cfg.chunk_size),
        attn_mask=None if kpm is None else kpm[:, None, None, :],
        is_causal=True,
        backend="reference",
    )
    torch.testing.assert_close(got, exact, atol=2e-5, rtol=2e-5)
    oracle = dense_window_attention(q.double(), k.double(), v.double(), cfg.sliding_window, cfg.chunk_size, kpm)
    torch.testing.assert_close(got.double(), oracle, atol=2e-5, rtol=2e-5)
    assert torch.allclose(sel.density, torch.ones_like(sel.density))


def test_dense_tail_attends_its_whole_window():
    """The dense tail's rows are the exact window's rows (not every causal key)."""
    q, k, v, kpm, cfg = _case(CASES["sliding-70-pad-b2-kvhead"])
    cfg = cfg.replace(dense_tail_blocks=2)
    got = R.pbs_attention(q, k, v, cfg, key_padding_mask=kpm)
    exact = dense_window_attention(q, k, v, cfg.sliding_window, cfg.chunk_size, kpm)
    start = (-(-q.shape[2] // cfg.block_size) - 2) * cfg.block_size
    torch.testing.assert_close(got[:, :, start:], exact[:, :, start:], atol=2e-5, rtol=2e-5)
    assert not torch.allclose(got[:, :, :start], exact[:, :, :start], atol=1e-3)  # the rest is sparse


@pytest.mark.parametrize(
    "backend",
    ["reference", pytest.param("triton", marks=needs_triton), "flex"],
)
def test_a_window_needs_causality(backend):
    q, k, v, _, cfg = _case(CASES["chunk-96-unpermuted"])
    if backend == "triton":
        q, k, v = (t.to(DEVICE) for t in (q, k, v))
    impl = sparseflow.methods.spec_for("pbs").backend(backend).load()
    with pytest.raises(ValueError, match="chunk_size=96 needs is_causal=True"):
        impl(q, k, v, cfg, is_causal=False)


# --------------------------------------------------------------------------- the fast backends


TRITON_RUNS = {  # case id, selection implementation, K/V layout, scoring
    "torch-selection-permuted": ("sliding-50-gqa3", "reference", "permuted", "mean"),
    "kernel-selection-gather": ("sliding-70-pad-b2-kvhead", "triton", "gather", "mean"),
    "kernel-selection-chunk": ("chunk-96-unpermuted", "triton", "permuted", "mean"),
    "kernel-selection-b32": ("sliding-100-b32-pad", "triton", "permuted", "mean"),
    # one estimate row per query row: the row tiles late in the sequence skip the segments before
    # their windows
    "kernel-sampled-rows": ("sliding-50-gqa3", "triton", "permuted", "sampled_rows"),
    "kernel-antidiagonal-pad": ("sliding-70-pad-b2-kvhead", "triton", "gather", "antidiagonal"),
}


@needs_triton
@pytest.mark.parametrize("run", TRITON_RUNS.values(), ids=TRITON_RUNS.keys())
def test_triton_equals_the_reference(run):
    case, select, layout, scoring = run
    q, k, v, kpm, cfg = _case(CASES[case])
    cfg = cfg.replace(scoring=scoring, antidiagonal_stride=1 if scoring == "sampled_rows" else 4)
    tuning = Tuning(pbs_select=select, pbs_kv_layout=layout)
    want, want_sel = R.pbs_attention(q, k, v, cfg, key_padding_mask=kpm, return_selection=True)
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    got, sel = _op(dev(q), dev(k), dev(v), dev(kpm), cfg, "triton", tuning)
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)
    assert torch.equal(sel.block_mask.cpu(), want_sel.block_mask)
    torch.testing.assert_close(sel.density.cpu(), want_sel.density)


@needs_triton
def test_triton_error_within_twice_torch_in_bf16():
    """The Triton kernel in bf16 against the fp64 oracle of its own selection: at most twice the
    error of PyTorch's SDPA in bf16 under the same mask (plus 1e-6)."""
    from sparseflow.methods.pbs import triton_impl

    q, k, v, kpm, cfg = _case(CASES["sliding-70-pad-b2-kvhead"])
    q, k, v = (t.to(DEVICE, torch.bfloat16) for t in (q, k, v))
    kpm = kpm.to(DEVICE)
    out, sel = triton_impl.pbs_attention(
        q, k, v, cfg, key_padding_mask=kpm, return_selection=True, tuning=Tuning(pbs_select="triton")
    )
    mask = sel.key_mask(q.shape[1])
    want = _masked_attention64(q, k, v, mask.cpu())
    g = q.shape[1] // k.shape[1]
    torch_out = F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=mask)
    torch_out = torch.where(mask.any(-1, keepdim=True), torch_out, torch.zeros_like(torch_out))

    def rel(x):
        return float((x.cpu().double() - want).norm() / want.norm())

    assert rel(out) <= 2 * rel(torch_out) + 1e-6, (rel(out), rel(torch_out))


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_flex_equals_the_reference(case):
    q, k, v, kpm, cfg = _case(case)
    want, want_sel = R.pbs_attention(q, k, v, cfg, key_padding_mask=kpm, return_selection=True)
    got, sel = _op(q, k, v, kpm, cfg, "flex")
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    assert torch.equal(sel.block_mask, want_sel.block_mask)


# --------------------------------------------------------------------------- registry.windowed


def test_a_windowed_layer_keeps_pbs_where_its_selection_pays_off():
    """PBS keeps a query block's segment whole and at least one block before it; a window that
    spans more than twice those blocks keeps PBS (its selection inside the window), a narrower one
    (Gemma 3's 512 keys at the defaults) and the exact mode run the dense method's exact window."""
    from sparseflow.methods import windowed

    pbs = PBSConfig(block_size=128, segment_size=256)  # keeps 3 blocks whatever the scores
    cfg, note = windowed(pbs, 4096)
    assert cfg == pbs.replace(sliding_window=4096) and note == ""
    cfg, note = windowed(pbs, 642)  # 7 blocks at most > 6: still PBS
    assert cfg == pbs.replace(sliding_window=642) and note == ""
    cfg, note = windowed(pbs, 641)  # 6 blocks at most
    assert cfg == DenseConfig(sliding_window=641) and "spans 6 blocks" in note and "exactly" in note
    cfg, note = windowed(pbs, 512)
    assert cfg == DenseConfig(sliding_window=512)
    cfg, note = windowed(pbs, 0, 256)  # a chunk inside one segment: nothing to choose from
    assert cfg == DenseConfig(chunk_size=256)
    cfg, note = windowed(pbs, 0, 8192)
    assert cfg == pbs.replace(chunk_size=8192)
    cfg, note = windowed(pbs.replace(threshold=1.0), 4096)
    assert cfg == DenseConfig(sliding_window=4096) and "threshold=1.0" in note
    wide = PBSConfig(block_size=64, segment_size=1024)  # keeps 17 blocks
    assert windowed(wide, 2048)[0].method == "dense" and windowed(wide, 2200)[0].method == "pbs"
