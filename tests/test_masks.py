"""SDPA's mask contract (issue 14): every mask form ``F.scaled_dot_product_attention`` accepts gives
SDPA's result through the op, ``sparseflow.compile`` and ``export_onnx``; recognised forms run
sparse, others dense with a logged reason; bad masks fail with a ValueError naming ``attn_mask``."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sparseflow
from sparseflow import BSAConfig, PBSConfig, PISAConfig
from sparseflow.masks import analyse_mask, describe_mask

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
BLOCK = 4
# exact mode: PBS keeps every block at threshold 1.0, BSA/PISA select every block with top_k >= blocks
EXACT = {
    "pbs": PBSConfig(block_size=BLOCK, segment_size=2 * BLOCK, threshold=1.0),
    "bsa": BSAConfig(block_size=BLOCK, top_k=64),
    "pisa": PISAConfig(block_size=BLOCK, top_k=64),
}
SPARSE = {
    "pbs": PBSConfig(block_size=BLOCK, segment_size=2 * BLOCK, threshold=0.6),
    "bsa": BSAConfig(block_size=BLOCK, top_k=3),
    "pisa": PISAConfig(block_size=BLOCK, top_k=3),
}


def _qkv(b, h, n, d=16, seed=0, hkv=None):
    g = torch.Generator().manual_seed(seed)
    hkv = hkv or h
    return (
        torch.randn(b, h, n, d, generator=g),
        torch.randn(b, hkv, n, d, generator=g),
        torch.randn(b, hkv, n, d, generator=g),
    )


def _sdpa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


# --------------------------------------------------------------------------- the snippet


def test_2d_mask_is_sdpas_lxs_mask_through_the_op():
    """A 2-D bool [L, S] mask with B == L is SDPA's [L, S] mask, not a [B, Nk] key padding."""
    b, h, n, d = 4, 2, 4, 16
    q, k, v = _qkv(b, h, n, d)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    out = sparseflow.bsa_attention(q, k, v, attn_mask=mask, is_causal=False, backend="reference")
    torch.testing.assert_close(out, _sdpa(q, k, v, mask), atol=1e-5, rtol=1e-5)


def test_2d_mask_with_batch_unlike_length_runs_like_sdpa():
    q, k, v = _qkv(2, 2, 12)
    mask = torch.ones(12, 12, dtype=torch.bool).tril()
    with sparseflow.capture() as cap:
        out = sparseflow.attention(q, k, v, config=EXACT["bsa"], attn_mask=mask, is_causal=False, backend="reference")
    torch.testing.assert_close(out, _sdpa(q, k, v, mask), atol=1e-5, rtol=1e-5)
    (call,) = cap.calls
    assert call.sparse, call.reason  # a causal [L, S] mask is recognised as causality


class _MaskedSDPA(nn.Module):
    def forward(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_2d_mask_through_compile():
    b, h, n = 4, 2, 4
    q, k, v = _qkv(b, h, n)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    model = sparseflow.compile(
        _MaskedSDPA(), method="bsa", config=EXACT["bsa"], backend="reference", inner_backend="eager"
    )
    out = model(q, k, v, mask)
    torch.testing.assert_close(out, _sdpa(q, k, v, mask), atol=1e-5, rtol=1e-5)
    (entry,) = sparseflow.report(model).entries
    assert entry.rewritten, entry.reason
    assert "[Nq, Nk]" in entry.mask and "padding" not in entry.mask.split(":")[0], entry.mask


class _MaskedLayer(nn.Module):
    """x [B, N, 32] -> one SDPA call with a [N, N] mask built from N (so N stays dynamic)."""

    def __init__(self, kind="causal"):
        super().__init__()
        self.kind = kind
        self.qkv = nn.Linear(32, 96)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 2, 16).permute(2, 0, 3, 1, 4).unbind(0)
        i = torch.arange(n, device=x.device)
        mask = i[None, :] <= i[:, None]  # [L, S] causal
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return o.transpose(1, 2).reshape(b, n, 32)


def test_2d_mask_through_export_onnx(tmp_path):
    pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from sparseflow.onnx_export import export_onnx

    torch.manual_seed(0)
    model = _MaskedLayer().eval()
    n = 16
    x = torch.randn(n, n, 32)  # B == L
    cfg = EXACT["bsa"]
    proto = export_onnx(model, (x,), None, method="bsa", config=cfg)
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        want = model(x)
    got = torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    x2 = torch.randn(n, 12, 32)  # another length, B != L: nothing was taken from the example's sizes
    with torch.no_grad():
        want2 = model(x2)
    got2 = torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: x2.numpy()})[0])
    torch.testing.assert_close(got2, want2, atol=1e-4, rtol=1e-4)
    node = next(nd for nd in proto.graph.node if nd.domain == "sparseflow")
    assert {a.name: a.i for a in node.attribute}["is_causal"] == 1


