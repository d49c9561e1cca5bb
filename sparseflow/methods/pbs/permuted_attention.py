"""PBS reference, stage 4: the attention over a block selection.

:func:`permuted_block_attention` -- softmax attention of every query over the keys of its
selected permuted blocks, element mask by original position (``orig_pos(k) <= pos(q)`` when
causal, and the window's lower bound under a local window: :mod:`.block_selection`'s
docstring), key padding applied, zeros for a query that sees no key. Differentiable in q, k, v.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional

import torch
from torch import Tensor

from ...kernels.token_blocks import check_window, window_lower_bounds
from .config import PBSConfig
from .reference_common import num_blocks, padded_permutation, slot_validity, softmax_scale

__all__ = [
    "permuted_block_attention",
]

_NEG_INF = float("-inf")


class _Geometry(NamedTuple):
    """What every (batch row, KV group, query block) of one permuted_block_attention call shares."""

    n: int
    d: int
    dv: int
    g: int  # query heads per KV head
    block_size: int
    nb: int
    shared: bool  # one permutation per KV head (else one per query head)
    sc: float
    acc: torch.dtype  # accumulation dtype
    is_causal: bool
    gather_below: float
    zero_f: Tensor
    window_lo: Optional[Tensor] = None  # [N]: each query's first visible key (a local window); None: none


class _BlockColumns(NamedTuple):
    """The permuted key columns one query block attends and the masks over them."""

    cols: Tensor  # permuted slots, [nc]
    gather: bool  # gather ``cols`` (else the contiguous prefix ``:nc``)
    hide: Optional[Tensor]  # [G or 1, 1 or bq, nc] True = not attended; None: all attended
    empty: Optional[Tensor]  # [G, bq] True = the query sees no key; None: every query sees one


def permuted_block_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    permutation: Tensor,
    block_mask: Tensor,
    *,
    key_padding_mask: Optional[Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    block_size: int = PBSConfig.block_size,
    gather_below: float = 0.85,
    sliding_window: int = PBSConfig.sliding_window,
    chunk_size: int = PBSConfig.chunk_size,
) -> Tensor:
    """``[B, Hq, N, Dv]`` in q.dtype: each query attends the keys of its selected permuted blocks
    (``orig_pos(k) <= pos(q)`` when causal, and ``orig_pos(k) >= lo(pos(q))`` under a local
    window; padded keys never), fp32 accumulation, zeros for a query with no visible key (fp64
    when given fp64). Differentiable in q, k, v.

    Works per (batch row, KV group, query block): the group's keys are permuted once per head
    (``[G, N, D]`` fp32, one group at a time; one copy when the permutation is per KV head), then
    one batched score matrix covers the group's query heads over either the contiguous permuted
    prefix up to the last selected block or, when the union of the heads' selected blocks is
    below ``gather_below`` of that prefix, over the gathered union. An additive bias carries the
    per-head block selection and key validity (broadcast over query rows) and, on the trailing
    columns from the first block holding a key later than the block's first query, the element
    mask ``orig_pos(k) <= pos(q)`` (with a window: on every column, with its lower bound too).
    Memory O(G · N · D + G · bs · N)."""
    check_window(sliding_window, chunk_size, is_causal)
    bsz, hq, n, d = q.shape
    hkv = k.shape[1]
    hp = permutation.shape[1]
    g = hq // hkv
    dv = v.shape[-1]
    sc = softmax_scale(scale, d)
    nb = num_blocks(n, block_size)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32  # fp64 stays fp64 (oracles)
    if bsz == 0:  # an empty batch: the empty result, still connected to q, k, v for autograd
        return (q.new_zeros(0, hq, n, dv) + 0 * q.sum() + 0 * k.sum() + 0 * v.sum()).to(q.dtype)
    geo = _Geometry(
        n=n,
        d=d,
        dv=dv,
        g=g,
        block_size=block_size,
        nb=nb,
        shared=hp != hq,
        sc=sc,
        acc=acc,
        is_causal=is_causal,
        gather_below=gather_below,
        zero_f=torch.tensor(0.0, dtype=acc, device=q.device),
        window_lo=(
            window_lower_bounds(torch.arange(n, device=q.device), sliding_window, chunk_size)
            if sliding_window or chunk_size
            else None
        ),
    )
    with torch.no_grad():
        perm_p = padded_permutation(permutation, nb, block_size)  # [B, Hp, total], -1 past N
        slot_ok = slot_validity(permutation, key_padding_mask, nb, block_size)  # [B, Hp, total]
        kmax = perm_p.view(bsz, hp, nb, block_size).amax(dim=-1)  # latest original key per block
    rows: List[Tensor] = []
    for b in range(bsz):
        groups = [_group_attention(q, k, v, block_mask, perm_p, slot_ok, kmax, b, kvh, geo) for kvh in range(hkv)]
        rows.append(torch.cat(groups, dim=0))
    return torch.stack(rows, dim=0).to(q.dtype)


def _group_attention(q, k, v, block_mask, perm_p, slot_ok, kmax, b: int, kvh: int, geo: _Geometry) -> Tensor:
    """``[G, N, Dv]``: the outputs of KV head ``kvh``'s query heads in batch row ``b``, query block
    by query block over the group's permuted keys (permuted once here)."""
    n, d, dv, g, acc = geo.n, geo.d, geo.dv, geo.g, geo.acc
    dev = q.device
    heads = slice(kvh * g, (kvh + 1) * g)
    hps = slice(kvh, kvh + 1) if geo.shared else heads
    with torch.no_grad():
        pidx = torch.where(perm_p[b, hps] < 0, torch.full_like(perm_p[b, hps], n), perm_p[b, hps])
        gpos = perm_p[b, hps]  # [P, total], P = 1 (shared) or G
        gok = slot_ok[b, hps]
        gkmax = kmax[b, hps].amax(dim=0)  # [nB], over the group's permutations
        bm = block_mask[b, heads]  # [G, nB, nB]
    kf = torch.cat([k[b, kvh].to(acc), k.new_zeros(1, d, dtype=acc)], dim=0)
    vf = torch.cat([v[b, kvh].to(acc), v.new_zeros(1, dv, dtype=acc)], dim=0)
    # permuted keys/values [P, total, D], zero in the slots past N and the padded ones
    # (probability 0 times a NaN value, or gradient 0 times a NaN key, is still NaN)
    zero = torch.zeros((), dtype=acc, device=dev)
    kp = torch.where(gok[..., None], kf[pidx], zero)
    vp = torch.where(gok[..., None], vf[pidx], zero)
    qg = q[b, heads].to(acc)  # [G, N, D]
    outs: List[Tensor] = []
    for i in range(geo.nb):
        q0, q1 = i * geo.block_size, min(n, (i + 1) * geo.block_size)
        with torch.no_grad():
            blk = _block_columns(bm[:, i], gok, gpos, gkmax, q0, q1, geo)
        if blk is None:
            outs.append(qg.new_zeros(g, q1 - q0, dv))
            continue
        if blk.gather:
            kk, vv = kp[:, blk.cols], vp[:, blk.cols]
        else:
            kk, vv = kp[:, : blk.cols.numel()], vp[:, : blk.cols.numel()]
        outs.append(_block_output(qg[:, q0:q1] * geo.sc, kk, vv, blk, geo))
    return torch.cat(outs, dim=1)


