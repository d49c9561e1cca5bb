"""The leaf-pairs PISA walk (``Tuning(pisa_walk="leaf_pairs")``): the scan walk without its node
table, for lengths the table does not fit.

The scan walk (``triton_select_scan``) scores every node above the leaves for every query in a
``[B*Hkv, Nq, nodes]`` table, which grows as ``N**2`` and stops fitting its budget near 64K
tokens; past it the per-token walk took the whole call, its leaf level included. Here the
per-token kernel scores the nodes above the leaves itself (``PRE_SCORES`` off: ``O(K log N)``
summaries a query, in ``Tuning.pisa_scores``' arithmetic) and stops at the leaf candidates
(``LEAF_OUT``); the scan's stages 3 and 4 then score the (query, leaf) pairs grouped by leaf,
each leaf's raw keys loaded once for a chunk of queries in a tensor-core dot, and keep each
query's ``top_k``. The per-token walk's leaf level, which loads each candidate leaf's keys for one
query, is most of its work at long lengths (``16 * C`` keys a query at K=8 against ``2 K log N``
summaries). Memory: ``12 * B * Hkv * Nq * CW`` bytes (candidates, ranks and pair scores).

Selections equal the per-token walk's (tests/methods/pisa/test_pisa_leaf_pairs.py).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.library import triton_op

from .config import PISAConfig
from .triton_select_common import candidate_width, walk_meta, window_args
from .triton_select_scan import WalkCall, leaf_pairs_cover, walk_then_leaf_pairs
from ...kernels.pdl import pdl_launch

__all__ = ["pairs_covers", "pairs_walk_covers", "pisa_select_pairs_fwd", "pairs_walk"]


# the leaf-pairs walk is the scan's stages 2-4: their rules, without the table's budget
pairs_covers = leaf_pairs_cover


def pairs_walk_covers(q, k, block_size: int, top_k: int, beam: int, branching: int) -> Optional[str]:
    """Why the leaf-pairs walk does not take a call of queries ``q`` and keys ``k``
    (:func:`pairs_covers` of its leaves and candidate slots, int32 pair indices), or None."""
    slots = q.shape[0] * k.shape[1] * q.shape[2] * candidate_width(beam, top_k, branching)
    return pairs_covers(max(1, -(-k.shape[2] // block_size)), top_k, slots)


@triton_op("sparseflow::pisa_select_pairs_fwd", mutates_args={})
def pisa_select_pairs_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    kpm: Optional[torch.Tensor],
    summ: torch.Tensor,
    nfv: torch.Tensor,
    lvl_off: torch.Tensor,
    lvl_span: torch.Tensor,
    scale: float,
    is_causal: bool,
    score: int,
    block_size: int,
    branching: int,
    top_k: int,
    force_sink: bool,
    force_previous: bool,
    beam: int,
    warps: Optional[int] = None,
    pdl: bool = False,
    sliding_window: int = PISAConfig.sliding_window,
    chunk_size: int = PISAConfig.chunk_size,
    scores: str = "fp32",
) -> torch.Tensor:
    return pairs_walk(
        q,
        k,
        kpm,
        summ,
        nfv,
        lvl_off,
        lvl_span,
        scale,
        is_causal,
        score,
        block_size,
        branching,
        top_k,
        force_sink,
        force_previous,
        beam,
        warps,
        pdl,
        sliding_window,
        chunk_size,
        scores,
    )


def pairs_walk(
    q: torch.Tensor,
    k: torch.Tensor,
    kpm: Optional[torch.Tensor],
    summ: torch.Tensor,
    nfv: torch.Tensor,
    lvl_off: torch.Tensor,
    lvl_span: torch.Tensor,
    scale: float,
    is_causal: bool,
    score: int,
    block_size: int,
    branching: int,
    top_k: int,
    force_sink: bool,
    force_previous: bool,
    beam: int,
    warps: Optional[int] = None,
    pdl: bool = False,
    sliding_window: int = PISAConfig.sliding_window,
    chunk_size: int = PISAConfig.chunk_size,
    scores: str = "fp32",
    trace: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The body of the op :func:`pisa_select_pairs_fwd` (its arguments); ``trace``: None, or an
    int32 ``[B*Hkv, Nq, levels, KP]`` tensor (-1 filled) that receives the walk's kept nodes of
    every level above the leaves (``triton_trace``, tests only: not an op argument)."""
    b, _, n_q, _ = q.shape
    out = torch.empty(b, k.shape[1], n_q, top_k, dtype=torch.int32, device=q.device)
    if n_q == 0:
        return out
    why = pairs_walk_covers(q, k, block_size, top_k, beam, branching)
    if why is not None:  # every leaf kept without a candidate written, or slots past int32
        raise ValueError(f"the leaf-pairs walk does not take this call: {why}")
    meta = walk_meta(
        q, k, kpm, summ, lvl_span, is_causal, score, force_sink, force_previous, block_size, branching, top_k, beam
    )
    window = window_args(sliding_window, chunk_size)
    call = WalkCall(q, k, kpm, summ, nfv, lvl_off, lvl_span, out, scale, meta, pdl_launch(q, pdl), window)
    return walk_then_leaf_pairs(call, None, beam, warps, scores, trace)


@pisa_select_pairs_fwd.register_fake
def _(
    q,
    k,
    kpm,
    summ,
    nfv,
    lvl_off,
    lvl_span,
    scale,
    is_causal,
    score,
    block_size,
    branching,
    top_k,
    force_sink,
    force_previous,
    beam,
    warps=None,
    pdl=False,
    sliding_window=PISAConfig.sliding_window,
    chunk_size=PISAConfig.chunk_size,
    scores="fp32",
):
    return q.new_empty(q.shape[0], k.shape[1], q.shape[2], top_k, dtype=torch.int32)
