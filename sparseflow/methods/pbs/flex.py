"""PBS-Attn on FlexAttention (``backend="flex"``).

The selection is the reference's (:func:`key_scores` -> :func:`segment_permutation` ->
:func:`select_blocks`, same Selection); the attention is compiled ``flex_attention`` over the
*permuted* keys with a BlockMask built from the selected block indices:

* K/V are gathered into the permuted order. ``gqa_permutation="kv_head"``: one permutation per KV
  head, so K/V keep ``Hkv`` heads and flex runs with native GQA (``enable_gqa=True``).
  ``"query_head"`` (the default): every query head has its own order, so the permuted K/V have
  ``Hq`` heads (``G`` times the K/V memory, gathered in one copy per tensor -- K/V are never
  repeated first).
* ``BLOCK_SIZE = block_size`` for queries and keys; the BlockMask's block lists are the selected
  permuted key blocks per query block. A selected block whose keys are all valid and (causal)
  all at original positions ``<= `` the query block's first position is a *full* block (no
  ``mask_mod``): every block of an earlier segment, the sink block, and own-segment blocks that
  happen to lie entirely in the past. All others (diagonal segment, tail, blocks holding padding)
  are *partial*: ``mask_mod`` looks up ``vis_pos[b, hp, kv_idx]`` -- the key's original position,
  or a sentinel for padded keys and slots past N -- and keeps it iff ``vis_pos <= q_idx`` (causal)
  or ``vis_pos < sentinel`` (non-causal).
* A local window (``sliding_window`` / ``chunk_size``, causal only): the reference's selection
  inside the window; a block is full only if, besides the above, its earliest key lies at or
  after the window's lower bound of the query block's last row (otherwise partial), and
  ``mask_mod`` also keeps a key only if ``vis_pos >= lo(q_idx)``.
* The sequence is padded to :func:`~sparseflow.kernels.flex_common.bucketed_length` (bounded number
  of compiled shapes); padded query blocks select nothing and are sliced off.
* On CUDA, where :func:`~sparseflow.kernels.flex_common.flex_plan` finds no Triton kernel Inductor
  accepts (block sizes not multiples of 16; with gradients, no flex backward config dividing the
  block size), the reference's attention over the same selection runs instead (logged).
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from ...config import backend_config
from .config import PBSConfig
from .tail import apply_tail
from ...selection import Selection
from ...kernels import flex_common as fc
from ...kernels.token_blocks import check_window, window_lower_bounds
from .block_selection import select_blocks
from .permutation import key_scores, segment_permutation
from .permuted_attention import permuted_block_attention
from .reference import pbs_report
from .memory import check_selection_memory

__all__ = ["pbs_attention", "pbs_block_mask"]


def _padded_perm(perm: Tensor, total: int) -> Tensor:
    return fc.pad_seq(perm, total, dim=2, value=-1)


@torch.no_grad()
def pbs_block_mask(
    block_mask: Tensor,
    permutation: Tensor,
    *,
    n: int,
    total: int,
    key_padding_mask: Optional[Tensor],
    is_causal: bool,
    block_size: int,
    need_backward: bool = False,
    sliding_window: int = PBSConfig.sliding_window,
    chunk_size: int = PBSConfig.chunk_size,
):
    """The flex ``BlockMask`` (over ``total`` padded positions) of a PBS selection, plus the
    ``vis_pos`` table its ``mask_mod`` reads. ``block_mask [B, Hq, nB, nB]`` over permuted key
    blocks, ``permutation [B, Hp, N]``; ``sliding_window`` / ``chunk_size``: the call's local
    window (causal only), applied by ``mask_mod`` wherever a key may precede it."""
    from torch.nn.attention.flex_attention import BlockMask

    check_window(sliding_window, chunk_size, is_causal)
    window = (sliding_window, chunk_size)
    hq, hp, bs = block_mask.shape[1], permutation.shape[1], block_size
    sentinel = total  # > every query index
    vis_pos = _visible_positions(permutation, key_padding_mask, n=n, total=total, sentinel=sentinel)
    full, partial = _full_and_partial_blocks(
        block_mask, vis_pos, n=n, sentinel=sentinel, is_causal=is_causal, block_size=bs, window=window
    )
    kv_num, kv_idx = fc.block_lists(partial)
    full_num, full_idx = fc.block_lists(full)
    bm = BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=(bs, bs),
        mask_mod=_mask_mod(vis_pos, hq // hp, is_causal, sentinel, window),
        seq_lengths=(total, total),
        compute_q_blocks=need_backward,
    )
    return bm, vis_pos


def _visible_positions(
    permutation: Tensor, key_padding_mask: Optional[Tensor], *, n: int, total: int, sentinel: int
) -> Tensor:
    """``vis_pos [B, Hp, total]`` int32: each permuted slot's original key position, or
    ``sentinel`` for padded keys and slots past N."""
    bsz, hp = permutation.shape[:2]
    perm_p = _padded_perm(permutation, total)  # [B, Hp, total], -1 past N
    valid = perm_p >= 0
    if key_padding_mask is not None:
        kpm = key_padding_mask.to(device=permutation.device, dtype=torch.bool)
        valid = valid & torch.gather(kpm[:, None, :].expand(bsz, hp, n), 2, perm_p.clamp_min(0))
    return torch.where(valid, perm_p, torch.full_like(perm_p, sentinel)).to(torch.int32)


def _key_block_stats(vis_pos: Tensor, hq: int, bs: int, sentinel: int) -> Tuple[Tensor, ...]:
    """Per query head and permuted key block ``[B, Hq, nBp]``: whether all / any of its keys are
    valid, its latest valid key position (-1: none) and its earliest (``sentinel``: none)."""
    bsz, hp, total = vis_pos.shape
    blocks = vis_pos.view(bsz, hp, total // bs, bs)
    all_valid = (blocks < sentinel).all(-1)  # [B, Hp, nBp]
    any_valid = (blocks < sentinel).any(-1)
    kmax = torch.where(blocks < sentinel, blocks, torch.full_like(blocks, -1)).amax(-1)  # [B, Hp, nBp]
    kmin = blocks.amin(-1)  # sentinel when the block holds no valid key
    head_map = torch.arange(hq, device=vis_pos.device) // (hq // hp)
    return tuple(t[:, head_map] for t in (all_valid, any_valid, kmax, kmin))


def _full_and_partial_blocks(
    block_mask: Tensor,
    vis_pos: Tensor,
    *,
    n: int,
    sentinel: int,
    is_causal: bool,
    block_size: int,
    window: Tuple[int, int] = (0, 0),
) -> Tuple[Tensor, Tensor]:
    """The selected blocks ``[B, Hq, nBp, nBp]`` split into full ones (no ``mask_mod`` needed)
    and partial ones (some but not all keys visible); padded query blocks get neither. Under a
    local ``window`` a block is full only if its earliest key is inside every row's window, and
    of use only if its latest key is inside the first row's."""
    bsz, hq, nb, _ = block_mask.shape
    bs = block_size
    nbp = vis_pos.shape[2] // bs
    dev = block_mask.device
    all_valid, any_valid, kmax, kmin = _key_block_stats(vis_pos, hq, bs, sentinel)
    sel = torch.zeros(bsz, hq, nbp, nbp, dtype=torch.bool, device=dev)
    sel[:, :, :nb, :nb] = block_mask.to(dev)
    if is_causal:
        q_first = torch.arange(nbp, device=dev) * bs  # [nBp]
        q_last = (q_first + bs - 1).clamp_max(n - 1)
        full = all_valid[:, :, None, :] & (kmax[:, :, None, :] <= q_first[None, None, :, None])
        useful = kmin[:, :, None, :] <= q_last[None, None, :, None]  # some element visible
        if window != (0, 0):  # the bound rises with the row: the last row's is the highest
            full = full & (kmin[:, :, None, :] >= window_lower_bounds(q_last, *window)[None, None, :, None])
            useful = useful & (kmax[:, :, None, :] >= window_lower_bounds(q_first, *window)[None, None, :, None])
    else:
        full = all_valid[:, :, None, :].expand(bsz, hq, nbp, nbp)
        useful = any_valid[:, :, None, :].expand(bsz, hq, nbp, nbp)
    full = sel & full
    partial = sel & ~full & useful
    # padded query blocks (past N) attend nothing
    q_real = (torch.arange(nbp, device=dev) * bs < n)[None, None, :, None]
    return full & q_real, partial & q_real


