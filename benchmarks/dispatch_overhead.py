"""What a sparseflow op call costs beyond its kernels: per-call time of plain SDPA, the dense op,
and ``backend="auto"`` once it has chosen dense, on SmolLM2's attention shape; then a profile of
the auto path's Python work.

    python benchmarks/dispatch_overhead.py --json benchmarks/results/dispatch_overhead_h200.json
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import platform
import pstats
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sparseflow  # noqa: E402
from common import mean_s_back_to_back  # noqa: E402


def per_call_us(fn, reps: int) -> float:
    """Wall microseconds per call, synchronising once at the end (what a model's layer loop
    sees when the GPU keeps up with the host)."""
    return mean_s_back_to_back(fn, reps, 10, torch.cuda.synchronize) * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 4096, 8192])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    dev = "cuda"
    rows = []
    profile_text = ""
    for n in args.ns:
        g = torch.Generator(device=dev).manual_seed(n)
        q = torch.randn(1, 9, n, 64, device=dev, dtype=torch.bfloat16, generator=g)
        k = torch.randn(1, 3, n, 64, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn_like(k)
        variants = {
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
            "op dense": lambda: sparseflow.dense_attention(q, k, v),
        }
        for method, cfg in (
            ("pbs", sparseflow.PBSConfig()),
            ("pisa", sparseflow.PISAConfig()),
            ("bsa", sparseflow.BSAConfig()),
        ):
            variants[f"{method} auto"] = lambda c=cfg: sparseflow.attention(q, k, v, config=c, backend="auto")
            variants[f"{method} triton"] = lambda c=cfg: sparseflow.attention(q, k, v, config=c, backend="triton")
        row = {"n": n}
        for name, fn in variants.items():
            try:
                row[name] = per_call_us(fn, args.reps)
            except Exception as exc:
                row[name] = f"{type(exc).__name__}: {exc}"[:200]
        with sparseflow.capture() as cap:
            variants["pbs auto"]()
        row["pbs auto chose"] = cap.calls[-1].backend if cap.calls else None
        rows.append(row)
        print(" ".join(f"{k}={v:.1f}us" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        if n == args.ns[-1]:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(100):
                variants["pbs auto"]()
            torch.cuda.synchronize()
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
            profile_text = buf.getvalue()
            print(profile_text[-6000:])
    if args.json:
        import triton

        env = {
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        with open(args.json, "w") as fh:
            json.dump({"env": env, "rows": rows, "profile_pbs_auto": profile_text}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
