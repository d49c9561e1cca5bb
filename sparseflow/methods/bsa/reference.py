"""Block-sparse attention baseline (BSA) in plain PyTorch: the oracle for the full-scan selector.

For each query token, every visible leaf block ``c`` (``C`` keys, see token_blocks for
visibility and the forced blocks) is scored by ``sum_{heads of the GQA group} q_h . kbar_c * scale``
with ``kbar_c`` the mean of the block's valid keys, in fp32 (fp64 for fp64 inputs). The forced
blocks (current / previous / sink, when visible) are kept first, then the best-scoring other
visible blocks, ``top_k`` in total; ties go to the lower block index. Selection costs
``O(N/C)`` per query (``O(N^2/C)`` in total) and is computed without gradient; attention over the
selected blocks is :func:`sparseflow.kernels.token_blocks.attend_selected_blocks`.

Only the current block can hold a key after ``p_i`` (causal mode) and it is never scored (it is
either forced, or not visible and dropped), so the selection is exactly causal.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ...config import backend_config
from ...kernels import token_blocks as tb
from ..topk_attention import reference_top_k_selection
from .config import BSAConfig

__all__ = ["bsa_select", "bsa_attention", "bsa_reference_selection"]


def _select(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    key_padding_mask: Optional[torch.Tensor],
    is_causal: bool,
    scale: Optional[float],
    block_size: int,
    top_k: int,
    force_sink: bool,
    force_previous: bool,
    sliding_window: int = BSAConfig.sliding_window,
    chunk_size: int = BSAConfig.chunk_size,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """(block_indices [B, Hkv, Nq, top_k], n_visible [B, Nq]). A local window leaves the blocks
    before each query's window out: the top-K (forced blocks included) is chosen inside it."""
    b, hq, n_q, d = q.shape
    _, hkv, n_k, _ = k.shape
    dev = q.device
    top_k = tb.selection_width(top_k, n_k, block_size)
    if n_k == 0 or b == 0 or n_q == 0:  # nothing to select from, or for
        return (
            torch.full((b, hkv, n_q, top_k), -1, dtype=torch.long, device=dev),
            torch.zeros(b, n_q, dtype=torch.long, device=dev),
        )
    sc = tb.default_scale(q, scale)
    cdt = tb.compute_dtype(q.dtype)
    kpm = None if key_padding_mask is None else key_padding_mask.to(device=dev, dtype=torch.bool)
    qg = tb.group_queries(q, hkv).to(cdt)
    sums, counts = tb.leaf_block_sums(k, block_size, kpm)
    means = sums / counts.clamp_min(1)[:, None, :, None].to(sums.dtype)  # [B, Hkv, nB, D]
    nb = means.shape[2]
    first_valid = tb.leaf_first_valid(kpm, b, n_k, block_size, dev)  # [B, nB]
    positions = tb.query_positions(n_q, n_k, dev)
    horizons = tb.query_horizons(n_q, n_k, is_causal=is_causal, device=dev)
    forced_leaf = tb.forced_leaf_blocks(
        positions,
        horizons,
        first_valid,
        block_size=block_size,
        force_sink=force_sink,
        force_previous=force_previous,
    )  # [B, Nq, 3]
    first_blocks = tb.window_first_blocks(positions, block_size, sliding_window, chunk_size)  # [Nq]
    n_visible = tb.count_window_blocks(first_valid, horizons, first_blocks, n_k)

    result = torch.full((b, hkv, n_q, top_k), -1, dtype=torch.long, device=dev)
    blocks = torch.arange(nb, device=dev)
    step = tb.chunk_rows(n_q, b * hkv * nb * max(qg.shape[2], 4))
    for s in range(0, n_q, step):
        e = min(n_q, s + step)
        nq = e - s
        scores = torch.einsum("bhgqd,bhnd->bhgqn", qg[:, :, :, s:e], means).sum(2) * sc  # [B,Hkv,nq,nB]
        valid = (first_valid[:, None, :] <= horizons[s:e].view(1, nq, 1))[:, None]  # [B,1,nq,nB]
        valid = valid & (blocks.view(1, 1, 1, nb) >= first_blocks[s:e].view(1, 1, nq, 1))
        forced = (blocks.view(1, 1, nb, 1) == forced_leaf[:, s:e, None, :]).any(-1)[:, None] & valid
        cand = blocks.view(1, 1, 1, nb).expand(b, hkv, nq, nb)
        valid = valid.expand(b, hkv, nq, nb)
        forced = forced.expand(b, hkv, nq, nb)
        kept, ok = tb.select_top_k(cand, valid, forced, scores, top_k)
        result[:, :, s:e, : kept.shape[-1]] = kept
    return result, n_visible


