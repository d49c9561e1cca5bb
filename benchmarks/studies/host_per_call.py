"""Host (Python) time per call of the eager attention paths on SmolLM2's attention shape, with the
GPU work kept small (1K tokens) so the host is what is timed; then a cProfile of the replayed
PBS call. Prints a table (no JSON: its output is kept as a log).

    python benchmarks/studies/host_per_call.py | tee benchmarks/results/host_per_call_h200.log
"""

import cProfile
import io
import pstats
import time

import torch
import torch.nn.functional as F
import sparseflow
from sparseflow import PBSConfig, BSAConfig, PISAConfig
from sparseflow import graph_replay as GR
from sparseflow import ops as O

n = 1024
q = torch.randn(1, n, 9, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
k = torch.randn(1, n, 3, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
v = torch.randn(1, n, 3, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
TUN = sparseflow.Tuning()
cfg = {"pbs": PBSConfig(), "bsa": BSAConfig(), "pisa": PISAConfig()}
try:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class M(torch.nn.Module):
        is_causal = True
        num_key_value_groups = 3

    mod = M()

    def hf():
        return sdpa_attention_forward(mod, q, k, v, None, scaling=0.125, is_causal=True)[0]
except Exception as e:
    print("no hf", e)
    hf = None


def host_us(fn, reps=2000):
    torch.cuda.synchronize()
    tot = 0.0
    for i in range(reps):
        t = time.perf_counter()
        fn()
        tot += time.perf_counter() - t
        if i % 50 == 49:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return tot / reps * 1e6


g = torch.cuda.CUDAGraph()
sq, sk, sv = q.clone(), k.clone(), v.clone()
F.scaled_dot_product_attention(sq, sk, sv, is_causal=True, enable_gqa=True)
torch.cuda.synchronize()
with torch.cuda.graph(g):
    so = F.scaled_dot_product_attention(sq, sk, sv, is_causal=True, enable_gqa=True)


def raw_replay():
    sq.copy_(q)
    sk.copy_(k)
    sv.copy_(v)
    g.replay()
    return so.clone()


variants = {
    "F.sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
    "F.sdpa + transpose.contiguous": lambda: (
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2).contiguous()
    ),
    "raw graph: 3 copies+replay+clone": raw_replay,
    "graph.replay only": lambda: g.replay(),
    "one copy_": lambda: sq.copy_(q),
    "clone": lambda: so.clone(),
}
if hf:
    variants["hf sdpa_attention_forward"] = hf
for m in ("pbs", "bsa", "pisa"):
    c = cfg[m]
    variants[f"sf.attention {m}"] = lambda c=c: sparseflow.attention(q, k, v, config=c, backend="triton")
    variants[f"sf.any_layout {m} + T.contig"] = lambda c=c: (
        O.attention_any_layout(q, k, v, config=c, is_causal=True, scale=None, backend="triton", tag="x", tuning=TUN)
        .transpose(1, 2)
        .contiguous()
    )

    layer_memo = {}  # what sparseflow.hf keeps per layer: its repeat calls replay their graph directly
    variants[f"sf.any_layout {m} + T.contig, a layer's repeat"] = lambda c=c, memo=layer_memo: (
        O.attention_any_layout(
            q, k, v, config=c, is_causal=True, scale=None, backend="triton", tag="x", tuning=TUN, known=memo
        )
        .transpose(1, 2)
        .contiguous()
    )


def copying(c):
    GR.default_replays.in_place = False
    try:
        return sparseflow.attention(q, k, v, config=c, backend="triton")
    finally:
        GR.default_replays.in_place = True


variants["sf.attention pbs copying"] = lambda: copying(cfg["pbs"])
with torch.inference_mode():
    for name, fn in variants.items():
        for _ in range(5):
            fn()
    for name, fn in variants.items():
        print(f"{host_us(fn):8.1f} us  {name}", flush=True)
    print("replays", GR.default_replays.replays, "captures", GR.default_replays.captures)
    pr = cProfile.Profile()
    pr.enable()
    for i in range(3000):
        sparseflow.attention(q, k, v, config=cfg["pbs"], backend="triton")
        if i % 50 == 49:
            torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
    print("\n".join(s.getvalue().splitlines()[4:45]))
