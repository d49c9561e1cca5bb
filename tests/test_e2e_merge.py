"""benchmarks/e2e_merge.py: several end-to-end runs as one table, each row against its own run's dense."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

import e2e_merge  # noqa: E402

ENV = {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "triton": "3.6.0", "transformers": "5.17.0"}


def _run(date, rows, **args):
    return {"env": {**ENV, "date": date}, "args": {"backend": ["triton"], **args}, "rows": rows}


def _row(n, path, setting, ms, backend=None, **extra):
    return {
        "n": n,
        "rope": "yarn",
        "text": "pydoc_topics",
        "path": path,
        "setting": setting,
        "ms": ms,
        "backend": backend,
        **extra,
    }


def test_speedups_use_each_runs_own_dense_and_the_later_run_wins_a_cell():
    early = _run(
        "2026-12-01T08:00",
        [
            _row(32768, "dense", None, 120.0),
            _row(32768, "converted", "pbs", 60.0, "triton", mean_kl=0.09, top1=0.83),
            _row(32768, "compile", "pbs", 80.0, "triton"),
        ],
    )
    late = _run(
        "2026-12-01T18:00",
        [  # cut short: no speedup fields, a slower dense this time
            _row(32768, "dense", None, 130.0),
            _row(32768, "compile", "pbs", 52.0, "triton", mean_kl=0.088, top1=0.84),
        ],
    )
    merged = e2e_merge.merge_runs({"late.json": late, "early.json": early})
    cells = {(r["path"], r["setting"]): r for r in merged["rows"]}
    assert cells[("converted", "pbs")]["speedup"] == pytest.approx(2.0)
    assert cells[("compile", "pbs")]["speedup"] == pytest.approx(2.5)
    assert cells[("compile", "pbs")]["source"] == "late.json"
    assert cells[("dense", None)]["ms"] == 130.0  # the later dense, which the later compile row used
    assert merged["env"]["date"] == "2026-12-01T18:00" and merged["sources"] == ["early.json", "late.json"]
    md = e2e_merge.table(merged)
    assert "| 32768 | yarn | pbs | 60.0 ms (2.00x), KL 0.090 / 83.0% | 52.0 ms (2.50x), KL 0.088 / 84.0% |" in md


def test_rows_with_every_kernel_launched_are_left_out():
    run = _run(
        "2026-12-02T10:00",
        [
            _row(8192, "dense", None, 20.0),
            _row(8192, "converted", "pbs", 21.5, "triton", cuda_graphs=True),
            _row(8192, "converted", "pbs", 72.0, "triton", cuda_graphs=False),
        ],
    )
    merged = e2e_merge.merge_runs({"graphs.json": run})
    pbs = [r for r in merged["rows"] if r["setting"] == "pbs"]
    assert len(pbs) == 1 and pbs[0]["ms"] == 21.5 and pbs[0]["speedup"] == pytest.approx(20.0 / 21.5)


def test_a_run_that_recorded_its_backend_once_gives_it_to_its_sparse_rows():
    run = _run(
        "2026-12-01T08:00", [_row(8192, "dense", None, 30.0), _row(8192, "converted", "bsa", 60.0)], backend="triton"
    )
    rows = e2e_merge.merge_runs({"a.json": run})["rows"]
    assert {r["path"]: r.get("backend") for r in rows} == {"dense": None, "converted": "triton"}


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda r: r["env"].update(torch="2.12.0"), "different env"),
        (lambda r: r["args"].update(random_init=True), "random-init"),
        (lambda r: r["args"].update(compile_mode="reduce-overhead"), "compile mode"),
        (lambda r: r["rows"][0].update(text="argparse_source"), "different texts"),
        (lambda r: r["args"].update(eval_positions=256), "different args"),
        (lambda r: r["env"].pop("date"), "env.date is missing"),
        (lambda r: r["rows"][0].pop("rope"), "lacks \\['rope'\\]"),
        (lambda r: r["rows"].append(_row(16384, "compile", "pbs", 40.0, "triton")), "no eager dense row"),
        (
            lambda r: (
                r["args"].update(backend=["auto", "triton"]),
                r["rows"].append(_row(8192, "converted", "pbs", 9.0)),
            ),
            "which backend ran them is unknown",
        ),
    ],
    ids=[
        "other-torch",
        "random-weights",
        "cuda-graph-mode",
        "other-text",
        "other-eval-positions",
        "no-date",
        "row-without-rope",
        "no-dense-at-that-length",
        "backend-unknown",
    ],
)
def test_runs_that_cannot_share_a_table_are_refused(change, message):
    a = _run("2026-12-01T08:00", [_row(8192, "dense", None, 30.0)])
    b = _run("2026-12-01T09:00", [_row(8192, "dense", None, 31.0)])
    change(b)
    with pytest.raises(ValueError, match=message):
        e2e_merge.merge_runs({"a.json": a, "b.json": b})


def test_matrix_has_one_line_per_setting_and_path_and_plain_rope_only_up_to_8k():
    plain = {"rope": "plain"}
    run = _run(
        "2026-12-01T08:00",
        [
            {**_row(8192, "dense", None, 30.0), **plain},
            {**_row(8192, "compile", "pbs", 60.0, "triton", mean_kl=0.25, top1=0.8), **plain},
            {**_row(32768, "dense", None, 120.0), **plain},  # plain beyond 8K: not a column
            _row(32768, "dense", None, 126.0),
            _row(32768, "compile", "pbs", 42.0, "triton", mean_kl=0.09, top1=0.83),
            _row(32768, "converted", "pbs", 63.0, "triton"),
        ],
    )
    lines = e2e_merge.matrix(e2e_merge.merge_runs({"a.json": run})).splitlines()
    assert lines[0] == "| setting | path | 8K plain | 32K yarn |"
    assert lines[2:] == ["| pbs | compile | 0.50x, KL 0.250 | 3.00x, KL 0.090 |", "| pbs | converted | - | 2.00x |"]
