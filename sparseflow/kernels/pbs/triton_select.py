"""PBS-Attn stages 1-3 in Triton: proxy key scores (``key_scores``), the per-segment stable sort
(``segment_permutation``) and the block selection (``select_block_lists``), which emits the
attention kernel's block lists directly.

``key_scores``: two passes, one program per (segment, batch*query head): per-proxy-row softmax
statistics over the segment's valid keys (combined over the complete segments in torch, or kept
per segment with ``causal_proxy``), then each key's mean probability over the proxy rows.
``segment_permutation``: one program per (segment, batch*head), a descending sort of packed
(score bits, reversed position) keys, so ties keep the lower position first (stable).

``select_block_lists`` replaces the reference's ``candidate_blocks`` + ``forced_blocks`` +
``block_probabilities`` (``scoring="mean"``) + ``threshold_blocks`` + ``block_mask_to_indices``:
one program per (batch, query head, query block) scores every key block against the pooled
query block, masks non-candidates, takes the softmax, sorts (descending, ties to the lower block
index, via a packed 64-bit key), finds the prefix whose mass reaches the threshold, adds the
forced blocks (own region, sink) and writes ``kv_num``, ``kv_full``, ``kv_idx`` (unmasked blocks
first, ascending; then the rest, ascending) and, optionally, the bool block mask.

Pooling (block means over valid tokens) and the small per-row tensors (regions, key-block
validity, sink block) are vectorised torch ops; the pooled keys come from the permuted K that the
attention layout needs anyway. Conventions are the reference's (see reference.py's docstring).

Status: checked against the reference on the CPU interpreter (tests/test_pbs_triton.py: scores
to ~1e-7 relative, identical permutations and selections); not yet compiled or timed on the
H200 -- ``triton_impl`` uses these only when ``SPARSEFLOW_PBS_SELECT=triton``.
"""
from __future__ import annotations

import math
import os
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from . import reference as _ref

