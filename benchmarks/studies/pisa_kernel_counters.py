"""Nsight Compute's counters for one PISA layer's kernels, with cuDNN SDPA's beside them: time,
registers, occupancy and what limits it, waves, SM and memory throughput, issue-slot use, and
the reasons warps stall most; and for the kernels named by ``--source``, the SASS instructions
warps stall at most (sampled, with their share). CUDA events give the kernels' times
(pisa_layer_kernels.py); these counters say why they take that long.

    python benchmarks/studies/pisa_kernel_counters.py --real 15 --json benchmarks/results/pisa_kernel_counters_8k_h200.json

SmolLM2's attention shape (B 1, Hq 9, Hkv 3, D 64), C 64, K 8, bf16, causal, PISA's defaults.
The script runs itself under ``ncu`` (``--clock-control none``: the clocks stay as the device
has them), profiling only one call of the op and one of SDPA after a warm-up, and writes the
report (``--rep``) beside the table. It needs a machine whose runtime lets ncu read the
counters; where ncu cannot, it prints ncu's message and exits 2.
"""

import argparse
import csv
import io
import os
import shutil
import subprocess
import sys
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, ".."))

SECTIONS = (
    "SpeedOfLight",
    "Occupancy",
    "LaunchStats",
    "WarpStateStats",
    "SchedulerStats",
    "MemoryWorkloadAnalysis",
    "SourceCounters",
)
STALL_PREFIX = "smsp__average_warps_issue_stalled_"
STALL_SUFFIX = "_per_issue_active.ratio"
# the table's columns: (heading, raw metric)
COLUMNS = (
    ("us", "gpu__time_duration.sum"),
    ("regs", "launch__registers_per_thread"),
    ("occ theor %", "sm__maximum_warps_per_active_cycle_pct"),
    ("occ achieved %", "sm__warps_active.avg.pct_of_peak_sustained_active"),
    ("waves", "launch__waves_per_multiprocessor"),
    ("SM %", "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("memory %", "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"),
    ("issue %", "smsp__issue_active.avg.pct_of_peak_sustained_active"),
)
# ncu's base units (--print-units base) to the table's: nanoseconds to microseconds
TO_TABLE_UNITS = {"gpu__time_duration.sum": 1e-3}
LIMITS = {
    "registers": "launch__occupancy_limit_registers",
    "shared": "launch__occupancy_limit_shared_mem",
    "warps": "launch__occupancy_limit_warps",
    "blocks": "launch__occupancy_limit_blocks",
}


def number(text: str) -> Optional[float]:
    """A CSV cell as a float (ncu writes thousands separators), None for a blank or a word."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def parse_raw_csv(text: str) -> List[Dict[str, object]]:
    """``ncu --import R --csv --page raw --print-units base`` -> one dict a kernel launch: its
    ``name``, ``grid`` and ``block``, its metrics as floats, its ``stalls`` (reason -> warps
    stalled per issued instruction, largest first) and ``limit`` (what caps its blocks per SM)."""
    rows = [r for r in csv.reader(io.StringIO(text)) if r]
    start = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
    if start is None:
        raise ValueError("no 'Kernel Name' header in ncu's CSV")
    head = rows[start]
    body = rows[start + 1 :]
    if body and body[0][head.index("Kernel Name")] == "":  # the units row
        body = body[1:]
    out = []
    for r in body:
        cells = dict(zip(head, r))
        metrics = {key: number(val) for key, val in cells.items()}
        stalls = {
            key[len(STALL_PREFIX) : -len(STALL_SUFFIX)]: val
            for key, val in metrics.items()
            if key.startswith(STALL_PREFIX) and key.endswith(STALL_SUFFIX) and val is not None
        }
        limits = {name: metrics.get(metric) for name, metric in LIMITS.items() if metrics.get(metric) is not None}
        out.append(
            {
                "name": cells["Kernel Name"],
                "grid": cells.get("Grid Size", ""),
                "block": cells.get("Block Size", ""),
                "metrics": {key: val for key, val in metrics.items() if val is not None},
                "stalls": dict(sorted(stalls.items(), key=lambda kv: -kv[1])),
                "limit": min(limits, key=limits.get) if limits else "",
                "blocks_per_sm": min(limits.values()) if limits else None,
            }
        )
    return out


def table(kernels: List[Dict[str, object]]) -> str:
    lines = [
        "kernel".ljust(34)
        + "".join(h.rjust(len(h) + 2) for h, _ in COLUMNS)
        + "  blocks/SM (limit)  top stalls (warps per issue)"
    ]
    for k in kernels:
        m = k["metrics"]
        cells = ""
        for h, key in COLUMNS:
            val = m.get(key)
            cells += ("-" if val is None else f"{val * TO_TABLE_UNITS.get(key, 1):.1f}").rjust(len(h) + 2)
        stalls = ", ".join(f"{r} {v:.2f}" for r, v in list(k["stalls"].items())[:4])
        per_sm = "-" if k["blocks_per_sm"] is None else f"{k['blocks_per_sm']:.0f} ({k['limit']})"
        lines.append(f"{k['name'][:34]:34s}{cells}  {per_sm:17s}  {stalls}")
    return "\n".join(lines)


def hot_sass_lines(text: str, most: int = 12) -> List[Dict[str, object]]:
    """``ncu --import R --page source --csv --print-source sass`` of one kernel -> its ``most``
    instructions with the most warp-stall samples: ``address``, ``source`` (the SASS) and
    ``samples``, largest first (empty when the page has no stall-sampling column)."""
    rows = [r for r in csv.reader(io.StringIO(text)) if r]
    start = next((i for i, r in enumerate(rows) if "Source" in r), None)
    if start is None:
        return []
    head = rows[start]
    sampled = next((c for c in head if c.startswith("Warp Stall Sampling (All")), None)
    if sampled is None:
        return []
    address = next((c for c in head if "Address" in c), None)
    lines = []
    for r in rows[start + 1 :]:
        cells = dict(zip(head, r))
        samples = number(cells.get(sampled, ""))
        if samples:
            lines.append({"address": cells.get(address, ""), "source": cells["Source"].strip(), "samples": samples})
    return sorted(lines, key=lambda line: -line["samples"])[:most]


def inner(args) -> None:
    """The profiled process: the op and SDPA warmed up, then one call of each between
    cudaProfilerStart and Stop (ncu runs with --profile-from-start off)."""
    import torch

    from common import qkv, sdpa_dense
    from sparseflow.methods.pisa.triton_impl import pisa_attention

    if args.real is not None:
        from pisa_layer_kernels import real_layer_qkv

        q, k, v = real_layer_qkv(args.n, [args.real])[args.real]
    else:
        q, k, v = qkv(1, 9, 3, args.n, 64, torch.bfloat16, structured=True)
    sdpa, _ = sdpa_dense(q, k, v, "cudnn")
    for _ in range(3):
        pisa_attention(q, k, v)
        sdpa()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    pisa_attention(q, k, v)
    sdpa()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def outer(args) -> int:
    from common import env_info, write_result

    ncu = shutil.which("ncu")
    if ncu is None:
        print("ncu (Nsight Compute) is not on the PATH")
        return 2
    rep = os.path.splitext(args.rep)[0]
    profile = [ncu, "--clock-control", "none", "--profile-from-start", "off", "-f", "-o", rep]
    for s in SECTIONS:
        profile += ["--section", s]
    profile += [sys.executable, os.path.abspath(__file__), "--inner", "--n", str(args.n)]
    if args.real is not None:
        profile += ["--real", str(args.real)]
    run = subprocess.run(profile, capture_output=True, text=True)
    if run.returncode != 0 or not os.path.exists(rep + ".ncu-rep"):
        print(f"ncu could not profile (exit {run.returncode}):\n{(run.stdout + run.stderr)[-3000:]}")
        return 2
    export = [ncu, "--import", rep + ".ncu-rep", "--csv", "--page", "raw", "--print-units", "base"]
    raw = subprocess.run(export, capture_output=True, text=True, check=True).stdout
    kernels = parse_raw_csv(raw)
    label = f"SmolLM2 layer {args.real}" if args.real is not None else "structured random"
    print(f"N={args.n} {label}: one PISA op (backend='triton', defaults) and one cuDNN SDPA, ncu counters")
    print(table(kernels))
    hot = {}
    for name in [n.strip() for n in args.source.split(",") if n.strip()]:
        page = [ncu, "--import", rep + ".ncu-rep", "--csv", "--page", "source", "--print-source", "sass"]
        page += ["--kernel-name", name]
        text = subprocess.run(page, capture_output=True, text=True).stdout
        with open(f"{rep}_{name}_sass.csv", "w") as f:
            f.write(text)
        hot[name] = hot_sass_lines(text)
        total = sum(line["samples"] for line in hot[name]) or 1
        print(f"{name}: the instructions warps stall at most (samples, share of the top {len(hot[name])})")
        for line in hot[name]:
            print(f"  {line['samples']:8.0f} {line['samples'] / total:6.1%}  {line['address']}  {line['source'][:90]}")
    if args.json:
        write_result(
            args.json, env_info(), args, inputs=label, kernels=kernels, hot_sass=hot, ncu_report=rep + ".ncu-rep"
        )
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--real", type=int, default=None, help="a SmolLM2 layer whose real q/k/v to use (default: random)")
    ap.add_argument("--json")
    ap.add_argument("--rep", default="pisa_kernel_counters.ncu-rep", help="where ncu's report goes")
    ap.add_argument(
        "--source",
        default="_node_scan_kernel,_pisa_select_kernel,_leaf_pairs_kernel,_fwd_kernel",
        help="kernels whose SASS lines with the most stall samples to list, comma list ('' for none)",
    )
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.inner:
        inner(args)
        return 0
    return outer(args)


if __name__ == "__main__":
    sys.exit(main())
