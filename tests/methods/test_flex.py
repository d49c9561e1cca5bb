"""backend="flex" (compiled FlexAttention) against the plain references, on the CPU.

Only the compiled flex path is exercised (eager FlexAttention ignores BlockMask block lists; the
backends refuse to run it). Compilation is slow on the CPU (~5-20 s per shape), so every test
reuses the few shapes of ``CASES``: tensors of equal shapes, dtype and mask kind hit the compile
cache whatever the seeds, padding patterns or method configs (thresholds, top_k, scores).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

import sparseflow
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparseflow.kernels import flex_common as fc
from sparseflow.methods.bsa import flex as bsa_flex
from sparseflow.methods.bsa import reference as bsa_ref
from sparseflow.methods.pbs import flex as pbs_flex
from sparseflow.methods.pbs import reference as pbs_ref
from sparseflow.methods.pisa import flex as pisa_flex
from sparseflow.methods.pisa import reference as pisa_ref
from sparseflow.testing import error_bound

pytestmark = pytest.mark.skipif(
    not __import__("torch._inductor.kernel.flex.flex_cpu", fromlist=["x"]).check_cpu_supported(),
    reason="compiled FlexAttention is not supported on this CPU",
)

IMPLS = {
    "pbs": (pbs_ref.pbs_attention, pbs_flex.pbs_attention),
    "pisa": (pisa_ref.pisa_attention, pisa_flex.pisa_attention),
    "bsa": (bsa_ref.bsa_attention, bsa_flex.bsa_attention),
}
BLOCK = 16


@dataclass(frozen=True)
class Case:
    name: str
    batch: int
    hkv: int
    group: int
    n: int
    d: int
    dtype: torch.dtype
    is_causal: bool
    padded: bool  # a key padding mask is passed (the mask kind is part of the compiled graph)

    @property
    def hq(self) -> int:
        return self.hkv * self.group

    def tensors(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(self.batch, self.hq, self.n, self.d, generator=g).to(self.dtype)
        k = torch.randn(self.batch, self.hkv, self.n, self.d, generator=g).to(self.dtype)
        v = torch.randn(self.batch, self.hkv, self.n, self.d, generator=g).to(self.dtype)
        return q, k, v

    def default_mask(self) -> Optional[torch.Tensor]:
        if not self.padded:
            return None
        m = torch.ones(self.batch, self.n, dtype=torch.bool)
        m[0, self.n - 7 :] = False  # trailing padding
        m[-1, :5] = False  # leading padding: the first queries of that row see no key
        return m


CASES = {
    # group 3, batch 2, key padding, odd length, causal
    "pad130": Case("pad130", 2, 2, 3, 130, 64, torch.float32, True, True),
    # one segment + tail for PBS, non-causal, small head dim
    "odd37": Case("odd37", 1, 1, 3, 37, 32, torch.float32, False, False),
    # bf16, head dim 80, long-ish odd length, causal
    "bf16_301": Case("bf16_301", 1, 1, 3, 301, 80, torch.bfloat16, True, False),
}


def _config(method: str, **kw):
    if method == "pbs":
        base = dict(block_size=BLOCK, segment_size=2 * BLOCK, threshold=0.6)
    else:
        base = dict(block_size=BLOCK, top_k=4)
    base.update(kw)
    return base


def _run_both(method, q, k, v, kpm, is_causal, cfg):
    ref, flex = IMPLS[method]
    with torch.no_grad():
        out_r, sel_r = ref(q, k, v, key_padding_mask=kpm, is_causal=is_causal, return_selection=True, **cfg)
        out_f, sel_f = flex(q, k, v, key_padding_mask=kpm, is_causal=is_causal, return_selection=True, **cfg)
    return out_r, sel_r, out_f, sel_f


def _assert_same_selection(sel_r, sel_f):
    assert sel_f.method == sel_r.method and sel_f.block_size == sel_r.block_size
    for name in ("block_mask", "permutation", "block_indices"):
        a, b = getattr(sel_r, name), getattr(sel_f, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(a, b), f"{name} differs"
    torch.testing.assert_close(sel_f.density, sel_r.density, rtol=0, atol=0)


def _check(method, case: Case, q, k, v, kpm, cfg):
    """flex == reference within the 2x-plain-PyTorch rule against the fp64 masked-dense oracle
    over the reported selection; same selection; finite; dtype/shape."""
    out_r, sel_r, out_f, sel_f = _run_both(method, q, k, v, kpm, case.is_causal, cfg)
    assert out_f.shape == out_r.shape and out_f.dtype == q.dtype
    assert torch.isfinite(out_f).all(), "flex output has NaN/inf"
    _assert_same_selection(sel_r, sel_f)
    oracle, bound = error_bound(
        q, k, v, key_mask=sel_f.key_mask(q.shape[1]), key_padding_mask=kpm, is_causal=case.is_causal
    )
    err_f = (out_f.double() - oracle).abs().max().item()
    err_r = (out_r.double() - oracle).abs().max().item()
    assert err_r <= bound, f"reference off the oracle: {err_r:.3g} > {bound:.3g}"
    assert err_f <= bound, f"{method} flex: max |out - fp64 oracle| = {err_f:.3g} > bound {bound:.3g}"
    return out_f, sel_f


# --------------------------------------------------------------------------- parametrized cases


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("method", ["pbs", "pisa", "bsa"])
def test_flex_matches_reference(method, case):
    c = CASES[case]
    q, k, v = c.tensors(seed=1)
    _check(method, c, q, k, v, c.default_mask(), _config(method))


def test_pbs_kv_head_permutation_native_gqa():
    c = CASES["pad130"]
    q, k, v = c.tensors(seed=2)
    _check("pbs", c, q, k, v, c.default_mask(), _config("pbs", gqa_permutation="kv_head"))


@pytest.mark.parametrize("method", ["pbs", "pisa", "bsa"])
def test_fully_padded_row_and_keyless_queries_are_zero_not_nan(method):
    c = CASES["pad130"]
    q, k, v = c.tensors(seed=3)
    kpm = torch.ones(c.batch, c.n, dtype=torch.bool)
    kpm[0] = False  # a fully padded batch row
    kpm[1, :20] = False  # leading padding: queries 0..19 see no key
    out, _ = _check(method, c, q, k, v, kpm, _config(method))
    assert out[0].abs().max().item() == 0.0
    assert out[1, :, :20].abs().max().item() == 0.0


@pytest.mark.parametrize("method", ["pisa", "bsa"])
def test_coarse_tiles_and_packed_selection(method, monkeypatch):
    """Query tiles of 3 leaf blocks and key tiles of 2 (unions over more tokens, full/partial
    classification of multi-block key tiles) with the bitset-packed selection table."""
    monkeypatch.setattr(fc, "SELECTION_TABLE_BUDGET", 0)
    c = CASES["pad130"]
    q, k, v = c.tensors(seed=10)
    kpm = c.default_mask()
    ref, flex = IMPLS[method]
    cfg = _config(method, top_k=5)
    with torch.no_grad():
        out_r, sel = ref(q, k, v, key_padding_mask=kpm, return_selection=True, **cfg)
        out_f = flex(q, k, v, key_padding_mask=kpm, q_tile=3 * BLOCK, kv_tile=2 * BLOCK, **cfg)
    oracle, bound = error_bound(q, k, v, key_mask=sel.key_mask(c.hq), key_padding_mask=kpm, is_causal=True)
    assert torch.isfinite(out_f).all()
    assert (out_f.double() - oracle).abs().max().item() <= bound


# --------------------------------------------------------------------------- the block lists matter


def _plant_hot_key(q, k, v, hot: int) -> None:
    """Key ``hot`` gets a logit >= 40 with every query and a value of 1e3: any query that can see
    it outputs ~1e3, any query that cannot stays O(1)."""
    d = q.shape[-1]
    q[..., 0] = q[..., 0].abs() + 1.0
    k[:, :, hot] = 0.0
    k[:, :, hot, 0] = 40.0 * d**0.5
    v[:, :, hot] = 1e3


def test_pbs_block_lists_are_honoured():
    """A key with a huge logit and a huge value sits in a block the selection skips. Dense
    attention (what eager flex computes: its mask_mod is only causality/padding) would be
    dominated by it; the compiled flex result must not see it at all."""
    c = CASES["pad130"]
    q, k, v = c.tensors(seed=4)
    n, bs = c.n, BLOCK
    total = fc.bucketed_length(n, bs)
    nb = -(-n // bs)
    hot = 40  # key 40 lies in block 2
    _plant_hot_key(q, k, v, hot)
    perm = torch.arange(n).expand(c.batch, c.hq, n).clone()  # identity order
    sel = torch.ones(c.batch, c.hq, nb, nb, dtype=torch.bool).tril()
    sel[..., 2] = False  # skip block 2 everywhere
    kpm = torch.ones(c.batch, n, dtype=torch.bool)
    with torch.no_grad():
        bm, _ = pbs_flex.pbs_block_mask(
            sel, perm, n=n, total=total, key_padding_mask=kpm, is_causal=True, block_size=bs
        )
        kp = fc.gather_rows(k, fc.pad_seq(perm, total, value=0))
        vp = fc.gather_rows(v, fc.pad_seq(perm, total, value=0))
        out = fc.flex_attention_compiled(fc.pad_seq(q, total), kp, vp, bm, scale=1 / math.sqrt(c.d), enable_gqa=False)[
            :, :, :n
        ]
    key_mask = torch.ones(n, n, dtype=torch.bool).tril().expand(c.batch, c.hq, n, n).clone()
    key_mask[..., 2 * bs : 3 * bs] = False
    oracle, bound = error_bound(q, k, v, key_mask=key_mask, is_causal=True)
    dense, _ = error_bound(q, k, v, is_causal=True)
    assert (dense - oracle).abs().max().item() > 100.0  # the skipped block matters a lot
    assert (out.double() - oracle).abs().max().item() <= bound


@pytest.mark.parametrize("method", ["pisa", "bsa"])
def test_token_selection_membership_is_per_token(method):
    """Two queries of one tile: one selected the block holding a huge key, the other did not.
    The tile's block list holds it (union), the mask_mod must hide it from the second query."""
    c = CASES["pad130"]
    q, k, v = c.tensors(seed=5)
    n = c.n
    hot = 40  # block 2
    _plant_hot_key(q, k, v, hot)
    pos = torch.arange(n)
    nb = -(-n // BLOCK)
    table = torch.zeros(n, nb, dtype=torch.bool)
    table[pos, pos // BLOCK] = True  # current block
    table[:, 0] = True  # sink
    table[(pos % 2 == 0) & (pos >= 3 * BLOCK), 2] = True  # even queries past block 2 also take it
    blocks = torch.arange(nb).expand(n, nb)
    idx = torch.where(table, blocks, torch.full_like(blocks, nb)).sort(-1).values[:, :3]
    idx = torch.where(idx == nb, torch.full_like(idx, -1), idx)
    idx = idx.expand(c.batch, c.hkv, n, 3).contiguous()
    kpm = torch.ones(c.batch, n, dtype=torch.bool)
    with torch.no_grad():
        out = fc.token_block_attention(q, k, v, idx, key_padding_mask=kpm, is_causal=True, scale=None, block_size=BLOCK)
    sel = fc.token_selection(method, idx, q, k, key_padding_mask=kpm, is_causal=True, block_size=BLOCK)
    oracle, bound = error_bound(q, k, v, key_mask=sel.key_mask(c.hq), key_padding_mask=kpm, is_causal=True)
    assert (out.double() - oracle).abs().max().item() <= bound
    odd = (pos % 2 == 1) & (pos >= 3 * BLOCK)
    assert out[:, :, odd].abs().max().item() < 50.0  # never saw v = 1e3
    assert out[:, :, ~odd & (pos >= 3 * BLOCK)].abs().max().item() > 100.0  # did see it


# --------------------------------------------------------------------------- compiled path only


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_only_the_compiled_callable_runs(monkeypatch):
    """The eager flex implementation (the dense math fallback) must never execute."""
    import importlib

    from torch.nn.attention.flex_attention import flex_attention

    hop = importlib.import_module("torch._higher_order_ops.flex_attention")  # the module, not the HOP

    c = CASES["odd37"]
    q, k, v = c.tensors(seed=6)
    cfg = _config("pisa")
    with torch.no_grad():
        pisa_flex.pisa_attention(q, k, v, is_causal=c.is_causal, **cfg)  # compile (cache) outside the spy

    calls = []

    def eager_spy(*a, **kw):
        calls.append(1)
        raise AssertionError("eager FlexAttention ran")

    compiled = fc.compiled_flex_attention()
    assert hasattr(compiled, "_torchdynamo_orig_callable"), "flex callable is not torch.compile'd"
    through = []
    monkeypatch.setattr(fc, "_compiled", lambda *a, **kw: (through.append(1), compiled(*a, **kw))[1])
    monkeypatch.setattr(hop, "math_attention", eager_spy)
    with torch.no_grad():
        for method in ("pisa", "bsa"):
            _, flex = IMPLS[method]
            flex(q, k, v, is_causal=c.is_causal, **_config(method))
        pbs_flex.pbs_attention(q, k, v, is_causal=c.is_causal, **_config("pbs"))
    assert not calls and len(through) == 3
    # the spy has teeth: an eager flex call does reach it
    with pytest.raises(AssertionError, match="eager FlexAttention ran"), torch.no_grad():
        flex_attention(q, k.expand(-1, c.hq, -1, -1), v.expand(-1, c.hq, -1, -1))


def test_refuses_to_run_eagerly():
    c = CASES["odd37"]
    q, k, v = c.tensors(seed=7)
    with torch.no_grad():
        with torch.compiler.set_stance("force_eager"):
            with pytest.raises(RuntimeError, match="eager FlexAttention"):
                pisa_flex.pisa_attention(q, k, v, **_config("pisa"))
        with torch._dynamo.config.patch(disable=True):
            with pytest.raises(RuntimeError, match="eager FlexAttention"):
                pbs_flex.pbs_attention(q, k, v, **_config("pbs"))


def test_clear_errors():
    c = CASES["odd37"]
    q, k, v = c.tensors(seed=8)
    with pytest.raises(ValueError, match="float64"):
        pisa_flex.pisa_attention(q.double(), k.double(), v.double(), **_config("pisa"))
    with pytest.raises(ValueError, match="float64"):
        pbs_flex.pbs_attention(q.double(), k.double(), v.double(), **_config("pbs"))
    with pytest.raises(NotImplementedError, match="inference-only"):
        bsa_flex.bsa_attention(q.requires_grad_(), k, v, **_config("bsa"))


def test_bucketed_length():
    assert [fc.bucketed_length(n, 16) // 16 for n in (1, 16, 17, 128, 129, 130, 160, 161, 301)] == [
        1,
        1,
        2,
        8,
        10,
        10,
        10,
        12,
        20,
    ]
    for n in range(1, 3000, 7):
        t = fc.bucketed_length(n, 64)
        assert t >= n and t % 64 == 0 and t < 1.25 * n + 64


# --------------------------------------------------------------------------- through the op


@pytest.mark.parametrize("method", ["pbs", "pisa", "bsa"])
def test_through_the_dispatcher(method):
    """The (method, "flex") backends of the method registry, via sparseflow.testing checks."""
    from sparseflow import ops
    from sparseflow.config import BSAConfig, PBSConfig, PISAConfig
    from sparseflow.testing import check_exact_mode, check_matches_own_selection

    assert ops.IMPLEMENTATIONS[(method, "flex")] == f"sparseflow.methods.{method}.flex:{method}_attention"
    c = CASES["pad130"]
    q, k, v = c.tensors(seed=9)
    cls = {"pbs": PBSConfig, "pisa": PISAConfig, "bsa": BSAConfig}[method]
    cfg = cls(**_config(method))
    with torch.no_grad():
        check_matches_own_selection(q, k, v, cfg, key_padding_mask=c.default_mask(), backend="flex")
        check_exact_mode(q, k, v, method, base=cfg, key_padding_mask=c.default_mask(), backend="flex")


# --------------------------------------------------------------------------- hypothesis


@settings(
    max_examples=10,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_hypothesis_flex_equals_reference(data):
    """Random seeds, padding patterns and method configs over the compiled shapes."""
    method = data.draw(st.sampled_from(["pbs", "pisa", "bsa"]), label="method")
    c = CASES[data.draw(st.sampled_from(list(CASES)), label="case")]
    q, k, v = c.tensors(seed=data.draw(st.integers(0, 2**31 - 1), label="seed"))
    kpm = None
    if c.padded:
        kpm = torch.ones(c.batch, c.n, dtype=torch.bool)
        for b in range(c.batch):
            lead = data.draw(st.integers(0, c.n), label="lead_pad")
            trail = data.draw(st.integers(0, c.n - lead), label="trail_pad")
            kpm[b, :lead] = False
            kpm[b, c.n - trail :] = False
    if method == "pbs":
        cfg = _config(
            "pbs",
            threshold=data.draw(st.sampled_from([0.3, 0.6, 0.9, 1.0]), label="threshold"),
            force_sink=data.draw(st.booleans(), label="force_sink"),
            permute=data.draw(st.booleans(), label="permute"),
            scoring=data.draw(st.sampled_from(["mean", "antidiagonal", "sampled_rows"]), label="scoring"),
            antidiagonal_stride=4,
            causal_proxy=data.draw(st.booleans(), label="causal_proxy"),
            gqa_permutation=data.draw(st.sampled_from(["query_head", "kv_head"]), label="gqa")
            if c.name == "pad130"
            else "query_head",
        )
    else:
        cfg = _config(
            method,
            top_k=data.draw(st.integers(3, 9), label="top_k"),
            force_previous=data.draw(st.booleans(), label="force_previous"),
        )
        if method == "pisa":
            cfg["score"] = data.draw(st.sampled_from(["lse", "mean", "mean_var"]), label="score")
            cfg["branching"] = data.draw(st.sampled_from([2, 3]), label="branching")
    _check(method, c, q, k, v, kpm, cfg)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled flex has no CPU backward")
@pytest.mark.parametrize("method", ["pbs", "pisa", "bsa"])
def test_flex_backward_on_cuda_matches_reference(method):
    cfgs = {
        "pbs": sparseflow.PBSConfig(threshold=0.8),  # block 128, segment 256
        "pisa": sparseflow.PISAConfig(block_size=32, top_k=4),
        "bsa": sparseflow.BSAConfig(block_size=32, top_k=4),
    }
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, h, 700, 64, generator=g).cuda() for h in (6, 2, 2))
    grads = {}
    for backend in ("flex", "reference"):
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        with sparseflow.capture() as cap:
            out = sparseflow.attention(qq, kk, vv, config=cfgs[method], backend=backend)
        assert cap.calls[-1].backend == backend and cap.calls[-1].sparse
        grads[backend] = torch.autograd.grad(out, (qq, kk, vv), torch.ones_like(out))
    for name, a, b in zip("qkv", grads["flex"], grads["reference"]):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4, msg=lambda m: f"d{name}: {m}")


