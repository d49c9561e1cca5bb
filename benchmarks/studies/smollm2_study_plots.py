"""Curves and a table from benchmarks/studies/smollm2_study.py's JSON (issue 8).

    python benchmarks/studies/smollm2_study_plots.py benchmarks/results/smollm2_study_pbs_8k_h200.json \\
        benchmarks/results/smollm2_study_calib_8k_h200.json benchmarks/results/smollm2_study_pbs_2k4k_h200.json \\
        --out benchmarks/results

Writes one KL-vs-density PNG per (text, length) -- ``smollm2_study_<text>_<n>.png`` -- and prints,
per text and length, each variant's mean KL interpolated (log-linearly between measured
thresholds) at fixed densities, so curves measured at different densities compare at equal cost.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))  # the repository root


def kl_at(points, density, floor=1e-12):
    """The value at ``density`` of (density, value) ``points`` (a KL curve, or missed mass) by
    log-linear interpolation, values floored at ``floor`` for the log; None outside the range."""
    pts = sorted(points)
    for (d0, k0), (d1, k1) in zip(pts, pts[1:]):
        if d0 <= density <= d1:
            w = 0.0 if d1 == d0 else (density - d0) / (d1 - d0)
            return math.exp((1 - w) * math.log(max(k0, floor)) + w * math.log(max(k1, floor)))
    return None


def curves(paths):
    out = defaultdict(list)
    for p in paths:
        with open(p) as fh:
            for r in json.load(fh)["rows"]:
                out[(r["text"], r["tokens"], r["variant"])].append((r["density"], r["mean_kl"]))
    return out


def grid_for(n):
    return {2048: [0.6, 0.65, 0.7, 0.75, 0.8, 0.85], 4096: [0.45, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75]}.get(
        n, [0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6]
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="+")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    from sparseflow.eval.plots import require_matplotlib

    plt = require_matplotlib()
    cur = curves(args.json)
    keys = sorted({(t, n) for t, n, _ in cur})
    for text, n in keys:
        grid = grid_for(n)
        print(f"\n{text}, {n} tokens: mean KL at density " + " ".join(f"{d:>7}" for d in grid))
        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        ax.set_prop_cycle(color=[plt.get_cmap("tab20")(i) for i in range(20)])
        for (t, nn, variant), pts in sorted(cur.items()):
            if (t, nn) != (text, n):
                continue
            vals = [kl_at(pts, d) for d in grid]
            print(f"  {variant:24s}" + " ".join(f"{v:7.4f}" if v is not None else f"{'-':>7}" for v in vals))
            pts = sorted(pts)
            style = "--" if "no_permute" in variant else "-"
            ax.plot([d for d, _ in pts], [k for _, k in pts], style, marker="o", ms=3, label=variant)
        ax.set_yscale("log")
        ax.set_xlabel("density (computed / causally visible blocks)")
        ax.set_ylabel("mean KL to dense (nats, last positions)")
        ax.set_title(f"SmolLM2-135M PBS, {text}, {n} tokens (H200, reference backend)")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        path = os.path.join(args.out, f"smollm2_study_{text}_{n}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        print(f"  wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
