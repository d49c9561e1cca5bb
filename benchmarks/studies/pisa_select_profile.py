"""Where PISA's selection spends its time on the GPU: one walk under torch's profiler, kernels by CUDA
time, in the paper's latency setting (B 1, Hq 32, Hkv 2, D 64, C 64, K 8, bf16 inputs).

    python benchmarks/studies/pisa_select_profile.py --n 262144 --walks leaf_pairs,per_token --scores bf16
    python benchmarks/studies/pisa_select_profile.py --n 32768 --heads 9,3,64 --walks scan,bsa --scores fp32

Issue 49's 256K target (10 ms) needs to know which of the walk's stages (the pyramid, the nodes above
the leaves, the leaf pairs, the keep) to make faster; a total time cannot say. ``bsa`` in ``--walks``
profiles BSA's bf16 scan of the same shape (its end-to-end time is PISA's bar at 8K-128K).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

from common import env_info, kernel_rows, use_scan_launch  # noqa: E402
from pisa import pisa_inputs  # noqa: E402


def main() -> None:
    from sparseflow import Tuning
    from sparseflow.methods.bsa import triton_select as BT
    from sparseflow.methods.pisa import triton_select as PT

    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=262144)
    ap.add_argument("--heads", default="32,2,64", help="query heads, KV heads, head dim")
    ap.add_argument("--walks", default="leaf_pairs", help="comma list of Tuning.pisa_walk values, or bsa")
    ap.add_argument("--scores", default="bf16")
    ap.add_argument("--structured", action="store_true", help="benchmarks/common.py's structured inputs")
    ap.add_argument("--scan-launch", default="", help='one variant of the scan\'s LAUNCH settings, e.g. "heads=packed"')
    ap.add_argument("--json")
    a = ap.parse_args()
    hq, hkv, d = (int(x) for x in a.heads.split(","))
    q, k, _ = pisa_inputs(a.n, hq, hkv, d, structured=a.structured)
    launch = use_scan_launch(a.scan_launch)
    out = {"env": env_info(), "args": vars(a), "launch": launch, "walks": {}}
    for walk in a.walks.split(","):
        if walk == "bsa":
            rows = kernel_rows(lambda: BT.bsa_select(q, k, block_size=64, top_k=8, precision="bf16"))
        else:
            tuning = Tuning(pisa_walk=walk, pisa_scores=a.scores)
            rows = kernel_rows(lambda: PT.pisa_select(q, k, block_size=64, top_k=8, branching=2, tuning=tuning))
        total = sum(r[1] for r in rows)
        print(f"== {walk} n={a.n} scores={a.scores}: {total:.3f} ms of kernels a call")
        for name, ms, count in rows[:12]:
            print(f"  {ms:8.3f} ms {100 * ms / total:5.1f}%  x{count:<3.0f} {name[:90]}")
        out["walks"][walk] = {"total_ms": total, "kernels": rows}
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
