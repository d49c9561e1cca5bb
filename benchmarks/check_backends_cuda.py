"""Run the op properties (exact mode; sparse == masked dense over the op's own selection)
for every available backend on the current device. Prints a table, writes JSON.

    python benchmarks/check_backends_cuda.py --json benchmarks/results/backends_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
import traceback

import torch

from sparseflow import BSAConfig, PBSConfig, PISAConfig
from sparseflow.ops import IMPLEMENTATIONS
from sparseflow.testing import check_exact_mode, check_matches_own_selection

CONFIGS = {
    "pbs": PBSConfig(block_size=32, segment_size=64, threshold=0.8),
    "pisa": PISAConfig(block_size=32, top_k=4),
    "bsa": BSAConfig(block_size=32, top_k=4),
}
SHAPES = [  # (B, Hq, Hkv, N, D, dtype, padded)
    (2, 6, 2, 301, 64, torch.bfloat16, True),
    (1, 9, 3, 1000, 64, torch.float16, False),
    (1, 8, 8, 517, 128, torch.float32, False),
    (2, 4, 1, 260, 80, torch.bfloat16, True),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--methods", type=lambda s: s.split(","), default=list(CONFIGS))
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for method, cfg in CONFIGS.items():
        if method not in args.methods:
            continue
        backends = sorted(b for (m, b) in IMPLEMENTATIONS if m == method)
        for backend in backends:
            for b, hq, hkv, n, d, dt, padded in SHAPES:
                g = torch.Generator().manual_seed(n)
                q = torch.randn(b, hq, n, d, generator=g).to(args.device, dt)
                k = torch.randn(b, hkv, n, d, generator=g).to(args.device, dt)
                v = torch.randn(b, hkv, n, d, generator=g).to(args.device, dt)
                kpm = None
                if padded:
                    kpm = torch.ones(b, n, dtype=torch.bool, device=args.device)
                    kpm[-1, n - n // 3 :] = False
                status, t0 = "ok", time.perf_counter()
                try:
                    check_exact_mode(q, k, v, method, base=cfg, key_padding_mask=kpm, backend=backend)
                    check_matches_own_selection(q, k, v, cfg, key_padding_mask=kpm, backend=backend)
                except Exception as exc:  # report every failure, keep going
                    status = f"FAIL: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                    traceback.print_exc()
                rows.append(
                    dict(
                        method=method,
                        backend=backend,
                        shape=f"B{b} Hq{hq} Hkv{hkv} N{n} D{d}",
                        dtype=str(dt).replace("torch.", ""),
                        padded=padded,
                        status=status,
                        seconds=round(time.perf_counter() - t0, 2),
                    )
                )
                r = rows[-1]
                print(
                    f"{r['method']:<5} {r['backend']:<10} {r['shape']:<26} {r['dtype']:<9} pad={int(padded)} {r['seconds']:>6.2f}s {r['status']}",
                    flush=True,
                )
    meta = dict(
        device=torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
        torch=torch.__version__,
        triton=_triton_version(),
        date=datetime.date.today().isoformat(),
    )
    failed = [r for r in rows if r["status"] != "ok"]
    print(f"{len(rows) - len(failed)}/{len(rows)} passed on {meta['device']}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({**meta, "rows": rows}, fh, indent=1)
    raise SystemExit(1 if failed else 0)


def _triton_version():
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


if __name__ == "__main__":
    main()
