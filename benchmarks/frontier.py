"""Speed against fidelity on a real checkpoint: every block estimate and threshold tried, both user
paths, the dense baselines of the same run, and which settings are on the frontier.

    python benchmarks/frontier.py --ns 32768,131072 --json benchmarks/results/frontier_smollm2_h100.json
    python benchmarks/frontier.py --plot benchmarks/results/frontier_smollm2_h100.json   # PNG from a JSON
    python benchmarks/frontier.py --markdown A.json,B.json   # README's table (tests/test_readme_data.py)

The grid is PBS with each ``--estimates`` scoring (``mean`` pooled blocks, ``moments`` (their
means plus the pairs' spread), ``sampled_rows``, ``antidiagonal``) at each ``--thresholds`` mass, plus any ``--extra`` settings (a shipped recipe's
``smollm2:pbs``, a calibrated ``plan.json:pbs``); each runs through ``sparseflow.compile`` and
through the converted path (transformers' attention interface, what ``sparseflow convert``'s folder
runs). The rows are ``e2e_prefill``'s (SmolLM2-135M, real text repeated to N, YaRN beyond its 8192
trained positions; eager dense SDPA gives the reference time and logits, ``torch.compile`` of the
dense model the other baseline), measured in one run, so every ratio is against its own run's dense.

A setting is on the frontier of its (N, path) when no other setting of that length and path is both
faster and lower in KL. The table lists, per length and path, the baselines and then every setting
by KL, marking the frontier; the JSON holds the rows with GPU, versions and date (``frontier`` per
row), and ``--plot`` draws KL against speedup per length.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Dict, Iterable, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import e2e_prefill as e2e  # noqa: E402

ESTIMATES = ("mean", "moments", "sampled_rows", "antidiagonal")
BASELINES = ("dense", "compile_dense")


def grid(estimates: Iterable[str], thresholds: Iterable[float], extra: Iterable[str] = ()) -> List[str]:
    """The setting names (``e2e_prefill``'s form) of every estimate at every threshold, then ``extra``."""
    names = [f"pbs@scoring={e}+threshold={t:g}" for e in estimates for t in thresholds]
    names += [s for s in extra if s not in names]
    for name in names:
        e2e.plan_parts(name)  # a bad estimate, threshold or recipe fails here, before the model loads
    return names


def mark_frontier(rows: List[Dict[str, object]]) -> List[Dict[str, object]]:
    """Set ``frontier`` on each measured setting row: True when no other row of its (n, rope, path)
    is at least as fast and as faithful and strictly better in one of the two (ties kept)."""
    measured = [r for r in rows if r.get("path") not in BASELINES and "speedup" in r and "mean_kl" in r]
    for r in measured:
        peers = [p for p in measured if (p["n"], p["rope"], p["path"]) == (r["n"], r["rope"], r["path"])]
        r["frontier"] = not any(_dominates(p, r) for p in peers if p is not r)
    return rows


def _dominates(a: Dict[str, object], b: Dict[str, object]) -> bool:
    no_worse = a["speedup"] >= b["speedup"] and a["mean_kl"] <= b["mean_kl"]
    return no_worse and (a["speedup"] > b["speedup"] or a["mean_kl"] < b["mean_kl"])


def table(rows: List[Dict[str, object]]) -> str:
    """Per (N, rope, path): the baselines, then the settings by KL; ``*`` marks the frontier."""
    lines = [
        "| N | rope | path | setting | ms | speedup | KL | top-1 | density | frontier |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n, rope in sorted({(r["n"], r["rope"]) for r in rows}):
        at = [r for r in rows if (r["n"], r["rope"]) == (n, rope)]
        paths = [p for p in BASELINES if any(r["path"] == p for r in at)]
        paths += sorted({r["path"] for r in at} - set(BASELINES))
        for path in paths:
            group = [r for r in at if r["path"] == path]
            for r in sorted(group, key=lambda r: (r.get("mean_kl", float("inf")), -r.get("speedup", 0.0))):
                lines.append(_table_row(r))
    return "\n".join(lines)


def _table_row(r: Dict[str, object]) -> str:
    head = f"| {r['n']} | {r['rope']} | {r['path']} | {r.get('setting') or '-'} |"
    if "ms" not in r:
        return f"{head} error: {str(r.get('error'))[:60]} ||||||"

    def num(key, fmt):
        return format(r[key], fmt) if key in r else "-"

    mark = {True: "*", False: ""}.get(r.get("frontier"), "")
    return (
        f"{head} {r['ms']:.2f} | {num('speedup', '.2f')}x | {num('mean_kl', '.4f')} | {num('top1', '.3f')} | "
        f"{num('density', '.3f')} | {mark} |"
    )


README_COLUMNS = "| tokens | path | setting | ms | speedup | KL | top-1 | density |\n|---|---|---|---|---|---|---|---|"


def readme_table(json_paths: Iterable[str]) -> str:
    """README's table from frontier JSONs: per length, the baselines, then each path's frontier
    settings by KL; a caption names the card, versions, dates and files (``--markdown``)."""
    lines, sources, versions = [README_COLUMNS], [], set()
    for json_path in json_paths:
        with open(json_path) as fh:
            data = json.load(fh)
        env = data.get("env", {})
        sources.append(f"{os.path.basename(json_path)} ({env.get('gpu')}, {str(env.get('date', ''))[:10]})")
        versions.add(f"torch {env.get('torch')}, triton {env.get('triton')}")
        rows = mark_frontier([r for r in data["rows"] if "ms" in r])
        for n in sorted({r["n"] for r in rows}):
            at = [r for r in rows if r["n"] == n]
            shown = [r for p in BASELINES for r in at if r["path"] == p]
            for path in ("compile", "converted"):
                shown += sorted((r for r in at if r["path"] == path and r.get("frontier")), key=lambda r: r["mean_kl"])
            lines += [_readme_row(r) for r in shown]
    lines += ["", f"Data: {'; '.join(sources)}; {', '.join(sorted(versions))}."]
    return "\n".join(lines)


def _readme_row(r: Dict[str, object]) -> str:
    label = {"dense": "eager dense SDPA", "compile_dense": "`torch.compile`, dense"}.get(r["path"], r["path"])
    tokens = f"{r['n'] // 1024}K" if r["n"] % 1024 == 0 else str(r["n"])
    return (
        f"| {tokens} | {label} | {r.get('setting') or '-'} | {r['ms']:.1f} | {r['speedup']:.2f}x | "
        f"{r['mean_kl']:.4f} | {r['top1'] * 100:.1f}% | {r.get('density', 1.0):.2f} |"
    )


def plot(json_path: str, png_path: Optional[str] = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as fh:
        data = json.load(fh)
    rows = [r for r in data["rows"] if "speedup" in r and "mean_kl" in r and r["path"] not in BASELINES]
    lengths = sorted({(r["n"], r["rope"]) for r in rows})
    fig, axes = plt.subplots(1, max(1, len(lengths)), figsize=(6 * max(1, len(lengths)), 4.8), squeeze=False)
    for ax, (n, rope) in zip(axes[0], lengths):
        for path, marker in (("compile", "o"), ("converted", "s")):
            pts = [r for r in rows if (r["n"], r["rope"], r["path"]) == (n, rope, path)]
            ax.scatter([r["speedup"] for r in pts], [max(r["mean_kl"], 1e-5) for r in pts], marker=marker, label=path)
            front = sorted((r["speedup"], max(r["mean_kl"], 1e-5)) for r in pts if r.get("frontier"))
            ax.plot([p[0] for p in front], [p[1] for p in front], lw=1)
        ax.axvline(1.0, color="gray", lw=0.8)
        ax.set(yscale="log", xlabel="speedup over eager dense SDPA", ylabel="mean KL vs dense", title=f"N={n} ({rope})")
        ax.legend(fontsize=7)
    env = data.get("env", {})
    fig.suptitle(
        f"{env.get('gpu', '?')}, torch {env.get('torch')}, triton {env.get('triton')}, {env.get('date', '')[:10]}"
    )
    fig.tight_layout()
    png_path = png_path or os.path.splitext(json_path)[0] + ".png"
    fig.savefig(png_path, dpi=110)
    return png_path


def _floats(s: str) -> List[float]:
    values = [float(x) for x in s.split(",") if x.strip()]
    if not values or any(not 0.0 < v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"--thresholds must be a comma list of masses in (0, 1], got {s!r}")
    return values


def _estimates(s: str) -> List[str]:
    names = [x.strip() for x in s.split(",") if x.strip()]
    if not names or set(names) - set(ESTIMATES):
        raise argparse.ArgumentTypeError(f"--estimates must be a comma list of {', '.join(ESTIMATES)}, got {s!r}")
    return names


def parse_args(argv=None):
    """``(frontier's arguments, e2e_prefill's arguments for the same run)``."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ns", default="32768,131072", help="comma list of lengths")
    ap.add_argument("--estimates", type=_estimates, default=list(ESTIMATES))
    ap.add_argument("--thresholds", type=_floats, default=[0.9, 0.95, 0.98, 0.99])
    ap.add_argument("--extra", default="smollm2:pbs", help="comma list of more settings (recipes, plan files)")
    ap.add_argument("--paths", default="compile,converted", help="comma list of compile, converted")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--eval-positions", type=int, default=512)
    ap.add_argument(
        "--random-init", action="store_true", help="SmolLM2's architecture with random weights (a smoke run)"
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--json")
    ap.add_argument("--plot", metavar="JSON", help="only draw the PNG of an existing JSON")
    ap.add_argument("--markdown", metavar="JSON,...", help="only print README's table of existing JSONs")
    args = ap.parse_args(argv)
    if args.plot or args.markdown:
        return args, None
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if not paths or set(paths) - {"compile", "converted"}:
        ap.error(f"--paths takes compile, converted; got {args.paths!r}")
    settings = ",".join(grid(args.estimates, args.thresholds, [s for s in args.extra.split(",") if s.strip()]))
    baselines = ["compile_dense"] if "compile" in paths else []  # the compile path's own dense baseline
    e2e_argv = ["--ns", args.ns, "--settings", settings, "--paths", ",".join(paths + baselines)]
    e2e_argv += ["--reps", str(args.reps), "--eval-positions", str(args.eval_positions), "--device", args.device]
    e2e_argv += ["--backend", args.backend] + (["--random-init"] if args.random_init else [])
    return args, e2e.parse_args(e2e_argv)


def main(argv=None) -> int:
    args, run = parse_args(argv)
    if args.plot:
        print(plot(args.plot))
        return 0
    if args.markdown:
        print(readme_table([p for p in args.markdown.split(",") if p.strip()]))
        return 0
    import sparseflow.hf  # noqa: F401  (registers the attention function used by the converted rows)
    from sparseflow.checkpoints import load_smollm2

    t0 = time.perf_counter()
    dtype = getattr(torch, run.dtype)
    model, tok = e2e.random_smollm2(dtype) if run.random_init else load_smollm2(dtype=dtype)
    model.to(run.device)
    print(f"loaded SmolLM2 in {time.perf_counter() - t0:.1f}s on {run.device}", flush=True)
    rows: List[Dict[str, object]] = []
    out = {"env": e2e.env_info(), "args": vars(args), "rows": rows}

    def write() -> None:
        mark_frontier(rows)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(out, fh, indent=1, default=str)

    def keep(row: Dict[str, object]) -> None:  # written as each row lands: a run cut short keeps its rows
        rows.append(row)
        write()

    for n in run.ns:
        rope = "yarn" if n > e2e.TRAINED_POSITIONS else "plain"
        e2e.run_length(model, tok, n, rope, run, on_row=keep)
        write()  # with the speedups, known once the length's rows are in
    print(table(rows))
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