def _block_columns(
    sel: Tensor, gok: Tensor, gpos: Tensor, gkmax: Tensor, q0: int, q1: int, geo: _Geometry
) -> Optional[_BlockColumns]:
    """The columns query block ``[q0, q1)`` attends, given its per-head block selection ``sel``
    ``[G, nB]`` (None when no head selected any block): the contiguous permuted prefix up to the
    last selected block, or the gathered union when that is below ``gather_below`` of the prefix.
    The element mask ``orig_pos(k) <= pos(q)`` covers only the trailing columns from the first
    block holding a key later than the block's first query; under a local window it covers every
    column, with the window's lower bound."""
    g, block_size = geo.g, geo.block_size
    dev = sel.device
    bq = q1 - q0
    used = sel.any(dim=0).nonzero().squeeze(1)
    if used.numel() == 0:
        return None
    qpos = torch.arange(geo.n, device=dev)
    offs = torch.arange(block_size, device=dev)
    last = int(used[-1]) + 1
    gather = used.numel() < geo.gather_below * last
    blocks = used if gather else torch.arange(last, device=dev)
    nblk = blocks.numel()
    cols = (blocks[:, None] * block_size + offs[None, :]).reshape(-1)
    ncols = cols.numel()
    col_ok = sel[:, blocks, None].expand(g, nblk, block_size).reshape(g, ncols) & gok[:, cols]
    hide = None if bool(col_ok.all()) else ~col_ok[:, None, :]  # [G, 1, nc]
    late = (gkmax[blocks] > q0).nonzero() if geo.is_causal else blocks[:0]
    p0 = int(late[0]) * block_size if late.numel() else ncols  # element mask on p0..
    if geo.window_lo is not None:
        p0 = 0  # (a permuted block holds keys of its whole segment: any column may precede a window)
    if p0 < ncols:
        key_pos = gpos[:, cols[p0:]][:, None, :]
        late_vis = key_pos <= qpos[q0:q1, None]  # [P, bq, nl]
        if geo.window_lo is not None:
            late_vis = late_vis & (key_pos >= geo.window_lo[q0:q1, None])
        future = torch.cat([late_vis.new_zeros(late_vis.shape[0], bq, p0), ~late_vis], dim=-1)
        hide = future if hide is None else hide | future  # [G or 1, bq, nc]
        seen = (late_vis & col_ok[:, None, p0:]).any(dim=-1)  # [G, bq]
        if p0:
            seen |= col_ok[:, :p0].any(dim=-1)[:, None]
    else:
        seen = col_ok.any(dim=-1)[:, None].expand(g, bq)
    empty = ~seen if not bool(seen.all()) else None  # [G, bq]: query sees no key
    return _BlockColumns(cols, gather, hide, empty)


