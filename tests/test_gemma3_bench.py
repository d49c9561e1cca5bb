"""benchmarks/gemma3_e2e.py on Gemma 3's architecture with random weights, small: every row it
runs is there, the exact rows match dense, and the speedups are against the fastest baseline."""

import json
import os
import sys

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

import gemma3_e2e  # noqa: E402


def test_random_gemma3_rows(tmp_path):
    out = tmp_path / "g.json"
    argv = ["--random", "--vocab", "256", "--layers", "6", "--ns", "700", "--eval-positions", "64", "--reps", "1"]
    argv += ["--warmup", "1", "--rows", "sdpa,windows,pbs", "--dtype", "float32", "--json", str(out), "--rounds", "3"]
    assert gemma3_e2e.main(argv) == 0
    data = json.loads(out.read_text())
    rows = {r["row"]: r for r in data["rows"]}
    assert set(rows) == {"sdpa", "windows", "pbs"} and "date" in data["env"]
    assert rows["sdpa"]["mean_kl"] < 1e-9 and rows["sdpa"]["speedup_vs_fastest_dense"] == 1.0
    # the sliding layers' windows are exact, and the global layers dense: the same model
    assert rows["windows"]["mean_kl"] < 1e-6 and rows["windows"]["sparse_calls"] == 5
    assert rows["pbs"]["op_calls"] == 6  # five sliding layers and one global
    # three interleaved rounds: each row's time is the median of its rounds; the fastest dense
    # baseline of a round (sdpa, the only one) is 1.0 in that round
    for r in rows.values():
        assert len(r["round_ms"]) == 3 and r["ms"] == sorted(r["round_ms"])[1]
    assert rows["sdpa"]["round_speedups"] == [1.0, 1.0, 1.0]


def test_rows_and_lengths_are_checked():
    with pytest.raises(SystemExit):
        gemma3_e2e.parse_args(["--random", "--rows", "sdpa,nope"])
    with pytest.raises(SystemExit):
        gemma3_e2e.parse_args(["--random", "--ns", "300"])  # not past --eval-positions
    with pytest.raises(SystemExit):
        gemma3_e2e.parse_args(["--random", "--rounds", "0"])
