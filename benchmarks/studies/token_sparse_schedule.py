"""The token-sparse attention forward (PISA's and BSA's attention) under launch variants, beside
cuDNN's dense causal attention and, optionally, an earlier copy of the kernel module.

    python benchmarks/studies/token_sparse_schedule.py --json benchmarks/results/token_sparse_schedule_h200.json
    python benchmarks/studies/token_sparse_schedule.py --baseline /path/to/old_token_sparse_triton.py

Inputs: ``structured_qkv`` (sink, local runs, scattered topics), bf16, causal; the selections are
BSA's (``bsa_select``, the fused Triton scan) at each K. Every variant runs on the same
selection; its output is compared with the first variant's (max abs difference) and its GPU time
(CUDA events, mean of back-to-back calls) with cuDNN's. ``--baseline``: a copy of an earlier
``sparseflow/kernels/token_sparse_triton.py`` (its ops are renamed on load so both register).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))  # benchmarks/, for common

from common import env_info, mean_ms_cuda_events, structured_qkv, write_result  # noqa: E402

SHAPES = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128), "g16": (32, 2, 64)}


def load_baseline(path: str):
    """The earlier module at ``path``, beside the package's (``pisa_select_ab.exec_renamed``)."""
    from pisa_select_ab import exec_renamed

    return exec_renamed(path, "sparseflow.kernels", "token_sparse_triton")


def variants(baseline):
    """(name, module, launch overrides: FWD_ROWS and _FWD_LAUNCH, or None for the baseline)."""
    from sparseflow.kernels import token_sparse_triton as ts

    out = []
    if baseline is not None:
        out.append(("baseline", baseline, None))
    out += [
        ("rows64 w4 s2", ts, (64, dict(num_warps=4, num_stages=2))),
        ("rows64 w4 s3", ts, (64, dict(num_warps=4, num_stages=3))),
        ("rows128 w8 s2", ts, (128, dict(num_warps=8, num_stages=2))),
        ("rows128 w4 s2", ts, (128, dict(num_warps=4, num_stages=2))),
    ]
    return out


def run_variant(mod, launch, q, k, v, idx, block_size):
    if launch is None:
        return lambda: mod.token_sparse_attention(q, k, v, idx, block_size=block_size)
    rows, kw = launch

    def call():
        saved = mod.FWD_ROWS, mod._FWD_LAUNCH
        mod.FWD_ROWS, mod._FWD_LAUNCH = rows, kw
        try:
            return mod.token_sparse_attention(q, k, v, idx, block_size=block_size)
        finally:
            mod.FWD_ROWS, mod._FWD_LAUNCH = saved

    return call


# (rows per program, warps, bitonic merge)
SELECT_VARIANTS = [(64, 4, False), (64, 4, True), (32, 4, True), (32, 2, True), (16, 1, True)]


def select_rows(q, k, top_k, block_size, dense_ms, shape, n):
    """BSA's fused scan under each launch variant: its GPU time and whether it selects exactly
    what the first variant selects."""
    from sparseflow.methods.bsa import triton_select as bs

    out, first = [], None
    for block_m, warps, bitonic in SELECT_VARIANTS:
        saved = dict(bs._SELECT_LAUNCH)
        bs._SELECT_LAUNCH.update(block_m=block_m, num_warps=warps, bitonic=bitonic)
        try:
            fn = lambda: bs.bsa_select(q, k, block_size=block_size, top_k=top_k)  # noqa: E731
            idx = fn()
            ms = mean_ms_cuda_events(fn)
        finally:
            bs._SELECT_LAUNCH.clear()
            bs._SELECT_LAUNCH.update(saved)
        first = idx if first is None else first
        row = {
            "shape": shape,
            "n": n,
            "k": top_k,
            "variant": f"select rows{block_m} w{warps} {'bitonic' if bitonic else 'rounds'}",
            "ms": ms,
            "dense_ms": dense_ms,
            "vs_dense": dense_ms / ms,
            "same_selection_as_first": bool(torch.equal(idx, first)),
        }
        out.append(row)
        print(
            f"{shape:8s} N={n:6d} K={top_k:3d} {row['variant']:28s} {ms:8.3f} ms"
            f"  same {row['same_selection_as_first']}",
            flush=True,
        )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", type=lambda s: [int(x) for x in s.split(",")], default=[8192, 32768])
    ap.add_argument("--ks", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16])
    ap.add_argument("--shapes", default="smollm2,llama8b,g16")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--baseline")
    ap.add_argument("--parts", default="select,attention", help="comma list of select, attention")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from sparseflow.methods.bsa.triton_select import bsa_select

    baseline = load_baseline(args.baseline) if args.baseline else None
    rows = []
    for shape in args.shapes.split(","):
        hq, hkv, d = SHAPES[shape]
        for n in args.ns:
            g = torch.Generator(device="cuda").manual_seed(n)
            q, k, v = structured_qkv(1, hq, hkv, n, d, torch.bfloat16, g)
            dense_ms = mean_ms_cuda_events(
                lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            )
            for top_k in args.ks:
                if "select" in args.parts:
                    rows += select_rows(q, k, top_k, args.block_size, dense_ms, shape, n)
                if "attention" not in args.parts:
                    continue
                idx = bsa_select(q, k, block_size=args.block_size, top_k=top_k)
                first = None
                for name, mod, launch in variants(baseline):
                    fn = run_variant(mod, launch, q, k, v, idx, args.block_size)
                    out = fn()
                    first = out if first is None else first
                    ms = mean_ms_cuda_events(fn)
                    row = {
                        "shape": shape,
                        "n": n,
                        "k": top_k,
                        "variant": name,
                        "ms": ms,
                        "dense_ms": dense_ms,
                        "vs_dense": dense_ms / ms,
                        "max_abs_diff_vs_first": (out.float() - first.float()).abs().max().item(),
                        "finite": bool(torch.isfinite(out).all()),
                    }
                    rows.append(row)
                    print(
                        f"{shape:8s} N={n:6d} K={top_k:3d} {name:14s} {ms:8.3f} ms  dense {dense_ms:8.3f} ms"
                        f"  x{row['vs_dense']:5.2f}  diff {row['max_abs_diff_vs_first']:.2e}",
                        flush=True,
                    )
    if args.json:
        write_result(args.json, env_info(), args, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
