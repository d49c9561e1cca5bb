"""sparseflow.compile on CUDA with Inductor and dynamic lengths (the Triton kernels as Inductor
emits them). GPU only; the same rewrites are checked on the CPU in test_pass.py/test_models.py."""

import pytest
import torch

import sparseflow
from sparseflow.config import BSAConfig, PBSConfig, PISAConfig

from conftest import make_tiny

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# every visible block kept, so the model must equal dense; block 64 so the lengths below span
# several blocks and a partial last one
_EXACT = {
    "pbs-mean": PBSConfig(block_size=64, segment_size=128, threshold=1.0),
    "pbs-sampled_rows": PBSConfig(block_size=64, segment_size=128, threshold=1.0, scoring="sampled_rows"),
    "pbs-antidiagonal": PBSConfig(block_size=64, segment_size=128, threshold=1.0, scoring="antidiagonal"),
    "pisa": PISAConfig(block_size=64, top_k=16),
    "bsa": BSAConfig(block_size=64, top_k=16),
}


@gpu
@pytest.mark.parametrize("name", list(_EXACT))
def test_cuda_compile_dynamic_lengths_equal_dense(name):
    # a second length makes Dynamo retrace with a symbolic length: every launch size the kernels
    # derive from it must stay a plain int (Inductor cannot emit a symbolic constexpr)
    torch._dynamo.reset()
    model = make_tiny("llama", layers=2).to("cuda", torch.bfloat16).eval()
    dense = make_tiny("llama", layers=2).to("cuda", torch.bfloat16).eval()
    cfg = _EXACT[name]
    sparseflow.compile(model, method=name.split("-")[0], config=cfg, backend="triton")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n in (300, 420, 600):
            ids = torch.randint(0, 128, (1, n), generator=gen).cuda()
            got, want = model(ids).logits.float(), dense(ids).logits.float()
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2, msg=f"{name} at n={n}")
    assert sparseflow.report(model).num_rewritten == 2
