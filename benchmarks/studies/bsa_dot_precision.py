"""The BSA selector's score dot in each precision, side by side: kernel time per call (a CUDA
graph of 10 calls, so no host time is read) and the share of query rows whose selection differs
from the reference's (``reference.bsa_select``, fp32), at SmolLM2's attention shape (B 1, Hq 9,
Hkv 3, D 64, C 64, K 8, bf16, causal), on Gaussian keys and on keys with a positional drift.
Prints a table and writes JSON.

    python benchmarks/studies/bsa_dot_precision.py --json benchmarks/results/bsa_dot_precision_h200.json
"""

import argparse
import itertools
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, ".."))

from common import graph_us_per_call, write_result  # noqa: E402
from e2e_prefill import env_info  # noqa: E402
from sparseflow.kernels.block_summaries_triton import leaf_sums  # noqa: E402
from sparseflow.methods.bsa import reference as bsa_ref  # noqa: E402
from sparseflow.methods.bsa import triton_select as bs  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ns", default="8192,32768")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = []
    for n, drift in itertools.product([int(x) for x in args.ns.split(",")], (False, True)):
        torch.manual_seed(0)
        q = torch.randn(1, 9, n, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, 3, n, 64, device="cuda", dtype=torch.bfloat16)
        if drift:
            ramp = torch.linspace(0, 2, n, device="cuda", dtype=torch.bfloat16)[None, None, :, None]
            k = k + ramp * torch.randn(1, 3, 1, 64, device="cuda", dtype=torch.bfloat16)
        want = bsa_ref.bsa_select(q, k, block_size=64, top_k=args.top_k)
        sums, cnt, lfv = leaf_sums(k, None, 64)
        for precision, warps in itertools.product(bs.PRECISIONS, (4, 8)):
            bs._SELECT_LAUNCH["num_warps"] = warps
            call = (q, sums, cnt, lfv, n, 0.125, True, 64, args.top_k, True, True, precision)
            try:
                got = bs._bsa_select_fwd(*call).long()
                us = graph_us_per_call(lambda: bs._bsa_select_fwd(*call))
            finally:
                bs._SELECT_LAUNCH["num_warps"] = None
            differ = (got != want).any(-1).float().mean().item()
            row = dict(n=n, keys="drift" if drift else "gaussian", precision=precision, num_warps=warps, us=us)
            rows.append(dict(row, rows_differing=differ))
            print(
                f"N={n:6d} {row['keys']:8s} {precision:6s} warps {warps}  {us:8.1f} us  "
                f"rows selecting otherwise than the reference {differ:.2e}",
                flush=True,
            )
    if args.json:
        write_result(args.json, env_info(), args, rows=rows)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
