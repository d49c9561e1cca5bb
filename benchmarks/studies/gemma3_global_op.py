"""Gemma 3's global layers at the op: which exact causal attention is fastest at head dim 256.

    python benchmarks/studies/gemma3_global_op.py --ns 8192,16384,32768 --json out.json

Shape of one global layer of Gemma 3 270M (batch 1, 4 query heads, 1 KV head, head dim 256, bf16).
Rows: SDPA as the dense op calls it (``enable_gqa``, PyTorch's choice), SDPA pinned to each CUDA
backend (cuDNN, flash; repeated K/V where a backend has no native GQA), and PBS's block-sparse
kernel with every causal block kept (exact attention; what a PBS plan at density 1 runs). Each:
median ms (``triton.testing.do_bench``), TFLOP/s of the causal work, and max error against SDPA.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from common import bench, causal_flops, env_info, pbs_kernel_call, pbs_kernel_inputs, sdpa_dense, write_result  # noqa: E402


def rows_for(n: int, hq: int, hkv: int, d: int, dtype: torch.dtype):
    inp = pbs_kernel_inputs(1, hq, hkv, n, d, dtype, gqa="query_head", layout="gather", density=1.0)
    q, k, v = inp["q"], inp["k"], inp["v"]
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hq > hkv)
    calls = {"sdpa_gqa_auto": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hq > hkv)}
    for backend in ("cudnn", "flash"):
        try:
            run, how = sdpa_dense(q, k, v, backend)
            calls[f"sdpa_{backend}_{how}"] = run
        except Exception as exc:  # a backend that refuses the shape is a row with its reason
            print(f"{n:6d} sdpa_{backend}: refused ({type(exc).__name__}: {str(exc)[:80]})")
    calls["pbs_kernel_all_blocks"] = pbs_kernel_call(inp)
    out = []
    for name, fn in calls.items():
        err = (fn().float() - ref.float()).abs().max().item()
        ms = bench(fn)
        tflops = causal_flops(1, hq, n, d) / ms / 1e9
        out.append({"n": n, "row": name, "ms": ms, "tflops": tflops, "max_err_vs_sdpa": err})
        print(f"{n:6d} {name:24s} {ms:8.3f} ms {tflops:7.1f} TFLOP/s  max err {err:.2e}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ns", default="8192,16384,32768")
    ap.add_argument("--heads", default="4,1", help="query heads,KV heads")
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--json")
    args = ap.parse_args()
    hq, hkv = (int(x) for x in args.heads.split(","))
    rows = []
    for n in (int(x) for x in args.ns.split(",")):
        rows += rows_for(n, hq, hkv, args.head_dim, torch.bfloat16)
    if args.json:
        write_result(args.json, env_info(), args, rows=rows)


if __name__ == "__main__":
    main()
