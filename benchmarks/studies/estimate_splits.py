"""PBS strided estimate (``scoring="sampled_rows"``, stride 8, blocks of 128, segments of 256) at
SmolLM2's attention shape (B 1, Hq 9, Hkv 3, D 64, bf16, causal): row tile x key splits x warps x
stages, GPU kernel time from the profiler (the split combine included; host launch cost excluded,
as under CUDA graphs). Each variant's output is checked against one pass with 128-row tiles.

    python benchmarks/studies/estimate_splits.py 8192,16384,32768 | tee benchmarks/results/estimate_splits_h200.log
"""

import itertools
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, ".."))
from common import kernel_us_per_call  # noqa: E402
from sparseflow.methods.pbs import triton_estimate as est  # noqa: E402

B, HQ, HKV, D = 1, 9, 3, 64


def run(n: int) -> None:
    torch.manual_seed(0)
    q = torch.randn(B, HQ, n, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, HKV, n, D, device="cuda", dtype=torch.bfloat16)
    kw = dict(scoring="sampled_rows", stride=8, hp=HKV, block_size=128, segment_size=256)
    ref = est.strided_estimate(q, k, None, None, None, block_m=128, key_splits=1, **kw)
    rows = []
    for bm, w, st, sp in itertools.product((64, 128), (4, 8), (2, 3), (1, 2, 4, 8)):

        def f(bm=bm, w=w, st=st, sp=sp):
            return est.strided_estimate(
                q, k, None, None, None, block_m=bm, num_warps=w, num_stages=st, key_splits=sp, **kw
            )

        lbm, lse = f()
        err = max((a - b).nan_to_num(0, 0, 0).abs().max().item() for a, b in zip((lbm, lse), ref))
        rows.append((kernel_us_per_call(f), bm, w, st, sp, err))
    default = kernel_us_per_call(lambda: est.strided_estimate(q, k, None, None, None, **kw))
    bm = est.default_row_tile(q, "sampled_rows", 8, HQ, 128)
    plan = est.estimate_plan("sampled_rows", 128, 8, bm)
    sp = est.default_key_splits(q, "sampled_rows", 8, HQ, 128, bm, plan["JB"])
    print(f"N={n}: default (bm={bm} w={plan['num_warps']} st={plan['num_stages']} splits={sp}) {default:.1f} us")
    for r in sorted(rows)[:10]:
        print(f"   {r[0]:7.1f} us  bm={r[1]} w={r[2]} st={r[3]} splits={r[4]} maxdiff={r[5]:.1e}", flush=True)
    one = [r for r in rows if r[1:5] == (128, 8, 3, 1)][0]
    print(f"   one pass, 128-row tiles, 8 warps, 3 stages: {one[0]:.1f} us", flush=True)


if __name__ == "__main__":
    for n in [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "8192").split(",")]:
        run(n)
