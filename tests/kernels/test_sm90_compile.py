"""Every Triton kernel compiles for Hopper (sm_90), checked on the CPU (see tests/sm90_compile.py).

The interpreter tests run a kernel's Python; this runs Triton's compiler down to a cubin with the
ptxas that ships with the triton wheel, so GPU-only compile errors show up in CI without a GPU.
"""

import json
import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "sm90_compile.py")


# two processes, each driving some entry points: the compiles are CPU-bound and one process uses
# one core. Balanced by each entry's time from a cold cache (the script's "entry_seconds"; about
# 4 minutes a shard on the 2-core machine): PISA's walks take the most, then PBS's autotuned forward
SHARDS = [
    "token_window,pisa_tiled,pisa_scan,decode",
    "pbs,pbs_strided,pisa_bsa,bsa_select,split_decode,short,pisa_scores",
]


def _env():
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def _run(*args, timeout=2400):
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=timeout, env=_env())


def _run_shards(tmp_path, timeout=2400):
    """Every shard at once; ``(return codes, outputs, merged report)``."""
    procs = []
    for i, entries in enumerate(SHARDS):
        out = tmp_path / f"sm90_{i}.json"
        cmd = [sys.executable, SCRIPT, "--entries", entries, "--json", str(out)]
        procs.append(
            (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env()), out)
        )
    codes, logs, reports = [], [], []
    for proc, out in procs:
        log, _ = proc.communicate(timeout=timeout)
        codes.append(proc.returncode)
        logs.append(log[-4000:])
        reports.append(json.loads(out.read_text()) if out.exists() else {})
    compiled = sorted({c for r in reports for c in r.get("compiled", [])})
    merged = {
        "entries": sorted(e for r in reports for e in r.get("entries", [])),
        "compiled": compiled,
        "compiles": sum(r.get("compiles", 0) for r in reports),
        "errors": [e for r in reports for e in r.get("errors", ["no report"])],
        "host_failures": [f for r in reports for f in r.get("host_failures", [])],
        "missing": sorted(set(reports[0].get("expected", ["?"])) - set(compiled)),
        "all_entries": sorted(reports[0].get("all_entries", ["?"])),
    }
    return codes, "\n".join(logs), merged


def test_checker_catches_a_gpu_only_compile_error():
    r = _run("--selftest", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "failed to compile, as it must" in r.stdout
    assert "compiled with fp32 scalars and failed with fp64 ones, as it must" in r.stdout


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90(tmp_path):
    codes, log, report = _run_shards(tmp_path)
    assert codes == [0] * len(SHARDS), log
    # the shards together drive every entry point the script has
    assert report["entries"] == report["all_entries"] == sorted(e for shard in SHARDS for e in shard.split(","))
    assert report["errors"] == [] and report["host_failures"] == [] and report["missing"] == []
    # every variant the entry points asked for was compiled (PBS autotune configs, PISA beams, ...)
    assert report["compiles"] >= 40, report["compiled"]
    # and again with Python-float arguments typed fp64, as Inductor passes them to a triton_op's
    # kernel under torch.compile (the attention, selection and backward kernels all take a scale)
    fp64 = {c.split("[")[0] for c in report["compiled"] if c.endswith("[fp64 scalars]")}
    assert {
        "_pbs_fwd_kernel",
        "_select_rows_kernel",
        "_fwd_kernel",
        "_bwd_dq_kernel",
        "_bwd_dkdv_kernel",
        "_pisa_select_kernel",
        "_bsa_select_kernel",
        "_decode_split_kernel",
    } <= fp64, sorted(fp64)
