"""Host cost per attention call of a converted Hugging Face model, on the CPU (issue 16).

On tiny tensors the kernel is negligible, so what is left is the Python each layer pays. Timed,
interleaved in one process so shared-core noise hits every variant alike:

- ``hf sdpa``: transformers' own ``sdpa_attention_forward`` on a tiny Llama's attention module;
- ``hf sparseflow``: ``sparseflow.hf.sparseflow_attention_forward`` on the same module, converted
  with a ``backend="auto"`` plan whose every layer runs dense at this length (min_seq_len);
- ``F.sdpa`` / ``ops.attention``: the same pair one level down, on the op's Python entry;
- ``model sdpa`` / ``model sparseflow``: the two attention functions timed per call inside a
  30-layer tiny Llama's forward (the layer loop's cold caches cost more than a tight loop shows).

    python benchmarks/hf_overhead.py --json benchmarks/results/hf_overhead_cpu.json
    python benchmarks/hf_overhead.py --profile   # cProfile of the HF path on a memo hit
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from typing import Callable, Dict, List

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import sparseflow  # noqa: E402
import sparseflow.hf as sfhf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import env_info  # noqa: E402


def tiny_llama(layers: int = 2):
    """A random-init Llama (6 query heads, 2 KV heads, head dim 16) converted to a dense-at-this-length plan."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=96,
        intermediate_size=128,
        num_attention_heads=6,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=1024,
    )
    cfg._attn_implementation = "sdpa"
    model = tf.LlamaForCausalLM(cfg).eval()
    plan = sfhf.Plan(method="pbs", config=sparseflow.PBSConfig(min_seq_len=1024), backend="auto", num_layers=layers)
    return sfhf.apply_plan(model, plan)


def variants(n: int) -> Dict[str, Callable[[], object]]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = tiny_llama().model.layers[1].self_attn
    g = torch.Generator().manual_seed(n)
    # the projections' layout, [B, N, H, D] viewed as [B, H, N, D], as a Llama attention hands them over
    q = torch.randn(1, n, 6, 16, generator=g).transpose(1, 2)
    k, v = (torch.randn(1, n, 2, 16, generator=g).transpose(1, 2) for _ in range(2))
    scale = module.scaling
    cfg = sfhf.plan_of(module.config).config
    return {
        "hf sdpa": lambda: sdpa_attention_forward(module, q, k, v, None, dropout=0.0, scaling=scale),
        "hf sparseflow": lambda: sfhf.sparseflow_attention_forward(module, q, k, v, None, dropout=0.0, scaling=scale),
        "F.sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True),
        "ops.attention": lambda: sparseflow.attention(q, k, v, config=cfg, scale=scale, backend="auto"),
    }


def interleaved_us(fns: Dict[str, Callable[[], object]], calls: int, block: int) -> Dict[str, float]:
    """Median over blocks of ``block`` back-to-back calls, in microseconds per call; the variants take
    turns block by block."""
    per_block: Dict[str, List[float]] = {name: [] for name in fns}
    for fn in fns.values():
        for _ in range(50):  # warm-up: the memo, the lazy imports, the allocator
            fn()
    for _ in range(max(1, calls // block)):
        for name, fn in fns.items():
            t0 = time.perf_counter_ns()
            for _ in range(block):
                fn()
            per_block[name].append((time.perf_counter_ns() - t0) / block / 1e3)
    return {name: statistics.median(times) for name, times in per_block.items()}


def in_model_us(layers: int, n: int, forwards: int) -> Dict[str, float]:
    """Median microseconds per attention-function call inside a ``layers``-layer model's forward
    (``sdpa``, then the converted ``sparseflow`` path, forward by forward in turn): the caches and
    branch predictors a real layer loop leaves them."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model = tiny_llama(layers)
    ids = torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(n))
    times: Dict[str, List[int]] = {"model sdpa": [], "model sparseflow": []}
    impls = {"sdpa": sdpa_attention_forward, sfhf.ATTN_IMPLEMENTATION: sfhf.sparseflow_attention_forward}
    for name, fn in impls.items():
        AttentionInterface.register(name, _timed(fn, times[f"model {name}"]))
    try:
        with torch.no_grad():
            for i in range(2 * forwards + 10):
                model.set_attn_implementation(list(impls)[i % 2])
                model(ids)
                if i == 9:  # the first forwards warm up
                    for t in times.values():
                        t.clear()
    finally:
        for name, fn in impls.items():
            AttentionInterface.register(name, fn)
    return {name: statistics.median(t) / 1e3 for name, t in times.items()}


def _timed(fn: Callable, into: List[int]) -> Callable:
    def timed(*args, **kwargs):
        t0 = time.perf_counter_ns()
        out = fn(*args, **kwargs)
        into.append(time.perf_counter_ns() - t0)
        return out

    return timed


def profile_text(fn: Callable[[], object], calls: int = 2000, lines: int = 25) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(lines)
    return buf.getvalue()


def env() -> Dict[str, object]:
    import transformers

    return {**env_info("cpu"), "transformers": transformers.__version__, "sparseflow": sparseflow.__version__}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16, help="sequence length (below the plan's min_seq_len: dense)")
    ap.add_argument("--calls", type=int, default=2000, help="calls per variant")
    ap.add_argument("--block", type=int, default=10, help="back-to-back calls per timed block")
    ap.add_argument("--layers", type=int, default=30, help="layers of the in-model measurement (SmolLM2-135M: 30)")
    ap.add_argument("--forwards", type=int, default=100, help="forwards per attention implementation in the model")
    ap.add_argument("--profile", action="store_true", help="print a cProfile of the HF sparseflow path")
    ap.add_argument("--json")
    ap.add_argument("--note", default="", help="stored in the JSON (e.g. which code was measured)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # the kernel is not what is measured; one thread keeps its noise down
    fns = variants(args.n)
    us = interleaved_us(fns, args.calls, args.block)
    us.update(in_model_us(args.layers, args.n, args.forwards))
    row = dict(
        us,
        **{
            "hf over sdpa": us["hf sparseflow"] - us["hf sdpa"],
            "op over sdpa": us["ops.attention"] - us["F.sdpa"],
            "model over sdpa": us["model sparseflow"] - us["model sdpa"],
        },
    )
    print(" ".join(f"{name}={t:.2f}us" for name, t in row.items()), flush=True)
    prof = profile_text(fns["hf sparseflow"]) if args.profile else ""
    if prof:
        print(prof)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "env": env(),
                    "note": args.note,
                    "n": args.n,
                    "calls": args.calls,
                    "block": args.block,
                    "layers": args.layers,
                    "forwards": args.forwards,
                    "us_per_call": row,
                    "profile_hf_sparseflow": prof,
                },
                fh,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
