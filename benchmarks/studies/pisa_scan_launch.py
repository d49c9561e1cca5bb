"""The scan PISA walk's launch settings (``triton_select_scan.LAUNCH``) side by side: GPU time
of each kernel of one selection (torch.profiler over 5 eager calls, kernels summed by name), with
the per-token walk beside it and each setting's selection checked against the per-token walk's.
SmolLM2's attention shape (B 1, Hq 9, Hkv 3) and the paper's (Hq 32, Hkv 2); D 64, C 64, K 8,
bf16, causal.

    python benchmarks/studies/pisa_scan_launch.py --json benchmarks/results/pisa_scan_launch_h200.json
"""

import argparse
import collections
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, ".."))

import sparseflow  # noqa: E402
from common import kernel_us_by_name, write_result  # noqa: E402
from e2e_prefill import env_info  # noqa: E402
from sparseflow.methods.pisa import triton_select as ts  # noqa: E402
from sparseflow.methods.pisa import triton_select_scan as scan  # noqa: E402

# each setting: LAUNCH entries that differ from the defaults ({}: the defaults)
SETTINGS = [
    {},
    {"scan_dot": "tf32x3"},
    {"pair_rows": 256, "leaf_warps": 8},
]


def parse_settings(text: str) -> list:
    """``"pair_rows=256+leaf_warps=8;scan_dot=tf32x3"`` -> ``[{"pair_rows": 256, "leaf_warps": 8},
    {"scan_dot": "tf32x3"}]`` (an empty item: the defaults)."""
    out = []
    for item in text.split(";"):
        setting = {}
        for pair in filter(None, item.split("+")):
            key, _, value = pair.partition("=")
            if key not in scan.LAUNCH:
                raise ValueError(f"--settings: {key!r} is not a LAUNCH entry ({sorted(scan.LAUNCH)})")
            setting[key] = int(value) if value.lstrip("-").isdigit() else value
        out.append(setting)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="9:3:8192,9:3:32768,32:2:8192", help="Hq:Hkv:N, comma separated")
    ap.add_argument("--settings", help="LAUNCH overrides: key=value joined by '+', settings by ';'")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    settings = parse_settings(args.settings) if args.settings else SETTINGS
    rows = []
    defaults = dict(scan.LAUNCH)
    for case in args.cases.split(","):
        hq, hkv, n = (int(x) for x in case.split(":"))
        torch.manual_seed(0)
        q = torch.randn(1, hq, n, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, hkv, n, 64, device="cuda", dtype=torch.bfloat16)
        kw = dict(block_size=64, top_k=8, is_causal=True)
        per_token = sparseflow.Tuning(pisa_walk="per_token")
        base = ts.pisa_select(q, k, tuning=per_token, **kw)
        variants = [("per_token", None)] + [("scan", s) for s in settings]
        for walk, setting in variants:
            if setting is not None:
                scan.LAUNCH.update(setting)
            tuning = sparseflow.Tuning(pisa_walk=walk)
            try:
                differ = (ts.pisa_select(q, k, tuning=tuning, **kw) != base).any(-1).float().mean().item()
                per_kernel = collections.Counter(
                    kernel_us_by_name(lambda: ts.pisa_select(q, k, tuning=tuning, **kw), 5, 2)
                )
            finally:
                scan.LAUNCH.update(defaults)
            total = sum(per_kernel.values())
            top = ", ".join(f"{name[:40]} {us:.0f}" for name, us in per_kernel.most_common(5))
            label = (
                walk if setting is None else "scan " + (" ".join(f"{k}={v}" for k, v in setting.items()) or "defaults")
            )
            print(
                f"Hq {hq:2d} Hkv {hkv} N {n:6d} {label:34s} {total:8.0f} us | {top} | differ {differ:.1e}", flush=True
            )
            rows.append(
                dict(
                    hq=hq,
                    hkv=hkv,
                    n=n,
                    walk=walk,
                    setting=setting,
                    total_us=total,
                    kernels_us=dict(per_kernel),
                    rows_differing=differ,
                )
            )
    if args.json:
        write_result(args.json, env_info(), args, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
