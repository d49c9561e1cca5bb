"""PBS ``scoring="sampled_rows"``: every ``antidiagonal_stride``-th query row of a block scores the
keys with its exact softmax (no averaging before the exponential); stride 1 is the exact block mass."""

import pytest
import torch

import sparseflow
from sparseflow.methods.pbs.block_selection import candidate_blocks
from sparseflow.methods.pbs.estimate import block_probabilities
from sparseflow.methods.pbs.permutation import key_scores, segment_permutation
from sparseflow.methods.pbs.reference import pbs_attention

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # where the Triton backend runs (the CPU: interpreted)


def _inputs(n=90, hq=4, hkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hq, n, d, generator=g)
    k = torch.randn(1, hkv, n, d, generator=g) * 2
    v = torch.randn(1, hkv, n, d, generator=g)
    return q, k, v


def _direct(q, k, perm, cand, bs, stride, kpm=None):
    """The definition, row by row: sampled valid rows of each query block, softmax over the
    candidate (valid) keys in permuted order, mass per key block, mean over the sampled rows."""
    b, hq, n, d = q.shape
    hp, g = perm.shape[1], hq // k.shape[1]
    nb = -(-n // bs)
    valid = torch.ones(n, dtype=torch.bool) if kpm is None else kpm[0]
    out = torch.zeros(hq, nb, nb)
    for h in range(hq):
        order = perm[0, h * hp // hq]
        for i in range(nb):
            keys = [
                (j, int(order[t]))
                for j in range(nb)
                if cand[0, h, i, j]
                for t in range(j * bs, min(n, (j + 1) * bs))
                if valid[int(order[t])]
            ]
            # a query block without a valid row scores with all its rows (the reference's rule)
            block_rows = range(i * bs, min(n, (i + 1) * bs))
            if not any(valid[r] for r in block_rows):
                valid_rows = list(block_rows)
            else:
                valid_rows = [r for r in block_rows if valid[r]]
            rows = [r for r in range(i * bs, min(n, (i + 1) * bs), stride) if r in valid_rows]
            if not keys or not rows:
                continue
            kk = k[0, h // g, [p for _, p in keys]]
            blocks = torch.tensor([j for j, _ in keys])
            p = torch.softmax(q[0, h, rows] @ kk.T * d**-0.5, dim=-1)
            out[h, i] = torch.zeros(len(rows), nb).index_add_(1, blocks, p).mean(0)
    return out


@pytest.mark.parametrize("stride", [1, 3, 8], ids=lambda s: f"stride{s}")
@pytest.mark.parametrize("pad", [False, True], ids=["nopad", "pad"])
def test_sampled_rows_matches_its_definition(stride, pad):
    q, k, _ = _inputs()
    n, bs, seg = q.shape[2], 16, 32
    kpm = None
    if pad:
        kpm = torch.ones(1, n, dtype=torch.bool)
        kpm[0, 70:] = False
        kpm[0, 3] = False
    perm = segment_permutation(
        key_scores(q, k, key_padding_mask=kpm, block_size=bs, segment_size=seg),
        segment_size=seg,
        key_padding_mask=kpm,
    )
    cand = candidate_blocks(perm, q.shape[1], key_padding_mask=kpm, block_size=bs, segment_size=seg)
    got = block_probabilities(
        q, k, perm, cand, key_padding_mask=kpm, block_size=bs, scoring="sampled_rows", antidiagonal_stride=stride
    )
    torch.testing.assert_close(got[0], _direct(q, k, perm, cand, bs, stride, kpm), rtol=1e-5, atol=1e-6)


def test_stride_one_is_the_exact_block_mass():
    q, k, _ = _inputs(seed=1)
    perm = segment_permutation(torch.rand(1, 4, 90, generator=torch.Generator().manual_seed(2)), segment_size=32)
    cand = candidate_blocks(perm, 4, block_size=16, segment_size=32)
    rows = block_probabilities(q, k, perm, cand, block_size=16, scoring="sampled_rows", antidiagonal_stride=1)
    exact = block_probabilities(q, k, perm, cand, block_size=16, scoring="antidiagonal", antidiagonal_stride=1)
    torch.testing.assert_close(rows, exact, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_op_runs_sampled_rows_and_matches_masked_dense(backend):
    # off CUDA the triton backend selects with the reference's torch stages (Tuning.pbs_select's
    # default there; on CUDA triton_estimate's kernels select, tests/methods/pbs/test_pbs_triton_estimate.py)
    # and attends with its kernel (the CPU interpreter here)
    q, k, v = (t.to(DEV if backend == "triton" else "cpu") for t in _inputs(n=77, d=16))
    kw = dict(block_size=16, segment_size=32, threshold=0.7, scoring="sampled_rows", antidiagonal_stride=4)
    ref, sel = pbs_attention(q, k, v, return_selection=True, **kw)
    mask = sel.key_mask(q.shape[1])
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    dense = torch.nn.functional.scaled_dot_product_attention(q.double(), kr.double(), vr.double(), attn_mask=mask)
    torch.testing.assert_close(ref.double(), dense, rtol=2e-4, atol=2e-5)
    assert float(sel.density.mean()) < 1.0
    out = sparseflow.attention(q, k, v, config=sparseflow.PBSConfig(**kw), backend=backend)
    torch.testing.assert_close(out, ref, rtol=2e-4, atol=2e-5)


def test_config_accepts_sampled_rows_and_onnx_refuses_it(tmp_path):
    cfg = sparseflow.PBSConfig(scoring="sampled_rows")
    assert sparseflow.config_from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="scoring"):
        sparseflow.PBSConfig(scoring="rows")
    from sparseflow.onnx_export import _refusal

    assert "scoring='sampled_rows'" in _refusal("pbs", cfg, None, "")
    assert _refusal("pbs", cfg.replace(scoring="antidiagonal"), None, "") == ""