# --------------------------------------------------------------------------- CPU vector width


def test_cpu_qk_head_dim_decision():
    """Small head dims are padded exactly when some key tile is not a multiple of 16."""
    assert fc.kv_tile_lengths(96, 8) == (8,)
    assert fc.kv_tile_lengths(93, 8) == (8, 5)
    assert fc.kv_tile_lengths(5, 8) == (5,)
    assert fc.cpu_qk_head_dim(16, (8,)) == 32
    assert fc.cpu_qk_head_dim(8, (24,)) == 32
    assert fc.cpu_qk_head_dim(16, (16, 8)) == 32
    assert fc.cpu_qk_head_dim(16, (16, 32)) == 16
    assert fc.cpu_qk_head_dim(24, (8,)) == 24
    assert fc.cpu_qk_head_dim(64, (8,)) == 64


def _avx2_supported() -> bool:
    from torch._inductor.cpu_vec_isa import VecAVX2, valid_vec_isa_list

    return any(isinstance(isa, VecAVX2) for isa in valid_vec_isa_list())


@pytest.mark.skipif(not _avx2_supported(), reason="needs an AVX2 CPU")
@pytest.mark.parametrize("block", [8, 24])
def test_flex_with_8_float_vectors_small_head_dim(block, monkeypatch):
    """Compiled with Inductor's 256-bit vectors (what an AVX2-only CPU gets): key tiles of 8 or 24
    keys at head dim 16 hit torch's CPU q @ k^T tail path that stores 16 columns; the result must
    still equal the reference (same selection, same output)."""
    from torch.nn.attention.flex_attention import flex_attention

    # a callable of its own: its Inductor options differ, so nothing compiled elsewhere is reused
    avx2 = torch.compile(flex_attention, dynamic=False, fullgraph=True, options={"cpp.simdlen": 256})
    monkeypatch.setattr(fc, "_compiled", avx2)
    g = torch.Generator().manual_seed(3)
    n = 4 * block + 5
    q = torch.randn(1, 2, n, 16, generator=g)
    k = torch.randn(1, 2, n, 16, generator=g)
    v = torch.randn(1, 2, n, 16, generator=g)
    cfg = dict(block_size=block, segment_size=2 * block, threshold=0.6)
    with torch.no_grad():
        out_r, sel_r = pbs_ref.pbs_attention(q, k, v, return_selection=True, **cfg)
        out_f, sel_f = pbs_flex.pbs_attention(q, k, v, return_selection=True, **cfg)
    _assert_same_selection(sel_r, sel_f)
    torch.testing.assert_close(out_f, out_r, rtol=2e-4, atol=2e-5)


