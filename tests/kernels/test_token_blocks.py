"""The shared reference attention over selected key blocks (kernels/token_blocks.py)."""

import pytest
import torch

from sparseflow.kernels import token_blocks as tb


def _case(seed=0, n=45, c=8, kk=3):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, n, 16, generator=g)
    k, v = (torch.randn(2, 2, n, 16, generator=g) for _ in range(2))
    nb = -(-n // c)
    idx = torch.stack([torch.randperm(nb, generator=g)[:kk] for _ in range(2 * 2 * n)]).view(2, 2, n, kk)
    idx[..., -1] = torch.where(torch.rand(2, 2, n, generator=g) < 0.3, -1, idx[..., -1])  # unused slots
    kpm = torch.ones(2, n, dtype=torch.bool)
    kpm[1, -5:] = False
    return q, k, v, idx, kpm, c


@pytest.mark.parametrize("window", [{}, {"sliding_window": 12}])
def test_hidden_entries_add_exact_zeros_with_or_without_non_finite_padding(window):
    # finite keys and values skip the zeroing of the gathered copies; a NaN / inf in a padded key
    # or value turns it on. Both give the same output and q / visible k, v gradients, bit for bit.
    q, k, v, idx, kpm, c = _case()
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[1, :, -5:] = float("nan")
    v_bad[1, :, -5:] = float("inf")
    outs = []
    for keys, values in ((k, v), (k_bad, v_bad)):
        leaves = [t.clone().requires_grad_(True) for t in (q, keys, values)]
        out = tb.attend_selected_blocks(*leaves, idx, key_padding_mask=kpm, block_size=c, **window)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        outs.append((out.detach(), *(t.grad for t in leaves)))
    (o1, dq1, dk1, dv1), (o2, dq2, dk2, dv2) = outs
    assert torch.isfinite(o2).all() and torch.equal(o1, o2)
    assert torch.equal(dq1, dq2)
    assert torch.equal(dk1[:, :, :-5], dk2[:, :, :-5]) and torch.equal(dv1[:, :, :-5], dv2[:, :, :-5])
    assert torch.equal(dk1[1, :, -5:], torch.zeros_like(dk1[1, :, -5:]))  # padding gets no gradient
