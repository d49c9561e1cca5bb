"""benchmarks/device_issue16.sh: the device steps call benchmark scripts that exist, with flags
and values those scripts accept (a renamed flag or variant would otherwise surface only on the
device, in its scarce time)."""

import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAN = os.path.join(ROOT, "benchmarks", "device_issue16.sh")
VALUES = {"$IN": ".device_in", "$OUT": "/tmp/out", "${BASE}": "48042ea"}


def invocations():
    """``(script, argv)`` of every ``python benchmarks/...py`` command in the plan."""
    with open(PLAN) as fh:
        text = fh.read().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        match = re.search(r"\bpython (benchmarks/\S+\.py)(.*)$", line)
        if match:
            args = match.group(2)
            for name, value in VALUES.items():
                args = args.replace(name, value)
            out.append((match.group(1), shlex.split(args)))
    return out


CALLS = invocations()


def test_the_plan_runs_benchmarks():
    scripts = {script for script, _ in CALLS}
    assert {
        "benchmarks/studies/pisa_layer_kernels.py",
        "benchmarks/studies/token_sparse_schedule.py",
        "benchmarks/auto_vs_dense.py",
        "benchmarks/e2e_prefill.py",
    } <= scripts


@pytest.mark.parametrize("script", sorted({s for s, _ in CALLS}), ids=os.path.basename)
def test_every_flag_is_the_scripts(script):
    flags = {a.split("=", 1)[0] for s, argv in CALLS if s == script for a in argv if a.startswith("--")}
    helped = subprocess.run(
        [sys.executable, os.path.join(ROOT, script), "--help"], capture_output=True, text=True, cwd=ROOT, check=True
    ).stdout
    known = set(re.findall(r"--[a-z][a-z0-9-]*", helped))
    assert flags and flags <= known, f"{script}: {sorted(flags - known)} not among its flags"


def _values(flag):
    return [argv[argv.index(flag) + 1] for _, argv in CALLS if flag in argv]


def test_variants_and_settings_are_known():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from auto_vs_dense import VARIANTS
    from common import parse_scan_launches
    from e2e_prefill import build_parser

    variants = [v.strip() for text in _values("--variants") for v in text.split(",")]
    assert variants and set(variants) <= set(VARIANTS), sorted(set(variants) - set(VARIANTS))
    layouts = [layout for text in _values("--scan-launch") for layout in parse_scan_launches(text)]
    assert len(layouts) == 3
    for script, argv in CALLS:
        if script.endswith("e2e_prefill.py"):
            build_parser().parse_args(argv)  # its types check the settings, backends and modes


def test_no_step_prints_the_usage_and_fails():
    done = subprocess.run(["bash", PLAN], capture_output=True, text=True)
    assert done.returncode == 2 and "prepare" in done.stdout


def test_a_device_step_without_the_gguf_says_what_to_run(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path))
    if os.path.exists("/tmp/sf/SmolLM2-135M-Instruct.Q4_1.gguf"):
        pytest.skip("this machine holds the joined GGUF where the device step looks for it")
    done = subprocess.run(["bash", PLAN, "auto"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert done.returncode == 2 and "gguf1" in done.stderr
