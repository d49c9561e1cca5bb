"""benchmarks/studies/pisa_kernel_counters.py reads ncu's raw CSV: its numbers (with thousands
separators), each launch's stall reasons ranked, and what caps its blocks per SM."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks", "studies"))

import pisa_kernel_counters as counters  # noqa: E402

STALL = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
HEAD = [
    "ID",
    "Kernel Name",
    "Block Size",
    "Grid Size",
    "gpu__time_duration.sum",
    "launch__occupancy_limit_registers",
    "launch__occupancy_limit_shared_mem",
    "launch__occupancy_limit_warps",
    "launch__occupancy_limit_blocks",
    STALL.format("long_scoreboard"),
    STALL.format("barrier"),
    STALL.format("wait"),
]
UNITS = ["", "", "", "", "nsecond", "block", "block", "block", "block", "", "", ""]
ROWS = [
    ["0", "_node_scan_kernel", "(256, 1, 1)", "(196, 3, 1)", "48,312", "2", "8", "8", "32", "1.5", "4.25", "0.5"],
    ["1", "_pisa_select_kernel", "(32, 1, 1)", "(8192, 3, 1)", "49,001.5", "32", "32", "64", "32", "9.75", "0", "n/a"],
]


SASS = [
    ["# Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)"],
    ["7f00", "LDG.E R4, desc[UR4][R2.64]", "1,210", "1,100"],
    ["7f10", "HMMA.16816.F32.BF16 R8, R12, R16, R8", "3,400", "3,000"],
    ["7f20", "EXIT", "", ""],
]


def _csv(rows) -> str:
    return "\n".join(",".join(f'"{c}"' for c in r) for r in rows) + "\n"


def test_raw_csv_gives_each_launch_its_numbers_stalls_and_occupancy_limit():
    got = counters.parse_raw_csv("==PROF== a line ncu prints first\n" + _csv([HEAD, UNITS] + ROWS))
    assert [k["name"] for k in got] == ["_node_scan_kernel", "_pisa_select_kernel"]
    scan, walk = got
    assert scan["metrics"]["gpu__time_duration.sum"] == 48312.0
    assert walk["metrics"]["gpu__time_duration.sum"] == 49001.5
    assert list(scan["stalls"]) == ["barrier", "long_scoreboard", "wait"]
    assert walk["stalls"] == {"long_scoreboard": 9.75, "barrier": 0.0}  # a word is no number
    assert (scan["limit"], scan["blocks_per_sm"]) == ("registers", 2.0)
    assert scan["grid"] == "(196, 3, 1)"
    text = counters.table(got)
    assert "48.3" in text and "2 (registers)" in text and "barrier 4.25" in text


def test_raw_csv_without_a_kernel_header_is_refused():
    with pytest.raises(ValueError, match="Kernel Name"):
        counters.parse_raw_csv("==ERROR== the profiler could not start\n")


def test_profiles_itself_under_ncu_then_reads_the_report(tmp_path, monkeypatch, capsys):
    """The outer process: ncu with the clocks left alone, profiling from cudaProfilerStart, over
    this script's inner mode; then the report's raw page parsed into the table and the JSON."""
    log = tmp_path / "calls"
    fake = tmp_path / "ncu"
    fake.write_text(
        "#!/bin/sh\n"
        f'echo "$@" >> {log}\n'
        'case "$*" in *"--page source"*) cat ' + str(tmp_path / "sass.csv") + "; exit 0;; esac\n"
        'if [ "$1" = "--import" ]; then cat ' + str(tmp_path / "raw.csv") + "; exit 0; fi\n"
        'while [ "$1" != "-o" ]; do shift; done; touch "$2.ncu-rep"\n'
    )
    fake.chmod(0o755)
    (tmp_path / "raw.csv").write_text(_csv([HEAD, UNITS] + ROWS))
    (tmp_path / "sass.csv").write_text(_csv(SASS))
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    rep = tmp_path / "layer15"
    argv = ["--real", "15", "--n", "4096", "--rep", str(rep), "--json", str(tmp_path / "out.json")]
    assert counters.main(argv + ["--source", "_node_scan_kernel"]) == 0
    profile, export, source = log.read_text().splitlines()
    assert "--clock-control none --profile-from-start off" in profile
    assert profile.endswith("--inner --n 4096 --real 15") and "--json" not in profile
    assert export.startswith(f"--import {rep}.ncu-rep --csv --page raw")
    assert "--page source --print-source sass --kernel-name _node_scan_kernel" in source
    out = capsys.readouterr().out
    assert "_pisa_select_kernel" in out and "HMMA" in out
    assert '"_node_scan_kernel"' in (tmp_path / "out.json").read_text()
    assert (tmp_path / "layer15__node_scan_kernel_sass.csv").read_text() == _csv(SASS)


def test_hot_sass_lines_rank_instructions_by_stall_samples():
    got = counters.hot_sass_lines("a line before the table\n" + _csv(SASS), most=5)
    assert [line["address"] for line in got] == ["7f10", "7f00"]  # the EXIT line has no samples
    assert got[0]["samples"] == 3400.0 and got[0]["source"].startswith("HMMA")
    assert counters.hot_sass_lines(_csv([["# Address", "Source"], ["7f00", "EXIT"]])) == []
