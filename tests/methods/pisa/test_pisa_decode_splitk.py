"""PISA decoding through the split-K attention: ``decode_step_static`` and the eager
``decode_step`` against the fp64 reference attention over their own selections (2x-PyTorch-error
rule), for G = 1 and G > 1 and the three dtypes, with the static buffers' unwritten slots
NaN-poisoned; the eager step keeps the differentiable tiled kernel under autograd.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sparseflow.kernels import token_blocks as tb

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _qkv(hq, hkv, n, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, n, d, generator=g) for h in (hq, hkv, hkv))
    k = k + 1.5 * torch.randn(1, hkv, n // 4 + 1, d, generator=g).repeat_interleave(4, dim=2)[:, :, :n]
    return q.to(DEV, dtype), k.to(DEV, dtype), v.to(DEV, dtype)


def _tolerance(dtype, plain, oracle) -> float:
    from sparseflow.kernels._triton_env import interpreting

    err = (plain.double() - oracle).abs().max().item()
    scale = oracle.abs().max().item()
    tol = 2 * err + (1e-6 if dtype == torch.float32 else 1e-3) * scale
    if dtype == torch.bfloat16 and interpreting():  # the interpreter truncates fp32 -> bf16 (the GPU rounds)
        tol += torch.finfo(dtype).eps * scale
    return tol


class _OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "hq, hkv, dtype",
    [
        (2, 2, torch.float32),  # G = 1
        (6, 2, torch.float16),  # G = 3
        (4, 1, torch.bfloat16),  # G = 4, one KV head
    ],
)
def test_static_step_attention_matches_fp64_reference(hq, hkv, dtype):
    from sparseflow.methods.pisa.pyramid_cache import PyramidCache

    n0, steps, c, top_k, d = 13, 12, 4, 5, 16  # 4 blocks -> 7: -1 padded ids first, a sparse selection later
    q, k, v = _qkv(hq, hkv, n0 + steps, d, dtype, seed=hq)
    cache = PyramidCache(k[:, :, :n0], capacity=n0 + steps + 9, block_size=c)
    k_buf, v_buf, length = cache.static_buffers(k[:, :, :n0], v[:, :, :n0])
    k_buf[:, :, n0:] = float("nan")  # slots no step wrote yet: never read
    v_buf[:, :, n0:] = float("nan")
    padded = sparse = False
    for t in range(n0, n0 + steps):
        length += 1
        qt = q[:, :, t : t + 1]
        with _OpNames() as ops:
            out, idx = cache.decode_step_static(
                qt, k[:, :, t : t + 1], v[:, :, t : t + 1], k_buf, v_buf, length, top_k=top_k
            )
        assert "sparseflow.token_sparse_decode_fwd.default" in ops.names
        assert "sparseflow.token_sparse_fwd.default" not in ops.names
        assert torch.isfinite(out).all(), f"step {t}: a NaN-poisoned slot leaked"
        padded, sparse = padded or bool((idx == -1).any()), sparse or -(-(t + 1) // c) > top_k
        kt, vt = k[:, :, : t + 1], v[:, :, : t + 1]
        oracle = tb.attend_selected_blocks(qt.double(), kt.double(), vt.double(), idx, block_size=c)
        plain = tb.attend_selected_blocks(qt, kt, vt, idx, block_size=c)
        err = (out.double() - oracle).abs().max().item()
        assert err <= _tolerance(dtype, plain, oracle), f"step {t}: {err:.3g}"
    assert padded and sparse, "the steps must cover -1 padded ids and a sparse selection"


def test_eager_step_keeps_the_tiled_kernel_and_stays_differentiable_under_autograd():
    from sparseflow.methods.pisa.pyramid_cache import PyramidCache

    n0, c, top_k = 30, 4, 4
    q, k, v = _qkv(6, 2, n0 + 1, 16, torch.float32, seed=9)
    cache = PyramidCache(k[:, :, :n0], capacity=64, block_size=c)
    qt = q[:, :, -1:]
    with _OpNames() as ops:
        out, idx = cache.decode_step(qt, k, v, top_k=top_k)
    # the eager step (transformers' generate) keeps the GPU-checked tiled kernel until the
    # split-K one has run on a GPU; decode_step_static uses split-K
    assert "sparseflow.token_sparse_fwd.default" in ops.names
    assert "sparseflow.token_sparse_decode_fwd.default" not in ops.names
    want = tb.attend_selected_blocks(qt.double(), k.double(), v.double(), idx, block_size=c)
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=2e-6)
    qg = qt.clone().requires_grad_(True)
    with _OpNames() as ops:
        out_g, _ = cache.decode_step(qg, k, v, top_k=top_k, append=False)
    assert "sparseflow.token_sparse_fwd.default" in ops.names, "autograd needs the kernel with a backward"
    (grad,) = torch.autograd.grad(out_g.sum(), qg)
    assert torch.isfinite(grad).all() and grad.abs().sum() > 0
    torch.testing.assert_close(out_g.detach(), out, atol=2e-6, rtol=2e-6)
