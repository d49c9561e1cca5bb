"""README's and docs/results.md's numbers against the data: a table between
``<!-- frontier: A.json,B.json -->`` and ``<!-- /frontier -->`` is what ``benchmarks/frontier.py
--markdown A.json,B.json`` prints; a hand-written table under ``<!-- checked against: A.json, ... -->``
prints only speedups, KLs and top-1s that rows of those files hold at the row's length; and every
result file the two documents name is in benchmarks/results/."""

from __future__ import annotations

import fnmatch
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


# every file in benchmarks/results/ is data a document or a script names: by its name (a
# backticked name or path, braces expanded: `a_{b,c}_h200.{json,log}`, `name_*.png`), or by its
# stem (`pisa_layer_kernels_pdl_h200`, a run's .json and .log); a file nothing names is a loose
# note, and its run's findings belong in docs/results.md with the commit that holds the file
BACKTICKED = re.compile(r"`([^`\s]+)`")


def _named_patterns(text):
    return {os.path.basename(e) for tok in BACKTICKED.findall(text) for e in _expand(tok)}


def _unnamed(files, text, sources):
    pats = _named_patterns(text)

    def named(f):
        if any(fnmatch.fnmatch(f, p) for p in pats) or f in sources:
            return True
        return re.search(re.escape(f.rsplit(".", 1)[0]) + r"(?![A-Za-z0-9_])", text + sources) is not None

    return sorted(f for f in files if not named(f))


def _read(paths):
    out = []
    for path in paths:
        with open(path) as fh:
            out.append(fh.read())
    return "\n".join(out)


def test_every_result_file_is_named_somewhere():
    docs = _read([os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md"))])
    scripts = [
        *glob.glob(os.path.join(ROOT, "benchmarks", "**", "*.py"), recursive=True),
        *glob.glob(os.path.join(ROOT, "benchmarks", "*.sh")),
        *glob.glob(os.path.join(ROOT, "tests", "**", "*.py"), recursive=True),
    ]
    files = os.listdir(os.path.join(ROOT, "benchmarks", "results"))
    assert len(files) > 100 and _unnamed(files, docs, _read(scripts)) == []


def test_an_unnamed_result_file_is_caught():
    text = "`a_{b,c}_h200.{json,log}` and `pisa_run_h200` and `plots_*.png`"
    files = ["a_b_h200.json", "a_c_h200.log", "pisa_run_h200.json", "plots_1.png", "pisa_run_h200_old.json", "x.log"]
    assert _unnamed(files, text, "see x.log") == ["pisa_run_h200_old.json"]


# --------------------------------------------------------------------------- hand-written tables

# ``<!-- checked against: a.json, b.json -->`` right above a table: every speedup, KL and top-1 in
# its rows is a value, rounded as printed, of a row of those files at the row's length
CHECKED = re.compile(r"<!-- checked against: (?P<files>[^>]+?) -->\n(?P<table>(?:\|.*\n)+)")
SPEEDUP_FIELDS = (
    "speedup",
    "ratio_vs_dense",
    "paired_ratio",
    "paired_quartiles",
    "speedup_vs_fastest_dense",
    "round_speedups",
)
FIGURES = {
    "speedup": re.compile(r"(\d+\.\d+)(?:-(\d+\.\d+))?x|\((\d+\.\d+)-(\d+\.\d+)\)"),
    "kl": re.compile(r"KL (\d+\.\d+)"),
    "top1": re.compile(r"top-1 (\d+\.\d+)%"),
}


def _values(row, kind):
    if kind == "kl":
        return [row.get("mean_kl")]
    if kind == "top1":
        return [None if row.get("top1") is None else 100 * row["top1"]]
    out = []
    for f in SPEEDUP_FIELDS:
        v = row.get(f)
        out.extend(v if isinstance(v, list) else [v])
    return out


def _matches(printed: str, values) -> bool:
    decimals = len(printed.split(".")[1])
    return any(isinstance(v, (int, float)) and f"{v:.{decimals}f}" == printed for v in values)


def _tokens(cell: str):
    m = re.match(r"\s*(\d+)K\b", cell)
    return None if m is None else int(m.group(1)) * 1024


def unmatched_figures(files, table: str):
    """``[(row's first cell, kind, printed figure)]`` that no row of ``files`` at that length holds."""
    import json

    rows = []
    for f in files:
        with open(os.path.join(ROOT, "benchmarks", "results", f.strip())) as fh:
            rows.extend(json.load(fh)["rows"])
    bad = []
    for line in table.strip().split("\n")[2:]:
        cells = line.strip("|").split("|")
        n = _tokens(cells[0])
        at_n = [r for r in rows if r.get("n") == n]
        for cell in cells[1:]:
            for kind, pattern in FIGURES.items():
                for m in pattern.finditer(cell):
                    for printed in filter(None, m.groups()):
                        if not _matches(printed, [v for r in at_n for v in _values(r, kind)]):
                            bad.append((cells[0].strip(), kind, printed))
    return bad


def _checked_tables(text):
    return [(m["files"].split(","), m["table"]) for m in CHECKED.finditer(text)]


def test_readmes_hand_written_tables_hold_their_datas_figures():
    with open(os.path.join(ROOT, "README.md")) as fh:
        tables = _checked_tables(fh.read())
    assert len(tables) >= 3, "README.md's measured tables lost their <!-- checked against: ... --> lines"
    for files, table in tables:
        assert unmatched_figures(files, table) == [], f"README's table from {files} prints figures its data lacks"


def test_a_figure_its_data_lacks_is_caught():
    table = (
        "| tokens | a | b |\n|---|---|---|\n"
        "| 32K | 1.28x, KL 0.017, top-1 93.9% | 9.99x, KL 0.018 |\n"
        "| 8K | (0.99-1.06x) | - |\n"
    )
    assert unmatched_figures(["e2e_prefill_h200.json"], table) == [
        ("32K", "speedup", "9.99"),
        ("32K", "kl", "0.018"),
        ("8K", "speedup", "0.99"),
        ("8K", "speedup", "1.06"),
    ]
