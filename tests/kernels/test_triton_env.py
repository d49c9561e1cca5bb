"""One reader of ``TRITON_INTERPRET`` (sparseflow.kernels._triton_env.interpreting)."""

from __future__ import annotations

import pathlib
import re

import torch

from sparseflow import op_backends
from sparseflow.kernels._triton_env import interpreting

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "sparseflow"
HELPER = PACKAGE / "kernels" / "_triton_env.py"


def test_interpreting_follows_the_variable_per_call(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert interpreting() is True
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert interpreting() is False
    monkeypatch.delenv("TRITON_INTERPRET")
    assert interpreting() is False


def test_dispatcher_asks_the_helper(monkeypatch):
    # the CPU triton backend is usable exactly when the interpreter is on
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not op_backends.triton_usable(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert op_backends.triton_usable(torch.device("cpu")) == op_backends.triton_installed()


def test_no_other_module_reads_the_variable():
    # the variable's name may appear in messages and docs; no other module may read it
    read = re.compile(r"environ[^\n]*TRITON_INTERPRET|getenv\([^\n]*TRITON_INTERPRET")
    readers = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if p != HELPER and read.search(p.read_text())]
    assert readers == []
    assert read.search(HELPER.read_text())  # the pattern matches a real read
