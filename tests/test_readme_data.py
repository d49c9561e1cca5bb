"""README's and docs/results.md's numbers against the data: a table between
``<!-- frontier: A.json,B.json -->`` and ``<!-- /frontier -->`` is what ``benchmarks/frontier.py
--markdown A.json,B.json`` prints, and every result file the two documents name is in
benchmarks/results/."""

from __future__ import annotations

import glob
import os
import re
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import frontier  # noqa: E402

BLOCK = re.compile(r"<!-- frontier: (?P<files>[^>]+?) -->\n(?P<table>.*?)\n<!-- /frontier -->", re.S)


def _blocks(text):
    return [(m["files"].split(","), m["table"]) for m in BLOCK.finditer(text)]


def test_readmes_frontier_tables_are_what_their_data_prints():
    with open(os.path.join(ROOT, "README.md")) as fh:
        blocks = _blocks(fh.read())
    assert blocks, "README.md has no generated frontier table"
    for files, table in blocks:
        expected = frontier.readme_table([os.path.join(ROOT, f) for f in files])
        assert table == expected, f"README's table from {files} is stale: rerun benchmarks/frontier.py --markdown"


def test_a_changed_number_is_caught(tmp_path):
    import json

    src = os.path.join(ROOT, "benchmarks", "results", "frontier_smollm2_32768_h100.json")
    with open(src) as fh:
        data = json.load(fh)
    table = frontier.readme_table([src])
    data["rows"][0]["ms"] *= 1.01  # eager dense, a little slower
    changed = tmp_path / "changed.json"
    changed.write_text(json.dumps(data))
    assert frontier.readme_table([str(changed)]).split("\n")[2] != table.split("\n")[2]


@pytest.mark.parametrize("text", ["no table here", "<!-- frontier: a.json -->\n| x |\n<!-- /frontier -->"])
def test_the_block_is_found_only_between_its_markers(text):
    assert len(_blocks(text)) == text.count("<!-- /frontier -->")


# a result file named in backticks: `name.json`, `name_{a,b}_h200.json`, `name_*.png`; fragments of
# a name (starting with "_" or ".") are prose, not citations
CITED = re.compile(r"`([A-Za-z0-9][A-Za-z0-9_{},.*-]*\.(?:json|png|log|csv))`")


def _expand(name):
    m = re.search(r"\{([^}]*)\}", name)
    if not m:
        return [name]
    return [x for alt in m.group(1).split(",") for x in _expand(name[: m.start()] + alt + name[m.end() :])]


def _missing(text):
    names = {e for n in CITED.findall(text) for e in _expand(n)}
    return sorted(n for n in names if not glob.glob(os.path.join(ROOT, "benchmarks", "results", n)))


@pytest.mark.parametrize("doc", ["README.md", "docs/results.md"])
def test_every_result_file_a_document_names_is_there(doc):
    with open(os.path.join(ROOT, doc)) as fh:
        text = fh.read()
    assert CITED.findall(text), f"{doc} names no result file"
    assert _missing(text) == [], f"{doc} names result files that benchmarks/results/ does not hold"


def test_a_missing_result_file_is_caught():
    assert _missing("see `frontier_smollm2_32768_h100.json` and `no_such_run_{a,b}_h200.json`") == [
        "no_such_run_a_h200.json",
        "no_such_run_b_h200.json",
    ]
