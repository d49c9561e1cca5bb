"""Command-line mistakes give one line naming the argument or path, exit code 2, before any slow
work (loading weights); SIGTERM during ``convert`` leaves no temporary folder; bugs keep their
traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from sparseflow import cli, convert as convert_mod  # noqa: E402
from sparseflow.cli import main  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Llama saved with save_pretrained (no tokenizer)."""
    import conftest

    path = tmp_path_factory.mktemp("tiny_llama_cli")
    conftest.make_tiny("llama", layers=1).save_pretrained(path)
    return path


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if a command gets as far as loading weights."""

    def refuse(*a, **k):
        raise AssertionError("the weights were loaded before the arguments were checked")

    monkeypatch.setattr(convert_mod, "load_source", refuse)


def _one_line_error(capsys, command: str, *needles: str) -> str:
    err = capsys.readouterr().err.strip()
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "Traceback" not in err, err
    err = errors[0]
    assert err.startswith(f"sparseflow {command}: error: "), err
    for n in needles:
        assert n in err, err
    return err


# --------------------------------------------------------------------------- convert


def test_convert_unwritable_output_fails_before_loading(folder, tmp_path, monkeypatch, capsys, no_loading):
    parent = tmp_path / "locked"
    parent.mkdir()
    real_mkdtemp = convert_mod.tempfile.mkdtemp

    def mkdtemp(*a, dir=None, **k):  # what a read-only folder does (even root cannot write on a read-only mount)
        if dir is not None and Path(dir) == parent:
            raise PermissionError(13, "Permission denied", str(parent))
        return real_mkdtemp(*a, dir=dir, **k)

    monkeypatch.setattr(convert_mod.tempfile, "mkdtemp", mkdtemp)
    rc = main(["convert", str(folder), "--method", "pbs", "--out", str(parent / "out")])
    assert rc == 2
    _one_line_error(capsys, "convert", str(parent), "Permission denied", "folder you can write")


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only folders")
def test_convert_read_only_parent(folder, tmp_path, capsys, no_loading):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        assert main(["convert", str(folder), "--method", "pbs", "--out", str(parent / "out")]) == 2
    finally:
        parent.chmod(0o755)
    _one_line_error(capsys, "convert", str(parent))


def test_convert_output_under_a_file(folder, tmp_path, capsys, no_loading):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["convert", str(folder), "--method", "pbs", "--out", str(blocker / "sub" / "out")]) == 2
    _one_line_error(capsys, "convert", "cannot create the folder")


_SLOW_CONVERT = textwrap.dedent("""
    import sys, time
    import sparseflow.hf as hf
    from sparseflow.cli import main

    def slow(cls, d):  # the last step before the rename: the temporary folder is full by now
        print("WRITING", flush=True)
        time.sleep(60)

    hf.Plan.from_dict = classmethod(slow)
    sys.exit(main(["convert", sys.argv[1], "--method", "pbs", "--out", sys.argv[2]]))
