"""One GGUF header parse per load: readers shared inside ``gguf_parsed_once``, and only there."""

import os

import pytest

gguf = pytest.importorskip("gguf")

from sparseflow.gguf_once import gguf_parsed_once  # noqa: E402


def _write(path, value):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("test.value", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


def _value(reader):
    field = reader.fields["test.value"]
    return int(field.parts[field.data[0]][0])


def test_one_reader_per_file_inside_the_block_and_the_real_class_after(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    _write(a, 1)
    _write(b, 2)
    real = gguf.GGUFReader
    with gguf_parsed_once():
        first = gguf.GGUFReader(str(a))
        assert gguf.GGUFReader(a) is first  # the same file, named as a str or a Path
        other = gguf.GGUFReader(str(b))
        assert other is not first and (_value(first), _value(other)) == (1, 2)
        with gguf_parsed_once():  # nested: the outer block's readers serve
            assert gguf.GGUFReader(str(a)) is first
        assert gguf.GGUFReader(str(a)) is first
    assert gguf.GGUFReader is real
    assert gguf.GGUFReader(str(a)) is not first


def test_a_rewritten_file_is_parsed_again(tmp_path):
    path = tmp_path / "m.gguf"
    _write(path, 1)
    with gguf_parsed_once():
        first = gguf.GGUFReader(str(path))
        _write(path, 7)
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a coarse clock may not move
        again = gguf.GGUFReader(str(path))
        assert again is not first and _value(again) == 7


def test_the_real_class_comes_back_after_an_error(tmp_path):
    real = gguf.GGUFReader
    with pytest.raises(RuntimeError), gguf_parsed_once():
        assert gguf.GGUFReader is not real
        raise RuntimeError("boom")
    assert gguf.GGUFReader is real


class _ConfigRead(Exception):
    pass


def _shares_readers_when_the_config_is_read(monkeypatch, module, call):
    """Run ``call`` until it reads the model's config; whether GGUF readers were shared then."""
    seen = []

    def load_config(source):
        seen.append(getattr(gguf.GGUFReader, "shares_readers", False))
        raise _ConfigRead

    monkeypatch.setattr(module, "load_config", load_config)
    try:
        call()
    except _ConfigRead:
        pass
    return seen


@pytest.mark.parametrize("command", ["eval", "export-onnx", "calibrate"])
def test_commands_that_load_a_gguf_share_its_readers_from_the_config_check_to_the_load(command, tmp_path, monkeypatch):
    import sparseflow.calibrate.command as calibrate_command
    import sparseflow.convert as convert
    from sparseflow.cli import main

    model = tmp_path / "m.gguf"
    _write(model, 1)
    argv = {
        "eval": ["eval", str(model), "--method", "pbs", "--tokens", "128"],
        "export-onnx": ["export-onnx", str(model), "--method", "pbs", "--out", str(tmp_path / "m.onnx")],
        "calibrate": [
            "calibrate",
            str(model),
            "--method",
            "pbs",
            "--kl-budget",
            "0.01",
            "--out",
            str(tmp_path / "r.json"),
        ],
    }[command]
    module = calibrate_command if command == "calibrate" else convert
    if command == "export-onnx":
        pytest.importorskip("onnxscript")
    assert _shares_readers_when_the_config_is_read(monkeypatch, module, lambda: main(argv)) == [True]


def test_a_command_that_reads_no_gguf_does_not_import_gguf():
    import subprocess
    import sys

    code = "import sys; from sparseflow.cli import main; main(['recipes']); assert 'gguf' not in sys.modules"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
