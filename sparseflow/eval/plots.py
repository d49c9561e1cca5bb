"""PNG plots for ``sparseflow eval --plots``: density per layer x head, one head's selected-block
map, KL-vs-density curves of a sweep, and the Recall@K diagnostic.

matplotlib is optional (``pip install 'sparseflow[hf]'`` or ``matplotlib``); it is imported on
first use and :func:`require_matplotlib` raises an ImportError that says how to install it, so
the CLI can fail before a long run rather than after it.
"""

from __future__ import annotations

import math
import os
from typing import Dict, List, Optional, Sequence

__all__ = ["require_matplotlib", "density_heatmap", "block_map_plot", "curve_plot", "bar_plot"]

_HINT = "pip install matplotlib (or pip install 'sparseflow[hf]')"


def require_matplotlib():
    """The ``matplotlib.pyplot`` module with the file-only Agg backend; ImportError with the
    install command when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(f"plots need matplotlib, which is not installed: {_HINT}") from exc
    return plt


def _save(fig, path: str) -> str:
    plt = require_matplotlib()
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def density_heatmap(rows: Sequence[Optional[Sequence[float]]], title: str, path: str) -> str:
    """Layers (rows) x query heads (columns), colour = density in [0, 1]; None rows are blank."""
    plt = require_matplotlib()
    width = max((len(r) for r in rows if r), default=1)
    grid = [list(r) + [math.nan] * (width - len(r)) if r else [math.nan] * width for r in rows]
    fig, ax = plt.subplots(figsize=(1.5 + 0.5 * width, 1 + 0.22 * len(grid)))
    im = ax.imshow(grid, aspect="auto", vmin=0.0, vmax=1.0, cmap="viridis", interpolation="nearest")
    ax.set_xlabel("query head")
    ax.set_ylabel("layer")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label="density")
    return _save(fig, path)


def block_map_plot(grid, title: str, path: str) -> str:
    """One head's selection: query block (rows) x original key block (columns), colour = the
    fraction of that key block's keys the query block attends."""
    plt = require_matplotlib()
    data = grid.tolist() if hasattr(grid, "tolist") else grid
    fig, ax = plt.subplots(figsize=(6, 5.5))
    im = ax.imshow(data, aspect="equal", vmin=0.0, vmax=1.0, cmap="magma", interpolation="nearest")
    ax.set_xlabel("key block (original order)")
    ax.set_ylabel("query block")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label="fraction of keys attended")
    return _save(fig, path)


def curve_plot(
    points: List[Dict],
    title: str,
    path: str,
    *,
    x: str = "density",
    y: str = "mean_kl",
    label: str = "value",
    log_y: bool = True,
) -> str:
    """One line per ``series`` of ``points`` (dicts), ``x`` vs ``y``, each point labelled."""
    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    series: Dict[str, List[Dict]] = {}
    for p in points:
        series.setdefault(p["series"], []).append(p)
    for name, pts in series.items():
        pts = sorted(pts, key=lambda p: p[x])
        ax.plot([p[x] for p in pts], [max(p[y], 1e-9) if log_y else p[y] for p in pts], marker="o", label=name)
        for p in pts:
            ax.annotate(
                str(p.get(label)),
                (p[x], max(p[y], 1e-9) if log_y else p[y]),
                fontsize=7,
                textcoords="offset points",
                xytext=(3, 3),
            )
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(x)
    ax.set_ylabel(y)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(fig, path)


def bar_plot(values: Dict[str, Dict[str, float]], title: str, path: str) -> str:
    """Grouped bars: ``values[group][metric]`` (e.g. method -> recall, retained mass)."""
    plt = require_matplotlib()
    groups = list(values)
    metrics = sorted({m for g in groups for m in values[g]})
    fig, ax = plt.subplots(figsize=(1.5 + 1.2 * len(groups), 4))
    width = 0.8 / max(len(metrics), 1)
    for i, m in enumerate(metrics):
        xs = [j + i * width for j in range(len(groups))]
        ax.bar(xs, [values[g].get(m, math.nan) for g in groups], width=width, label=m)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(groups))])
    ax.set_xticklabels(groups, rotation=20)
    ax.set_ylim(0, 1.05)
    ax.set_title(title)
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, path)