def test_2d_mask_through_dynamic_compile():
    model = sparseflow.compile(
        _MaskedSDPA(),
        method="pisa",
        config=EXACT["pisa"],
        backend="reference",
        inner_backend="eager",
        dynamic=True,
        fullgraph=True,
    )
    for b, n in ((3, 12), (12, 12), (2, 20)):
        q, k, v = _qkv(b, 2, n, seed=b)
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        with sparseflow.capture() as cap:
            out = model(q, k, v, mask)
        torch.testing.assert_close(out, _sdpa(q, k, v, mask), atol=1e-5, rtol=1e-5)
        assert [c.sparse for c in cap.calls] == [True], [c.reason for c in cap.calls]


@pytest.mark.parametrize("form", ["lxs", "b11s_causal", "float_hls"])
def test_opcheck_with_sdpa_mask_forms(form):
    from sparseflow.ops import op_args, op_for

    q, k, v = _qkv(2, 2, 12)
    causal = form == "b11s_causal"
    if form == "lxs":
        mask = torch.ones(12, 12, dtype=torch.bool).tril()
    elif causal:
        mask = torch.ones(2, 1, 1, 12, dtype=torch.bool)
        mask[1, ..., 9:] = False
    else:
        mask = torch.zeros(2, 12, 12).masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))
    cfg = EXACT["bsa"]
    torch.library.opcheck(op_for("bsa"), (q, k, v, mask, causal, None, *op_args(cfg), "reference", "t"))


# --------------------------------------------------------------------------- sparseflow's key padding


@pytest.mark.parametrize("causal", [False, True])
def test_key_padding_form_b11s_combines_with_causality(causal):
    """sparseflow's key padding is the SDPA form [B, 1, 1, Nk]; with is_causal=True the op attends
    to causal & padding (what SDPA's CPU path computes for a mask with is_causal)."""
    q, k, v = _qkv(3, 2, 16)
    kpm = torch.ones(3, 16, dtype=torch.bool)
    kpm[1, 11:] = False
    kpm[2, 5] = False
    mask = kpm[:, None, None, :]
    full = mask & torch.ones(16, 16, dtype=torch.bool).tril() if causal else mask
    with sparseflow.capture() as cap:
        out = sparseflow.attention(q, k, v, config=EXACT["pisa"], attn_mask=mask, is_causal=causal, backend="reference")
    (call,) = cap.calls
    assert call.sparse, call.reason
    torch.testing.assert_close(out, _sdpa(q, k, v, full), atol=1e-5, rtol=1e-5)


def test_analysis_reads_forms_by_sdpa_broadcasting():
    n = 6
    tril = torch.ones(n, n, dtype=torch.bool).tril()
    res = analyse_mask(tril, False, n, n, n)  # B == L: still [L, S]
    assert res.supported and res.is_causal and res.key_padding_mask is None
    kpm = torch.ones(n, n, dtype=torch.bool)
    kpm[2, 3:] = False
    res = analyse_mask(kpm, False, n, n, n)  # a [L, S] mask whose rows differ: not key padding
    assert not res.supported
    res = analyse_mask(kpm[:, None, None, :], False, n, n, n)
    assert res.supported and not res.is_causal and torch.equal(res.key_padding_mask, kpm)
    res = analyse_mask(kpm[:, None, None, :], True, n, n, n)
    assert res.supported and res.is_causal and torch.equal(res.key_padding_mask, kpm)


def test_description_names_the_form():
    assert "[Nq, Nk]" in describe_mask((4, 4), torch.bool)
    assert "key padding" in describe_mask((2, 1, 1, 9), torch.bool)
    assert "key padding (broadcast" not in describe_mask((4, 4), torch.bool)
    assert "key padding (broadcast" not in describe_mask((2, 1, 9, 9), torch.bool)
    assert "[B, H, Nq, Nk]" in describe_mask(("s0", 2, 9, 9), torch.float32)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "mask,match",
    [
        (torch.ones(3, 12, dtype=torch.bool), r"attn_mask of shape \(3, 12\) is not broadcastable"),
        (torch.ones(2, 12, dtype=torch.bool), r"attn_mask of shape \(2, 12\) is not broadcastable"),
        (torch.ones(2, 3, 12, 12, dtype=torch.bool), r"attn_mask of shape \(2, 3, 12, 12\)"),
        (torch.ones(1, 2, 1, 12, 12, dtype=torch.bool), "attn_mask must have 2 to 4 dims"),
        (torch.ones(12, dtype=torch.bool), "attn_mask must have 2 to 4 dims"),
        (torch.ones(12, 12, dtype=torch.int64), "attn_mask must be bool"),
        (torch.zeros(12, 12, dtype=torch.float64), "attn_mask must be bool"),
    ],
)
def test_bad_masks_name_attn_mask_and_the_forms(mask, match):
    q, k, v = _qkv(2, 2, 12)
    with pytest.raises(ValueError, match=match) as info:
        sparseflow.attention(q, k, v, config=EXACT["bsa"], attn_mask=mask, is_causal=False, backend="reference")
    assert "[B, 1, 1, Nk]" in str(info.value) or "dtype" in str(info.value)