__all__ = ["pool_blocks", "select_block_lists", "key_scores", "segment_permutation"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _select_kernel(
    QBAR, KBAR, REGION, KVALID, SINK, KV_NUM, KV_FULL, KV_IDX, BMASK,
    H, NB, HP_GROUP, N, scale, threshold, block_size, segment_size,
    HEAD_DIM: tl.constexpr, BLOCK_B: tl.constexpr, CHUNK_D: tl.constexpr,
    IS_CAUSAL: tl.constexpr, EXACT: tl.constexpr, HAS_PAD: tl.constexpr, WRITE_MASK: tl.constexpr,
):
    qb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    p = h // HP_GROUP
    hp = H // HP_GROUP
    offs = tl.arange(0, BLOCK_B)
    kb_ok = offs < NB
    b64 = b.to(tl.int64)

    region_k = tl.load(REGION + b64 * NB + offs, mask=kb_ok, other=-1)
    region_q = tl.load(REGION + b64 * NB + qb)
    kvalid = tl.load(KVALID + (b64 * hp + p) * NB + offs, mask=kb_ok, other=0) != 0
    if IS_CAUSAL:
        cand = kb_ok & kvalid & (region_k < region_q)
    else:
        cand = kb_ok & kvalid & (region_k != region_q)
    sink = tl.load(SINK + b64 * H + h)  # -1: none
    forced = kb_ok & ((region_k == region_q) | (offs == sink))

    if EXACT:
        keep = cand
    else:
        # block logits q̄·k̄·scale, fp32, reduced over D in chunks
        q_row = QBAR + (b64 * H + h) * NB * HEAD_DIM + qb * HEAD_DIM
        k_rows = KBAR + (b64 * hp + p) * NB * HEAD_DIM
        logit = tl.zeros([BLOCK_B], dtype=tl.float32)
        for d0 in tl.static_range(0, HEAD_DIM, CHUNK_D):
            dd = d0 + tl.arange(0, CHUNK_D)
            d_ok = dd < HEAD_DIM
            qv = tl.load(q_row + dd, mask=d_ok, other=0.0)
            kv = tl.load(k_rows + offs[:, None] * HEAD_DIM + dd[None, :], mask=kb_ok[:, None] & d_ok[None, :],
                         other=0.0)
            logit += tl.sum(kv * qv[None, :], axis=1)
        logit = tl.where(cand, logit * scale, float("-inf"))
        m = tl.max(logit, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        e = tl.where(cand, tl.exp(logit - m), 0.0)
        denom = tl.sum(e, 0)
        prob = e / tl.where(denom > 0.0, denom, 1.0)
        # sort key: probability bits (>= 0, so integer order = float order; -1 for non-candidates)
        # in the high word, (BLOCK_B-1-index) in the low word: descending = ties to the lower index
        pbits = tl.where(cand, prob.to(tl.int32, bitcast=True), -1)
        packed = (pbits.to(tl.int64) << 32) | (BLOCK_B - 1 - offs).to(tl.int64)
        srt = tl.sort(packed, descending=True)
        s_bits = (srt >> 32).to(tl.int32)
        s_cand = s_bits >= 0
        s_prob = tl.where(s_cand, s_bits.to(tl.float32, bitcast=True), 0.0)
        before = tl.cumsum(s_prob, 0) - s_prob
        keep_sorted = s_cand & (before < threshold)
        cut = tl.min(tl.where(keep_sorted, srt, 9223372036854775807), 0)
        keep = cand & (packed >= cut)

    final = keep | forced
    # blocks that need the attention kernel's element mask
    seg_first = (qb * block_size // segment_size) * segment_size // block_size
    if IS_CAUSAL:
        needs = offs >= seg_first
    else:
        needs = offs < 0
    needs = needs | ((offs == NB - 1) & (N % block_size != 0))
    if HAS_PAD:
        needs = offs >= 0
    full = final & ~needs
    rest = final & needs
    fi = full.to(tl.int32)
    ri = rest.to(tl.int32)
    n_full = tl.sum(fi, 0)
    n_tot = n_full + tl.sum(ri, 0)
    pos = tl.where(full, tl.cumsum(fi, 0) - 1, n_full + tl.cumsum(ri, 0) - 1)
    row = (b64 * H + h) * tl.num_programs(0) + qb
    tl.store(KV_IDX + row * NB + pos, offs, mask=final)
    tl.store(KV_NUM + row, n_tot)
    tl.store(KV_FULL + row, n_full)
    if WRITE_MASK:
        tl.store(BMASK + row * NB + offs, final.to(tl.int8), mask=kb_ok)


def pool_blocks(x: torch.Tensor, valid: torch.Tensor, block_size: int, fallback_all: bool) -> torch.Tensor:
    """fp32 ``[B, H, nB, D]`` block means of ``x [B, H, N, D]`` over ``valid`` (``[B, N]`` or
    ``[B, H, N]`` bool) positions; a block with no valid position averages all its positions
    (``fallback_all``, the reference's query rule) or is zero (keys)."""
    b, h, n, d = x.shape
    nb = -(-n // block_size)
    total = nb * block_size
    if valid.dim() == 2:
        valid = valid[:, None, :].expand(b, h, n)
    xf = torch.nn.functional.pad(x.float(), (0, 0, 0, total - n)).view(b, h, nb, block_size, d)
    vb = torch.nn.functional.pad(valid, (0, total - n)).view(b, h, nb, block_size)
    if fallback_all:
        exists = torch.nn.functional.pad(torch.ones_like(valid), (0, total - n)).view(b, h, nb, block_size)
        vb = torch.where(vb.any(dim=-1, keepdim=True), vb, exists)
    w = vb.float()[..., None]
    return (xf * w).sum(dim=3) / w.sum(dim=3).clamp_min(1.0)


def select_block_lists(
    q: torch.Tensor,
    k_perm: torch.Tensor,
    permutation: torch.Tensor,
    *,
    key_padding_mask: Optional[torch.Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    block_size: int = 128,
    segment_size: int = 256,
    threshold: float = 0.9,
    force_sink: bool = True,
    mask_segment: Optional[int] = None,
    return_block_mask: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(kv_num, kv_full, kv_idx, block_mask or None)`` for ``q [B, Hq, N, D]`` and the permuted
    keys ``k_perm [B, Hp, N, D]`` (``permute_kv(k, permutation)``). ``mask_segment`` (default
    ``segment_size``) decides which blocks take the attention kernel's unmasked path."""
    bsz, hq, n, d = q.shape
    hp = permutation.shape[1]
    dev = q.device
    nb = -(-n // block_size)
    sc = 1.0 / math.sqrt(d) if scale is None else float(scale)
    has_pad = key_padding_mask is not None and not bool(key_padding_mask.all())
    kpm = key_padding_mask.to(torch.bool) if key_padding_mask is not None else None
    valid = kpm if kpm is not None else torch.ones(bsz, n, dtype=torch.bool, device=dev)
    region = _ref.block_regions(kpm, bsz, n, block_size=block_size, segment_size=segment_size,
                                device=dev).to(torch.int32).contiguous()
    slot_valid = torch.gather(valid[:, None, :].expand(bsz, hp, n), 2, permutation)  # [B, Hp, N]
    kvalid = torch.nn.functional.pad(slot_valid, (0, nb * block_size - n)).view(bsz, hp, nb, block_size).any(-1)
    kvalid = kvalid.to(torch.int8).contiguous()
    if force_sink:
        first = _ref._first_valid(kpm, bsz, n, dev)  # [B], -1 if none
        slot = (permutation == first.clamp_min(0)[:, None, None]).to(torch.int8).argmax(dim=-1)  # [B, Hp]
        sink = (slot // block_size).repeat_interleave(hq // hp, dim=1)
        sink = torch.where(first[:, None] >= 0, sink, torch.full_like(sink, -1))
    else:
        sink = torch.full((bsz, hq), -1, device=dev, dtype=torch.int64)
    sink = sink.to(torch.int32).contiguous()
    exact = float(threshold) >= 1.0
    if exact:
        qbar = torch.empty(1, device=dev, dtype=torch.float32)
        kbar = qbar
    else:
        qbar = pool_blocks(q, valid, block_size, fallback_all=True).contiguous()
        kbar = pool_blocks(k_perm, slot_valid, block_size, fallback_all=False).contiguous()
    kv_num = torch.empty(bsz, hq, nb, dtype=torch.int32, device=dev)
    kv_full = torch.empty_like(kv_num)
    kv_idx = torch.zeros(bsz, hq, nb, nb, dtype=torch.int32, device=dev)
    bmask = torch.empty(bsz, hq, nb, nb, dtype=torch.int8, device=dev) if return_block_mask else kv_num
    block_b = max(16, triton.next_power_of_2(nb))
    chunk_d = max(1, min(triton.next_power_of_2(d), max(1, 8192 // block_b)))
    _select_kernel[(nb, bsz * hq)](
        qbar, kbar, region, kvalid, sink, kv_num, kv_full, kv_idx, bmask,
        hq, nb, hq // hp, n, sc, float(threshold), block_size,
        mask_segment if mask_segment is not None else segment_size,
        HEAD_DIM=d, BLOCK_B=block_b, CHUNK_D=chunk_d, IS_CAUSAL=bool(is_causal), EXACT=exact,
        HAS_PAD=has_pad, WRITE_MASK=return_block_mask, num_warps=4 if block_b <= 256 else 8,
    )
    return kv_num, kv_full, kv_idx, (bmask.bool() if return_block_mask else None)


# --------------------------------------------------------------------------- 1. proxy key scores


@triton.jit
def _proxy_pass(
    Q, K, KVALID, PIDX, PCNT, LENS, M_OUT, L_OUT, LSE, SCORE,
    H, HKV, N, NSEG_MAX, qk_scale,
    stride_qb, stride_qh, stride_qn, stride_kb, stride_kh, stride_kn,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    SEGMENT: tl.constexpr, SCORE_PASS: tl.constexpr, HAS_PAD: tl.constexpr, IEEE: tl.constexpr,
    INTERP: tl.constexpr,
):
    """One program per (segment, batch*query head). Pass 1 (SCORE_PASS=False): per proxy row, the
    running max / sum of exp2 over the segment's valid keys. Pass 2: per key, the mean over
    proxy rows of exp2(s - lse_row) (the proxy softmax probability)."""
    seg = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    kvh = h // (H // HKV)
    n_seg = tl.load(LENS + b) // SEGMENT
    if seg < n_seg:
        rows = tl.arange(0, BLOCK_P)
        pcnt = tl.load(PCNT + b)
        r_ok = rows < pcnt
        pidx = tl.load(PIDX + b * BLOCK_P + rows, mask=r_ok, other=0)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        b64 = b.to(tl.int64)
        q = tl.load(Q + b64 * stride_qb + h.to(tl.int64) * stride_qh + pidx[:, None] * stride_qn + offs_d[None, :],
                    mask=r_ok[:, None] & d_ok[None, :], other=0.0)
        k_base = K + b64 * stride_kb + kvh.to(tl.int64) * stride_kh
        if SCORE_PASS:
            lse = tl.load(LSE + ((b64 * H + h) * NSEG_MAX + seg) * BLOCK_P + rows, mask=r_ok, other=float("inf"))
            inv_cnt = 1.0 / pcnt.to(tl.float32)
        else:
            m_i = tl.full([BLOCK_P], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_P], dtype=tl.float32)
        for j in tl.static_range(0, SEGMENT, BLOCK_N):
            offs_n = seg * SEGMENT + j + tl.arange(0, BLOCK_N)
            n_ok = (j + tl.arange(0, BLOCK_N)) < SEGMENT
            k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :],
                        other=0.0)
            if INTERP:
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            elif IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * qk_scale
            k_ok = n_ok
            if HAS_PAD:
                k_ok = k_ok & (tl.load(KVALID + b64 * N + offs_n, mask=n_ok, other=0) != 0)
            s = tl.where(k_ok[None, :], s, float("-inf"))
            if SCORE_PASS:
                pr = tl.exp2(s - lse[:, None])
                pr = tl.where(r_ok[:, None] & k_ok[None, :], pr, 0.0)
                sc = tl.sum(pr, 0) * inv_cnt
                tl.store(SCORE + (b64 * H + h) * N + offs_n, sc, mask=n_ok)
            else:
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
                l_i = l_i * tl.exp2(m_i - m_use) + tl.sum(tl.exp2(s - m_use[:, None]), 1)
                m_i = m_new
        if not SCORE_PASS:
            o = ((b64 * H + h) * NSEG_MAX + seg) * BLOCK_P + rows
            tl.store(M_OUT + o, m_i)
            tl.store(L_OUT + o, l_i)


def key_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    key_padding_mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    block_size: int = 128,
    segment_size: int = 256,
    causal_proxy: bool = False,
    gqa_permutation: str = "query_head",
) -> torch.Tensor:
    """The reference's ``key_scores`` (same definition, fp32 ``[B, Hp, N]``) in two Triton passes:
    per-segment softmax statistics of the proxy rows, then per-key mean probabilities."""
    bsz, hq, n, d = q.shape
    hkv = k.shape[1]
    dev = q.device
    sc = 1.0 / math.sqrt(d) if scale is None else float(scale)
    kpm = key_padding_mask.to(torch.bool) if key_padding_mask is not None else None
    lens = _ref.effective_lengths(kpm, bsz, n, dev).to(torch.int32).contiguous()
    nseg_max = n // segment_size
    out = torch.zeros(bsz, hq, n, dtype=torch.float32, device=dev)
    if nseg_max > 0 and n > 0:
        block_p = max(16, triton.next_power_of_2(block_size))
        # proxy rows: the last block_size valid positions of each row
        if kpm is None:
            valid = torch.ones(bsz, n, dtype=torch.bool, device=dev)
        else:
            valid = kpm
        pos = torch.arange(n, device=dev).expand(bsz, n)
        rank_from_end = valid.flip(-1).cumsum(-1).flip(-1)  # 1 for the last valid position
        is_proxy = valid & (rank_from_end <= block_size)
        pcnt = is_proxy.sum(-1).to(torch.int32).contiguous()
        key = torch.where(is_proxy, pos, pos + n)  # proxies first, ascending
        pidx = torch.sort(key, dim=-1).values[:, : min(block_p, n)] % n
        if pidx.shape[1] < block_p:
            pidx = torch.nn.functional.pad(pidx, (0, block_p - pidx.shape[1]))
        pidx = pidx.to(torch.int32).contiguous()
        kvalid = valid.to(torch.int8).contiguous()
        m = torch.empty(bsz, hq, nseg_max, block_p, dtype=torch.float32, device=dev)
        l = torch.empty_like(m)
        block_d = max(16, triton.next_power_of_2(d))
        block_n = min(64, max(16, triton.next_power_of_2(segment_size)))
        meta = dict(HEAD_DIM=d, BLOCK_D=block_d, BLOCK_P=block_p, BLOCK_N=block_n, SEGMENT=segment_size,
                    HAS_PAD=kpm is not None, IEEE=q.dtype == torch.float32, INTERP=_INTERPRET,
                    num_warps=4 if block_p * block_n <= 128 * 32 else 8)
        common = (hq, hkv, n, nseg_max, sc * 1.4426950408889634,
                  q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2))
        grid = (nseg_max, bsz * hq)
        _proxy_pass[grid](q, k, kvalid, pidx, pcnt, lens, m, l, m, out, *common, SCORE_PASS=False, **meta)
        # softmax normaliser per proxy row: over all complete segments, or per segment
        seg_ok = (torch.arange(nseg_max, device=dev)[None, :] < (lens.long() // segment_size)[:, None])  # [B, S]
        lse_seg = torch.where(l > 0, m + torch.log2(l.clamp_min(1e-38)), torch.full_like(m, float("-inf")))
        lse_seg = torch.where(seg_ok[:, None, :, None], lse_seg, torch.full_like(lse_seg, float("-inf")))
        if causal_proxy:
            lse = lse_seg
        else:
            mx = lse_seg.amax(dim=2, keepdim=True)
            mx_safe = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)
            lse = mx_safe + torch.log2(torch.exp2(lse_seg - mx_safe).sum(dim=2, keepdim=True))
            lse = lse.expand_as(lse_seg)
        lse = lse.contiguous()
        _proxy_pass[grid](q, k, kvalid, pidx, pcnt, lens, m, l, lse, out, *common, SCORE_PASS=True, **meta)
    if gqa_permutation == "kv_head":
        out = out.view(bsz, hkv, hq // hkv, n).mean(dim=2)
    elif gqa_permutation != "query_head":
        raise ValueError(f"gqa_permutation must be 'query_head' or 'kv_head', got {gqa_permutation!r}")
    return out


# --------------------------------------------------------------------------- 2. segment sort


@triton.jit
def _segment_sort_kernel(SCORES, LENS, PERM, N, SEGMENT: tl.constexpr, BLOCK_S: tl.constexpr, HP):
    seg = tl.program_id(0)
    bp = tl.program_id(1)
    b = bp // HP
    n_seg = tl.load(LENS + b) // SEGMENT
    if seg < n_seg:
        i = tl.arange(0, BLOCK_S)
        ok = i < SEGMENT
        base = bp.to(tl.int64) * N + seg * SEGMENT
        s = tl.load(SCORES + base + i, mask=ok, other=0.0)
        # scores are >= 0: their bits sort like the floats; padding lanes sort last; the low word
        # (BLOCK_S-1-i) makes the descending sort stable (ties keep the lower position first)
        bits = tl.where(ok, s.to(tl.int32, bitcast=True), -1)
        packed = (bits.to(tl.int64) << 32) | (BLOCK_S - 1 - i).to(tl.int64)
        srt = tl.sort(packed, descending=True)
        src = BLOCK_S - 1 - (srt & 0xFFFFFFFF).to(tl.int32)
        tl.store(PERM + base + i, (seg * SEGMENT + src).to(tl.int64), mask=ok)


def segment_permutation(
    scores: torch.Tensor,
    *,
    segment_size: int = 256,
    key_padding_mask: Optional[torch.Tensor] = None,
    permute: bool = True,
) -> torch.Tensor:
    """The reference's ``segment_permutation`` (``[B, Hp, N]`` int64) with one Triton program per
    (segment, batch*head): a stable descending sort of the segment's scores."""
    bsz, hp, n = scores.shape
    perm = torch.arange(n, device=scores.device).expand(bsz, hp, n).contiguous()
    if not permute or n // segment_size == 0:
        return perm
    lens = _ref.effective_lengths(key_padding_mask, bsz, n, scores.device).to(torch.int32).contiguous()
    block_s = max(16, triton.next_power_of_2(segment_size))
    sc = scores.float().clamp_min(0.0).contiguous()
    _segment_sort_kernel[(n // segment_size, bsz * hp)](sc, lens, perm, n, SEGMENT=segment_size,
                                                         BLOCK_S=block_s, HP=hp)
    return perm