def _mask_mod(vis_pos: Tensor, ratio: int, is_causal: bool, sentinel: int, window: Tuple[int, int] = (0, 0)):
    """The flex ``mask_mod`` of the partial blocks: a key is kept iff its original position is
    ``<= q_idx`` (causal) or it is a real key (non-causal); ``ratio`` query heads share a row.
    A local ``window`` (causal only) also needs the position at or after ``q_idx``'s bound."""
    if window != (0, 0):
        return _windowed_mask_mod(vis_pos, ratio, window)
    if is_causal:
        if ratio == 1:

            def mask_mod(b, h, q_idx, kv_idx):
                return vis_pos[b, h, kv_idx] <= q_idx
        else:

            def mask_mod(b, h, q_idx, kv_idx):
                return vis_pos[b, h // ratio, kv_idx] <= q_idx
    else:
        if ratio == 1:

            def mask_mod(b, h, q_idx, kv_idx):
                return vis_pos[b, h, kv_idx] < sentinel
        else:

            def mask_mod(b, h, q_idx, kv_idx):
                return vis_pos[b, h // ratio, kv_idx] < sentinel

    return mask_mod


def _windowed_mask_mod(vis_pos: Tensor, ratio: int, window: Tuple[int, int]):
    """The causal ``mask_mod`` with the window's lower bound: ``lo(q_idx) <= vis_pos <= q_idx``
    (a padded key's sentinel fails the upper side)."""

    def mask_mod(b, h, q_idx, kv_idx):
        pos = vis_pos[b, h // ratio, kv_idx]
        return (pos <= q_idx) & (pos >= window_lower_bounds(q_idx, *window))

    return mask_mod


def pbs_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    config: Optional[PBSConfig] = None,
    *,
    key_padding_mask: Optional[Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    return_selection: bool = False,
    **fields,
) -> Union[Tensor, Tuple[Tensor, Selection]]:
    """PBS-Attn prefill with compiled FlexAttention. Same signature, selection and result (to
    floating-point tolerance) as :func:`sparseflow.methods.pbs.reference.pbs_attention`."""
    cfg = backend_config(PBSConfig, config, fields)
    check_selection_memory(q, cfg.block_size)
    fc.check_flex_inputs(q, k, v)
    n, d = q.shape[2], q.shape[3]
    if k.shape[2] != n:
        raise ValueError(f"PBS is a prefill method: needs Nq == Nk, got Nq={n}, Nk={k.shape[2]}")
    if cfg.gqa_permutation not in ("query_head", "kv_head"):
        raise ValueError(f"gqa_permutation must be 'query_head' or 'kv_head', got {cfg.gqa_permutation!r}")
    check_window(cfg.sliding_window, cfg.chunk_size, is_causal)
    window = dict(sliding_window=cfg.sliding_window, chunk_size=cfg.chunk_size)
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.to(device=q.device, dtype=torch.bool)
    bs = cfg.block_size
    grad = fc.needs_grad(q, k, v)  # before no_grad, inside which it would always be False
    with torch.no_grad():
        perm, block_mask = _select(q.detach(), k.detach(), cfg, key_padding_mask, is_causal, scale)
        plan = fc.flex_plan(q.device, bs, bs, d, q.dtype, needs_grad=grad)
    if plan.fallback:
        out = permuted_block_attention(
            q,
            k,
            v,
            perm,
            block_mask,
            key_padding_mask=key_padding_mask,
            is_causal=is_causal,
            scale=scale,
            block_size=bs,
            **window,
        )
    else:
        out = _flex_over_selection(
            q, k, v, perm, block_mask, key_padding_mask, is_causal, scale, bs, plan, grad, tuple(window.values())
        )
    out, block_mask = apply_tail(
        out, block_mask, q, k, v, cfg, key_padding_mask=key_padding_mask, is_causal=is_causal, scale=scale
    )
    if not return_selection:
        return out
    return out, pbs_report(block_mask, perm, cfg, key_padding_mask=key_padding_mask, is_causal=is_causal)


def _select(qd: Tensor, kd: Tensor, cfg: PBSConfig, key_padding_mask, is_causal, scale) -> Tuple[Tensor, Tensor]:
    """The reference's ``(permutation [B, Hp, N], block_mask [B, Hq, nB, nB])`` for ``cfg``."""
    bsz, hq, n = qd.shape[:3]
    if cfg.permute:
        scores = key_scores(
            qd,
            kd,
            key_padding_mask=key_padding_mask,
            scale=scale,
            block_size=cfg.block_size,
            segment_size=cfg.segment_size,
            causal_proxy=cfg.causal_proxy,
            gqa_permutation=cfg.gqa_permutation,
            proxy_blocks=cfg.proxy_blocks,
        )
        perm = segment_permutation(scores, segment_size=cfg.segment_size, key_padding_mask=key_padding_mask)
    else:
        hp = hq if cfg.gqa_permutation == "query_head" else kd.shape[1]
        perm = torch.arange(n, device=qd.device).expand(bsz, hp, n).clone()
    block_mask = select_blocks(
        qd,
        kd,
        perm,
        key_padding_mask=key_padding_mask,
        is_causal=is_causal,
        scale=scale,
        block_size=cfg.block_size,
        segment_size=cfg.segment_size,
        threshold=cfg.threshold,
        force_sink=cfg.force_sink,
        scoring=cfg.scoring,
        antidiagonal_stride=cfg.antidiagonal_stride,
        moments_sd=cfg.moments_sd,
        sliding_window=cfg.sliding_window,
        chunk_size=cfg.chunk_size,
    )
    return perm, block_mask


def _flex_over_selection(
    q, k, v, perm, block_mask, key_padding_mask, is_causal, scale, block_size, plan, grad, window=(0, 0)
) -> Tensor:
    """Compiled flex attention over the permuted K/V with the selection's BlockMask (and the
    local ``window``'s bound in its mask_mod)."""
    hq, n, d = q.shape[1], q.shape[2], q.shape[3]
    with torch.no_grad():
        total = fc.bucketed_length(n, block_size)
        bm, _ = pbs_block_mask(
            block_mask,
            perm,
            n=n,
            total=total,
            key_padding_mask=key_padding_mask,
            is_causal=is_causal,
            block_size=block_size,
            need_backward=grad,
            sliding_window=window[0],
            chunk_size=window[1],
        )
        gather_index = _padded_perm(perm, total).clamp_min(0)  # [B, Hp, total]
    # permuted K/V: Hp heads (Hq under per-query-head permutation, Hkv under kv_head)
    kp = fc.gather_rows(k, gather_index)
    vp = fc.gather_rows(v, gather_index)
    qp = fc.pad_seq(q, total)
    out = fc.flex_attention_compiled(
        qp.contiguous(),
        kp,
        vp,
        bm,
        scale=fc.default_scale(d, scale),
        enable_gqa=perm.shape[1] != hq,
        kernel_options=plan.kernel_options,
    )
    return out[:, :, :n].to(q.dtype)