# --------------------------------------------------------------------------- gradients on the CPU


@pytest.mark.parametrize("method", ["pbs", "pisa", "bsa"])
def test_cpu_inputs_requiring_grad_through_the_op(method):
    """backend='flex' on the CPU with q/k/v that require grad: the forward runs flex (the op's
    forward is a no-grad call, so nothing needs a CPU flex backward) and the backward goes
    through the reference, so both match backend='reference'."""
    from sparseflow.config import BSAConfig, PBSConfig, PISAConfig

    # a length of whole blocks: no padding copy, so q itself (requiring grad) reaches flex
    c = Case("whole64", 1, 1, 2, 64, 32, torch.float32, False, False)
    cfg = {"pbs": PBSConfig, "pisa": PISAConfig, "bsa": BSAConfig}[method](**_config(method))
    outs, grads = {}, {}
    for backend in ("flex", "reference"):
        q, k, v = (t.requires_grad_(True) for t in c.tensors(seed=11))
        with sparseflow.capture() as cap:
            out = sparseflow.attention(q, k, v, config=cfg, is_causal=c.is_causal, backend=backend)
        assert cap.calls[-1].backend == backend and cap.calls[-1].sparse, cap.calls[-1].reason
        outs[backend] = out.detach()
        grads[backend] = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    torch.testing.assert_close(outs["flex"], outs["reference"], rtol=2e-4, atol=2e-5)
    for name, a, b in zip("qkv", grads["flex"], grads["reference"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"d{name}: {m}")


# --------------------------------------------------------------------------- index ranges


def _grid(bm, q_len: int, kv_len: int):
    b = torch.arange(bm.kv_num_blocks.shape[0])[:, None, None, None]
    h = torch.arange(bm.kv_num_blocks.shape[1])[None, :, None, None]
    return b, h, torch.arange(q_len)[None, None, :, None], torch.arange(kv_len)[None, None, None, :]


def _assert_block_mask_in_range(bm, q_len: int, kv_len: int):
    """Every table entry the kernels may read is a valid index, and mask_mod indexes its captured
    tensors in range on the whole padded grid (eager indexing raises on an out-of-range index)."""
    qb, kb = bm.BLOCK_SIZE
    n_qb, n_kb = -(-q_len // qb), -(-kv_len // kb)
    assert bm.seq_lengths == (q_len, kv_len)
    for num, idx in ((bm.kv_num_blocks, bm.kv_indices), (bm.full_kv_num_blocks, bm.full_kv_indices)):
        assert num.dtype == idx.dtype == torch.int32
        assert num.shape[2] == n_qb and idx.shape[2] == n_qb and idx.shape[3] == n_kb
        assert int(num.min()) >= 0 and int(num.max()) <= n_kb, f"block count outside [0, {n_kb}]"
        # entries past num are never used by flex, but they must still be valid block indices
        assert int(idx.min()) >= 0 and int(idx.max()) < n_kb, f"block index outside [0, {n_kb})"
        used = torch.arange(n_kb) < num[..., None].long()
        listed = torch.zeros(idx.shape, dtype=torch.int32).scatter_add_(-1, idx.long(), used.int())
        assert int(listed.max()) <= 1, "a block listed twice in one row"
    both = bm.to_dense().bool()  # partial | full per (q block, kv block)
    n_listed = bm.kv_num_blocks.long() + bm.full_kv_num_blocks.long()
    assert torch.equal(both.sum(-1), n_listed), "a block is both partial and full"
    keep = bm.mask_mod(*_grid(bm, q_len, kv_len))
    assert keep.dtype == torch.bool and keep.shape[-2:] == (q_len, kv_len)


def _spy_block_masks(monkeypatch):
    seen = []
    real = fc.flex_attention_compiled

    def spy(q, k, v, block_mask, **kw):
        seen.append((block_mask, q.shape[2], k.shape[2]))
        return real(q, k, v, block_mask, **kw)

    monkeypatch.setattr(fc, "flex_attention_compiled", spy)
    return seen


@pytest.mark.parametrize("gqa", ["query_head", "kv_head"])
def test_pbs_block_mask_indices_in_range_odd_shape(gqa, monkeypatch):
    """Odd length, key padding (holes, leading, trailing), several proxies, GQA: the tables and the
    vis_pos reads of mask_mod stay in range."""
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, h, 93, 16, generator=g) for h in (6, 2, 2))
    kpm = torch.rand(2, 93, generator=g) > 0.25
    kpm[0, 62:] = False
    kpm[1, :5] = False
    seen = _spy_block_masks(monkeypatch)
    with torch.no_grad():
        pbs_flex.pbs_attention(
            q,
            k,
            v,
            key_padding_mask=kpm,
            block_size=8,
            segment_size=16,
            threshold=0.5,
            proxy_blocks=3,
            gqa_permutation=gqa,
        )
    ((bm, q_len, kv_len),) = seen
    assert q_len == kv_len == 96  # padded past N=93
    _assert_block_mask_in_range(bm, q_len, kv_len)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("method", ["pisa", "bsa"])
