"""PISA's decoding walk with its leaf level split off (``Tuning(pisa_walk="leaf_pairs")`` in
``PyramidCache``): the eager and the static step select what the per-token walk and the reference
select, step by step, on small odd shapes (Triton's interpreter on the CPU, compiled on CUDA)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from test_pisa_decode_static import _caches, _qkv

from sparseflow import Tuning
from sparseflow.methods.pisa import reference as pisa_ref

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

SPLIT = Tuning(pisa_walk="leaf_pairs")


@pytest.fixture
def split_calls(monkeypatch):
    """Counts the leaf-split walk's launches."""
    from sparseflow.methods.pisa import triton_select_leaf_split as split

    calls = []
    real = split.pisa_select_leaf_split_fwd

    def op(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(split, "pisa_select_leaf_split_fwd", op)
    return calls


@pytest.mark.parametrize(
    "b, hq, n0, steps, c, top_k, beam, score, dtype",
    [
        (1, 4, 37, 5, 8, 3, 1, "lse", torch.float32),  # crosses a block boundary (40)
        (2, 6, 29, 4, 4, 4, 2, "mean_var", torch.float32),  # beam 2, a group of 3
        (1, 4, 21, 4, 8, 3, 1, "lse", torch.bfloat16),
    ],
)
def test_split_steps_select_what_the_per_token_walk_selects(
    b, hq, n0, steps, c, top_k, beam, score, dtype, split_calls
):
    """The static step's buffers past the prompt are NaN: a leaf scored past the device length
    would poison its score."""
    n = n0 + steps
    q, k, v = _qkv(b, hq, 2, n, 16, dtype, seed=n0)
    eager, static, k_buf, v_buf, length = _caches(k, v, n0, n + 13, c)
    per_token, _, _, _, _ = _caches(k, v, n0, n + 13, c)
    kw = dict(top_k=top_k, beam=beam, score=score)
    for t in range(n0, n):
        qt, kt, vt = q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1]
        out, idx = eager.decode_step(qt, kt, vt, tuning=SPLIT, **kw)
        want_out, want = per_token.decode_step(qt, kt, vt, tuning=Tuning(pisa_walk="per_token"), **kw)
        assert torch.equal(idx, want), f"eager step {t}"
        torch.testing.assert_close(out, want_out, rtol=0, atol=0)
        length += 1
        _, s_idx = static.decode_step_static(
            qt, k[:, :, t : t + 1], v[:, :, t : t + 1], k_buf, v_buf, length, tuning=SPLIT, **kw
        )
        assert torch.equal(s_idx[..., : want.shape[-1]], want), f"static step {t}"
        if dtype == torch.float32:
            ref = pisa_ref.pisa_select(qt, kt, block_size=c, **kw)
            assert torch.equal(idx.long(), ref), f"step {t}"
    assert len(split_calls) == 2 * steps, "every step must have run the split walk"
    assert (idx >= 0).sum(-1).max() < -(-n // c), "the last step must select fewer blocks than it sees"


@pytest.mark.parametrize("score, capacity", [("mean", 60), ("lse", 8)], ids=["pisa-1", "one-leaf-block"])
def test_nothing_to_split_walks_per_token(score, capacity, split_calls):
    """PISA-1 scores its leaves by their summaries, and a capacity of one leaf block has no level
    to stop at: both walk per token, with the reference's selection."""
    q, k, v = _qkv(1, 4, 2, 6, 16, torch.float32, seed=3)
    eager, _, _, _, _ = _caches(k, v, 5, capacity, 8)
    _, idx = eager.decode_step(q[:, :, 5:6], k, v, top_k=3, score=score, tuning=SPLIT)
    assert split_calls == []
    assert torch.equal(idx.long(), pisa_ref.pisa_select(q[:, :, 5:6], k, block_size=8, top_k=3, score=score))


def test_the_split_walk_names_what_it_cannot_take():
    from sparseflow.methods.pisa.triton_select import build_pyramid, level_sizes
    from sparseflow.methods.pisa.triton_select_leaf_split import leaf_split_walk, pyramid_leaves

    q, k, _ = _qkv(1, 4, 2, 20, 16, torch.float32, seed=0)
    summ, nfv, _, lvl_off, lvl_span = build_pyramid(k, block_size=8, branching=2)  # 3 leaves, 6 nodes
    call = (q, k, summ, nfv, lvl_off, lvl_span, 0.25, True)
    with pytest.raises(ValueError, match="score='mean'"):
        leaf_split_walk(*call, 1, 8, 2, 2, True, True, 1)
    with pytest.raises(ValueError, match="more leaf blocks than top_k=3, got 3"):
        leaf_split_walk(*call, 0, 8, 2, 3, True, True, 1)
    sizes = {n: sum(level_sizes(n, 3)) for n in range(1, 200)}
    assert all(pyramid_leaves(total, 3) == n for n, total in sizes.items())


def test_auto_splits_the_leaves_in_the_static_step_on_cuda_only(split_calls):
    """``pisa_walk="auto"``: the leaf split in the graph-capturable step on CUDA (timed there),
    per token in the eager step and under the interpreter."""
    q, k, v = _qkv(1, 4, 2, 42, 16, torch.float32, seed=7)
    eager, static, k_buf, v_buf, length = _caches(k, v, 41, 60, 8)
    eager.decode_step(q[:, :, 41:42], k, v, top_k=3)
    assert split_calls == []
    length += 1
    static.decode_step_static(q[:, :, 41:42], k[:, :, 41:42], v[:, :, 41:42], k_buf, v_buf, length, top_k=3)
    assert len(split_calls) == (1 if torch.cuda.is_available() else 0)
