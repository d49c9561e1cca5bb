"""benchmarks/studies/real_layers_interpreted.py: one layer's row (the scan's selection against the
reference's, the forward's error against fp64 beside plain torch's), on small random inputs."""

from __future__ import annotations

import os
import sys

import pytest
import torch

if torch.cuda.is_available():  # the study is the interpreter's: it switches Triton to it on import
    pytest.skip("a CPU study (Triton's interpreter)", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks", "studies"))

import real_layers_interpreted as study  # noqa: E402


def _qkv(n=256, hq=3, hkv=1, d=16):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, h, n, d, generator=g) for h in (hq, hkv, hkv))


def test_a_layers_row_compares_selection_and_errors():
    # 128 tokens in 16 blocks of 8, PISA's default 8 kept: sparse, at a quarter of 256 tokens'
    # interpreted kernel time
    row = study.check_layer(*_qkv(n=128), block_size=8)
    assert row["scan selection equal"] is True and row["rows"] == 128
    assert not row["bfloat16 kernel NaN"] and not row["float32 kernel NaN"]
    assert 0 < row["float32 kernel error"] < 1e-4
    assert 0 < row["bfloat16 kernel error"] < 4 * row["bfloat16 plain torch error"]


def test_a_wrong_forward_shows_in_its_error(monkeypatch):
    monkeypatch.setattr(study, "token_sparse_attention", lambda q, k, v, sel, **kw: torch.zeros_like(q))
    row = study.check_layer(*_qkv(n=128), block_size=16)
    assert row["float32 kernel error"] > 100 * row["float32 plain torch error"]


def test_a_lower_precision_walk_reports_its_kept_share_and_contract():
    q, k, _ = _qkv(n=128)
    ref = study.pisa_ref.pisa_select(q, k, block_size=16)
    row = study.lower_precision_walk(q, k, ref, "bf16", 16, walk="per_token")
    assert 0.9 <= row["bf16 kept share"] <= 1.0 and row["bf16 contract"] == "held"


def test_the_kept_share_counts_the_references_blocks_kept():
    ref = torch.tensor([[[[0, 1, 2], [3, 4, -1]]]])
    sel = torch.tensor([[[[2, 0, 5], [4, 3, -1]]]])
    assert study.kept_share(sel, ref) == 4 / 5
    assert study.kept_share(ref, ref) == 1.0