def test_token_block_mask_indices_in_range_odd_shape(method, causal, packed, monkeypatch):
    """Token-level selections (bool table or packed bitset), odd Nq < Nk, key padding, coarse key
    tiles: the tables and the table / padding reads of mask_mod stay in range."""
    if packed:
        monkeypatch.setattr(fc, "SELECTION_TABLE_BUDGET", 0)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 37, 16, generator=g)
    k, v = (torch.randn(2, 2, 75, 16, generator=g) for _ in range(2))
    kpm = torch.ones(2, 75, dtype=torch.bool)
    kpm[0, 70:] = False
    kpm[1, :3] = False
    seen = _spy_block_masks(monkeypatch)
    select = {"pisa": pisa_ref.pisa_select, "bsa": bsa_ref.bsa_select}[method]
    idx = select(q, k, key_padding_mask=kpm, is_causal=causal, scale=None, block_size=8, top_k=3)
    # the selection itself calls no flex; only token_block_attention's BlockMask is inspected
    fc_kwargs = dict(key_padding_mask=kpm, is_causal=causal, scale=None, block_size=8, q_tile=16, kv_tile=16)
    bm, q_len, kv_len = _build_only(monkeypatch, seen, q, k, v, idx, fc_kwargs)
    assert q_len > 37 and kv_len > 75
    _assert_block_mask_in_range(bm, q_len, kv_len)


