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
