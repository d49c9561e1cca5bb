"""What ``backend="auto"`` picks on this GPU, and the timings it measured (issue 5).

    python benchmarks/auto_backend.py --json benchmarks/results/auto_backend_h200.json

For each method and length it calls ``sparseflow.attention(..., backend="auto")`` on the structured inputs (B=1, Hq=32, Hkv=8, D=128, bf16) under ``sparseflow.capture()``, prints the
backend the report shows and the per-backend times the chooser measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import sparseflow  # noqa: E402
from common import env_info, structured_qkv  # noqa: E402
from sparseflow.autobackend import default_chooser  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 16384])
    ap.add_argument("--json", default=os.path.join(HERE, "results", "auto_backend_h200.json"))
    args = ap.parse_args(argv)
    configs = {
        "pbs": sparseflow.PBSConfig(),
        "pisa": sparseflow.PISAConfig(top_k=16),
        "bsa": sparseflow.BSAConfig(top_k=16),
    }
    rows = []
    for n in args.ns:
        g = torch.Generator(device="cuda").manual_seed(n)
        q, k, v = structured_qkv(1, 32, 8, n, 128, torch.bfloat16, g)
        for method, cfg in configs.items():
            with sparseflow.capture() as cap:
                sparseflow.attention(q, k, v, config=cfg, backend="auto")
            rec = cap.calls[-1]
            key = default_chooser.key(method, q, k, ())[:-1]
            times = next((t for kk, t in default_chooser.timings.items() if kk[:-1] == key), {})
            rows.append(dict(method=method, n=n, chosen=rec.backend, measured_ms=times))
            print(
                f"auto n={n:6d} {method:5s} -> {rec.backend:9s} measured: "
                + ", ".join(f"{b} {t:.3f} ms" for b, t in times.items()),
                flush=True,
            )
    with open(args.json, "w") as fh:
        json.dump({"env": env_info(), "rows": rows}, fh, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
