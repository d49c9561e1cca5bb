"""benchmarks/frontier.py: the settings grid, the frontier marking and the table (the GPU run itself
is a benchmark)."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

import frontier  # noqa: E402


def test_the_grid_is_every_estimate_at_every_threshold_then_the_extras():
    names = frontier.grid(["mean", "antidiagonal"], [0.9, 0.95], ["smollm2:pbs", "pbs@scoring=mean+threshold=0.9"])
    assert names == [
        "pbs@scoring=mean+threshold=0.9",
        "pbs@scoring=mean+threshold=0.95",
        "pbs@scoring=antidiagonal+threshold=0.9",
        "pbs@scoring=antidiagonal+threshold=0.95",
        "smollm2:pbs",
    ]
    with pytest.raises(ValueError):
        frontier.grid(["mean"], [0.9], ["nosuchmethod"])


def _row(path, setting, speedup, kl, n=32768):
    return {
        "n": n,
        "rope": "yarn",
        "path": path,
        "setting": setting,
        "ms": 10 / speedup,
        "speedup": speedup,
        "mean_kl": kl,
    }


def test_the_frontier_keeps_what_nothing_beats():
    rows = [
        _row("dense", None, 1.0, 0.0),
        _row("compile", "a", 2.0, 0.010),
        _row("compile", "b", 1.5, 0.020),  # slower and worse than a
        _row("compile", "c", 3.0, 0.050),  # faster, worse: on the frontier
        _row("compile", "d", 2.0, 0.010),  # ties a: both kept
        _row("converted", "b", 1.5, 0.020),  # another path: its own frontier
        _row("compile", "b", 1.0, 0.030, n=8192),  # another length
    ]
    frontier.mark_frontier(rows)
    assert "frontier" not in rows[0]
    assert [r["frontier"] for r in rows[1:]] == [True, False, True, True, True, True]


def test_the_table_lists_baselines_first_then_settings_by_kl():
    rows = frontier.mark_frontier(
        [
            _row("compile", "c", 3.0, 0.050),
            _row("compile", "a", 2.0, 0.010),
            _row("compile", "b", 1.5, 0.020),
            _row("compile_dense", None, 0.8, 0.001),
            _row("dense", None, 1.0, 0.0),
            {"n": 32768, "rope": "yarn", "path": "converted", "setting": "x", "error": "boom"},
        ]
    )
    lines = frontier.table(rows).splitlines()[2:]
    assert [line.split(" | ")[2:4] for line in lines] == [
        ["dense", "-"],
        ["compile_dense", "-"],
        ["compile", "a"],
        ["compile", "b"],
        ["compile", "c"],
        ["converted", "x"],
    ]
    assert lines[2].endswith("| * |") and lines[3].endswith("|  |") and "error: boom" in lines[5]


def test_the_arguments_become_one_e2e_run():
    args, run = frontier.parse_args(["--ns", "8192", "--estimates", "mean", "--thresholds", "0.9", "--extra", ""])
    assert run.ns == [8192] and run.settings == ["pbs@scoring=mean+threshold=0.9"]
    assert run.paths == ["compile", "converted", "compile_dense"] and run.compile_ns == [8192]
    for bad in (["--thresholds", "1.5"], ["--estimates", "exact"], ["--paths", "dense"]):
        with pytest.raises(SystemExit):
            frontier.parse_args(bad)
    _, run = frontier.parse_args(["--paths", "converted"])
    assert run.paths == ["converted"]


def test_a_run_cut_short_keeps_the_rows_it_measured(tmp_path, monkeypatch):
    def two_rows_then_a_crash(model, tok, n, rope, run, on_row):
        on_row(_row("dense", None, 1.0, 0.0, n=n))
        on_row(_row("converted", "smollm2:pbs", 1.3, 0.02, n=n))
        raise RuntimeError("out of time")

    monkeypatch.setattr(frontier.e2e, "run_length", two_rows_then_a_crash)
    path = tmp_path / "frontier.json"
    argv = ["--ns", "256", "--paths", "converted", "--random-init", "--device", "cpu", "--json", str(path)]
    with pytest.raises(RuntimeError, match="out of time"):
        frontier.main(argv)
    rows = json.loads(path.read_text())["rows"]
    assert [(r["path"], r.get("frontier")) for r in rows] == [("dense", None), ("converted", True)]
