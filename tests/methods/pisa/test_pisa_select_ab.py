"""benchmarks/studies/pisa_select_ab.py: an earlier commit's PISA selection loaded beside the tree's
(here the tree's own sources from a folder, so both must select the same blocks)."""

import os
import shutil
import sys

import pytest
import torch

pytest.importorskip("triton")
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..", "..")
sys.path.insert(0, os.path.join(ROOT, "benchmarks", "studies"))

import pisa_select_ab as ab  # noqa: E402
from sparseflow import Tuning  # noqa: E402
from sparseflow.methods.pisa import triton_select  # noqa: E402

PISA_DIR = os.path.join(ROOT, "sparseflow", "methods", "pisa")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU tensors run the kernels interpreted only


def test_earlier_modules_load_beside_the_tree_and_select_alike(tmp_path):
    for name in ab.OLD_MODULES:
        shutil.copy(os.path.join(PISA_DIR, name + ".py"), tmp_path / (name + ".py"))
    old = ab.load_old(str(tmp_path))
    assert old is not triton_select and old.__name__ == "sparseflow.methods.pisa._ab_triton_select"
    assert hasattr(torch.ops.sparseflow_ab, "pisa_select_fwd") and hasattr(
        torch.ops.sparseflow_ab, "pisa_select_scan_fwd"
    )
    assert ab.load_old(str(tmp_path)) is old  # one earlier commit per process, loaded once
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(tmp_path / "triton_select.py", elsewhere / "triton_select.py")
    with pytest.raises(ValueError, match="already loaded"):
        ab.load_old(str(elsewhere))
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(1, h, 90, 16, generator=g).to(DEVICE) for h in (4, 2))
    kw = dict(block_size=8, top_k=3, is_causal=True)
    for walk in ("per_token", "scan"):
        tuning = Tuning(pisa_walk=walk)
        assert torch.equal(
            old.pisa_select(q, k, tuning=tuning, **kw), triton_select.pisa_select(q, k, tuning=tuning, **kw)
        )


def test_a_folder_without_the_walk_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="triton_select.py"):
        ab.load_old(str(tmp_path))
