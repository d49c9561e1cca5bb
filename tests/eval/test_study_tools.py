"""The issue-8 study helpers: equal-density interpolation, the calibration's choice, the plots."""

import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "studies"))

import smollm2_study as study  # noqa: E402
import smollm2_study_plots as plots  # noqa: E402


def test_kl_interpolation_is_log_linear_and_refuses_to_extrapolate():
    pts = [(0.5, 0.01), (0.3, 0.1)]
    assert plots.kl_at(pts, 0.4) == pytest.approx(math.sqrt(0.1 * 0.01))
    assert plots.kl_at(pts, 0.3) == pytest.approx(0.1)
    assert plots.kl_at(pts, 0.29) is None and plots.kl_at(pts, 0.51) is None


def test_missed_mass_clamps_at_the_measured_ends():
    pts = [(0.2, 0.2), (0.6, 0.02)]
    assert study._missed_at(pts, 0.1) == 0.2 and study._missed_at(pts, 0.9) == 0.02
    assert study._missed_at(pts, 0.4) == pytest.approx(math.sqrt(0.2 * 0.02))


def test_every_variant_is_a_valid_pbs_config():
    from sparseflow import PBSConfig

    for name, changes in study.VARIANTS.items():
        PBSConfig(threshold=0.9, **changes)  # raises on a bad field or value


def test_plots_write_one_png_per_text_and_length(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rows = [
        {"text": t, "tokens": n, "variant": v, "density": d, "mean_kl": k}
        for t in ("a", "b")
        for n in (2048,)
        for v, off in (("paper", 1.0), ("no_permute", 2.0))
        for d, k in ((0.6, 0.03 * off), (0.7, 0.01 * off), (0.8, 0.004 * off))
    ]
    src = tmp_path / "s.json"
    src.write_text(json.dumps({"rows": rows}))
    assert plots.main([str(src), "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["smollm2_study_a_2048.png", "smollm2_study_b_2048.png"]
    out = capsys.readouterr().out

    # the no_permute row is twice the paper row at every interpolated density
    def row(name):
        line = next(ln for ln in out.splitlines() if ln.split() and ln.split()[0] == name)
        return [float(x) for x in line.split()[1:] if x != "-"]

    plain, paper = row("no_permute"), row("paper")
    assert plain[1] == pytest.approx(math.sqrt(0.06 * 0.02), rel=5e-3)  # density 0.65: log-linear
    assert [a / b for a, b in zip(plain, paper)] == pytest.approx([2.0] * len(plain), rel=1e-2)


def test_study_cli_rejects_unknown_variants_and_parts():
    with pytest.raises(SystemExit):
        study.main(["--variants", "paper,nope", "--out", "/tmp/x"])
    with pytest.raises(SystemExit):
        study.main(["--parts", "pbs,everything", "--out", "/tmp/x"])


def test_oracle_variant_scores_blocks_by_exact_attention_mass():
    # the study's "oracle" rows use antidiagonal scoring with stride 1: a block's score must then be
    # the mean over its query rows of their exact softmax mass (over the candidate keys) in that block
    import torch

    from sparseflow.methods.pbs.block_selection import candidate_blocks
    from sparseflow.methods.pbs.estimate import block_probabilities

    assert study.VARIANTS["oracle_no_permute"] == {
        "permute": False,
        "scoring": "antidiagonal",
        "antidiagonal_stride": 1,
    }
    g = torch.Generator().manual_seed(0)
    b, hq, hkv, n, d, bs = 1, 2, 1, 90, 8, 16  # ragged last block
    q, k = torch.randn(b, hq, n, d, generator=g), torch.randn(b, hkv, n, d, generator=g) * 2
    perm = torch.arange(n).expand(b, hq, n).clone()
    cand = candidate_blocks(perm, hq, block_size=bs, segment_size=bs)
    probs = block_probabilities(q, k, perm, cand, block_size=bs, scoring="antidiagonal", antidiagonal_stride=1)
    nb = -(-n // bs)
    checked = 0
    for h in range(hq):
        for i in range(nb):
            keys = torch.cat(
                [torch.arange(j * bs, min(n, (j + 1) * bs)) for j in range(nb) if cand[0, h, i, j]]
                or [torch.zeros(0, dtype=torch.long)]
            )
            if keys.numel() == 0:
                assert probs[0, h, i].abs().sum() == 0
                continue
            rows = q[0, h, i * bs : min(n, (i + 1) * bs)]
            p = torch.softmax(rows @ k[0, 0, keys].T * d**-0.5, dim=-1)  # [rows, keys]
            mass = torch.zeros(rows.shape[0], nb).index_add_(1, keys // bs, p)
            torch.testing.assert_close(probs[0, h, i], mass.mean(0), rtol=1e-5, atol=1e-6)
            checked += 1
    assert checked >= hq * (nb - 1)