def _block_output(qs: Tensor, kk: Tensor, vv: Tensor, blk: _BlockColumns, geo: _Geometry) -> Tensor:
    """``[G, bq, Dv]``: softmax attention of the scaled queries ``qs`` over the block's columns
    ``kk, vv`` ``[P, nc, D]`` with its masks; zeros for a query that sees no key."""
    g, d, dv = geo.g, geo.d, geo.dv
    bq, ncols = qs.shape[1], kk.shape[1]
    hide, empty = blk.hide, blk.empty
    if geo.shared:  # one GEMM for the whole group
        s = torch.matmul(qs.reshape(g * bq, d), kk[0].t()).view(g, bq, ncols)
    else:
        s = torch.bmm(qs, kk.transpose(1, 2))
    if hide is not None:
        # masked_fill, not an additive -inf bias: a NaN/inf logit of a hidden key (padded,
        # unselected or in the query's future) must not reach the softmax
        s = s.masked_fill(hide, _NEG_INF)
    if empty is not None:
        s = torch.where(empty[..., None], geo.zero_f, s)  # finite rows; output zeroed below
    pr = torch.softmax(s, dim=-1)
    if geo.shared:
        o = torch.matmul(pr.reshape(g * bq, ncols), vv[0]).view(g, bq, dv)
    else:
        o = torch.bmm(pr, vv)
    if empty is not None:
        o = torch.where(empty[..., None], torch.zeros((), dtype=o.dtype, device=o.device), o)
    return o