def _build_only(monkeypatch, seen, q, k, v, idx, kwargs):
    """token_block_attention's BlockMask and padded lengths, without compiling flex."""
    monkeypatch.setattr(
        fc,
        "flex_attention_compiled",
        lambda q, k, v, block_mask, **kw: (
            seen.append((block_mask, q.shape[2], k.shape[2])),
            q.new_zeros(q.shape[:-1] + v.shape[-1:]),
        )[1],
    )
    with torch.no_grad():
        fc.token_block_attention(q, k, v, idx, **kwargs)
    return seen[-1]


# --------------------------------------------------------------------------- CUDA kernel choice (decided on the CPU)

# flex backward tiles (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2) of torch 2.13's default table
SM90_BF16_SMALL_D = ((64, 64, 64, 64),)
SM90_BF16_D128 = ((64, 128, 128, 64),)
FP32 = ((16, 16, 16, 16),)


def test_cuda_plan_forward_tiles_divide_the_blocks():
    assert fc.cuda_flex_plan(16, 16, 16, needs_grad=False) == fc.FlexPlan({"fwd_BLOCK_M": 16, "fwd_BLOCK_N": 16})
    assert fc.cuda_flex_plan(48, 96, 64, needs_grad=False).kernel_options == {"fwd_BLOCK_M": 16, "fwd_BLOCK_N": 32}
    assert fc.cuda_flex_plan(64, 64, 256, needs_grad=False).kernel_options == {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 32}
    assert fc.cuda_flex_plan(128, 256, 64, needs_grad=False) == fc.FlexPlan(None)  # defaults divide them
    for qb, kb in ((16, 16), (48, 96), (64, 64), (32, 128)):
        opts = fc.cuda_flex_plan(qb, kb, 64, needs_grad=False).kernel_options
        assert qb % opts["fwd_BLOCK_M"] == 0 and kb % opts["fwd_BLOCK_N"] == 0
        assert min(opts.values()) >= 16


