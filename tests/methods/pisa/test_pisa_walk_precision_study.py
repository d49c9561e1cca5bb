"""benchmarks/studies/pisa_walk_precision.py: its CPU-runnable parts (the rows it checks, the
contract check on those rows through Triton's interpreter, the table row)."""

from __future__ import annotations

import math
import os
import sys

import pytest
from _pisa_walk_inputs import walk_inputs

from sparseflow.methods.pisa.config import PISAConfig
from sparseflow.tuning import Tuning

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks", "studies"))

import pisa_walk_precision as study  # noqa: E402

pytest.importorskip("triton")


def test_lengths_and_checked_rows():
    assert study.parse_ns("16384, 32768") == [16384, 32768]
    with pytest.raises(ValueError, match="--ns"):
        study.parse_ns("0")
    assert study.row_groups(400, 8) == [(100, 98, 100), (200, 198, 200), (300, 298, 300), (400, 398, 400)]


def test_the_contract_check_runs_the_asked_walk_on_its_rows():
    import torch

    q, k, _ = walk_inputs(1, 4, 2, 41, 41, 16, torch.float32, False, seed=2)  # on the test device
    cfg = PISAConfig(block_size=2, top_k=3)
    found = study.check_contract(q, k, cfg, Tuning(pisa_walk="tiled", pisa_scores="bf16"), rows=8, mem_gib=1e-4)
    assert found["ok"] and found["ran"] == ["tiled"] and found["broken"] is None, found
    assert 0.0 < found["leaf_agreement"] <= 1.0 and found["min_margin"] > -math.inf
    row = dict(n=41, walk="tiled", scores="bf16", ran="tiled", ms=1.5, speedup_vs_first=2.0)
    row.update(contract_ok=found["ok"], leaf_agreement=found["leaf_agreement"], broken=None)
    text = study.format_row(row)
    assert "tiled" in text and "2.00x" in text and "contract ok" in text