""")


def test_sigterm_during_convert_leaves_no_temporary_folder(folder, tmp_path):
    out_parent = tmp_path / "outs"
    out_parent.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_CONVERT, str(folder), str(out_parent / "model")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline()
        assert line.strip() == "WRITING", proc.stderr.read()
        assert [p.name for p in out_parent.iterdir()]  # the temporary folder exists now
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert rc == 128 + signal.SIGTERM
    assert list(out_parent.iterdir()) == []


# --------------------------------------------------------------------------- export-onnx


def test_export_onnx_out_is_a_folder(folder, tmp_path, capsys, no_loading):
    pytest.importorskip("onnxscript")
    assert main(["export-onnx", str(folder), "--method", "pbs", "--out", str(tmp_path)]) == 2
    _one_line_error(capsys, "export-onnx", "--out", "is a folder", "model.onnx")


def test_export_onnx_without_onnx_shows_the_install_hint(folder, tmp_path, monkeypatch, capsys, no_loading):
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # import onnxscript -> ImportError
    assert main(["export-onnx", str(folder), "--method", "pbs", "--out", str(tmp_path / "m.onnx")]) == 2
    _one_line_error(capsys, "export-onnx", "pip install 'sparseflow[onnx]'")


# --------------------------------------------------------------------------- numeric arguments


@pytest.mark.parametrize(
    "argv, arg",
    [
        (["bench", "--reps", "0", "--no-scripts"], "--reps"),
        (["bench", "--hq", "0", "--no-scripts"], "--hq"),
        (["bench", "--hkv", "-2", "--no-scripts"], "--hkv"),
        (["bench", "--d", "0", "--no-scripts"], "--d"),
        (["bench", "--reps", "x", "--no-scripts"], "--reps"),
        (["bench", "--ns", "0", "--no-scripts"], "--ns"),
        (["eval", "m", "--map-head", "-1"], "--map-head"),
        (["eval", "m", "--map-layer", "-3"], "--map-layer"),
        (["eval", "m", "--tokens", "0"], "--tokens"),
        (["demo", "--eval-positions", "-5"], "--eval-positions"),
        (["export-onnx", "m", "--tokens", "1", "--out", "x.onnx"], "--tokens"),
    ],
)
def test_bad_numbers_are_argparse_errors(argv, arg, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {arg}:" in err and "Traceback" not in err


# --------------------------------------------------------------------------- other paths


def test_eval_bad_paths_fail_before_loading(folder, tmp_path, capsys, no_loading):
    base = ["eval", str(folder), "--method", "pbs", "--tokens", "64"]
    assert main(base + ["--json", str(tmp_path / "missing" / "r.json")]) == 2
    _one_line_error(capsys, "eval", "--json", "does not exist")
    assert main(base + ["--json", str(tmp_path)]) == 2
    _one_line_error(capsys, "eval", "--json", "is a folder")
    (tmp_path / "f").write_text("x")
    assert main(base + ["--plots", str(tmp_path / "f")]) == 2
    _one_line_error(capsys, "eval", "--plots", "not a folder")
    assert main(base + ["--tokenizer", str(tmp_path / "no_tok")]) == 2
    _one_line_error(capsys, "eval", "--tokenizer")
    assert main(["eval", str(tmp_path / "nothing"), "--method", "pbs"]) == 2
    _one_line_error(capsys, "eval", "does not exist")


@pytest.mark.parametrize(
    "command",
    [
        ["convert", "--method", "pbs", "--out", "OUT"],
        ["eval", "--method", "pbs", "--tokens", "64"],
        ["calibrate", "--method", "pbs", "--kl-budget", "0.01", "--out", "OUT.json"],
    ],
    ids=lambda c: c[0],
)
def test_an_unsupported_architecture_fails_before_loading(tmp_path_factory, command, capsys, no_loading):
    """Gemma 2 soft-caps its attention logits (transformers runs it without SDPA): every command
    names the model type, the class and the reason from the config alone."""
    import conftest

    src = tmp_path_factory.mktemp("gemma2")
    conftest.make_family("gemma2", layers=1, attn_implementation="eager").save_pretrained(src)
    out = str(tmp_path_factory.mktemp("out") / "result")
    argv = [command[0], str(src)] + [a.replace("OUT", out) for a in command[1:]]
    assert main(argv) == 2
    _one_line_error(capsys, command[0], "model_type='gemma2' (Gemma2ForCausalLM)", "_supports_sdpa is False")


def test_bench_json_into_a_folder(tmp_path, capsys):
    assert main(["bench", "--no-scripts", "--json", str(tmp_path)]) == 2
    _one_line_error(capsys, "bench", "--json", "is a folder")


# --------------------------------------------------------------------------- the main() wrapper


def test_main_shows_user_errors_as_one_line_and_bugs_with_traceback(monkeypatch, capsys):
    def user_error(args):
        raise FileNotFoundError("recipe file '/x/y.json' does not exist")

    monkeypatch.setattr(cli.recipes, "run", user_error)
    assert main(["recipes"]) == 2
    _one_line_error(capsys, "recipes", "/x/y.json")

    def usage(args):
        raise cli.UsageError("--foo must be positive")

    monkeypatch.setattr(cli.recipes, "run", usage)
    assert main(["recipes"]) == 2
    _one_line_error(capsys, "recipes", "--foo must be positive")

    def bug(args):
        return {}["missing"]

    monkeypatch.setattr(cli.recipes, "run", bug)
    with pytest.raises(KeyError):
        main(["recipes"])


def test_sigterm_handler_is_restored(monkeypatch):
    seen = []
    monkeypatch.setattr(cli.recipes, "run", lambda args: seen.append(signal.getsignal(signal.SIGTERM)) or 0)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["recipes"]) == 0
    assert seen[0] is not before and signal.getsignal(signal.SIGTERM) is before


def test_json_write_interrupted_leaves_no_partial_file(tmp_path, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.common.json, "dump", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cli._write_json_atomic(str(tmp_path / "r.json"), {"a": 1})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "device,says",
    [("tpu", "auto, cpu, cuda or cuda:N"), ("cuda:x", "auto, cpu, cuda or cuda:N")]
    + ([] if __import__("torch").cuda.is_available() else [("cuda", "no CUDA device")]),
    ids=lambda v: str(v).replace(" ", "_"),
)
def test_eval_bad_device_fails_before_loading(folder, capsys, no_loading, device, says):
    assert main(["eval", str(folder), "--method", "pbs", "--tokens", "64", "--device", device]) == 2
    _one_line_error(capsys, "eval", "--device", says)


def test_device_auto_and_cpu_resolve_here():
    import torch

    from sparseflow.cli.common import resolve_device

    want = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    assert resolve_device("auto") == want
    assert resolve_device("cpu") == torch.device("cpu")
