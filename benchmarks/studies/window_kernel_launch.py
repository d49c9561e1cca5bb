"""The exact sliding-window kernel's launch on Gemma 3's shape, side by side (issue 48).

Gemma 3 270M's 15 sliding layers (4 query heads, 1 KV head, head dim 256, window 512) run the
token-sparse forward over the window's own block lists; at 32K they took 6.17 ms of a 39.2 ms
forward (about 190 TFLOP/s, against cuDNN's 620 on the global layers; docs/results.md). That
kernel's launch was tuned on SmolLM2 (head dim 64, a group of 3): 64 dot rows (16 tokens x 4
heads here), 4 warps, and pipeline stages capped by the key/value block's bytes (2 at head dim
256 with 64-key blocks); the launch from head dim 256 is now 128 rows on 8 warps (the first run of
this study). This times the forward alone (``token_sparse_fwd``, lists built once)
for dot rows 64 / 128, warps 4 / 8, stages 1-3 and window blocks of 64 / 128 keys, beside
compiled FlexAttention's window (``flex_window_attention``) and cuDNN's dense causal attention of
the same shape; each variant's output is checked against the default's.

    python benchmarks/studies/window_kernel_launch.py --ns 8192,32768 --json out.json
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, ".."))

from common import bench, env_info, write_result  # noqa: E402

SHAPE = dict(b=1, hq=4, hkv=1, d=256, window=512)


def _variant_forward(q, k, v, rows: int, warps: int, stages: int, block: int):
    """A callable running the window's forward with this launch, and its output once."""
    from sparseflow.kernels import token_sparse_triton as ts
    from sparseflow.kernels.token_blocks import window_block_indices

    n = q.shape[2]
    sel = window_block_indices(n, n, block, SHAPE["window"], 0, q.device).expand(1, 1, -1, -1).contiguous()
    tokens = max(1, rows // (SHAPE["hq"] // SHAPE["hkv"]))
    num, lists = ts.tile_block_lists(sel, tokens, -(-n // block))
    scale = SHAPE["d"] ** -0.5

    def run():
        real_tile, real_launch = ts.forward_token_tile, ts._fwd_launch
        ts.forward_token_tile = lambda *shape: tokens
        ts._fwd_launch = lambda k_, c_: dict(num_warps=warps, num_stages=stages)
        try:
            return ts.token_sparse_fwd(q, k, v, sel, num, lists, None, scale, block, True, False, SHAPE["window"], 0)[0]
        finally:
            ts.forward_token_tile, ts._fwd_launch = real_tile, real_launch

    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ns", default="8192,32768")
    ap.add_argument("--rows", default="64,128")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument("--blocks", default="64,128")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("window_kernel_launch: needs a CUDA GPU", file=sys.stderr)
        return 2
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from sparseflow.methods.dense.window import flex_window_attention

    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    rows_out = []
    for n in ints(args.ns):
        torch.manual_seed(0)
        q = torch.randn(SHAPE["b"], SHAPE["hq"], n, SHAPE["d"], device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(SHAPE["b"], SHAPE["hkv"], n, SHAPE["d"], device="cuda", dtype=torch.bfloat16) for _ in "kv")
        base = _variant_forward(q, k, v, 64, 4, 2, 64)()
        flex = lambda: flex_window_attention(q, k, v, sliding_window=SHAPE["window"])  # noqa: E731  (compiles its own flex)
        flex_ms = bench(flex)
        kr, vr = (t.expand(-1, SHAPE["hq"], -1, -1) for t in (k, v))

        def dense():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, kr, vr, is_causal=True)

        dense_ms = bench(dense)
        print(f"N={n}: compiled flex window {flex_ms:.3f} ms, cuDNN dense causal {dense_ms:.3f} ms", flush=True)
        for rows, warps, stages, block in itertools.product(
            ints(args.rows), ints(args.warps), ints(args.stages), ints(args.blocks)
        ):
            row = dict(n=n, rows=rows, warps=warps, stages=stages, block=block, flex_ms=flex_ms, dense_ms=dense_ms)
            try:
                fn = _variant_forward(q, k, v, rows, warps, stages, block)
                out = fn()
                row["max_diff_vs_default"] = float((out.float() - base.float()).abs().max())
                row["ms"] = bench(fn)
                row["vs_flex"] = flex_ms / row["ms"]
                print(
                    f"  rows {rows:3d} warps {warps} stages {stages} block {block:3d}: {row['ms']:.3f} ms "
                    f"({row['vs_flex']:.2f}x flex), diff {row['max_diff_vs_default']:.1e}",
                    flush=True,
                )
            except Exception as exc:  # e.g. out of shared memory or registers: report, go on
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                print(f"  rows {rows} warps {warps} stages {stages} block {block}: {row['error']}", flush=True)
            rows_out.append(row)
            torch.cuda.empty_cache()
        if args.json:
            write_result(args.json, env_info("cuda"), args, shape=SHAPE, rows=rows_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
