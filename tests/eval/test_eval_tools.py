"""Tools behind ``sparseflow eval`` and ``sparseflow bench``: sweeps, block maps, the dense-logits
cache, plots, the benchmark runner (all on tiny inputs; the CLI end to end is in test_convert)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from sparseflow.config import BSAConfig, PBSConfig, PISAConfig
from sparseflow.eval.diagnostics import block_map
from sparseflow.ops import attention
from sparseflow.recording import capture
from sparseflow.eval.sweep import curve_points, parse_sweep, sweep_plans

# --------------------------------------------------------------------------- sweeps


def test_parse_sweep():
    assert parse_sweep("threshold=0.8, 0.9") == ("threshold", ["0.8", "0.9"])
    for bad in ("threshold", "=1,2", "top_k=", 3):
        with pytest.raises(ValueError, match="sweep must"):
            parse_sweep(bad)


def test_sweep_plans_types_values_and_rejects_bad_fields():
    from sparseflow.hf import Plan

    base = Plan("pbs", PBSConfig(block_size=16, segment_size=32), dense_layers=(0,))
    plans = sweep_plans(base, "threshold", ["0.5", "1"], no_permute=True)
    assert [(p.config.threshold, p.config.permute) for p in plans] == [
        (0.5, True),
        (1.0, True),
        (0.5, False),
        (1.0, False),
    ]
    assert all(p.dense_layers == (0,) and p.config.block_size == 16 for p in plans)
    assert [p.config.gqa_permutation for p in sweep_plans(base, "gqa_permutation", ["kv_head"])] == ["kv_head"]
    assert [p.config.force_sink for p in sweep_plans(base, "force_sink", ["false"])] == [False]
    topk = sweep_plans(Plan("bsa", BSAConfig()), "top_k", ["4", "16"])
    assert [p.config.top_k for p in topk] == [4, 16] and isinstance(topk[0].config.top_k, int)
    with pytest.raises(ValueError, match=r"'top_k' is not a pbs setting; expected one of \[.*'threshold'"):
        sweep_plans(base, "top_k", ["4"])
    with pytest.raises(ValueError, match="must be a int"):
        sweep_plans(Plan("bsa", BSAConfig()), "top_k", ["4.5"])
    with pytest.raises(ValueError, match="must be a bool"):
        sweep_plans(base, "permute", ["maybe"])
    with pytest.raises(ValueError, match="threshold must be in"):  # the config validates values
        sweep_plans(base, "threshold", ["1.5"])
    with pytest.raises(ValueError, match="--no-permute compares PBS"):
        sweep_plans(Plan("pisa", PISAConfig()), "top_k", ["8"], no_permute=True)
    with pytest.raises(ValueError, match="not a pbs setting"):
        sweep_plans(base, "min_seq_len", ["4"])  # the dispatcher's, not a selection setting


def test_parse_config_field_is_public_and_types_like_the_default():
    from sparseflow.eval import sweep

    assert sweep.parse_config_field("pbs", "threshold", "0.5") == 0.5
    assert (
        sweep.parse_config_field("pisa", "top_k", "16") == 16
        and sweep.parse_config_field("pbs", "permute", "0") is False
    )
    assert sweep.parse_config_field("pbs", "scoring", "antidiagonal") == "antidiagonal"
    assert sweep._typed is sweep.parse_config_field
    with pytest.raises(ValueError, match="'top_k' is not a pbs setting"):
        sweep.parse_config_field("pbs", "top_k", "4")


def test_curve_points_series():
    from sparseflow.eval.evaluate import MethodResult
    from sparseflow.eval.fidelity import Fidelity

    fid = Fidelity(positions=4, mean_kl=0.1, p99_kl=0.2, top1_agreement=0.75, ppl_dense=2.0, ppl_sparse=2.5)
    rs = [
        MethodResult("pbs", PBSConfig(threshold=t, permute=p).to_dict(), fid, d, 1, 0)
        for t, p, d in ((0.9, True, 0.3), (0.9, False, 0.4))
    ]
    pts = curve_points(rs, "threshold")
    assert [(p["series"], p["value"], p["density"]) for p in pts] == [("pbs", 0.9, 0.3), ("pbs (no permute)", 0.9, 0.4)]
    assert pts[0]["top1"] == 0.75 and pts[0]["ppl_delta"] == 0.5
    # a sweep over permute itself keeps one series
    assert {p["series"] for p in curve_points(rs, "permute")} == {"pbs"}


# --------------------------------------------------------------------------- block maps


def _selection(cfg, n=160, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, n, 16, generator=g) for h in (6, 2, 2))
    with capture() as cap:
        attention(q, k, v, config=cfg, is_causal=True, backend="reference")
    (call,) = cap.calls
    assert call.sparse, call.reason
    return call.selection


@pytest.mark.parametrize(
    "cfg",
    [
        PBSConfig(block_size=16, segment_size=32, threshold=0.6),
        PBSConfig(block_size=16, segment_size=32, threshold=0.6, gqa_permutation="kv_head"),
        PISAConfig(block_size=16, top_k=4),
        BSAConfig(block_size=16, top_k=4),
    ],
    ids=["pbs", "pbs-kv", "pisa", "bsa"],
)
def test_block_map_matches_the_key_mask(cfg):
    """Strictly below the diagonal every key of a block is visible to every query of a block, so
    the map must equal the quadratic key mask averaged over each (query block, key block)."""
    sel = _selection(cfg)
    bs, n = 16, sel.num_keys
    nb = -(-n // bs)
    km = sel.key_mask(6)[0].float()  # [Hq, N, N], causal applied
    for head in (0, 4):
        got = block_map(sel, head)
        assert got.shape == (nb, nb)
        want = km[head].reshape(nb, bs, nb, bs).mean(dim=(1, 3))
        below = torch.ones(nb, nb, dtype=torch.bool).tril(-1)
        torch.testing.assert_close(got[below], want[below])
        assert 0.0 < float(got[below].mean()) < 1.0  # really sparse: the comparison is not vacuous
    # coarser blocks pool the same selection
    coarse = block_map(sel, 4, block_size=32)
    assert coarse.shape == (-(-n // 32),) * 2


def test_block_map_errors():
    sel = _selection(BSAConfig(block_size=16, top_k=4))
    with pytest.raises(ValueError, match=r"head must be an int in \[0, 5\], got 6"):
        block_map(sel, 6)
    with pytest.raises(TypeError, match="selection must be a sparseflow Selection"):
        block_map(object(), 0)
    import dataclasses

    with pytest.raises(ValueError, match="carries no blocks"):
        block_map(dataclasses.replace(sel, block_indices=None), 0)


# --------------------------------------------------------------------------- dense-logits cache


def test_dense_logits_cache_hits_and_keys_on_weights(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    import conftest
    import sparseflow.eval.evaluate as ev

    model = conftest.make_tiny("llama", layers=1)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    first = ev.dense_logits(model, ids, 8, cache_dir=tmp_path)
    assert first.shape == (8, 128) and len(list(tmp_path.glob("*.pt"))) == 1
    real = ev.last_logits
    monkeypatch.setattr(ev, "last_logits", lambda *a: pytest.fail("cache miss"))
    torch.testing.assert_close(ev.dense_logits(model, ids, 8, cache_dir=tmp_path), first, rtol=0, atol=0)
    monkeypatch.setattr(ev, "last_logits", real)
    # other tokens, other positions and other weights are other entries
    ev.dense_logits(model, ids.flip(1), 8, cache_dir=tmp_path)
    ev.dense_logits(model, ids, 4, cache_dir=tmp_path)
    with torch.no_grad():
        model.model.norm.weight.mul_(2.0)
    changed = ev.dense_logits(model, ids, 8, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.pt"))) == 4
    assert not torch.allclose(changed, first)


def test_evaluate_plans_per_plan_results_densities_and_block_map():
    """Each plan gives one result, reported through on_result as it comes: the dense plan is
    exact at density 1, the sparse one drops blocks; per-layer densities cover every layer and
    the block map of map_at comes from the sparse call; the model is left on SDPA."""
    pytest.importorskip("transformers")
    import conftest
    import sparseflow.eval.evaluate as ev
    from sparseflow.config import DenseConfig
    from sparseflow.hf import Plan

    model = conftest.make_tiny("llama", layers=2)
    ids = torch.randint(3, 128, (1, 160), generator=torch.Generator().manual_seed(0))
    pbs = PBSConfig(block_size=16, segment_size=32, threshold=0.6)
    plans = [Plan(method="pbs", config=pbs), Plan(method="dense", config=DenseConfig())]
    seen = []
    sparse, dense = ev.evaluate_plans(model, ids, plans, eval_positions=64, map_at=(1, 2), on_result=seen.append)
    assert seen == [sparse, dense]
    assert dense.density == 1.0 and dense.fidelity.top1_agreement == 1.0 and dense.block_map is None
    assert dense.fidelity.mean_kl < 1e-6
    assert 0.0 < sparse.density < 1.0 and sparse.sparse_calls == 2 and sparse.dense_calls == 0
    assert len(sparse.density_per_layer) == 2 and all(0.0 < d < 1.0 for d in sparse.density_per_layer)
    assert [len(row) for row in sparse.density_per_layer_head] == [model.config.num_attention_heads] * 2
    assert sparse.block_map is not None and sparse.map_at == (1, 2)
    assert model.config._attn_implementation == "sdpa"


# --------------------------------------------------------------------------- plots


def test_plots_write_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    from sparseflow.eval import plots

    paths = [
        plots.density_heatmap([[0.2, 0.5], None, [1.0, 1.0]], "d", str(tmp_path / "a" / "d.png")),
        plots.block_map_plot(torch.rand(5, 5), "m", str(tmp_path / "m.png")),
        plots.curve_plot(
            [
                {"series": "s", "density": 0.3, "mean_kl": 0.0, "value": 1},
                {"series": "s", "density": 0.5, "mean_kl": 0.1, "value": 2},
            ],
            "c",
            str(tmp_path / "c.png"),
        ),
        plots.bar_plot({"pisa": {"recall": 0.8}, "bsa": {"recall": 0.6}}, "b", str(tmp_path / "b.png")),
    ]
    for p in paths:
        data = Path(p).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000, p


def test_plots_without_matplotlib(monkeypatch):
    from sparseflow.eval import plots

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"plots need matplotlib, which is not installed: pip install matplotlib"):
        plots.require_matplotlib()


# --------------------------------------------------------------------------- bench


def test_bench_op_timings_tiny():
    from sparseflow.bench import BenchShape, format_rows, op_timings

    rows = op_timings([BenchShape(320, hq=4, hkv=2, d=16)], ["pbs", "bsa"], ["reference"], reps=1)
    assert [(r["method"], r["backend"], r["n"]) for r in rows] == [("pbs", "reference", 320), ("bsa", "reference", 320)]
    for r in rows:
        assert r["ran"] == "reference" and r["sparse"] and r["op_s"] > 0 and r["dense_sdpa_s"] > 0
        assert r["ratio_vs_dense"] == pytest.approx(r["op_s"] / r["dense_sdpa_s"])
        assert 0.0 < r["density"] <= 1.0
    assert "op/SDPA" in format_rows(rows)
    with pytest.raises(ValueError, match="hq must be a multiple of hkv=3"):
        BenchShape(64, hq=4, hkv=3)
    with pytest.raises(ValueError, match="n must be a positive int"):
        BenchShape(0)


def test_bench_scripts_found_missing_and_skipped(tmp_path, monkeypatch):
    from sparseflow import bench

    folder = tmp_path / "benchmarks"
    folder.mkdir()
    # a stand-in pbs.py that records its arguments; pisa.py is absent
    (folder / "pbs.py").write_text(
        "import json, sys\nout = sys.argv[sys.argv.index('--json') + 1]\n"
        "json.dump({'argv': sys.argv[1:]}, open(out, 'w'))\n"
    )
    assert bench.find_benchmarks(str(folder)) == folder
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        bench.find_benchmarks(str(tmp_path / "nope"))
    if not torch.cuda.is_available():
        rows = bench.run_scripts(folder, tmp_path)
        assert {r["status"] for r in rows} == {"skipped"} and "CUDA" in rows[0]["reason"]
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the CUDA path's bookkeeping
    rows = {r["script"]: r for r in bench.run_scripts(folder, tmp_path / "out")}
    assert rows["pbs.py"]["status"] == "ok", rows["pbs.py"]
    argv = json.loads(Path(rows["pbs.py"]["json"]).read_text())["argv"]
    assert "--ns" in argv and str(tmp_path / "out") in argv[argv.index("--json") + 1]
    assert rows["pisa.py"]["status"] == "skipped" and "pisa.py not found" in rows["pisa.py"]["reason"]
    with pytest.raises(ValueError, match="unknown benchmark script"):
        bench.run_scripts(folder, tmp_path, scripts=["x.py"])


def test_bench_cuda_parts_need_no_benchmarks_folder(tmp_path, monkeypatch):
    """Without ``--benchmarks`` the CUDA parts run from the package (an installed wheel has no
    benchmarks/ folder); a part whose check fails is reported failed, one that raises too."""
    from sparseflow import bench

    assert bench.find_benchmarks() is None
    calls = []

    def fake_part(name, out_json, **kw):
        calls.append(name)
        if name == "pisa.py":
            raise RuntimeError("no kernel")
        result = {"ok": False, "check": [], "op_timing": []}
        Path(out_json).write_text(json.dumps(result))
        return result

    monkeypatch.setattr(bench, "run_part", fake_part)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    rows = {r["script"]: r for r in bench.run_scripts(None, tmp_path / "out")}
    assert calls == ["pbs.py", "pisa.py"]
    assert rows["pbs.py"]["status"] == "failed" and rows["pbs.py"]["returncode"] == 1
    assert Path(rows["pbs.py"]["json"]).is_file()
    assert rows["pisa.py"]["status"] == "failed" and "RuntimeError: no kernel" in rows["pisa.py"]["output_tail"]


def test_bench_part_runs_from_the_package_alone(tmp_path):
    """A CUDA part's checks and op timings, shrunk to the CPU reference backend."""
    from sparseflow import bench

    out = tmp_path / "pbs.json"
    result = bench.run_part("pbs.py", out, device="cpu", backend="reference", reps=1, max_n=96)
    assert result["ok"] and json.loads(out.read_text())["part"] == "pbs.py"
    assert [(r["method"], r["n"], r["status"]) for r in result["check"]] == [("pbs", 96, "ok")] * 2
    assert [(r["method"], r["hq"], r["n"]) for r in result["op_timing"]] == [("pbs", 32, 96)]
    assert "check pbs" in bench._part_text(result) and "op/SDPA" in bench._part_text(result)
    with pytest.raises(ValueError, match="unknown bench part 'x.py'"):
        bench.run_part("x.py", out)


