"""``sparseflow bench``: each method's op vs dense SDPA on this device at a small size, plus (on CUDA) the
package's PBS and PISA parts: correctness checks and op timings (the logic is :mod:`sparseflow.bench`)."""

from __future__ import annotations

import argparse
import json
import sys

from ..methods import sparse_names
from .common import _backends, _check_out_dir, _check_out_file, _count, _error, _ints, _sparse_methods


def add_parser(sub) -> None:
    be = sub.add_parser(
        "bench",
        help="small benchmark on this device: each method's op vs dense SDPA, and "
        "(on CUDA) PBS/PISA checks and op timings at a small size",
    )
    be.add_argument("--ns", type=_ints, help="sequence lengths (default 1024,2048 on CPU; 8192,16384 on CUDA)")
    be.add_argument("--hq", type=_count, default=8, help="query heads (default 8)")
    be.add_argument("--hkv", type=_count, default=2, help="KV heads (default 2)")
    be.add_argument("--d", type=_count, default=64, help="head dim (default 64)")
    methods = list(sparse_names())  # the registry's, read when the parser is built
    be.add_argument(
        "--methods", type=_sparse_methods, default=methods, help=f"comma list (default all: {','.join(methods)})"
    )
    be.add_argument("--backends", type=_backends, help="comma list (default reference on CPU, auto on CUDA)")
    be.add_argument("--reps", type=_count, default=3, help="timed repetitions per point (median; default 3)")
    be.add_argument("--benchmarks", help="run the scripts of this benchmarks folder instead of the package's parts")
    be.add_argument("--no-scripts", action="store_true", help="only the op timing (no CUDA parts)")
    be.add_argument("--out", help="folder for the parts' JSON (default: a new temporary folder)")
    be.add_argument("--json", help="write the op timings and part statuses to this JSON file")
    be.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    import torch

    from ..bench import BenchShape, environment, find_benchmarks, format_rows, op_timings, run_scripts, write_json

    cuda = torch.cuda.is_available()
    try:
        ns = args.ns or ([8192, 16384] if cuda else [1024, 2048])
        shapes = [BenchShape(n, hq=args.hq, hkv=args.hkv, d=args.d) for n in ns]
        backends = args.backends or (["auto"] if cuda else ["reference"])
        folder = find_benchmarks(args.benchmarks)
        _check_out_file(args.json, "--json")
        _check_out_dir(args.out, "--out")
    except (ValueError, FileNotFoundError) as exc:
        return _error("bench", exc)
    env = environment()
    print(json.dumps(env))
    print(
        f"op timing: {'CUDA' if cuda else 'CPU'}, shapes {[s.to_dict() for s in shapes]}, backends {backends}",
        flush=True,
    )
    rows = op_timings(shapes, args.methods, backends, reps=args.reps)
    print(format_rows(rows))
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="sparseflow-bench-"))
    scripts = [] if args.no_scripts else run_scripts(folder, out_dir)
    _print_scripts(scripts)
    if args.json:
        write_json(args.json, {"env": env, "op_timing": rows, "scripts": scripts})
        print(f"wrote {args.json}")
    failed = [r for r in scripts if r["status"] == "failed"] + [
        r for r in rows if "error" in r and r["backend"] != "auto"
    ]
    return 1 if failed else 0


def _print_scripts(scripts: list) -> None:
    for r in scripts:
        detail = r.get("reason") or (f"rc {r.get('returncode')}, {r.get('seconds', 0):.0f} s, json {r.get('json')}")
        print(f"benchmarks/{r['script']}: {r['status']} ({detail})")
        if r["status"] == "failed" and r.get("output_tail"):
            print(r["output_tail"], file=sys.stderr)
