"""The BSA selector's merge of each key chunk into the rows' running top-K, side by side: kernel
time per call (CUDA events over back-to-back calls; the selector is GPU-bound at these lengths)
for each merge, row tile and warp count, at SmolLM2's attention shape (B 1, Hq 9, Hkv 3, D 64,
C 64, bf16, causal), on keys with a positional drift (later blocks score higher, so every chunk
brings a row new entrants) and on plain Gaussian keys. Every variant's selection is checked equal
to the first one's. Prints a table and writes JSON. (``bsa_merge_h200.log`` also holds an
"entrants" merge, measured on top of a0140c6 and dropped: docs/results.md.)

    python benchmarks/studies/bsa_merge.py --json benchmarks/results/bsa_merge_h200.json
"""

import argparse
import itertools
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, ".."))

from common import mean_ms_cuda_events, write_result  # noqa: E402
from e2e_prefill import env_info  # noqa: E402
from sparseflow.kernels.block_summaries_triton import leaf_sums  # noqa: E402
from sparseflow.methods.bsa import triton_select as bs  # noqa: E402


def keys(n: int, drift: bool, hkv: int = 3, d: int = 64) -> torch.Tensor:
    k = torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16)
    if drift:
        ramp = torch.linspace(0, 2, n, device="cuda", dtype=torch.bfloat16)[None, None, :, None]
        k = k + ramp * torch.randn(1, hkv, 1, d, device="cuda", dtype=torch.bfloat16)
    return k


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ns", default="8192,32768")
    ap.add_argument("--top-ks", default="8,16")
    ap.add_argument("--merges", default="packed,bitonic")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    saved = dict(bs._SELECT_LAUNCH)
    rows = []
    for n, drift, top_k in itertools.product(
        [int(x) for x in args.ns.split(",")], (True, False), [int(x) for x in args.top_ks.split(",")]
    ):
        torch.manual_seed(0)
        q = torch.randn(1, 9, n, 64, device="cuda", dtype=torch.bfloat16)
        sums, cnt, lfv = leaf_sums(keys(n, drift), None, 64)
        call = (q, sums, cnt, lfv, n, 0.125, True, 64, top_k, True, True, "ieee")
        first = None
        for merge, block_m, num_warps in itertools.product(args.merges.split(","), (16, 32, 64), (4, 8)):
            bs._SELECT_LAUNCH.update(merge=merge, block_m=block_m, block_n=64, num_warps=num_warps)
            got = bs._bsa_select_fwd(*call)
            first = got.clone() if first is None else first
            us = mean_ms_cuda_events(lambda: bs._bsa_select_fwd(*call), reps=20) * 1e3
            rows.append(
                dict(
                    n=n,
                    keys="drift" if drift else "gaussian",
                    top_k=top_k,
                    merge=merge,
                    block_m=block_m,
                    num_warps=num_warps,
                    us=us,
                    same=bool(torch.equal(got, first)),
                )
            )
        bs._SELECT_LAUNCH.clear()
        bs._SELECT_LAUNCH.update(saved)
        here = sorted(
            (r for r in rows if (r["n"], r["keys"], r["top_k"]) == (n, rows[-1]["keys"], top_k)), key=lambda r: r["us"]
        )
        default = next(
            r["us"]
            for r in here
            if (r["merge"], r["block_m"], r["num_warps"]) == (saved["merge"], saved["block_m"], 8 if top_k <= 8 else 4)
        )
        print(f"-- N={n} keys={here[0]['keys']} K={top_k}: default {default:.1f} us", flush=True)
        for r in here[:6]:
            print(
                f"   {r['us']:7.1f} us  {r['us'] / default:5.2f}x  {r['merge']:8s} rows {r['block_m']:3d} "
                f"warps {r['num_warps']}  same={r['same']}",
                flush=True,
            )
        best_of = {}
        for r in here:
            best_of.setdefault(r["merge"], r)
        print("   best per merge: " + ", ".join(f"{m} {r['us']:.1f}" for m, r in best_of.items()), flush=True)
    if args.json:
        write_result(args.json, env_info(), args, launch=saved, rows=rows)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
