"""PISA's selection walk per token against the scan walk (``Tuning(pisa_walk=...)``), side by
side: selection time per call (the pyramid build included; a CUDA graph of 10 calls, so no host
time is read), the share of query rows whose selection differs between the two walks and from the
reference (``reference.pisa_select``, fp32; up to ``--ref-max``), and the whole PISA attention
against dense SDPA (flash, causal) at the same shape. Shapes: SmolLM2's attention (B 1, Hq 9,
Hkv 3, D 64) and the paper's latency setting (Hq 32, Hkv 2, D 64); C 64, K 8, g 2, bf16, causal.

    python benchmarks/studies/pisa_scan_walk.py --json benchmarks/results/pisa_scan_walk_h200.json
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, ".."))

import sparseflow  # noqa: E402
from common import graph_us_per_call, write_result  # noqa: E402
from e2e_prefill import env_info  # noqa: E402
from sparseflow.methods.pisa import reference as pisa_ref  # noqa: E402
from sparseflow.methods.pisa import triton_select as ts  # noqa: E402

SHAPES = {"smollm2": (9, 3), "paper": (32, 2)}
WALKS = ("per_token", "scan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ns", default="4096,8192,16384,32768")
    ap.add_argument("--shapes", default="smollm2,paper")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--ref-max", type=int, default=8192, help="compare with the reference up to this length")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = []
    for shape in args.shapes.split(","):
        hq, hkv = SHAPES[shape]
        for n in (int(x) for x in args.ns.split(",")):
            torch.manual_seed(0)
            q, k, v = (torch.randn(1, h, n, 64, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv, hkv))
            kw = dict(block_size=64, top_k=args.top_k, is_causal=True)
            cfg = sparseflow.PISAConfig(block_size=64, top_k=args.top_k)
            sel = {w: ts.pisa_select(q, k, tuning=sparseflow.Tuning(pisa_walk=w), **kw) for w in WALKS}
            want = pisa_ref.pisa_select(q, k, **kw) if n <= args.ref_max else None
            kr, vr = (t.repeat_interleave(hq // hkv, dim=1) for t in (k, v))
            dense_us = graph_us_per_call(lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=True))
            for walk in WALKS:
                tuning = sparseflow.Tuning(pisa_walk=walk, cuda_graphs=False)
                select_us = graph_us_per_call(lambda: ts.pisa_select(q, k, tuning=tuning, **kw))
                attn_us = graph_us_per_call(
                    lambda: sparseflow.pisa_attention(
                        q, k, v, config=cfg, is_causal=True, backend="triton", tuning=tuning
                    )
                )
                row = dict(
                    shape=shape,
                    n=n,
                    walk=walk,
                    select_us=select_us,
                    attention_us=attn_us,
                    dense_sdpa_us=dense_us,
                    attention_vs_dense=dense_us / attn_us,
                    rows_differing_from_per_token=(sel[walk] != sel["per_token"]).any(-1).float().mean().item(),
                    rows_differing_from_reference=None
                    if want is None
                    else (sel[walk] != want).any(-1).float().mean().item(),
                )
                rows.append(row)
                ref = "-" if want is None else f"{row['rows_differing_from_reference']:.1e}"
                print(
                    f"{shape:8s} N={n:6d} {walk:9s} select {select_us:9.1f} us  attention {attn_us:9.1f} us  "
                    f"dense {dense_us:8.1f} us  ({dense_us / attn_us:5.3f}x dense)  rows differing: "
                    f"per-token {row['rows_differing_from_per_token']:.1e} reference {ref}",
                    flush=True,
                )
    if args.json:
        write_result(args.json, env_info(), args, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