def test_cuda_plan_falls_back_where_no_kernel_exists():
    plan = fc.cuda_flex_plan(8, 8, 16, needs_grad=False)
    assert plan.kernel_options is None and "multiples of 16" in plan.fallback
    # bf16, head dim 16, blocks of 16 with gradients: every backward config is filtered out
    plan = fc.cuda_flex_plan(16, 16, 16, needs_grad=True, bwd_tiles=SM90_BF16_SMALL_D)
    assert "no flex backward config" in plan.fallback
    assert fc.cuda_flex_plan(16, 16, 16, needs_grad=True, bwd_tiles=FP32).fallback == ""
    assert fc.cuda_flex_plan(64, 64, 16, needs_grad=True, bwd_tiles=SM90_BF16_SMALL_D).fallback == ""
    assert (
        "no flex backward config" in fc.cuda_flex_plan(64, 64, 128, needs_grad=True, bwd_tiles=SM90_BF16_D128).fallback
    )
    assert fc.cuda_flex_plan(128, 128, 128, needs_grad=True, bwd_tiles=SM90_BF16_D128) == fc.FlexPlan(None)


def test_cuda_head_dims_padded_to_16():
    assert [fc.cuda_head_dim(d) for d in (4, 8, 15, 16, 80)] == [16, 16, 16, 16, 80]


