"""benchmarks/studies/pisa_pair_units.py: the scored pairs it counts from the reference walk are
the pairs PISA's scan kernels count, one leaf a pair and a parent's children a pair (their
per-segment counters, summed, through Triton's interpreter on the CPU)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from _pisa_walk_inputs import walk_inputs

from sparseflow import Tuning

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks", "studies"))

import pisa_pair_units as study  # noqa: E402

pytest.importorskip("triton")
from sparseflow.methods.pisa import triton_select  # noqa: E402
from sparseflow.methods.pisa import triton_select_scan as scan  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def scan_pair_total(monkeypatch, unit: str, q, k, **kw) -> int:
    """The scan's scored pairs: the sum of the walk's per-segment counters."""
    totals = []
    real = scan.leaf_pair_index

    def record(counts, *args, **kwargs):
        totals.append(int(counts.sum()))
        return real(counts, *args, **kwargs)

    monkeypatch.setitem(scan.LAUNCH, "pair_unit", unit)
    monkeypatch.setattr(scan, "leaf_pair_index", record)
    triton_select.pisa_select(q.to(DEVICE), k.to(DEVICE), tuning=Tuning(pisa_walk="scan"), **kw)
    assert len(totals) == 1, "the scan must have scored leaf pairs"
    return totals[0]


def test_counts_are_the_scan_kernels_pairs(monkeypatch):
    q, k, _ = walk_inputs(1, 6, 2, 70, 100, 16, torch.float32, False, seed=3)
    kw = dict(block_size=8, top_k=5, branching=2)
    cand, valid, forced, width = study.leaf_level_candidates(q, k, **kw)
    counts = study.pair_counts(cand, valid, forced, width, 2)
    assert counts["rows"] == 2 * 70
    assert 0 < counts["sibling_pairs"] < counts["leaf_pairs"] <= counts["sibling_leaf_lses"]
    assert counts["leaf_pairs"] == scan_pair_total(monkeypatch, "leaf", q, k, **kw)
    assert counts["sibling_pairs"] == scan_pair_total(monkeypatch, "siblings", q, k, **kw)
