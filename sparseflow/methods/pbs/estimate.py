"""PBS reference, the block-probability estimate: each query block's distribution over its
candidate (permuted) key blocks, which the threshold selection of :mod:`.block_selection`
cuts. ``triton_estimate`` computes the strided scorings with the same definitions.

* **Pooling**: a query block's mean is over its valid positions (valid = key_padding_mask, as
  Nq == Nk); a query block with no valid position falls back to the mean over all its
  positions, so padded query rows still get an ordinary (finite) selection and the exact mode
  equals dense attention on every row. A key block's mean is over its valid keys.
* **scoring="mean"**: block logit ``q̄_I · k̄_J · scale`` (= the mean over all valid (q, k) pairs of
  the block of ``q·k·scale``); block probability = softmax of the logits over the candidates.
* **scoring="moments"**: the block pair's logits summarised by their first two moments, no per-key
  exponential: the mean ``mu = q̄_I · k̄_J · scale`` (``"mean"``'s logit) and the variance of
  ``q·k·scale`` for a query of ``I`` and a key of ``J`` drawn independently (over the same positions
  as the means), from the blocks' centred second moments (:mod:`.moments`); the block logit is
  ``mu + moments_sd * sqrt(max(var, 0))`` and the probability its softmax over the candidates. A
  block whose few keys align with the queries (which the mean averages away) scores by its spread.
* **scoring="antidiagonal"** (PBS+, XAttention style, stride ``s``): split the query block into
  ``bs/s`` strided rows and each key block into ``bs/s`` strided columns of ``s`` consecutive
  tokens. The strided logit of row ``r`` (queries ``I*bs + r*s + t``) and column ``c`` (permuted
  keys ``J*bs + c*s + t``) is the mean over ``t`` of ``q[I*bs + r*s + s-1-t] · k'[J*bs + c*s + t]
  · scale`` -- the antidiagonal of that ``s x s`` tile, i.e. the pairs ``(i, j)`` of the block with
  ``(i mod s) + (j mod s) = s - 1`` -- averaged over the pairs whose query and key are both valid
  (a tile with no such pair is dropped). For every strided row, softmax over all strided columns
  of all candidate blocks; a block's mass in that row is the sum over its columns; the block
  probability is the mean of that mass over the strided rows that have at least one column. So
  the probabilities again form a distribution over the candidates.
* **scoring="sampled_rows"** (stride ``s``): the query rows ``I*bs + t*s`` (``t = 0, 1, ...``) that
  are valid (with the pooling's fallback: all rows of a block without a valid one) each take the
  softmax of ``q · k' · scale`` over every valid key of the candidate blocks; a block's mass in
  that row is the sum over its keys, and the block probability is the mean of that mass over the
  sampled rows that see a candidate key. Stride 1 is the exact attention mass of each block
  (restricted to the candidates); the exponential is taken per key, never of an averaged logit.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .config import PBSConfig
from . import moments as _moments
from .reference_common import num_blocks, padded_permutation, safe_softmax, softmax_scale, valid_positions

__all__ = [
    "block_probabilities",
    "query_validity",
    "query_block_means",
    "query_blocks",
]

_NEG_INF = float("-inf")


def query_validity(valid: Tensor, block_size: int) -> Tensor:
    """``[B, nB*bs]`` bool: the query positions a block is pooled over -- its valid positions, or
    all of its (in-range) positions when it has none."""
    bsz, n = valid.shape
    nb = num_blocks(n, block_size)
    total = nb * block_size
    vb = torch.cat([valid, valid.new_zeros(bsz, total - n)], dim=-1).view(bsz, nb, block_size)
    exists = torch.cat([valid.new_ones(bsz, n), valid.new_zeros(bsz, total - n)], dim=-1).view(bsz, nb, block_size)
    return torch.where(vb.any(dim=-1, keepdim=True), vb, exists).reshape(bsz, total)


def query_blocks(q: Tensor, valid: Tensor, block_size: int) -> Tuple[Tensor, Tensor]:
    """``(fp32 [B, H, nB, bs, D], bool [B, 1, nB, bs])``: q by block (zero past N) and the
    positions :func:`query_block_means` averages (see :func:`query_validity`)."""
    bsz, h, n, d = q.shape
    nb = num_blocks(n, block_size)
    use = query_validity(valid, block_size).view(bsz, 1, nb, block_size)
    qf = torch.nn.functional.pad(q.float(), (0, 0, 0, nb * block_size - n)).view(bsz, h, nb, block_size, d)
    return qf, use


def query_block_means(q: Tensor, valid: Tensor, block_size: int) -> Tensor:
    """fp32 ``[B, H, nB, D]``: block means of q ``[B, H, N, D]`` (see :func:`query_validity`)."""
    qf, use = query_blocks(q, valid, block_size)
    use = use[..., None]
    # where, not a 0/1 weight: a NaN in an excluded (padded) row must not reach the mean
    total_q = torch.where(use, qf, torch.zeros((), dtype=qf.dtype, device=qf.device)).sum(dim=3)
    return total_q / use.sum(dim=3).clamp_min(1).float()


def _permuted_keys(k_bh: Tensor, perm_row: Tensor, total: int) -> Tensor:
    """fp32 ``[total, D]``: k rows in permuted order, zero rows for slots past N."""
    kp = k_bh.float().index_select(0, perm_row)
    if total > kp.shape[0]:
        kp = torch.cat([kp, kp.new_zeros(total - kp.shape[0], kp.shape[1])], dim=0)
    return kp


@torch.no_grad()
def block_probabilities(
    q: Tensor,
    k: Tensor,
    permutation: Tensor,
    candidates: Tensor,
    *,
    key_padding_mask: Optional[Tensor] = None,
    scale: Optional[float] = None,
    block_size: int = PBSConfig.block_size,
    scoring: str = PBSConfig.scoring,
    antidiagonal_stride: int = PBSConfig.antidiagonal_stride,
    moments_sd: float = PBSConfig.moments_sd,
    chunk_blocks: int = 16,
) -> Tensor:
    """fp32 ``[B, Hq, nB, nB]``: each query block's distribution over its candidate key blocks
    (zeros elsewhere; all zeros for a query block without candidates). See the module docstring
    for the exact definition of both scorings."""
    bsz, hq, n, d = q.shape
    hp = permutation.shape[1]
    sc = softmax_scale(scale, d)
    nb = num_blocks(n, block_size)
    valid = valid_positions(key_padding_mask, bsz, n, q.device)
    qvalid_eff = query_validity(valid, block_size)  # [B, total]
    perm_p = padded_permutation(permutation, nb, block_size)  # [B, Hp, total]
    # validity of every permuted slot, per (b, hp)
    kvalid_slot = torch.gather(
        torch.cat([valid, valid.new_zeros(bsz, 1)], dim=-1)[:, None, :].expand(bsz, hp, n + 1),
        2,
        torch.where(perm_p < 0, torch.full_like(perm_p, n), perm_p),
    )  # [B, Hp, total]
    out = torch.zeros(bsz, hq, nb, nb, dtype=torch.float32, device=q.device)
    if scoring in ("mean", "moments"):
        return _pooled_block_probabilities(
            q,
            k,
            perm_p,
            kvalid_slot,
            valid,
            candidates,
            out,
            sc,
            block_size,
            moments_sd if scoring == "moments" else 0.0,
        )
    if scoring == "sampled_rows":
        return _sampled_row_probabilities(
            q, k, perm_p, kvalid_slot, qvalid_eff, candidates, out, sc, block_size, antidiagonal_stride, chunk_blocks
        )
    if scoring != "antidiagonal":
        raise ValueError(f"scoring must be 'mean', 'moments', 'antidiagonal' or 'sampled_rows', got {scoring!r}")
    if block_size % antidiagonal_stride:
        raise ValueError(f"antidiagonal_stride must divide block_size={block_size}, got {antidiagonal_stride}")
    return _antidiagonal_probabilities(
        q, k, perm_p, kvalid_slot, qvalid_eff, candidates, out, sc, block_size, antidiagonal_stride, chunk_blocks
    )


def _pooled_block_probabilities(q, k, perm_p, kvalid_slot, valid, candidates, out, sc, block_size, sds: float):
    """``scoring="mean"``: softmax over the candidates of the block-mean logits ``q̄_I · k̄_J ·
    scale``; with ``sds > 0`` (``scoring="moments"``) each logit plus ``sds`` standard deviations
    of the pair's logits (see the module docstring)."""
    bsz, hq, n, d = q.shape
    hkv, hp = k.shape[1], perm_p.shape[1]
    nb = out.shape[-1]
    total = nb * block_size
    hq_per_hp, g = hq // hp, hq // hkv
    qbar = query_block_means(q, valid, block_size)  # [B, Hq, nB, D]
    qblocks, quse = query_blocks(q, valid, block_size) if sds else (None, None)
    for b in range(bsz):
        for p in range(hp):
            kv_head = (p * hq_per_hp) // g
            kp = _permuted_keys(k[b, kv_head], perm_p[b, p].clamp_min(0), total)
            use = kvalid_slot[b, p].view(nb, block_size, 1)
            kb = torch.where(use, kp.view(nb, block_size, d), 0.0)
            count = use.sum(1).clamp_min(1)
            kbar = kb.sum(1) / count  # [nB, D]
            heads = slice(p * hq_per_hp, (p + 1) * hq_per_hp)
            logits = torch.matmul(qbar[b, heads], kbar.t()) * sc  # [hpp, nB, nB]
            if sds:
                # the reference's spread: fp32 products, whatever the global setting
                with _moments.products("ieee", q.is_cuda):
                    left = _moments.left_operand(*_moments.block_moments(qblocks[b, heads], quse[b]))
                    right = _moments.right_operand(*_moments.block_moments(kp.view(nb, block_size, d), use[..., 0]))
                    var = _moments.pair_variance(left, right) * (sc * sc)
                logits = logits + sds * var.clamp_min(0.0).sqrt()
            logits = logits.masked_fill(~candidates[b, heads], _NEG_INF)
            out[b, heads] = safe_softmax(logits)
    return out


