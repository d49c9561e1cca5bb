"""PBS under context parallelism (:mod:`sparseflow.context_parallel`).

The permutation needs the proxy queries (the last block of the sequence, and more with
``proxy_blocks``), and a query block straddling a shard boundary needs its rows from the
neighbour: those rows are shared by one small all-reduce. The selection and the block-sparse
attention then run on a full-length query tensor holding the rank's rows (zeros elsewhere), with
the block lists of other ranks' query blocks emptied so no work is spent on them. Each rank thus
selects exactly what the single-device op selects.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from ...context_parallel import SEQ_DIM, Layout, share_rows
from ...tuning import DEFAULT_TUNING, Tuning

__all__ = ["shared_rows", "shared_pbs_rows"]


def shared_pbs_rows(layout: Layout, block_size: int, segment_size: int, proxy_blocks: int, device) -> Tensor:
    """Sorted global positions every rank needs besides its own: the proxy rows and the rows of
    every query block that straddles a shard boundary."""
    from .permutation import proxy_queries

    n = layout.total
    parts = [
        rows
        for rows, _ in proxy_queries(
            None, 1, n, block_size=block_size, segment_size=segment_size, proxy_blocks=proxy_blocks, device=device
        )[0]
    ]
    for r in range(layout.world):
        for s, e in layout.chunks(r):
            for edge in (s, e):
                if 0 < edge < n and edge % block_size:
                    b0 = edge // block_size * block_size
                    parts.append(torch.arange(b0, min(n, b0 + block_size), device=device))
    if not parts:
        return torch.zeros(0, dtype=torch.long, device=device)
    return torch.unique(torch.cat(parts))


def _pbs_queries(q: Tensor, layout: Layout, pg, kwargs) -> Tuple[Tensor, Tensor]:
    """(full-length queries holding the rank's rows and the shared ones, zeros elsewhere;
    the rank's global positions)."""
    b, h, _, d = q.shape
    own = layout.positions(device=q.device)
    extra = shared_pbs_rows(layout, kwargs["block_size"], kwargs["segment_size"], kwargs["proxy_blocks"], q.device)
    rows = share_rows(q, extra, layout, pg)
    full = q.new_zeros(b, h, layout.total, d).index_copy(SEQ_DIM, extra, rows)
    return full.index_copy(SEQ_DIM, own, q), own


def _pbs_permutation(q_full: Tensor, k_all: Tensor, kwargs, scale, kernels: bool) -> Tensor:
    from .permutation import key_scores, segment_permutation

    bsz, hq, n, _ = q_full.shape
    hp = hq if kwargs["gqa_permutation"] == "query_head" else k_all.shape[1]
    if not kwargs["permute"]:
        return torch.arange(n, device=q_full.device).expand(bsz, hp, n).clone()
    if kernels:
        from . import triton_select as sel

        score_fn, perm_fn = sel.key_scores, sel.segment_permutation
    else:
        score_fn, perm_fn = key_scores, segment_permutation
    names = ("block_size", "segment_size", "causal_proxy", "gqa_permutation", "proxy_blocks")
    scores = score_fn(q_full, k_all, key_padding_mask=None, scale=scale, **{x: kwargs[x] for x in names})
    return perm_fn(scores, segment_size=kwargs["segment_size"], key_padding_mask=None)


def _owned_blocks(own: Tensor, n: int, block_size: int) -> Tensor:
    """``[nB]`` bool: the query blocks holding one of the rank's rows."""
    owned = torch.zeros(-(-n // block_size), dtype=torch.bool, device=own.device)
    owned[own // block_size] = True
    return owned


def _pbs_local(
    q,
    k_all,
    v_all,
    layout: Layout,
    pg,
    cfg,
    kwargs,
    is_causal: bool,
    scale,
    backend: str,
    tuning: Tuning = DEFAULT_TUNING,
) -> Tensor:
    """PBS for the rank's query blocks: the single-device selection, restricted to them."""
    from .block_selection import select_blocks
    from .permuted_attention import permuted_block_attention

    q_full, own = _pbs_queries(q, layout, pg, kwargs)
    # the Triton PBS kernel is forward-only: a call that needs gradients runs the reference stages,
    # which select the same blocks (as the single-device op's backward does)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_all, v_all))
    kernels = backend == "triton" and _pbs_kernels(q, tuning) and not needs_grad
    with torch.no_grad():
        perm = _pbs_permutation(q_full.detach(), k_all.detach(), kwargs, scale, kernels)
    owned = _owned_blocks(own, layout.total, kwargs["block_size"])
    geo = dict(key_padding_mask=None, is_causal=is_causal, scale=scale, block_size=kwargs["block_size"])
    if kernels:
        from .triton_impl import select_and_attend

        out, _ = select_and_attend(
            q_full,
            k_all,
            v_all,
            perm,
            segment_size=kwargs["segment_size"],
            threshold=kwargs["threshold"],
            force_sink=kwargs["force_sink"],
            mask_segment=kwargs["segment_size"] if kwargs["permute"] else kwargs["block_size"],
            want_mask=False,
            scoring=kwargs["scoring"],
            antidiagonal_stride=kwargs["antidiagonal_stride"],
            moments_sd=kwargs["moments_sd"],
            tuning=tuning,
            owned=owned,
            **geo,
        )
    else:
        with torch.no_grad():
            block_mask = select_blocks(
                q_full.detach(),
                k_all.detach(),
                perm,
                segment_size=kwargs["segment_size"],
                threshold=kwargs["threshold"],
                force_sink=kwargs["force_sink"],
                scoring=kwargs["scoring"],
                antidiagonal_stride=kwargs["antidiagonal_stride"],
                moments_sd=kwargs["moments_sd"],
                **geo,
            )
            block_mask[:, :, ~owned] = False  # other ranks' query blocks: no work
        out = permuted_block_attention(q_full, k_all, v_all, perm, block_mask, **geo)
    return out.index_select(SEQ_DIM, own).contiguous()


def shared_rows(method, q, k_all, v_all, layout, pg, config, kwargs, is_causal, scale, chosen, tuning) -> Tensor:
    """PBS's strategy (``MethodSpec.context_parallel``): the proxy and boundary query rows shared,
    the single-device selection restricted to the rank's query blocks."""
    return _pbs_local(q, k_all, v_all, layout, pg, config, kwargs, is_causal, scale, chosen, tuning)


def _pbs_kernels(q: Tensor, tuning: Tuning = DEFAULT_TUNING) -> bool:
    """The Triton selection and attention (CUDA, or the interpreter with ``Tuning(pbs_select="triton")``)."""
    from . import triton_gather, triton_impl

    return triton_gather._use_kernels(q) and triton_impl.select_impl(q.device, tuning) == "triton"
