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
from ...selection import Selection
from ...kernels import flex_common as fc
from .reference import (key_scores, permuted_block_attention, segment_permutation, select_blocks,
                        selection_density)

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
):
    """The flex ``BlockMask`` (over ``total`` padded positions) of a PBS selection, plus the
    ``vis_pos`` table its ``mask_mod`` reads. ``block_mask [B, Hq, nB, nB]`` over permuted key
    blocks, ``permutation [B, Hp, N]``."""
    from torch.nn.attention.flex_attention import BlockMask

    bsz, hq, nb, _ = block_mask.shape
    hp = permutation.shape[1]
    bs = block_size
    nbp = total // bs
    dev = block_mask.device
    perm_p = _padded_perm(permutation, total)  # [B, Hp, total], -1 past N
    valid = perm_p >= 0
    if key_padding_mask is not None:
        kpm = key_padding_mask.to(device=dev, dtype=torch.bool)
        valid = valid & torch.gather(kpm[:, None, :].expand(bsz, hp, n), 2, perm_p.clamp_min(0))
    sentinel = total  # > every query index
    vis_pos = torch.where(valid, perm_p, torch.full_like(perm_p, sentinel)).to(torch.int32)  # [B, Hp, total]

    blocks = vis_pos.view(bsz, hp, nbp, bs)
    all_valid = (blocks < sentinel).all(-1)  # [B, Hp, nBp]
    any_valid = (blocks < sentinel).any(-1)
    kmax = torch.where(blocks < sentinel, blocks, torch.full_like(blocks, -1)).amax(-1)  # [B, Hp, nBp]
    kmin = blocks.amin(-1)  # sentinel when the block holds no valid key
    head_map = torch.arange(hq, device=dev) // (hq // hp)
    all_valid, any_valid, kmax, kmin = (t[:, head_map] for t in (all_valid, any_valid, kmax, kmin))

    sel = torch.zeros(bsz, hq, nbp, nbp, dtype=torch.bool, device=dev)
    sel[:, :, :nb, :nb] = block_mask.to(dev)
    if is_causal:
        q_first = torch.arange(nbp, device=dev) * bs  # [nBp]
        q_last = (q_first + bs - 1).clamp_max(n - 1)
        full = all_valid[:, :, None, :] & (kmax[:, :, None, :] <= q_first[None, None, :, None])
        useful = kmin[:, :, None, :] <= q_last[None, None, :, None]  # some element visible
    else:
        full = all_valid[:, :, None, :].expand(bsz, hq, nbp, nbp)
        useful = any_valid[:, :, None, :].expand(bsz, hq, nbp, nbp)
    full = sel & full
    partial = sel & ~full & useful
    # padded query blocks (past N) attend nothing
    q_real = (torch.arange(nbp, device=dev) * bs < n)[None, None, :, None]
    full, partial = full & q_real, partial & q_real
    kv_num, kv_idx = fc.block_lists(partial)
    full_num, full_idx = fc.block_lists(full)

    ratio = hq // hp
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

    bm = BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(bs, bs), mask_mod=mask_mod,
        seq_lengths=(total, total), compute_q_blocks=need_backward,
    )
    return bm, vis_pos


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
    block_size, segment_size, threshold = cfg.block_size, cfg.segment_size, cfg.threshold
    force_sink, permute, gqa_permutation = cfg.force_sink, cfg.permute, cfg.gqa_permutation
    scoring, antidiagonal_stride, causal_proxy = cfg.scoring, cfg.antidiagonal_stride, cfg.causal_proxy
    proxy_blocks = cfg.proxy_blocks
    fc.check_flex_inputs(q, k, v)
    bsz, hq, n, d = q.shape
    hkv = k.shape[1]
    if k.shape[2] != n:
        raise ValueError(f"PBS is a prefill method: needs Nq == Nk, got Nq={n}, Nk={k.shape[2]}")
    if gqa_permutation not in ("query_head", "kv_head"):
        raise ValueError(f"gqa_permutation must be 'query_head' or 'kv_head', got {gqa_permutation!r}")
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.to(device=q.device, dtype=torch.bool)
    hp = hq if gqa_permutation == "query_head" else hkv
    grad = fc.needs_grad(q, k, v)  # before no_grad, inside which it would always be False
    with torch.no_grad():
        qd, kd = q.detach(), k.detach()
        if permute:
            scores = key_scores(qd, kd, key_padding_mask=key_padding_mask, scale=scale, block_size=block_size,
                                segment_size=segment_size, causal_proxy=causal_proxy,
                                gqa_permutation=gqa_permutation, proxy_blocks=proxy_blocks)
            perm = segment_permutation(scores, segment_size=segment_size, key_padding_mask=key_padding_mask)
        else:
            perm = torch.arange(n, device=q.device).expand(bsz, hp, n).clone()
        block_mask = select_blocks(
            qd, kd, perm, key_padding_mask=key_padding_mask, is_causal=is_causal, scale=scale,
            block_size=block_size, segment_size=segment_size, threshold=threshold, force_sink=force_sink,
            scoring=scoring, antidiagonal_stride=antidiagonal_stride,
        )
        plan = fc.flex_plan(q.device, block_size, block_size, d, q.dtype, needs_grad=grad)
    if plan.fallback:
        out = permuted_block_attention(q, k, v, perm, block_mask, key_padding_mask=key_padding_mask,
                                       is_causal=is_causal, scale=scale, block_size=block_size)
        return _with_selection(out, block_mask, perm, key_padding_mask, is_causal, block_size, n,
                               return_selection)
    with torch.no_grad():
        total = fc.bucketed_length(n, block_size)
        bm, _ = pbs_block_mask(block_mask, perm, n=n, total=total, key_padding_mask=key_padding_mask,
                               is_causal=is_causal, block_size=block_size,
                               need_backward=grad)
        gather_index = _padded_perm(perm, total).clamp_min(0)  # [B, Hp, total]
    # permuted K/V: Hp heads (Hq under per-query-head permutation, Hkv under kv_head)
    kp = fc.gather_rows(k, gather_index)
    vp = fc.gather_rows(v, gather_index)
    qp = fc.pad_seq(q, total)
    out = fc.flex_attention_compiled(
        qp.contiguous(), kp, vp, bm, scale=fc.default_scale(d, scale), enable_gqa=hp != hq,
        kernel_options=plan.kernel_options,
    )
    out = out[:, :, :n].to(q.dtype)
    return _with_selection(out, block_mask, perm, key_padding_mask, is_causal, block_size, n, return_selection)


def _with_selection(out, block_mask, perm, key_padding_mask, is_causal, block_size, n, return_selection):
    if not return_selection:
        return out
    density = selection_density(block_mask, perm, key_padding_mask=key_padding_mask, is_causal=is_causal,
                                block_size=block_size)
    sel = Selection(
        method="pbs", density=density, block_size=block_size, is_causal=is_causal, num_keys=n,
        block_mask=block_mask, permutation=perm, key_padding_mask=key_padding_mask,
    )
    return out, sel