def bsa_select(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    key_padding_mask: Optional[torch.Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    block_size: int = BSAConfig.block_size,
    top_k: int = BSAConfig.top_k,
    force_sink: bool = BSAConfig.force_sink,
    force_previous: bool = BSAConfig.force_previous,
    sliding_window: int = BSAConfig.sliding_window,
    chunk_size: int = BSAConfig.chunk_size,
) -> torch.Tensor:
    """BSA block selection: ``[B, Hkv, Nq, top_k]`` int64 leaf block ids per query token, shared
    by the query heads of a GQA group, ascending, ``-1`` padded; exactly
    ``min(top_k, #visible blocks)`` distinct visible blocks, forced blocks included (width
    ``min(top_k, #blocks)``: a larger ``top_k`` is the exact mode at its cost). With a local
    window (causal only) the visible blocks are those from the window's first block on."""
    tb.check_window(sliding_window, chunk_size, is_causal)
    with torch.no_grad():
        idx, _ = _select(
            q,
            k,
            key_padding_mask=key_padding_mask,
            is_causal=is_causal,
            scale=scale,
            block_size=block_size,
            top_k=top_k,
            force_sink=force_sink,
            force_previous=force_previous,
            sliding_window=sliding_window,
            chunk_size=chunk_size,
        )
    return idx


def bsa_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    config: Optional[BSAConfig] = None,
    *,
    key_padding_mask: Optional[torch.Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    return_selection: bool = False,
    **fields,
):
    """BSA attention: full-scan top-K selection (no gradient), then attention over the selected
    blocks (differentiable in q, k, v). Returns ``[B, Hq, Nq, D]`` in ``q.dtype``, plus the :class:`Selection` when
    ``return_selection``. A config's local window: the top-K inside each query's window, and the
    window's bound on the keys of its first block."""
    cfg = backend_config(BSAConfig, config, fields)
    block_size, top_k, force_sink = cfg.block_size, cfg.top_k, cfg.force_sink
    force_previous = cfg.force_previous
    window = dict(sliding_window=cfg.sliding_window, chunk_size=cfg.chunk_size)
    with torch.no_grad():
        idx, n_visible = _select(
            q.detach(),
            k.detach(),
            key_padding_mask=key_padding_mask,
            is_causal=is_causal,
            scale=scale,
            block_size=block_size,
            top_k=top_k,
            force_sink=force_sink,
            force_previous=force_previous,
            **window,
        )
    out = tb.attend_selected_blocks(
        q,
        k,
        v,
        idx,
        key_padding_mask=key_padding_mask,
        is_causal=is_causal,
        scale=scale,
        block_size=block_size,
        **window,
    )
    if not return_selection:
        return out
    sel = tb.make_selection(
        "bsa",
        idx,
        n_visible,
        num_query_heads=q.shape[1],
        block_size=block_size,
        is_causal=is_causal,
        num_keys=k.shape[2],
        key_padding_mask=key_padding_mask,
        **window,
    )
    return out, sel


def bsa_reference_selection(q: torch.Tensor, k: torch.Tensor, cfg: BSAConfig, **call):
    """The :class:`~sparseflow.selection.Selection` :func:`bsa_attention` reports, without the
    attention (the registry's ``selection``; ``call``: ``key_padding_mask``, ``is_causal``, ``scale``)."""
    return reference_top_k_selection("bsa", bsa_select, q, k, cfg, **call)
