"""PISA inside a local window: each query's walk runs over the blocks from its window's first
block on (a node wholly before it is never a candidate; a forced sink or previous block before it
is not forced), and the attention applies the window's key bound.

The reference against a brute-force oracle (a per-query walk in Python loops, fp64, and dense
attention under the materialised mask: selection, causality, window, padding); the Triton walks
(per-token, tiled, scan; Triton's interpreter on the CPU) and the op's backends (reference,
Triton, flex compiled on the CPU) against the reference; a window narrower than the top-K is
exact. Small shapes: the interpreter is slow.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from _window_oracle import cpu_qkv_inputs, dense_window_attention, one_sparse_call

import sparseflow
from sparseflow import Tuning
from sparseflow.methods.pisa import reference as pisa_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
F32, BF16 = torch.float32, torch.bfloat16
NEAR_TIE = 1e-4  # fp32 walk vs fp64 oracle: a level decided by a smaller gap may go either way

# id: (B, Hq, Hkv, Nq, Nk, D, C, K, g, score, pad, dtype, beam, sliding_window, chunk_size)
# (both bounds at once, and fewer queries than keys, are the kernels' cases only: the op runs
# one window, and causal calls with Nq == Nk)
CASES = {
    "sliding-17-lse-gqa2": (1, 4, 2, 64, 64, 16, 4, 3, 2, "lse", False, F32, 1, 17, 0),
    "sliding-19-mean_var-pad-b2": (2, 3, 1, 61, 61, 16, 4, 4, 2, "mean_var", True, F32, 1, 19, 0),
    "sliding-20-chunk-32-mean-br3-beam2-nq40-nk133": (1, 2, 1, 40, 133, 16, 8, 3, 3, "mean", False, F32, 2, 20, 32),
    "chunk-24-bf16-g3-pad": (1, 3, 1, 75, 75, 16, 4, 4, 2, "lse", True, BF16, 1, 0, 24),
    "sliding-13-tiny-pad": (1, 2, 1, 50, 50, 16, 4, 3, 2, "mean_var", True, F32, 1, 13, 0),
    "sliding-40-lse-nq60-nk100": (1, 2, 1, 60, 100, 16, 4, 3, 2, "lse", False, F32, 1, 40, 0),
}


def _inputs(case):
    b, hq, hkv, nq, nk, d, c, kk, g, score, pad, dtype, beam, sw, cs = case
    q, k, v, kpm = cpu_qkv_inputs(b, hq, hkv, nq, nk, d, dtype, pad, seed=nq)  # queries: the last nq positions
    kw = dict(block_size=c, top_k=kk, branching=g, score=score, beam=beam)
    return q, k, v, kpm, kw, dict(sliding_window=sw, chunk_size=cs)


def _window_lo(p, sliding_window, chunk_size):
    """The first key a query at position ``p`` sees, from the definitions (not the library's)."""
    lo = 0
    if sliding_window:
        lo = max(lo, p - sliding_window + 1)
    if chunk_size:
        lo = max(lo, (p // chunk_size) * chunk_size)
    return lo


class _Pyramid:
    """One (batch row, KV head)'s pyramid, written out by loops: node ``u`` of level ``l`` (1 =
    leaves) covers leaves ``u * g**(l-1) ..``; its summary is the mean of its valid keys."""

    def __init__(self, k, valid, c, g):
        self.k, self.valid, self.c, self.g = k.double(), valid, c, g
        self.nk = k.shape[0]
        self.nb = -(-self.nk // c)
        self.levels = 1
        while g ** (self.levels - 1) < self.nb:
            self.levels += 1

    def leaves(self, level, u):
        span = self.g ** (level - 1)
        return range(u * span, min((u + 1) * span, self.nb))

    def keys(self, level, u, horizon):
        return [
            j
            for leaf in self.leaves(level, u)
            for j in range(leaf * self.c, min((leaf + 1) * self.c, self.nk))
            if self.valid[j] and j <= horizon
        ]

    def summary(self, level, u):
        return self.k[self.keys(level, u, self.nk)].mean(0)


def _node_score(pyr, qh, level, u, horizon, score, scale):
    """Group-summed score of node ``u`` (fp64): LSE / mean + var/2 over its children holding a
    visible key (raw keys at the leaves), or its own mean's logit for ``mean``."""
    if score == "mean":
        return float((qh @ pyr.summary(level, u)).sum() * scale)
    if level == 1:
        logits = (qh @ pyr.k[pyr.keys(1, u, horizon)].T) * scale
    else:
        kids = [c for c in range(u * pyr.g, u * pyr.g + pyr.g) if pyr.keys(level - 1, c, horizon)]
        logits = (qh @ torch.stack([pyr.summary(level - 1, c) for c in kids]).T) * scale
    if score == "lse":
        return float(torch.logsumexp(logits, -1).sum())
    return float((logits.mean(-1) + 0.5 * logits.var(-1, unbiased=False)).sum())


def _oracle_walk(pyr, qh, p, window, kw, scale):
    """``(kept leaves, ambiguous)`` of one query's walk inside its window, by loops."""
    c, g, top_k = kw["block_size"], kw["branching"], kw["top_k"]
    first = _window_lo(p, **window) // c
    in_window = lambda level, u: (u + 1) * g ** (level - 1) - 1 >= first  # noqa: E731  (last leaf)
    visible = lambda level, u: bool(pyr.keys(level, u, p)) and in_window(level, u)  # noqa: E731
    cur = p // c
    forced_leaves = {f for f in (cur, cur - 1, 0) if f >= 0 and visible(1, f)}  # current, previous, sink
    kept = [0] if visible(pyr.levels, 0) else []
    ambiguous = False
    for level in range(pyr.levels - 1, 0, -1):
        width = top_k if level == 1 else kw["beam"] * top_k
        cands = [ch for u in kept for ch in range(u * g, u * g + g) if ch < pyr.nb and visible(level, ch)]
        if len(cands) <= width:
            kept = cands
            continue
        span = g ** (level - 1)
        forced = {ch for ch in cands if ch in {f // span for f in forced_leaves | {cur}}}
        scores = {ch: _node_score(pyr, qh, level, ch, p, kw["score"], scale) for ch in cands if ch not in forced}
        rest = sorted(scores, key=lambda ch: (-scores[ch], ch))
        free = width - len(forced)
        if 0 < free < len(rest):
            ambiguous = ambiguous or scores[rest[free - 1]] - scores[rest[free]] < NEAR_TIE
        kept = sorted(forced | set(rest[:free]))
    return kept, ambiguous


def _oracle_select(q, k, kpm, kw, window):
    """``(kept leaves [B, Hkv, Nq] lists, ambiguous [B, Hkv, Nq])`` for every query."""
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    grp = hq // hkv
    out, amb = {}, {}
    for bi in range(b):
        valid = torch.ones(nk, dtype=torch.bool) if kpm is None else kpm[bi].cpu()
        for h in range(hkv):
            pyr = _Pyramid(k[bi, h].cpu(), valid, kw["block_size"], kw["branching"])
            for i in range(nq):
                qh = q[bi, h * grp : (h + 1) * grp, i].cpu().double()
                out[bi, h, i], amb[bi, h, i] = _oracle_walk(pyr, qh, i + nk - nq, window, kw, d**-0.5)
    return out, amb


def _rows(idx):
    return [int(x) for x in idx.tolist() if x >= 0]


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_reference_selection_is_the_walk_inside_the_window(case):
    q, k, _, kpm, kw, window = _inputs(case)
    got = pisa_ref.pisa_select(q, k, key_padding_mask=kpm, **kw, **window)
    want, ambiguous = _oracle_select(q, k, kpm, kw, window)
    decided = [key for key in want if not ambiguous[key]]
    assert len(decided) >= 0.9 * len(want), "too many near-ties: the case tests little"
    for bi, h, i in decided:
        assert _rows(got[bi, h, i]) == want[bi, h, i], (bi, h, i)
    outside = pisa_ref.pisa_select(q, k, key_padding_mask=kpm, **kw)
    assert not torch.equal(got, outside), "the window must change the selection somewhere"
    n = k.shape[2]
    first = torch.tensor([_window_lo(i + n - q.shape[2], **window) // kw["block_size"] for i in range(q.shape[2])])
    assert ((got < 0) | (got >= first.view(1, 1, -1, 1).to(got.device))).all()


def _oracle_density(sel_idx, kpm, n_q, n_k, c, window):
    """Selected / visible blocks in each query's window, averaged over the queries that see one."""
    b = sel_idx.shape[0]
    valid = torch.ones(b, n_k, dtype=torch.bool) if kpm is None else kpm.cpu()
    dens = torch.zeros(b, sel_idx.shape[1], dtype=torch.float64)
    for bi in range(b):
        ratios = []
        for i in range(n_q):
            p = i + n_k - n_q
            first = _window_lo(p, **window) // c
            vis = [j for j in range(first, p // c + 1) if valid[bi, j * c : min(p + 1, (j + 1) * c)].any()]
            if vis:
                ratios.append((sel_idx[bi, :, i] >= 0).sum(-1).double() / len(vis))
        if ratios:
            dens[bi] = torch.stack(ratios).mean(0)
    return dens


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_reference_attention_is_dense_attention_on_selection_and_window(case):
    """The reference's output is softmax attention under selection ∩ causality ∩ window ∩
    padding, materialised (fp64 oracle): its error is at most twice plain PyTorch's in the same
    dtype; the reported density is selected / visible blocks of each query's window."""
    q, k, v, kpm, kw, window = _inputs(case)
    out, sel = pisa_ref.pisa_attention(q, k, v, key_padding_mask=kpm, return_selection=True, **kw, **window)
    idx, c = sel.block_indices, kw["block_size"]
    w, chunk = window["sliding_window"], window["chunk_size"]
    exact = dense_window_attention(q.double(), k.double(), v.double(), w, chunk, kpm, idx, c)
    plain = dense_window_attention(q, k, v, w, chunk, kpm, idx, c)
    err = (out.double() - exact).abs().max().item()
    plain_err = (plain.double() - exact).abs().max().item()
    assert err <= 2 * plain_err + 1e-6, (err, plain_err)
    want = _oracle_density(idx, kpm, q.shape[2], k.shape[2], c, window)
    torch.testing.assert_close(sel.density.double().cpu()[:, :: q.shape[1] // k.shape[1]], want)


# the scan (the slowest interpreted) on the cases of padding with two batch rows, both bounds
# with fewer queries than keys, 16-bit inputs, and a wide window (scored levels whose first node
# the early tiles read and the later ones skip); its middle stage is the rows walk (8 candidates
# a level) or, with the beam and 3 children (32), the per-token walk's kernel
SCAN_CASES = (
    "sliding-19-mean_var-pad-b2",
    "sliding-20-chunk-32-mean-br3-beam2-nq40-nk133",
    "chunk-24-bf16-g3-pad",
    "sliding-40-lse-nq60-nk100",
)
WALK_CASES = [
    pytest.param(walk, case, id=f"{walk}-{key}")
    for walk in ("per_token", "tiled", "scan")
    for key, case in CASES.items()
    if walk != "scan" or key in SCAN_CASES
]


@needs_triton
@pytest.mark.parametrize("walk, case", WALK_CASES)
def test_triton_walks_equal_the_reference(walk, case, monkeypatch, poisoned):
    """Every Triton walk runs the window (none ignores it): the reference's selection exactly.
    Buffers start poisoned: the scan's node scores skipped before a tile's windows are never read."""
    from sparseflow.methods.pisa import triton_select, triton_select_scan, triton_select_tiled

    module = {"tiled": triton_select_tiled, "scan": triton_select_scan}.get(walk)
    ran = []
    if module is not None:  # the chosen walk must run, not the per-token fallback
        name = f"pisa_select_{walk}_fwd"
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a: ran.append(a) or real(*a))
    if walk == "scan":  # small node-scan tiles: the later ones start past nodes their scan skips
        monkeypatch.setitem(triton_select_scan.LAUNCH, "rows", 16)
    q, k, _, kpm, kw, window = _inputs(case)
    want = pisa_ref.pisa_select(q, k, key_padding_mask=kpm, **kw, **window)
    q, k, kpm = (None if t is None else t.to(DEVICE) for t in (q, k, kpm))
    got = poisoned(triton_select.pisa_select, q, k, key_padding_mask=kpm, tuning=Tuning(pisa_walk=walk), **kw, **window)
    assert module is None or len(ran) == 1, f"the {walk} walk did not run"
    assert torch.equal(got.cpu(), want)


OP_CASES = {key: CASES[key] for key in ("sliding-17-lse-gqa2", "chunk-24-bf16-g3-pad", "sliding-13-tiny-pad")}


def _config(kw, window, **over):
    return sparseflow.PISAConfig(**{**kw, **window, **over})


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_triton), "flex"])
@pytest.mark.parametrize("case", OP_CASES.values(), ids=OP_CASES.keys())
def test_backends_run_the_window(case, backend):
    """The op runs PISA inside the window on every backend (no dense fallback): the reference's
    output (the oracle's over the same blocks: the walks select them exactly), with at most twice
    plain PyTorch's error against fp64 in the inputs' dtype."""
    q, k, v, kpm, kw, window = _inputs(case)
    cfg = _config(kw, window)
    want, _ = one_sparse_call(q, k, v, kpm, cfg, "reference")
    dev = DEVICE if backend == "triton" else "cpu"
    to = lambda t: None if t is None else t.to(dev)  # noqa: E731
    got, call = one_sparse_call(to(q), to(k), to(v), to(kpm), cfg, backend)
    assert call.backend == backend
    idx = pisa_ref.pisa_select(q, k, key_padding_mask=kpm, **kw, **window)
    w, chunk, c = window["sliding_window"], window["chunk_size"], kw["block_size"]
    exact = dense_window_attention(q.double(), k.double(), v.double(), w, chunk, kpm, idx, c)
    plain_err = (dense_window_attention(q, k, v, w, chunk, kpm, idx, c).double() - exact).abs().max().item()
    for out in (want, got.cpu()):
        assert (out.double() - exact).abs().max().item() <= 2 * plain_err + 1e-6


@pytest.mark.parametrize("case", OP_CASES.values(), ids=OP_CASES.keys())
def test_wide_top_k_is_the_exact_window(case):
    """A top-K at least the window's block count keeps every block of the window: PISA equals the
    dense method's exact window, density 1."""
    q, k, v, kpm, kw, window = _inputs(case)
    q, k, v = q.float(), k.float(), v.float()
    cfg = _config(kw, window, top_k=-(-k.shape[2] // kw["block_size"]))
    got, call = one_sparse_call(q, k, v, kpm, cfg, "reference")
    exact, _ = one_sparse_call(q, k, v, kpm, sparseflow.DenseConfig(**window), "reference")
    torch.testing.assert_close(got, exact, atol=1e-5, rtol=1e-5)
    assert call.density == pytest.approx(1.0)


def test_a_window_narrower_than_the_top_k_is_exact():
    """Top-K 4 of blocks of 8 and a 20-key window (at most 4 blocks): the walk keeps every visible
    block of each window, so PISA is the exact window although most queries see 13 blocks."""
    q, k, v, _ = cpu_qkv_inputs(1, 2, 1, 104, 104, 16, F32, False, seed=3)
    window = dict(sliding_window=20, chunk_size=0)
    got, call = one_sparse_call(q, k, v, None, sparseflow.PISAConfig(block_size=8, top_k=4, **window), "reference")
    exact, _ = one_sparse_call(q, k, v, None, sparseflow.DenseConfig(**window), "reference")
    torch.testing.assert_close(got, exact, atol=1e-5, rtol=1e-5)
    assert call.density == pytest.approx(1.0)
    unwindowed, _ = one_sparse_call(q, k, v, None, sparseflow.PISAConfig(block_size=8, top_k=4), "reference")
    assert not torch.allclose(unwindowed, exact, atol=1e-3), "PISA ignoring the window would not be exact"


def test_a_windowed_layer_keeps_pisa_inside_a_wide_window_only():
    """``registry.windowed``: a window spanning more blocks than PISA's top-K keeps PISA (its walk
    inside the window); one whose blocks all fit runs the dense method's exact window."""
    from sparseflow.methods import windowed

    pisa = sparseflow.PISAConfig(block_size=64, top_k=8)
    cfg, note = windowed(pisa, 4096)
    assert cfg == pisa.replace(sliding_window=4096) and note == ""
    cfg, note = windowed(pisa, 0, 1024)
    assert cfg == pisa.replace(chunk_size=1024) and note == ""
    cfg, note = windowed(pisa, 449)  # 8 blocks at most
    assert cfg == sparseflow.DenseConfig(sliding_window=449) and "top_k=8" in note


@pytest.mark.parametrize(
    "window, is_causal, error, words",
    [
        (dict(sliding_window=-1), True, ValueError, "sliding_window must be an int >= 0"),
        (dict(chunk_size=2.0), True, TypeError, "chunk_size must be an int >= 0"),
        (dict(sliding_window=True), True, TypeError, "sliding_window must be an int >= 0"),
        (dict(sliding_window=16), False, ValueError, "sliding_window=16 needs is_causal=True"),
    ],
)
@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=needs_triton)])
def test_a_bad_window_is_refused_naming_it(window, is_causal, error, words, impl):
    if impl == "triton":
        from sparseflow.methods.pisa.triton_select import pisa_select
    else:
        pisa_select = pisa_ref.pisa_select
    q, k, _, _ = cpu_qkv_inputs(1, 2, 1, 40, 40, 16, F32, False)
    with pytest.raises(error, match=words):
        pisa_select(q, k, is_causal=is_causal, block_size=8, top_k=3, **window)


@needs_triton
def test_a_decode_step_never_serves_a_window_from_the_cached_pyramid():
    """The cached pyramid's decode step takes no window, and none reaches it: a generate() step's
    window comes as its mask (key padding to the op: the Triton backend's own walk runs it, the
    reference's result), and a config window on the one-query causal call runs dense. Without a
    window the same step is served from the cache (what the first two must not do)."""
    from sparseflow import decode_state

    q, k, v = (t.to(DEVICE) for t in cpu_qkv_inputs(1, 2, 1, 60, 60, 16, F32, False, seed=4)[:3])
    q1 = q[:, :, -1:]
    cfg = sparseflow.PISAConfig(block_size=8, top_k=3)
    in_window = (torch.arange(60, device=DEVICE) > 59 - 20)[None, None, None, :]  # the step's last 20 keys
    state = decode_state.DecodeState()
    with decode_state.active(state), sparseflow.capture() as cap:
        got = sparseflow.attention(q1, k, v, config=cfg, attn_mask=in_window, is_causal=False, backend="triton")
        sparseflow.attention(q1, k, v, config=cfg.replace(sliding_window=20), is_causal=True, backend="triton")
    assert state.rebuilt == state.appended == 0
    assert cap.calls[0].sparse and cap.calls[0].backend == "triton"
    assert not cap.calls[1].sparse and "Nq=1 != Nk=60" in cap.calls[1].reason
    want = sparseflow.attention(q1, k, v, config=cfg, attn_mask=in_window, is_causal=False, backend="reference")
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    with decode_state.active(state):
        sparseflow.attention(q1, k, v, config=cfg, is_causal=False, backend="triton")
    assert state.rebuilt == 1
