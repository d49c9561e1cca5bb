"""Merge several ``e2e_prefill.py`` runs into one table, one JSON and one PNG.

Device time comes in calls of a few minutes, so the whole grid (every setting, both user paths,
8K-128K) is measured over several runs. Each row's speedup is taken against the eager dense row of
**its own run** at the same length and RoPE (side by side, never across runs); where two runs
measured the same cell, the later run's row is kept.

    cd benchmarks/results && python ../e2e_merge.py e2e_all_h200.json e2e_prefill_h200.json \
        e2e_compile_8k_h200.json e2e_compile_8k_after_mask_fix_h200.json e2e_compile_long_h200.json \
        e2e_paths_*_h200.json e2e_auto_4k_8k_h200.json e2e_auto_16k_128k_yarn_h200.json

(runs with random weights, CUDA graphs or another text are refused: they are not the same table).
Rows with every kernel launched (``--cuda-graphs off``) are left out: the table is the default
path's, which replays an eager sparse call's kernels from a CUDA graph.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

Cell = Tuple[int, str, str, str, str]  # (n, rope, path, setting, backend)
DENSE_PATHS = ("dense", "compile_dense")


def _cell(row: Dict[str, object]) -> Cell:
    return (
        int(row["n"]),
        str(row["rope"]),
        str(row["path"]),
        str(row["setting"] or "-"),
        str(row.get("backend") or "-"),
    )


REQUIRED_ROW_FIELDS = ("n", "rope", "path", "setting", "ms")
# run settings that change what a row's numbers mean: runs that differ in one cannot share a table
SAME_ARGS = ("text", "dtype", "eval_positions", "device")
SAME_ENV = ("gpu", "torch", "triton", "transformers")


def _run_backend(name: str, run: Dict[str, object]) -> Optional[str]:
    """Runs before ``--backend`` took a list recorded it once in args, not per row."""
    b = run.get("args", {}).get("backend")
    if isinstance(b, str):
        return b
    if isinstance(b, list) and len(b) == 1:
        return b[0]
    if any(r["path"] not in DENSE_PATHS and not r.get("backend") for r in run["rows"]):
        raise ValueError(f"{name}: rows without a backend and args.backend={b!r}: which backend ran them is unknown")
    return None


def _check_mergeable(name: str, run: Dict[str, object]) -> None:
    if not isinstance(run.get("rows"), list):
        raise ValueError(f"{name}: no 'rows' list; not a JSON written by e2e_prefill.py")
    if not run.get("env", {}).get("date"):
        raise ValueError(f"{name}: env.date is missing; the merge keeps the later run's row and needs it")
    for r in run["rows"]:
        missing = [f for f in REQUIRED_ROW_FIELDS if f not in r and (f != "ms" or "error" not in r)]
        if missing or ("mean_kl" in r and "top1" not in r):
            raise ValueError(f"{name}: a row lacks {missing or ['top1']}: {r}")
    args = run.get("args", {})
    if args.get("random_init"):
        raise ValueError(f"{name}: a --random-init run has no place in the real checkpoint's table")
    if args.get("compile_mode") not in (None, "default"):
        raise ValueError(f"{name}: compile mode {args['compile_mode']!r}; the merged table is the default mode's")


def _with_own_speedups(name: str, run: Dict[str, object]) -> List[Dict[str, object]]:
    """The run's measured rows, each with ``speedup`` over that run's dense row (a run cut short
    by its time limit never computed them) and the ``source`` file and date."""
    rows = [r for r in run["rows"] if "ms" in r and r.get("cuda_graphs") is not False]
    dense = {(r["n"], r["rope"]): r["ms"] for r in rows if r["path"] == "dense"}
    lone = sorted({(r["n"], r["rope"]) for r in rows} - set(dense))
    if lone:
        raise ValueError(
            f"{name}: no eager dense row at (N, RoPE) {lone}, so its rows there have nothing to compare with"
        )
    date = str(run["env"]["date"])
    backend = _run_backend(name, run)
    out = []
    for r in rows:
        row = {**r, "speedup": dense[(r["n"], r["rope"])] / r["ms"], "source": name, "run_date": date}
        if r["path"] not in DENSE_PATHS and not r.get("backend"):
            row["backend"] = backend
        out.append(row)
    return out


def _the_same(runs: Dict[str, Dict[str, object]], where: str, keys: Sequence[str]) -> Dict[str, object]:
    """The one value each of ``keys`` takes across the runs' ``where`` ("env" or "args")."""
    seen = {k: {json.dumps(run.get(where, {}).get(k)) for run in runs.values()} for k in keys}
    mixed = {k: sorted(v) for k, v in seen.items() if len(v) > 1}
    if mixed:
        raise ValueError(f"runs with different {where} cannot share one table: {mixed}")
    return {k: json.loads(next(iter(v))) for k, v in seen.items()}