def _antidiagonal_probabilities(
    q, k, perm_p, kvalid_slot, qvalid_eff, candidates, out, sc, block_size, s, chunk_blocks
):
    """``scoring="antidiagonal"`` with stride ``s`` (see the module docstring)."""
    bsz, hq, n, d = q.shape
    hkv, hp = k.shape[1], perm_p.shape[1]
    nb = out.shape[-1]
    total = nb * block_size
    hq_per_hp, g = hq // hp, hq // hkv
    r = block_size // s
    for b in range(bsz):
        qv = qvalid_eff[b]  # [total]
        qgv = qv.view(nb * r, s).flip(-1).float()  # [nB*R, s] (reversed inside each stride)
        for p in range(hp):
            kv_head = (p * hq_per_hp) // g
            kp = _permuted_keys(k[b, kv_head], perm_p[b, p].clamp_min(0), total)
            kvs = kvalid_slot[b, p]
            kg = torch.where(kvs[:, None], kp, 0.0).view(nb * r, s * d)  # strided key columns (padded: 0)
            kgv = kvs.view(nb * r, s).float()
            for h in range(p * hq_per_hp, (p + 1) * hq_per_hp):
                qf = torch.nn.functional.pad(q[b, h].float(), (0, 0, 0, total - n))
                qg = torch.where(qv[:, None], qf, 0.0).view(nb * r, s, d).flip(1).reshape(nb * r, s * d)
                for i0 in range(0, nb, chunk_blocks):
                    i1 = min(nb, i0 + chunk_blocks)
                    rows = slice(i0 * r, i1 * r)
                    cnt = torch.matmul(qgv[rows], kgv.t())  # valid pairs per tile antidiagonal
                    logit = torch.matmul(qg[rows], kg.t()) / cnt.clamp_min(1.0) * sc  # [cR, nB*R]
                    col_ok = candidates[b, h, i0:i1].repeat_interleave(r, dim=0).repeat_interleave(r, dim=1)
                    col_ok = col_ok & (cnt > 0)
                    prob = safe_softmax(logit.masked_fill(~col_ok, _NEG_INF))
                    mass = prob.view(i1 - i0, r, nb, r).sum(dim=-1)  # [c, R, nB]
                    rows_ok = col_ok.any(dim=-1).view(i1 - i0, r).sum(dim=-1)  # [c]
                    out[b, h, i0:i1] = mass.sum(dim=1) / rows_ok.clamp_min(1)[:, None].float()
    return out