# --------------------------------------------------------------------------- property


def _visibility(kind, b, n, data):
    """``(vis, kpm)``: the [B, N, N] bool visibility of ``kind`` (every query row keeps at least one
    key) and its true [B, N] key padding (None where there is none)."""
    tril = torch.ones(n, n, dtype=torch.bool).tril()
    if kind == "causal":
        return tril.expand(b, n, n), None
    if kind == "random":
        seed = data.draw(st.integers(0, 2**16), label="mask_seed")
        m = torch.rand(b, n, n, generator=torch.Generator().manual_seed(seed)) < 0.6
        m[:, :, 0] = True
        return m, None
    kpm = torch.ones(b, n, dtype=torch.bool)
    pad = data.draw(st.integers(0, n - 1), label="pad")
    kpm[-1, n - pad :] = False
    if kind == "padding":
        return kpm[:, None, :].expand(b, n, n), kpm
    return tril[None] & kpm[:, None, :], kpm  # causal + right padding: key 0 is always visible


def _sdpa_form(vis, rank, batch_dim, query_dim, head_dim, hq, floating):
    """The visibility ``vis`` [B, N, N] in an SDPA form of ``rank`` (None when that rank cannot
    carry it: a per-batch mask as [L, S]); the batch / query dims are 1 where the mask does not
    depend on them and ``batch_dim`` / ``query_dim`` say to broadcast them."""
    b, n, _ = vis.shape
    shared = bool((vis == vis[:1]).all())
    if rank < 4 and not shared:
        return None
    m = vis[:, None]  # [B, 1, N, N]
    if shared and not batch_dim:
        m = m[:1]
    if query_dim and bool((vis == vis[:, :1]).all()):
        m = m[:, :, :1]
    if head_dim:
        m = m.expand(m.shape[0], hq, m.shape[2], n)
    if rank < 4:
        m = m[0]
    if rank == 2:
        m = m[0]
    if floating:
        m = torch.zeros(m.shape).masked_fill(~m, float("-inf"))
    return m.contiguous()


@st.composite
def _cases(draw):
    n = draw(st.sampled_from((4, 8, 11, 16)))
    b = draw(st.sampled_from((1, 2, n)))  # B == L included
    kind = draw(st.sampled_from(("causal", "padding", "causal+padding", "random")))
    return dict(
        n=n,
        b=b,
        kind=kind,
        rank=draw(st.sampled_from((2, 3, 4))),
        batch_dim=draw(st.booleans()),
        query_dim=draw(st.booleans()),
        head_dim=draw(st.booleans()),
        floating=draw(st.booleans()),
        hkv=draw(st.sampled_from((1, 2))),
        group=draw(st.sampled_from((1, 2))),
        method=draw(st.sampled_from(("pbs", "bsa", "pisa"))),
    )


@SETTINGS
@given(case=_cases(), data=st.data())
def test_every_sdpa_mask_form_gives_sdpas_result(case, data):
    n, b, kind = case["n"], case["b"], case["kind"]
    hq = case["hkv"] * case["group"]
    vis, kpm = _visibility(kind, b, n, data)
    mask = _sdpa_form(vis, case["rank"], case["batch_dim"], case["query_dim"], case["head_dim"], hq, case["floating"])
    if mask is None:  # the form cannot carry this visibility (a per-batch mask in [L, S], say)
        mask = vis[:, None]
    q, k, v = _qkv(b, hq, n, seed=n + b, hkv=case["hkv"])
    want = _sdpa(q, k, v, mask)
    method = case["method"]
    with sparseflow.capture() as cap:
        got = sparseflow.attention(q, k, v, config=EXACT[method], attn_mask=mask, is_causal=False, backend="reference")
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    (call,) = cap.calls
    recognised = kind != "random"
    if method == "pbs" and n < EXACT["pbs"].segment_size:
        recognised = False  # too short for one PBS segment: dense by design
    assert call.sparse == recognised, (call.reason, tuple(mask.shape))
    if not call.sparse:
        assert call.reason
    # sparse mode: a recognised form gives what the same call with is_causal / [B, 1, 1, Nk] gives
    if recognised:
        native = None if kpm is None else kpm[:, None, None, :]
        a = sparseflow.attention(q, k, v, config=SPARSE[method], attn_mask=mask, is_causal=False, backend="reference")
        ref = sparseflow.attention(
            q,
            k,
            v,
            config=SPARSE[method],
            attn_mask=native,
            is_causal=kind in ("causal", "causal+padding"),
            backend="reference",
        )
        torch.testing.assert_close(a, ref, atol=1e-6, rtol=1e-6)
