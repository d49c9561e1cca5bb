"""PBSConfig.dense_tail_blocks: the prompt's last query blocks attend every visible key, on every
backend; rows before the tail are the plain selection's; the selection reports the tail as kept."""

from __future__ import annotations

import pytest
import torch

from sparseflow import op_backends, ops
from sparseflow.config import PBSConfig
from sparseflow.methods.pbs import reference as R
from sparseflow.methods.pbs.tail import tail_first_block, tail_start
from sparseflow.selection import visible_key_mask

from test_pbs_reference import dense64

SPARSE = dict(block_size=16, segment_size=32, threshold=0.3)
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # where the Triton backend runs (the CPU: interpreted)


def _inputs(n, b=2, hq=4, hkv=2, d=16, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, n, d, generator=g).to(dtype) for h in (hq, hkv, hkv))


def _left_padding(n):
    pad = torch.ones(2, n, dtype=torch.bool)
    pad[1, : n // 4] = False
    return pad


def test_tail_start():
    assert tail_start(100, 16, 0) == 100 and tail_start(100, 16, 1) == 96 and tail_start(96, 16, 1) == 80
    assert tail_start(100, 16, 2) == 80 and tail_start(100, 16, 50) == 0
    # blocks: 100 rows of 16 are 7 blocks, the last one ragged; no tail starts past every block
    assert tail_first_block(100, 16, 0) == 7 and tail_first_block(100, 16, 1) == 6
    assert tail_first_block(96, 16, 2) == 4 and tail_first_block(100, 16, 50) == 0


@pytest.mark.parametrize("padded", [False, True], ids=["no-padding", "left-padding"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("n,tail", [(97, 1), (128, 2), (70, 9)], ids=["n97-tail1", "n128-tail2", "n70-all"])
def test_reference_tail_rows_are_dense_and_the_rest_unchanged(n, tail, causal, padded):
    q, k, v = _inputs(n)
    pad = _left_padding(n) if padded else None
    plain, plain_sel = R.pbs_attention(q, k, v, key_padding_mask=pad, is_causal=causal, return_selection=True, **SPARSE)
    out, sel = R.pbs_attention(
        q, k, v, key_padding_mask=pad, is_causal=causal, return_selection=True, dense_tail_blocks=tail, **SPARSE
    )
    start = tail_start(n, 16, tail)
    assert torch.equal(out[:, :, :start], plain[:, :, :start])
    want = dense64(q, k, v, is_causal=causal, key_padding_mask=pad)[:, :, start:]
    # anchors' rule: at most about twice plain PyTorch's fp32 error against the fp64 oracle
    vis = visible_key_mask(n, n, is_causal=causal, key_padding_mask=pad, batch=2)[:, None].expand(-1, 4, -1, -1)
    plain_torch = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=vis
    )
    torch_err = (plain_torch[:, :, start:].double() - want).abs().max()
    assert (out[:, :, start:].double() - want).abs().max() <= 2 * torch_err + 1e-7
    assert torch.equal(sel.key_mask(4)[:, :, start:], vis[:, :, start:])
    assert torch.equal(sel.key_mask(4)[:, :, :start], plain_sel.key_mask(4)[:, :, :start])
    assert bool((sel.density >= plain_sel.density).all())
    assert bool((plain_sel.key_mask(4)[:, :, start:] != vis[:, :, start:]).any())  # the tail had been sparse


@pytest.mark.parametrize(
    "backend, select",
    [("triton", "reference"), ("triton", "triton"), ("flex", None)],
    ids=["triton-torch-selection", "triton-kernel-selection", "flex"],
)
@pytest.mark.parametrize("scoring", ["mean", "sampled_rows"])
@pytest.mark.parametrize("n, tail", [(96, 2), (100, 1)], ids=["n96-tail2", "n100-tail1"])
def test_backends_run_the_tail_like_the_reference(backend, select, scoring, n, tail, monkeypatch):
    kw = {}
    if backend == "triton":
        pytest.importorskip("triton")
        from sparseflow import Tuning
        from sparseflow.methods.pbs import triton_attention as TA

        # the kernel's output starts as NaN: a row it leaves unwritten fails the comparison
        monkeypatch.setattr(TA, "_alloc_out", lambda q: torch.full_like(q, float("nan")))
        # "triton": the selection kernel keeps the tail's blocks and the attention kernel runs them
        kw["tuning"] = Tuning(pbs_select=select)
    device = DEV if backend == "triton" else "cpu"
    q, k, v = (t.to(device) for t in _inputs(n, d=16))
    pad = _left_padding(n).to(device)
    cfg = PBSConfig(dense_tail_blocks=tail, scoring=scoring, **SPARSE)
    want, want_sel = R.pbs_attention(q, k, v, cfg, key_padding_mask=pad, return_selection=True)
    plain, plain_sel = R.pbs_attention(
        q, k, v, cfg.replace(dense_tail_blocks=0), key_padding_mask=pad, return_selection=True
    )
    impl = op_backends.load("pbs", backend)
    got, sel = impl(q, k, v, cfg, key_padding_mask=pad, is_causal=True, return_selection=True, **kw)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert torch.equal(sel.key_mask(4), want_sel.key_mask(4))
    start = tail_start(n, 16, tail)
    assert not torch.equal(
        plain_sel.key_mask(4)[:, :, start:], want_sel.key_mask(4)[:, :, start:]
    )  # it had been sparse


def test_the_op_takes_the_field_and_gradients_flow_through_the_tail():
    q, k, v = (t.requires_grad_(True) for t in _inputs(80))
    cfg = PBSConfig(dense_tail_blocks=1, **SPARSE)
    out = ops.attention(q, k, v, config=cfg, is_causal=True, backend="reference")
    start = tail_start(80, 16, 1)
    out[:, :, start:].sum().backward()
    qd, kd, vd = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    dense = torch.nn.functional.scaled_dot_product_attention(
        qd, kd.repeat_interleave(2, 1), vd.repeat_interleave(2, 1), is_causal=True
    )
    dense[:, :, start:].sum().backward()
    for got, want in ((q.grad, qd.grad), (k.grad, kd.grad), (v.grad, vd.grad)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    sparse = ops.attention(q, k, v, config=cfg.replace(dense_tail_blocks=0), is_causal=True, backend="reference")
    assert not torch.allclose(sparse[:, :, start:], dense[:, :, start:], atol=1e-3)  # the tail changed them


def test_float64_tail_rows_stay_float64():
    q, k, v = _inputs(97, dtype=torch.float64)
    out = R.pbs_attention(q, k, v, dense_tail_blocks=1, **SPARSE)
    start = tail_start(97, 16, 1)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out[:, :, start:], dense64(q, k, v)[:, :, start:], rtol=1e-12, atol=1e-12)


def test_bad_values_name_the_field():
    with pytest.raises(ValueError, match="dense_tail_blocks"):
        PBSConfig(dense_tail_blocks=-1)
    with pytest.raises(TypeError, match="dense_tail_blocks"):
        PBSConfig(dense_tail_blocks=1.5)


def test_onnx_and_context_parallel_refuse_a_tail():
    from sparseflow import context_parallel as cpm
    from sparseflow.methods import spec_for

    refuse = spec_for("pbs").onnx.refuse
    assert refuse(PBSConfig()) == ""
    assert "['dense_tail_blocks'] (got dense_tail_blocks=1, needs 0)" in refuse(PBSConfig(dense_tail_blocks=1))
    import torch.distributed as dist

    q, k, v = _inputs(64)
    mine = not dist.is_initialized()
    if mine:  # a one-process group: the refusal comes before any collective
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cp = cpm.ContextParallel(dist.group.WORLD)
        with pytest.raises(ValueError, match="context_parallel does not run dense_tail_blocks=1"):
            cpm.attention(q, k, v, config=PBSConfig(dense_tail_blocks=1), context_parallel=cp)
    finally:
        if mine:
            dist.destroy_process_group()
