"""The shipped texts (sparseflow.texts): each has a kind, is the same on every call, and the
copy-heavy ones repeat earlier passages verbatim; the command line's list of them is the same."""

from __future__ import annotations

import re

import pytest

from sparseflow import copy_texts
from sparseflow.checkpoints import SMOLLM2_PACKAGE_HINT, smollm2_gguf
from sparseflow.texts import KINDS, LONG_TEXTS, TEXTS, check_text, real_text, text_kind


def test_every_text_has_a_kind_and_is_deterministic():
    assert set(KINDS) == {"prose", "code", "copy"}
    assert {TEXTS[n].kind for n in TEXTS} == set(KINDS)  # every kind has a text
    for name, entry in TEXTS.items():
        assert entry.kind in KINDS and entry.description and text_kind(name) == entry.kind
        assert real_text(name) == real_text(name), name  # seeded: the same text every call
    with pytest.raises(ValueError, match="text must be one of"):
        real_text("nope")
    with pytest.raises(ValueError, match="--text must be one of"):
        check_text(3, "--text")


def test_cli_text_list_is_the_shipped_one():
    from sparseflow.cli.common import TEXT_KINDS, TEXTS_CHOICES

    assert TEXT_KINDS == {n: t.kind for n, t in TEXTS.items()} and TEXTS_CHOICES == tuple(TEXTS)


def _sections(text: str):
    return re.split(r"(?:^|\n\n)Section \d+\.\n\n", text)[1:]


def test_copy_clauses_repeat_earlier_sections_verbatim():
    bodies = _sections(real_text("copy_clauses"))
    seen, repeats = set(), 0
    for body in bodies:
        repeats += body in seen
        seen.add(body)
    assert len(bodies) > 500 and 0.4 < repeats / len(bodies) < 0.6  # about half are copies of earlier ones
    # its opening is the end of pydoc_topics: not the passages a pydoc_topics calibration reads first
    assert bodies[0] not in real_text("pydoc_topics")[:200_000]
    assert len(real_text("copy_clauses")) >= copy_texts.COPY_CHARS


def test_copy_log_repeats_blocks_and_lines():
    log = real_text("copy_log")
    traces = re.findall(r"Traceback \(most recent call last\):\n(?:  .*\n)+\S.*", log)
    assert len(traces) > 100 and len(set(traces)) == 6  # six tracebacks, each recurring verbatim
    lines = log.splitlines()
    retries = [ln.split(" ", 1)[1][: -len(" (retry)")] for ln in lines if ln.endswith(" (retry)")]
    firsts = {ln.split(" ", 1)[1] for ln in lines if not ln.endswith(" (retry)")}
    assert len(retries) > 500 and all(r in firsts for r in retries)  # a retry repeats an earlier request line


def test_generators_check_their_arguments():
    with pytest.raises(ValueError, match="repeat must be in"):
        copy_texts.clauses(["a"], repeat=1.0)
    with pytest.raises(ValueError, match="source must hold"):
        copy_texts.clauses([])
    short = copy_texts.clauses(["one passage", "another"], n_chars=200, seed=1)
    assert len(short) >= 200 and short == copy_texts.clauses(["one passage", "another"], n_chars=200, seed=1)
    assert copy_texts.passages("a\n\nb\n\n" + "c" * 500, min_chars=3) == ["a\n\nb\n\n" + "c" * 500]


def test_stdlib_docs_is_prose_from_other_modules_than_the_code_texts():
    docs = real_text("stdlib_docs")
    assert "A ChainMap groups multiple dicts" in docs and "class ArgumentParser" not in docs
    assert docs.split("\n\n").count("An enumeration.") == 1  # a generated docstring is kept once, not repeated


@pytest.mark.slow
@pytest.mark.skipif(smollm2_gguf() is None, reason=f"SmolLM2 GGUF not installed ({SMOLLM2_PACKAGE_HINT})")
def test_long_texts_hold_128k_smollm2_tokens():
    from transformers import AutoTokenizer

    path = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for name in LONG_TEXTS:
        assert len(tok(real_text(name)).input_ids) > 128 * 1024, name
