"""What PBS's dense tail (``PBSConfig.dense_tail_blocks``) costs at the op level, beside dense SDPA.

For each shape and length: the PBS op (``backend="triton"``, structured q/k/v, causal) with
``dense_tail_blocks`` 0 / 1 / 2, and dense SDPA, each timed back to back between CUDA events;
the tail's rows against dense SDPA's rows of the same inputs (they must agree to bf16 rounding).
``--orders``: the attention kernel's launch order (``triton_attention.HEADS_FIRST``): the tail's
query block is the heaviest, so when it starts decides how much of it overlaps the rest.

    python benchmarks/pbs_tail.py --json benchmarks/results/pbs_tail_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import sparseflow
from sparseflow.methods.pbs.tail import tail_start

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import env_info, mean_ms_cuda_events, qkv  # noqa: E402

SHAPES = {"smollm2": (1, 9, 3, 64), "llama8b": (1, 32, 8, 128)}


ORDERS = {"heads_first": True, "head_by_head": False}


def run(shape: str, n: int, tails, reps: int, order: str):
    from sparseflow.methods.pbs import triton_attention

    triton_attention.HEADS_FIRST = ORDERS[order]
    b, hq, hkv, d = SHAPES[shape]
    q, k, v = qkv(b, hq, hkv, n, d, torch.bfloat16, structured=True)

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    dense_ms = mean_ms_cuda_events(sdpa, reps=reps)
    dense_out = sdpa()
    rows = [{"shape": shape, "n": n, "order": order, "setting": "dense SDPA", "ms": dense_ms, "vs_dense": 1.0}]
    for tail in tails:
        cfg = sparseflow.PBSConfig(dense_tail_blocks=tail)

        def op():
            return sparseflow.attention(q, k, v, config=cfg, is_causal=True, backend="triton")

        ms = mean_ms_cuda_events(op, reps=reps)
        out = op()
        start = tail_start(n, cfg.block_size, tail)
        diff = (out[:, :, start:].float() - dense_out[:, :, start:].float()).abs().max().item() if start < n else None
        rows.append(
            {
                "shape": shape,
                "n": n,
                "order": order,
                "setting": f"pbs tail={tail}",
                "ms": ms,
                "vs_dense": dense_ms / ms,
                "tail_rows": n - start,
                "tail_max_abs_diff_vs_sdpa": diff,
            }
        )
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ns", default="8192,32768")
    ap.add_argument("--shapes", default="smollm2,llama8b")
    ap.add_argument("--tails", default="0,1,2")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--orders", default="heads_first", help=f"comma list of {sorted(ORDERS)}")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    tails = [int(t) for t in args.tails.split(",")]
    orders = args.orders.split(",")
    bad = sorted(set(orders) - set(ORDERS))
    if bad:
        ap.error(f"--orders: unknown {bad}; expected a comma list of {sorted(ORDERS)}")
    out = {"env": env_info(), "args": vars(args), "rows": []}
    for shape in args.shapes.split(","):
        for n in (int(x) for x in args.ns.split(",")):
            for r in (r for order in orders for r in run(shape, n, tails, args.reps, order)):
                out["rows"].append(r)
                diff = r.get("tail_max_abs_diff_vs_sdpa")
                print(
                    f"{r['shape']:>8} N={r['n']:>6} {r['order']:<12} {r['setting']:<12} {r['ms']:8.3f} ms"
                    f"  {r['vs_dense']:.3f}x dense"
                    + ("" if diff is None else f"  tail rows {r['tail_rows']}, max |diff| vs SDPA {diff:.2e}"),
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1, default=str)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