def test_cpu_plan_has_no_options():
    assert fc.flex_plan(torch.device("cpu"), 8, 8, 16, torch.float32, needs_grad=False) == fc.FlexPlan(None)


def test_cuda_fallback_is_logged_with_its_reason(caplog):
    with caplog.at_level("WARNING", logger="sparseflow"):
        plan = fc.flex_plan(torch.device("cuda"), 8, 8, 16, torch.bfloat16, needs_grad=False)
    assert plan.fallback and plan.fallback in caplog.text and "reference" in caplog.text


def test_pbs_falls_back_to_the_reference_when_the_plan_says_so(monkeypatch):
    """The fallback path itself (forced here on the CPU): the reference's output and selection."""
    reason = "no flex backward config (forced by the test)"
    monkeypatch.setattr(fc, "flex_plan", lambda *a, **kw: fc.FlexPlan(None, reason))
    monkeypatch.setattr(fc, "flex_attention_compiled", lambda *a, **kw: pytest.fail("flex ran"))
    c = CASES["odd37"]
    q, k, v = c.tensors(seed=12)
    with torch.no_grad():
        out_r, sel_r = pbs_ref.pbs_attention(q, k, v, is_causal=False, return_selection=True, **_config("pbs"))
        out_f, sel_f = pbs_flex.pbs_attention(q, k, v, is_causal=False, return_selection=True, **_config("pbs"))
        out_t = pisa_flex.pisa_attention(q, k, v, is_causal=False, **_config("pisa"))
    _assert_same_selection(sel_r, sel_f)
    torch.testing.assert_close(out_f, out_r, rtol=0, atol=0)
    torch.testing.assert_close(
        out_t, pisa_ref.pisa_attention(q, k, v, is_causal=False, **_config("pisa")), rtol=1e-6, atol=1e-6
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [8, 16])
@pytest.mark.parametrize("method", ["pbs", "pisa", "bsa"])
def test_cuda_small_head_dims_and_blocks_run(method, d, dtype):
    """Head dims 8/16 with blocks of 16 (PBS) or 8 (PISA/BSA), forward and backward through the
    op: flex (or its logged reference fallback) matches backend='reference'."""
    cfgs = {
        "pbs": sparseflow.PBSConfig(block_size=16, segment_size=32, threshold=0.8),
        "pisa": sparseflow.PISAConfig(block_size=8, top_k=4),
        "bsa": sparseflow.BSAConfig(block_size=8, top_k=4),
    }
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, 200, d, generator=g).cuda().to(dtype) for h in (4, 2, 2))
    tol = dict(atol=2e-5, rtol=2e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    res = {}
    for backend in ("flex", "reference"):
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        out = sparseflow.attention(qq, kk, vv, config=cfgs[method], backend=backend)
        res[backend] = (out.detach(),) + torch.autograd.grad(out, (qq, kk, vv), torch.ones_like(out))
    for name, a, b in zip(["out", "dq", "dk", "dv"], res["flex"], res["reference"]):
        torch.testing.assert_close(a.float(), b.float(), **tol, msg=lambda m: f"{name}: {m}")
