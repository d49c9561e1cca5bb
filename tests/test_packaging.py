"""Packaging habits: one version string, py.typed shipped, ruff configured and run by CI."""

from __future__ import annotations

import pathlib

import pytest

import sparseflow

ROOT = pathlib.Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")


def _pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_one_version_string():
    data = _pyproject()
    assert "version" not in data["project"] and "version" in data["project"]["dynamic"]
    assert data["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "sparseflow._version.__version__"}
    assert isinstance(sparseflow.__version__, str) and sparseflow.__version__.count(".") >= 2
    assert sparseflow.__version__ is sparseflow._version.__version__


def test_py_typed_ships():
    assert (ROOT / "sparseflow" / "py.typed").is_file()
    assert "py.typed" in _pyproject()["tool"]["setuptools"]["package-data"]["sparseflow"]


def test_ruff_is_configured_and_run_by_ci():
    ruff = _pyproject()["tool"]["ruff"]
    assert ruff["line-length"] == 120
    assert {"E9", "F"} <= set(ruff["lint"]["select"])
    assert not ruff.get("exclude") and not ruff["lint"].get("ignore")
    assert not ruff.get("format", {}).get("exclude")
    ci = (ROOT / ".ci" / "run").read_text()
    assert "ruff check ." in ci and "ruff format --check ." in ci