def test_cli_bench_tiny(tmp_path, capsys):
    from sparseflow.cli import main

    out = tmp_path / "b.json"
    rc = main(
        [
            "bench",
            "--ns",
            "320",
            "--hq",
            "4",
            "--hkv",
            "2",
            "--d",
            "16",
            "--reps",
            "1",
            "--methods",
            "pisa",
            "--backends",
            "reference",
            "--json",
            str(out),
            "--out",
            str(tmp_path / "o"),
        ]
    )
    assert rc == 0, capsys.readouterr().err
    text = capsys.readouterr().out
    assert "op/SDPA" in text and "benchmarks/pbs.py" in text
    data = json.loads(out.read_text())
    assert [r["method"] for r in data["op_timing"]] == ["pisa"] and data["env"]["torch"] == torch.__version__
    assert {s["script"] for s in data["scripts"]} == {"pbs.py", "pisa.py"}
    assert main(["bench", "--hq", "4", "--hkv", "3"]) == 2
    assert "hq must be a multiple" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["pbs.py", "pisa.py"])
def test_bench_small_arguments_parse_with_the_real_scripts(name):
    """The arguments `sparseflow bench` passes must be accepted by the repository's script (its
    argument parser runs; measuring needs CUDA and is stopped right after parsing)."""
    import subprocess

    from sparseflow.bench import SCRIPTS

    folder = Path(__file__).resolve().parents[2] / "benchmarks"
    if not (folder / name).is_file():
        pytest.skip(f"benchmarks/{name} is not in this checkout")
    args = [a.replace("{json}", "out.json") for a in SCRIPTS[name]]
    code = (
        "import argparse, runpy, sys\n"
        f"sys.argv = [{name!r}] + {args!r}\n"
        "parse = argparse.ArgumentParser.parse_args\n"
        "def stop(self, a=None, ns=None):\n"
        "    parse(self, a, ns)\n"
        "    print('PARSED')\n"
        "    raise SystemExit(0)\n"
        "argparse.ArgumentParser.parse_args = stop\n"
        f"runpy.run_path({str(folder / name)!r}, run_name='__main__')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=str(folder.parent)
    )
    assert proc.returncode == 0 and "PARSED" in proc.stdout, proc.stderr[-2000:]
