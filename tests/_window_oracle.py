"""The tests' oracle of local-window attention: the mask materialised from the definitions
(causal ``j <= p``, window ``p - W < j``, chunk ``j // C == p // C``, selection, padding) and plain
softmax attention under it, independent of the block lists and the kernels."""

from __future__ import annotations

import torch

import sparseflow


def dense_window_attention(q, k, v, w, chunk, kpm=None, block_indices=None, block_size=1, shift=0):
    """Plain softmax attention under the materialised mask (selection, causal, window, padding)
    in ``q``'s dtype; a row that sees nothing outputs 0. ``shift`` moves every window's lower
    bound by that many keys (the off-by-one masks the tests rule out)."""
    b, hq, n_q, d = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    p = torch.arange(n_q, device=q.device)[:, None] + n_k - n_q
    j = torch.arange(n_k, device=q.device)[None, :]
    mask = j <= p
    if w:
        mask = mask & (p - w < j - shift)
    if chunk:
        mask = mask & ((j - shift) // chunk == p // chunk)
    mask = mask.expand(b, hkv, n_q, n_k)
    if block_indices is not None:
        hit = torch.zeros(b, hkv, n_q, -(-n_k // block_size) + 1, dtype=torch.bool, device=q.device)
        hit.scatter_(-1, torch.where(block_indices < 0, hit.shape[-1] - 1, block_indices.long()), True)
        mask = mask & hit[..., :-1].repeat_interleave(block_size, -1)[..., :n_k]
    if kpm is not None:
        mask = mask & kpm[:, None, None, :]
    mask = mask.repeat_interleave(hq // hkv, 1)
    kk, vv = (t.repeat_interleave(hq // hkv, 1) for t in (k, v))
    logits = (q @ kk.transpose(-1, -2)) * d**-0.5
    seen = mask.any(-1, keepdim=True)
    # a row that sees nothing keeps its finite logits (an all -inf softmax's NaN would reach the
    # gradients through the where) and is zeroed after
    probs = torch.softmax(logits.masked_fill(~mask & seen, float("-inf")), -1)
    return torch.where(seen, probs, torch.zeros((), dtype=q.dtype)) @ vv


def one_sparse_call(q, k, v, kpm, cfg, backend, tuning=None):
    """The op on ``cfg`` with ``kpm`` as its key-padding mask: ``(output, its one call record)``,
    checked to have run ``cfg``'s method sparsely (not a dense fallback)."""
    mask = None if kpm is None else kpm[:, None, None, :]
    with sparseflow.capture() as cap:
        out = sparseflow.attention(q, k, v, config=cfg, attn_mask=mask, is_causal=True, backend=backend, tuning=tuning)
    (call,) = cap.calls
    assert call.sparse and call.method == cfg.method, call.reason
    return out, call


def cpu_qkv_inputs(*args, **kw):
    """``_pisa_walk_inputs.qkv_inputs`` on the CPU, where the oracles and the reference backend
    of the window tests run (a test moves them to the GPU for the Triton backend itself)."""
    from _pisa_walk_inputs import qkv_inputs

    return tuple(None if t is None else t.cpu() for t in qkv_inputs(*args, **kw))
