"""A PISA-rewritten model trains (selection without gradient, gradients through the
attention over the selected blocks), on the CPU with the reference backend."""

from __future__ import annotations

import pytest
import torch

import sparseflow


@pytest.mark.usefixtures("fresh_dynamo")
def test_pisa_rewritten_tiny_llama_trains_and_loss_falls(tiny):
    model = tiny("llama", layers=2, seed=0).train()
    cfg = sparseflow.PISAConfig(block_size=16, top_k=4, min_seq_len=0)
    sparseflow.compile(model, "pisa", cfg, backend="reference", inner_backend="aot_eager")
    g = torch.Generator().manual_seed(0)
    # a learnable sequence family: token t+1 = (token t * 5 + 3) mod V, 150 tokens (10 leaf blocks)
    start = torch.randint(0, 128, (4, 1), generator=g)
    ids = [start]
    for _ in range(149):
        ids.append((ids[-1] * 5 + 3) % 128)
    ids = torch.cat(ids, dim=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    with sparseflow.capture() as cap:
        for _ in range(12):
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    sparse_calls = [c for c in cap.calls if c.method == "pisa" and c.sparse]
    assert sparse_calls, "the attention must have run as PISA"
    assert all(0 < float(c.selection.density.mean()) < 1 for c in sparse_calls if c.selection is not None)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.6 * losses[0], losses
    rep = sparseflow.report(model)
    assert len(rep.rewritten) == 2 and not rep.skipped, rep
