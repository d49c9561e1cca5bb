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


# sparse settings (a few blocks of each row kept) on both kernel paths a user gets, triton named
# and auto (which times the backends during Inductor's warm-up run), and one exact setting
_REDUCE_OVERHEAD = {
    "pbs-triton": (PBSConfig(block_size=64, segment_size=128), "triton"),
    "pbs-auto": (PBSConfig(block_size=64, segment_size=128), "auto"),
    "pisa-triton": (PISAConfig(block_size=64, top_k=4), "triton"),
    "bsa-triton": (BSAConfig(block_size=64, top_k=4), "triton"),
    "bsa-exact": (BSAConfig(block_size=64, top_k=16), "triton"),
}


@gpu
@pytest.mark.parametrize("name", list(_REDUCE_OVERHEAD))
def test_cuda_reduce_overhead_runs_from_the_first_call(name):
    # Inductor's CUDA-graph trees warm up in their own memory pool and refuse a graph that leaves
    # a tensor there which is not an output: the ops' own CUDA-graph replays (their static inputs)
    # and any device tensor an op keeps between calls would do that. Four layers of one shape: the
    # second layer's call is the repeat that would record an op-level graph.
    torch._dynamo.reset()
    cfg, backend = _REDUCE_OVERHEAD[name]
    model = make_tiny("llama", layers=4).to("cuda", torch.bfloat16).eval()
    sparseflow.compile(model, method=name.split("-")[0], config=cfg, backend=backend, mode="reduce-overhead")
    ids = torch.randint(0, 128, (1, 1000), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        outs = [model(ids).logits.float().clone() for _ in range(3)]  # warm-up, record, replay
    # the three runs of one compiled graph agree (a top-k selection on a random model is not
    # compared with an eager run: Inductor's rounding of the layers before it can flip near-ties)
    for i, got in enumerate(outs):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, outs[0], atol=1e-2, rtol=1e-2, msg=f"{name}, call {i + 1}")
    if name.endswith("exact"):
        dense = make_tiny("llama", layers=4).to("cuda", torch.bfloat16).eval()
        with torch.no_grad():
            torch.testing.assert_close(outs[0], dense(ids).logits.float(), atol=3e-2, rtol=3e-2)
    assert sparseflow.report(model).num_rewritten == 4


def _smollm2_shaped(seed: int = 0):
    """SmolLM2-135M's architecture with random weights (the shipped recipe accepts its config)."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    )
    return tf.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()


@gpu
@pytest.mark.parametrize("method", ["pbs", "pisa", "bsa"])
def test_cuda_reduce_overhead_smollm2_shape_8k(method):
    # the README's call: the shipped recipe (recipe="auto") at 8K, mode="reduce-overhead"
    torch._dynamo.reset()
    model = _smollm2_shaped()
    sparseflow.compile(model, method=method, mode="reduce-overhead")
    ids = torch.randint(0, 49152, (1, 8192), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        outs = [model(ids, logits_to_keep=1).logits.float().clone() for _ in range(3)]
    for got in outs:
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, outs[0], atol=1e-2, rtol=1e-2)