def merge_runs(runs: Dict[str, Dict[str, object]]) -> Dict[str, object]:
    """``runs``: file name -> the JSON ``e2e_prefill.py`` wrote. Returns ``{"env", "sources", "rows"}``
    with one row per cell (the latest run's; equal dates go by file name), sorted by length, RoPE,
    path and setting."""
    if not runs:
        raise ValueError("merge_runs needs at least one run")
    for name, run in runs.items():
        _check_mergeable(name, run)
    texts = {str(r.get("text")) for run in runs.values() for r in run["rows"]}
    if len(texts) > 1:
        raise ValueError(f"runs on different texts cannot share one table: {sorted(texts)}")
    env = _the_same(runs, "env", SAME_ENV)
    _the_same(runs, "args", SAME_ARGS)
    latest: Dict[Cell, Dict[str, object]] = {}
    for name, run in sorted(runs.items(), key=lambda kv: (str(kv[1]["env"]["date"]), kv[0])):
        for row in _with_own_speedups(name, run):
            latest[_cell(row)] = row
    dates = sorted(str(r["env"]["date"]) for r in runs.values())
    return {
        "env": {**env, "date": dates[-1], "first_run_date": dates[0]},
        "sources": sorted(runs),
        "rows": [latest[c] for c in sorted(latest)],
    }


def _fmt(row: Optional[Dict[str, object]]) -> str:
    if row is None:
        return "-"
    text = f"{row['ms']:.1f} ms"
    if row.get("speedup"):
        text += f" ({row['speedup']:.2f}x)"
    if "mean_kl" in row:
        text += f", KL {row['mean_kl']:.3f} / {100 * row['top1']:.1f}%"
    return text


def table(merged: Dict[str, object], backend: str = "triton") -> str:
    """Markdown: one line per (N, RoPE, setting), the converted and compiled paths side by side."""
    rows = merged["rows"]
    index = {_cell(r): r for r in rows}
    lines = [
        "| N | RoPE | setting | converted checkpoint (eager) | `sparseflow.compile` |",
        "|---|---|---|---|---|",
    ]
    for n, rope in sorted({(int(r["n"]), str(r["rope"])) for r in rows}):
        dense = index.get((n, rope, "dense", "-", "-"))
        cdense = index.get((n, rope, "compile_dense", "-", "-"))
        lines.append(f"| {n} | {rope} | dense SDPA | {_fmt(dense)} | `torch.compile`: {_fmt(cdense)} |")
        settings = sorted({str(r["setting"]) for r in rows if r["n"] == n and r["rope"] == rope and r["setting"]})
        for s in settings:
            conv = index.get((n, rope, "converted", s, backend))
            comp = index.get((n, rope, "compile", s, backend))
            if conv or comp:
                lines.append(f"| {n} | {rope} | {s} | {_fmt(conv)} | {_fmt(comp)} |")
    return "\n".join(lines)


def matrix(merged: Dict[str, object], backend: str = "triton", plain_up_to: int = 8192) -> str:
    """Markdown, compact: one line per (setting, path), one column per length; each cell is the
    speedup over eager dense and the mean KL. Plain RoPE up to ``plain_up_to``, YaRN beyond."""
    rows = merged["rows"]
    index = {_cell(r): r for r in rows}
    cols = sorted({(int(r["n"]), str(r["rope"])) for r in rows})
    cols = [(n, rope) for n, rope in cols if (rope == "plain") == (n <= plain_up_to)]
    head = "| setting | path | " + " | ".join(f"{n // 1024}K {rope}" for n, rope in cols) + " |"
    lines = [head, "|---|---|" + "---|" * len(cols)]
    keys = sorted({(str(r["setting"] or "-"), str(r["path"])) for r in rows if r["path"] != "dense"})
    for setting, path in keys:
        cells = []
        for n, rope in cols:
            r = index.get((n, rope, path, setting, "-" if path in DENSE_PATHS else backend))
            kl = f", KL {r['mean_kl']:.3f}" if r is not None and "mean_kl" in r else ""
            cells.append(f"{r['speedup']:.2f}x{kl}" if r is not None and r.get("speedup") else "-")
        lines.append(f"| {setting} | {path} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _load(paths: Iterable[str]) -> Dict[str, Dict[str, object]]:
    runs = {}
    for p in paths:
        with open(p) as fh:
            runs[os.path.basename(p)] = json.load(fh)
    return runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="merged JSON to write (its PNG goes beside it)")
    ap.add_argument("runs", nargs="+", help="JSON files written by e2e_prefill.py")
    ap.add_argument("--backend", default="triton", help="the sparse rows' backend the tables show (default triton)")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    runs = _load(p for p in args.runs if os.path.abspath(p) != os.path.abspath(args.out))
    try:
        merged = merge_runs(runs)
    except ValueError as exc:
        print(f"e2e_merge: {exc}", file=sys.stderr)
        return 2
    with open(args.out, "w") as fh:
        json.dump(merged, fh, indent=1)
    print(table(merged, args.backend))
    print()
    print(matrix(merged, args.backend))
    print(f"wrote {args.out} ({len(merged['rows'])} rows from {len(runs)} runs)")
    if not args.no_plot:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from e2e_prefill import plot

        print(f"wrote {plot(args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
