"""Where a Gemma 3 forward's GPU time goes, row by row: the CUDA kernels of ``gemma3_e2e``'s rows.

    python benchmarks/studies/gemma3_row_kernels.py --ns 8192,32768 --rows windows,pbs,flex_compile

Gemma 3 270M's architecture with random weights (speed only), bf16, one forward with
``logits_to_keep=1``. Per row and length: median ms of the forward and the kernels taking the most
GPU time per call (profiler), so two rows' gap can be read kernel by kernel.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from common import env_info, kernel_launches_and_us, write_result  # noqa: E402
from e2e_prefill import time_forward  # noqa: E402
from gemma3_e2e import random_gemma3, variant  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ns", default="8192,32768")
    ap.add_argument("--rows", default="windows,pbs,flex_compile")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--json")
    args = ap.parse_args()
    base, _ = random_gemma3(torch.bfloat16, "cuda")
    out = []
    for n in (int(x) for x in args.ns.split(",")):
        ids = torch.randint(0, base.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n)).cuda()
        for row in args.rows.split(","):
            model = variant(base, row, None)
            timing = time_forward(model, ids, 5, 2)

            def fwd(model=model):
                with torch.inference_mode():
                    model(input_ids=ids, use_cache=False, logits_to_keep=1)

            kernels = kernel_launches_and_us(fwd, reps=3, warmup=1)
            top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[: args.top]
            total = sum(us for _, us in kernels.values())
            print(
                f"{n:6d} {row:13s} {timing['ms']:8.2f} ms  GPU kernels {total / 1e3:8.2f} ms  launches {sum(c for c, _ in kernels.values()):.0f}"
            )
            for name, (calls, us) in top:
                print(f"         {us / 1e3:8.3f} ms  x{calls:5.0f}  {name[:110]}")
            out.append({"n": n, "row": row, **timing, "kernels": {k: list(v) for k, v in kernels.items()}})
            del model
    if args.json:
        write_result(args.json, env_info(), args, rows=out)


if __name__ == "__main__":
    main()
