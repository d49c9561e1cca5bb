"""PBS refuses a call whose block scores would not fit in the device's free memory, naming
block_size and N, before it allocates them."""

import pytest
import torch

import sparseflow
from sparseflow.methods.pbs import memory

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # where the Triton backend runs (the CPU: interpreted)


def _call(backend="reference", n=256, block_size=16):
    device = DEV if backend == "triton" else "cpu"
    q = torch.randn(1, 4, n, 16, device=device)
    k = torch.randn(1, 2, n, 16, device=device)
    cfg = sparseflow.PBSConfig(block_size=block_size, segment_size=2 * block_size)
    return sparseflow.attention(q, k, k, config=cfg, is_causal=True, backend=backend)


@pytest.mark.parametrize("backend", ["reference", "flex", "triton"])
def test_block_scores_beyond_free_memory_are_refused(monkeypatch, backend):
    need = memory.selection_bytes(1, 4, 256, 16)
    monkeypatch.setattr(memory, "_free_bytes", lambda device: need - 1)
    with pytest.raises(ValueError, match=r"block_size=16 at N=256 needs about .* use a larger block_size"):
        _call(backend)
    monkeypatch.setattr(memory, "_free_bytes", lambda device: need)
    assert _call(backend).shape == (1, 4, 256, 16)


def test_unknown_free_memory_does_not_refuse(monkeypatch):
    monkeypatch.setattr(memory, "_free_bytes", lambda device: -1)
    assert _call().shape == (1, 4, 256, 16)


def test_the_estimate_grows_with_the_square_of_the_block_count():
    assert memory.selection_bytes(1, 9, 16384, 1) == 3 * 4 * 9 * 16384**2
    assert memory.selection_bytes(2, 9, 16384, 128) == 3 * 4 * 2 * 9 * 128**2