def _sampled_row_probabilities(
    q, k, perm_p, kvalid_slot, qvalid_eff, candidates, out, sc, block_size, stride, chunk_blocks
):
    """``scoring="sampled_rows"``: every ``stride``-th valid query row of a block takes its exact
    softmax over the candidate keys (one logit per key: no averaging before the exponential, so a
    single dominant key keeps its mass), and the block's distribution is the mean over those rows
    of their mass per key block. Stride 1 is the exact block mass."""
    bsz, hq, n, d = q.shape
    hkv, hp = k.shape[1], perm_p.shape[1]
    nb = out.shape[-1]
    total = nb * block_size
    hq_per_hp, g = hq // hp, hq // hkv
    offs = torch.arange(0, block_size, stride, device=q.device)  # sampled rows inside a block
    r = offs.numel()
    rows_idx = (torch.arange(nb, device=q.device)[:, None] * block_size + offs[None, :]).reshape(-1)  # [nB*r]
    for b in range(bsz):
        row_ok = qvalid_eff[b][rows_idx].view(nb, r)
        for p in range(hp):
            kv_head = (p * hq_per_hp) // g
            kp = _permuted_keys(k[b, kv_head], perm_p[b, p].clamp_min(0), total).float()  # [total, D]
            kvs = kvalid_slot[b, p]
            for h in range(p * hq_per_hp, (p + 1) * hq_per_hp):
                qf = torch.nn.functional.pad(q[b, h].float(), (0, 0, 0, total - n))[rows_idx]  # [nB*r, D]
                for i0 in range(0, nb, chunk_blocks):
                    i1 = min(nb, i0 + chunk_blocks)
                    logit = torch.matmul(qf[i0 * r : i1 * r], kp.t()) * sc  # [c*r, total]
                    col_ok = candidates[b, h, i0:i1].repeat_interleave(block_size, dim=1) & kvs[None, :]
                    col_ok = col_ok.repeat_interleave(r, dim=0)  # [c*r, total]
                    prob = safe_softmax(logit.masked_fill(~col_ok, _NEG_INF))
                    mass = prob.view(i1 - i0, r, nb, block_size).sum(-1)  # [c, r, nB]
                    ok = row_ok[i0:i1] & col_ok.view(i1 - i0, r, total).any(-1)  # [c, r]
                    mass = torch.where(ok[..., None], mass, 0.0)  # (a padded NaN row's mass is NaN)
                    out[b, h, i0:i1] = mass.sum(1) / ok.sum(1).clamp_min(1)[:, None].float()
    return out
