"""PBS-Attn stages 1-3 in Triton: proxy key scores (``key_scores``), the per-segment stable sort
(``segment_permutation``) and the block selection (``select_block_lists``), which emits the
attention kernel's block lists directly.

``key_scores``: two passes, one program per (segment, batch*query head): per-proxy-row softmax
statistics over the segment's valid keys (combined over the complete segments in torch, or kept
per segment with ``causal_proxy``), then each key's mean probability over the proxy rows. With
``proxy_blocks > 1`` the passes run once per proxy (planned by the reference's ``proxy_queries``)
and the per-key probabilities are averaged over the proxies that see the key.
``segment_permutation``: one program per (segment, batch*head), a descending sort of packed
(score bits, reversed position) keys, so ties keep the lower position first (stable).

Under a local window the selection kernel takes each permuted block's latest valid key position
and keeps only the candidates and forced blocks inside the query block's window (the reference's
``window_blocks``); the blocks a window can cut go to the attention kernel's masked list.

``select_block_lists`` replaces the reference's ``candidate_blocks`` + ``forced_blocks`` +
``block_probabilities`` (``scoring="mean"``) + ``threshold_blocks`` + ``block_mask_to_indices``:
one program per (batch, query head, query block) scores every key block against the pooled
query block, masks non-candidates, takes the softmax, sorts (descending, ties to the lower block
index, via a packed 64-bit key), finds the prefix whose mass reaches the threshold, adds the
forced blocks (own region, sink) and writes ``kv_num``, ``kv_full``, ``kv_idx`` (unmasked blocks
first, ascending; then the rest, ascending) and, optionally, the bool block mask. With
``scoring="sampled_rows"|"antidiagonal"`` the same kernel takes its probabilities from
``triton_estimate``'s one-pass strided estimate (the ``sparseflow::pbs_strided_estimate`` op)
instead of the pooled logits.

Pooling (block means over valid tokens) and the small per-row tensors (regions, key-block
validity, sink block) are vectorised torch ops; the pooled keys come from the permuted K that the
attention layout needs anyway. Conventions are the reference's (see reference.py's docstring).

Status: ``triton_impl`` uses these by default on CUDA (``Tuning(pbs_select="reference")`` selects
with the reference's torch stages instead; off CUDA that is the default). Checked against the
reference on the CPU interpreter (tests/methods/pbs/test_pbs_triton.py: scores to ~1e-7 relative, identical
permutations and selections; tests/methods/pbs/test_pbs_triton_estimate.py for the strided scorings) and
compiled for sm_90 (tests/sm90_compile.py). On an H200 (B=1, Hq=32, Hkv=8, D=128, bf16,
``scoring="mean"``, threshold 0.9) scores + sort + selection cost 1-26% of cuDNN's dense attention
at N = 8K-128K (the smaller share at the longer N), and the selection is the reference's but for
near-ties of the threshold rule (``selection_diff`` in benchmarks/pbs.py).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl

from .block_selection import block_last_keys
from .permutation import proxy_queries
from .reference_common import effective_lengths, first_valid
from . import estimate as _estimate
from . import moments as _moments
from . import reference_common as _common
from . import triton_estimate as _est
from .triton_estimate import _strided_prob_row
from .triton_gather import pool_query_blocks
from ...kernels._triton_env import interpreting
from ...kernels.launch_sizes import pow2_at_least
from ...kernels.token_blocks import check_window
from ...kernels.token_sparse_triton import _window_lo
from .config import PBSConfig
from .tuning import PBSTuning

# the scorings whose block logits come from pooled blocks (the others from triton_estimate)
POOLED_SCORINGS = ("mean", "moments")

__all__ = ["pool_blocks", "block_logits", "select_block_lists", "key_scores", "segment_permutation"]


@triton.jit
def _select_rows_kernel(  # noqa: PLR0912, PLR0915
    LOGITS,
    LENS,
    KCNT,
    SINK,
    KLAST,
    KV_NUM,
    KV_FULL,
    KV_IDX,
    BMASK,
    LBM,
    LSE,
    QV,
    H,
    H0,
    HC,
    NB,
    HP_GROUP,
    HP,
    N,
    NROWS,
    scale,
    threshold,
    block_size,
    segment_size,
    mask_segment,
    dense_from,
    SLIDING,
    CHUNK,
    BLOCK_B: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    EXACT: tl.constexpr,
    HAS_PAD: tl.constexpr,
    WRITE_MASK: tl.constexpr,
    CUT_SORT: tl.constexpr,
    STRIDED: tl.constexpr,
    BS: tl.constexpr,
    STRIDE: tl.constexpr,
    RPB: tl.constexpr,
    RC: tl.constexpr,
    ROW_QV: tl.constexpr,
):
    """One program per (query block, batch * head of the chunk ``[H0, H0 + HC)``): reads its row
    of raw block logits ``q̄·k̄`` (``LOGITS [B, HC, nB, nB]`` fp32), applies the scale, masks the
    non-candidates, takes the softmax, finds the threshold prefix, adds the forced blocks and
    writes the block lists (and the mask). ``STRIDED``: the probabilities come instead from the
    strided estimate's per-row block masses (``LBM``, ``LSE``, ``QV``: triton_estimate). Query
    blocks from ``dense_from`` on keep every candidate (``PBSConfig.dense_tail_blocks``).
    ``HAS_WINDOW``: the candidates and forced blocks are those inside the query block's local
    window (``KLAST [B, Hp, nB]``: each permuted block's latest valid key position, -1: none)."""
    # Inductor types a Python float argument fp64 (Triton's JIT: fp32): keep the math in fp32 either way
    scale = tl.cast(scale, tl.float32)
    thr_pos = threshold > 0.0  # before the cast: the interpreter's cast scalar compares as a float
    threshold = tl.cast(threshold, tl.float32)
    qb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HC
    hc = bh % HC
    h = H0 + hc
    p = h // HP_GROUP
    offs = tl.arange(0, BLOCK_B)
    kb_ok = offs < NB
    b64 = b.to(tl.int64)

    # regions: segment index, capped at floor(L_b / S) (the tail); L_b = N without padding
    if HAS_PAD:
        n_seg = tl.load(LENS + b) // segment_size
    else:
        n_seg = N // segment_size
    region_k = tl.minimum((offs * block_size) // segment_size, n_seg)
    region_q = tl.minimum((qb * block_size) // segment_size, n_seg)
    kvalid = tl.load(KCNT + (b64 * HP + p) * NB + offs, mask=kb_ok, other=0) > 0
    if IS_CAUSAL:
        cand = kb_ok & kvalid & (region_k < region_q)
    else:
        cand = kb_ok & kvalid & (region_k != region_q)
    sink = tl.load(SINK + b64 * HP + p)  # -1: none
    forced = kb_ok & ((region_k == region_q) | (offs == sink))
    if HAS_WINDOW:
        # inside the window: a valid key at or after the bound of the block's first row (the
        # lowest of its rows' bounds); the softmax below then normalises over these candidates
        lo_first = _window_lo(qb * block_size + offs * 0, SLIDING, CHUNK, HAS_WINDOW)
        inside = tl.load(KLAST + (b64 * HP + p) * NB + offs, mask=kb_ok, other=-1) >= lo_first
        cand = cand & inside
        forced = forced & inside

    if EXACT:
        keep = cand
    else:
        if STRIDED:
            prob = _strided_prob_row(
                LBM,
                LSE,
                QV,
                b64 * HC + hc,
                b64,
                qb,
                offs,
                cand,
                N,
                NB,
                NROWS,
                BS,
                STRIDE,
                RPB,
                RC,
                BLOCK_B,
                ROW_QV,
                HAS_PAD,
                HAS_WINDOW,
            )
            prob = tl.where(cand, prob, 0.0)
        else:
            raw = tl.load(LOGITS + ((b64 * HC + hc) * NB + qb) * NB + offs, mask=cand, other=0.0)
            logit = tl.where(cand, raw * scale, float("-inf"))
            m = tl.max(logit, 0)
            m = tl.where(m == float("-inf"), 0.0, m)
            e = tl.where(cand, tl.exp(logit - m), 0.0)
            denom = tl.sum(e, 0)
            prob = e / tl.where(denom > 0.0, denom, 1.0)
        # total order: probability bits (>= 0, integer order = float order; -1 for
        # non-candidates) in the high part, (BLOCK_B-1-index) in the low part, so descending
        # order breaks ties to the lower block index
        pbits = tl.where(cand, prob.to(tl.int32, bitcast=True), -1)
        packed = pbits.to(tl.int64) * BLOCK_B + (BLOCK_B - 1 - offs).to(tl.int64)
        if CUT_SORT:
            srt = tl.sort(packed, descending=True)
            s_bits = (srt // BLOCK_B).to(tl.int32)
            s_cand = srt >= 0
            s_prob = tl.where(s_cand, s_bits.to(tl.float32, bitcast=True), 0.0)
            before = tl.cumsum(s_prob, 0) - s_prob
            keep_sorted = s_cand & (before < threshold)
            cut = tl.min(tl.where(keep_sorted, srt, 9223372036854775807), 0)
            keep = cand & (packed >= cut)
        else:
            # a candidate is kept iff the mass of the candidates ranked before it is below the
            # threshold; that mass falls as the key rises, so bisect for the smallest key whose
            # mass-above is < threshold (no sort; ~log2(range) masked sums)
            hi = tl.max(packed, 0)  # mass above the top key is 0 (< threshold when threshold > 0)
            lo = tl.min(tl.where(cand, packed, hi), 0) - 1  # mass above it: everything
            while hi - lo > 1:
                mid = lo + (hi - lo) // 2
                above = tl.sum(tl.where(packed > mid, prob, 0.0), 0)
                go = above < threshold
                hi = tl.where(go, mid, hi)
                lo = tl.where(go, lo, mid)
            # (when even the total mass is below the threshold, hi ends at the lowest key: all kept)
            keep = cand & (packed >= hi) & thr_pos

    final = keep | forced | (cand & (qb >= dense_from))
    # blocks that need the attention kernel's element mask
    seg_first = (qb * block_size // mask_segment) * mask_segment // block_size
    if IS_CAUSAL:
        needs = offs >= seg_first
    else:
        needs = offs < 0
    needs = needs | ((offs == NB - 1) & (N % block_size != 0))
    if HAS_WINDOW:
        # a key of the block's segment may precede the window of the query block's last row
        last_row = tl.minimum(qb * block_size + block_size, N) - 1 + offs * 0
        seg_start = (offs * block_size // mask_segment) * mask_segment
        needs = needs | (seg_start < _window_lo(last_row, SLIDING, CHUNK, HAS_WINDOW))
    if HAS_PAD:
        needs = offs >= 0
    full = final & ~needs
    rest = final & needs
    fi = full.to(tl.int32)
    ri = rest.to(tl.int32)
    n_full = tl.sum(fi, 0)
    n_tot = n_full + tl.sum(ri, 0)
    pos = tl.where(full, tl.cumsum(fi, 0) - 1, n_full + tl.cumsum(ri, 0) - 1)
    row = (b64 * H + h) * NB + qb
    tl.store(KV_IDX + row * NB + pos, offs, mask=final)
    tl.store(KV_IDX + row * NB + offs, tl.zeros_like(offs), mask=kb_ok & (offs >= n_tot))
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


def block_logits(qbar: torch.Tensor, kbar: torch.Tensor, p0: int = 0, p1: Optional[int] = None) -> torch.Tensor:
    """fp32 ``[B, (p1-p0)*G, nB, nB]`` raw block logits ``q̄_I · k̄_J`` of the query heads of
    permutation heads ``[p0, p1)``: one batched fp32 GEMM (no TF32) with the group of query heads
    sharing a permutation head folded into the rows (a view, no repeat), as the reference's
    ``torch.matmul(qbar[b, heads], kbar.t())``."""
    bsz, hq, nb, d = qbar.shape
    hp = kbar.shape[1]
    p1 = hp if p1 is None else p1
    g = hq // hp
    qv = qbar.view(bsz, hp, g * nb, d)[:, p0:p1]
    with _moments.products("ieee", qbar.is_cuda):
        out = torch.matmul(qv, kbar[:, p0:p1].transpose(-1, -2))  # [B, P, G*nB, nB]
    return out.view(bsz, (p1 - p0) * g, nb, nb)


def select_block_lists(
    q: torch.Tensor,
    k_perm: Optional[torch.Tensor],
    permutation: torch.Tensor,
    *,
    key_padding_mask: Optional[torch.Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    block_size: int = PBSConfig.block_size,
    segment_size: int = PBSConfig.segment_size,
    threshold: float = PBSConfig.threshold,
    force_sink: bool = PBSConfig.force_sink,
    mask_segment: Optional[int] = None,
    return_block_mask: bool = True,
    layout=None,
    max_logit_bytes: int = 1 << 30,
    cut: str = "bisect",
    scoring: str = PBSConfig.scoring,
    antidiagonal_stride: int = PBSConfig.antidiagonal_stride,
    moments_sd: float = PBSConfig.moments_sd,
    moments_product: str = PBSTuning.moments_product,
    padding_checked: bool = False,
    dense_from: Optional[int] = None,
    sliding_window: int = PBSConfig.sliding_window,
    chunk_size: int = PBSConfig.chunk_size,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """``(kv_num, kv_full, kv_idx, block_mask or None)`` for ``q [B, Hq, N, D]`` and the permuted
    keys. ``layout``: the :class:`triton_gather.PermutedLayout` of the permutation (its pooled key
    blocks, valid-key counts and sink blocks, made by the same launch that permutes K/V); without
    it they are computed here in torch from ``k_perm [B, Hp, N, D]`` (``permute_kv(k,
    permutation)``). ``mask_segment`` (default ``segment_size``) decides which blocks take the
    attention kernel's unmasked path. ``max_logit_bytes`` bounds the logits buffer (heads are
    processed in chunks beyond it). ``cut``: ``"bisect"`` or ``"sort"`` (same selection; two
    ways to find the threshold prefix). ``scoring="sampled_rows"|"antidiagonal"`` (stride
    ``antidiagonal_stride``): the block probabilities come from triton_estimate's one-pass
    strided estimate over the permuted keys (``layout.k`` or ``k_perm``), the estimate buffer
    bounded by ``max_logit_bytes`` the same way; the threshold rule is the same.
    ``moments_product`` (``scoring="moments"``): the spread's products on TF32 tensor cores
    (``"tf32"``) or in IEEE fp32 (``"ieee"``, the reference's arithmetic); see :mod:`.moments`.
    ``padding_checked``: the caller passes ``key_padding_mask`` only when it hides a key, so
    this call need not read it on the host again (each such read waits for the device).
    ``dense_from``: the query blocks from this one on keep every visible key block (the dense
    tail; None: none), so the attention kernel computes their rows exactly. ``sliding_window`` /
    ``chunk_size``: a local window (causal only): the selection among the blocks inside each query
    block's window, as the reference's ``select_blocks``; the blocks it may cut take the kernel's
    element mask (pass the same window to the attention)."""
    check_window(sliding_window, chunk_size, is_causal)
    bsz, hq, n, d = q.shape
    nb = -(-n // block_size)
    sc = 1.0 / math.sqrt(d) if scale is None else float(scale)
    has_pad = key_padding_mask is not None and (padding_checked or not bool(key_padding_mask.all()))
    kpm = key_padding_mask.to(torch.bool) if has_pad else None
    exact, strided = _selection_kind(threshold, cut, scoring, block_size, antidiagonal_stride)
    lens = effective_lengths(kpm, bsz, n, q.device).to(torch.int32) if has_pad else None
    kbar, kcnt, sink = _key_block_stats(
        layout, k_perm, permutation, kpm, force_sink, not exact and not strided, nb, block_size
    )
    kv_num, kv_full, kv_idx, bmask = outputs = _selection_outputs(bsz, hq, nb, q.device, return_block_mask)
    has_window = bool(sliding_window or chunk_size)
    # each permuted block's latest valid key: inside a window or not (unread without one)
    klast = block_last_keys(permutation, kpm, block_size).to(torch.int32).contiguous() if has_window else kcnt
    hp = permutation.shape[1]
    shape_args = (hq, nb, hq // hp, hp, n)
    seg_args = (
        sc,
        float(threshold),
        block_size,
        segment_size,
        segment_size if mask_segment is None else mask_segment,
        nb if dense_from is None else min(max(int(dense_from), 0), nb),
        int(sliding_window),
        int(chunk_size),
    )
    meta = _row_meta(nb, is_causal, exact, has_pad, return_block_mask, cut, strided, block_size, has_window)
    launch = _row_launch(outputs, lens, kcnt, sink, klast, shape_args, seg_args, meta)
    if exact:
        launch.run(kv_num, launch.no_est, 0, hq, 0)
    elif strided:
        _select_strided(
            launch,
            q,
            k_perm,
            permutation,
            layout,
            kpm,
            lens,
            is_causal,
            scale,
            block_size,
            segment_size,
            scoring,
            antidiagonal_stride,
            max_logit_bytes,
            (int(sliding_window), int(chunk_size)),
        )
    else:
        moments = scoring == "moments" and float(moments_sd) > 0.0
        spread = (
            _moments_spread(layout, k_perm, permutation, kpm, q, float(moments_sd), sc, moments_product)
            if moments
            else None
        )
        _select_from_pooled_logits(launch, q, kpm, kbar, block_size, max_logit_bytes, spread)
    return kv_num, kv_full, kv_idx, bmask


def _selection_outputs(bsz: int, hq: int, nb: int, dev, with_mask: bool):
    """``(kv_num, kv_full, kv_idx, block mask or None)``, allocated for the kernel to fill."""
    kv_num = torch.empty(bsz, hq, nb, dtype=torch.int32, device=dev)
    kv_full = torch.empty_like(kv_num)
    kv_idx = torch.empty(bsz, hq, nb, nb, dtype=torch.int32, device=dev)  # fully written (zeros past kv_num)
    bmask = torch.empty(bsz, hq, nb, nb, dtype=torch.bool, device=dev) if with_mask else None
    return kv_num, kv_full, kv_idx, bmask


def _row_meta(
    nb: int,
    is_causal,
    exact: bool,
    has_pad: bool,
    write_mask: bool,
    cut: str,
    strided: bool,
    block_size: int,
    has_window: bool = False,
) -> dict:
    """``_select_rows_kernel``'s compile-time arguments (the strided ones as for no estimate)."""
    block_b = pow2_at_least(nb, 16)
    meta = dict(
        BLOCK_B=block_b,
        IS_CAUSAL=bool(is_causal),
        HAS_WINDOW=has_window,
        EXACT=exact,
        HAS_PAD=has_pad,
        WRITE_MASK=write_mask,
        CUT_SORT=cut == "sort",
        num_warps=4 if block_b <= 256 else 8,
    )
    meta.update(STRIDED=strided, BS=block_size, STRIDE=1, RPB=1, RC=1, ROW_QV=False)
    return meta


def _row_launch(outputs, lens, kcnt, sink, klast, shape_args, seg_args, meta) -> "_RowLaunch":
    """The shared launch arguments; kv_num stands in for the pointers a launch does not read."""
    kv_num, kv_full, kv_idx, bmask = outputs
    return _RowLaunch(
        head_args=(
            lens if lens is not None else kv_num,
            kcnt,
            sink,
            klast,
            kv_num,
            kv_full,
            kv_idx,
            bmask.view(torch.int8) if bmask is not None else kv_num,
        ),
        shape_args=shape_args,
        seg_args=seg_args,
        no_est=(kv_num, kv_num, kv_num),  # LBM, LSE, QV: unused unless STRIDED
        meta=meta,
        bsz=kv_num.shape[0],
        unused=kv_num,
    )


def _selection_kind(threshold, cut: str, scoring: str, block_size: int, antidiagonal_stride: int) -> Tuple[bool, bool]:
    """``(exact, strided)``: threshold >= 1 keeps every visible block (no scores needed); strided
    block probabilities come from triton_estimate, the others from pooled block logits."""
    exact = float(threshold) >= 1.0
    if cut not in ("bisect", "sort"):
        raise ValueError(f"cut must be 'bisect' or 'sort', got {cut!r}")
    if scoring not in POOLED_SCORINGS + ("sampled_rows", "antidiagonal"):
        raise ValueError(f"scoring must be 'mean', 'moments', 'antidiagonal' or 'sampled_rows', got {scoring!r}")
    strided = scoring not in POOLED_SCORINGS and not exact
    if strided:
        _est._check(scoring, block_size, antidiagonal_stride)
    return exact, strided


def _key_block_stats(layout, k_perm, permutation, kpm, force_sink: bool, need_kbar: bool, nb: int, block_size: int):
    """``(kbar, kcount, sink)`` of the permuted key blocks: pooled keys (when ``need_kbar``),
    valid-key counts ``[B, Hp, nB]`` int32 and the sink's block ``[B, Hp]`` int32 (-1: none).
    Taken from ``layout`` when it has them (the permuting launch made them), else computed in torch."""
    bsz, hp, n = permutation.shape
    dev = permutation.device
    if (
        layout is not None
        and layout.kcount is not None
        and (not need_kbar or layout.kbar is not None)
        and (layout.sink is not None or not force_sink)
    ):
        kbar, kcnt = layout.kbar, layout.kcount
        sink = layout.sink if force_sink else None
    else:  # pooled keys, counts and sink from the permuted K in torch
        valid = kpm if kpm is not None else torch.ones(bsz, n, dtype=torch.bool, device=dev)
        slot_valid = _slot_validity(valid, permutation)
        kcnt = (
            torch.nn.functional.pad(slot_valid, (0, nb * block_size - n))
            .view(bsz, hp, nb, block_size)
            .sum(-1, dtype=torch.int32)
        )
        kbar = pool_blocks(k_perm, slot_valid, block_size, fallback_all=False).contiguous() if need_kbar else None
        sink = None
        if force_sink:
            first = first_valid(kpm, bsz, n, dev)  # [B], -1 if none
            slot = (permutation == first.clamp_min(0)[:, None, None]).to(torch.int8).argmax(dim=-1)  # [B, Hp]
            sink = torch.where(first[:, None] >= 0, slot // block_size, torch.full_like(slot, -1))
    if sink is None:
        sink = torch.full((bsz, hp), -1, device=dev, dtype=torch.int32)
    return kbar, kcnt.contiguous(), sink.to(torch.int32).contiguous()


class _RowLaunch(NamedTuple):
    """The arguments every ``_select_rows_kernel`` launch of one call shares; ``run`` launches it
    for ``hc`` heads from ``h0`` with the block scores ``scores`` (logits, or unused)."""

    head_args: Tuple  # LENS, KCOUNT, SINK, KLAST, KV_NUM, KV_FULL, KV_IDX, BMASK
    shape_args: Tuple  # Hq, nB, G, Hp, N
    # scale, threshold, block size, segment size, mask segment, first dense query block, window
    seg_args: Tuple
    no_est: Tuple
    meta: dict
    bsz: int
    unused: torch.Tensor  # a placeholder for pointer arguments a launch does not read

    def run(self, scores, est: Tuple, h0: int, hc: int, nrows: int) -> None:
        hq, nb, g, hp, n = self.shape_args
        lens, kcnt, sink = self.head_args[:3]
        _select_rows_kernel[(nb, self.bsz * hc)](
            scores,
            lens,
            kcnt,
            sink,
            *self.head_args[3:],
            *est,
            hq,
            h0,
            hc,
            nb,
            g,
            hp,
            n,
            nrows,
            *self.seg_args,
            **self.meta,
        )


def _select_strided(
    launch: _RowLaunch,
    q,
    k_perm,
    permutation,
    layout,
    kpm,
    lens,
    is_causal,
    scale,
    block_size,
    segment_size,
    scoring,
    antidiagonal_stride,
    max_logit_bytes,
    window=(0, 0),
) -> None:
    """Selection from triton_estimate's strided block probabilities, in head chunks whose
    estimate buffers fit ``max_logit_bytes`` (``window``: the call's local window, which the
    estimate skips the segments before)."""
    hq, nb, _, hp, _ = launch.shape_args
    bsz = launch.bsz
    k_src = _permuted_key_source(layout, k_perm, scoring)
    kpos = layout.kpos if layout is not None else None
    kpos, _, qvalid = _est.padding_inputs(kpm, permutation, block_size, kpos=kpos)
    launch.meta.update(_est.prob_meta(scoring, block_size, antidiagonal_stride, launch.meta["BLOCK_B"]))
    nrows = nb * launch.meta["RPB"]
    hc = max(1, min(hq, max_logit_bytes // max(bsz * nrows * (nb + 1) * 4, 1)))
    for h0 in range(0, hq, hc):
        hcc = min(hc, hq - h0)
        lbm, lse = _est.strided_estimate(
            q,
            k_src,
            kpos,
            lens,
            qvalid,
            scoring=scoring,
            stride=antidiagonal_stride,
            hp=hp,
            h0=h0,
            hc=hcc,
            is_causal=is_causal,
            scale=scale,
            block_size=block_size,
            segment_size=segment_size,
            sliding_window=window[0],
            chunk_size=window[1],
        )
        est = (lbm, lse, qvalid if qvalid is not None else lse)
        launch.run(launch.unused, est, h0, hcc, nrows)


class _Spread(NamedTuple):
    """What ``scoring="moments"`` adds to the pooled logits: ``sds`` standard deviations (signed as
    the scale, which the selection kernel applies to the raw logits), over the permuted keys
    ``k_src [B, Hp, N, D]`` of ``permutation`` and the valid query positions ``valid [B, N]``, its
    products in ``product``'s arithmetic (:mod:`.moments`)."""

    sds: float
    k_src: torch.Tensor
    permutation: torch.Tensor
    valid: torch.Tensor
    product: str


def _permuted_key_source(layout, k_perm, scoring: str) -> torch.Tensor:
    """The permuted keys a scoring reads: the layout's, else ``k_perm``."""
    k_src = layout.k if layout is not None and layout.k is not None else k_perm
    if k_src is None:
        raise ValueError(f"scoring={scoring!r} needs the permuted keys: pass k_perm or a layout with k")
    return k_src


def _slot_validity(valid: torch.Tensor, permutation: torch.Tensor) -> torch.Tensor:
    """``[B, Hp, N]`` bool: whether each permuted slot holds a valid key (``valid [B, N]``)."""
    bsz, hp, n = permutation.shape
    return torch.gather(valid[:, None, :].expand(bsz, hp, n), 2, permutation)


def _moments_spread(layout, k_perm, permutation, kpm, q, sds: float, scale: float, product: str) -> _Spread:
    k_src = _permuted_key_source(layout, k_perm, "moments")
    valid = _common.valid_positions(kpm, q.shape[0], q.shape[2], q.device)
    return _Spread(math.copysign(sds, scale), k_src, permutation, valid, product)


def _key_blocks(spread: _Spread, p0: int, p1: int, block_size: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(fp32 [B, P, nB, bs, D], bool [B, P, nB, bs])``: permutation heads ``[p0, p1)``'s permuted
    keys by block (zero past N) and which slots hold a valid key (what the key blocks' moments are
    taken over, as their means are)."""
    perm = spread.permutation[:, p0:p1]
    bsz, hp, n = perm.shape
    total = -(-n // block_size) * block_size
    slot_valid = torch.nn.functional.pad(_slot_validity(spread.valid, perm), (0, total - n))
    kf = torch.nn.functional.pad(spread.k_src[:, p0:p1].float(), (0, 0, 0, total - n))
    nb = total // block_size
    return kf.view(bsz, hp, nb, block_size, kf.shape[-1]), slot_valid.view(bsz, hp, nb, block_size)


def _add_spread(spread: _Spread, qs, p0: int, p1: int, block_size: int, mu):
    """``mu + sds * sd`` of the raw (unscaled) block logits ``mu [B, P*G, nB, nB]`` of permutation
    heads ``[p0, p1)`` (``qs``: their query heads ``[B, P*G, N, D]``): the pairs' variance from the
    blocks' centred second moments (:mod:`.moments`), in ``spread.product``'s arithmetic."""
    bsz, pg, nb, _ = mu.shape
    p = p1 - p0
    prod = spread.product
    with _moments.products(prod, mu.is_cuda):
        qblocks, quse = _estimate.query_blocks(qs, spread.valid, block_size)
        left = _moments.left_operand(*_moments.block_moments(qblocks, quse, prod))
        right = _moments.right_operand(*_moments.block_moments(*_key_blocks(spread, p0, p1, block_size), prod))
        var = _moments.pair_variance(left.view(bsz, p, (pg // p) * nb, -1), right, prod).view(bsz, pg, nb, nb)
    return mu + spread.sds * var.clamp_min(0.0).sqrt()


def _select_from_pooled_logits(
    launch: _RowLaunch, q, kpm, kbar, block_size, max_logit_bytes, spread: Optional[_Spread] = None
) -> None:
    """Selection from the logits of pooled query blocks against pooled key blocks, in chunks of
    permutation heads whose logits fit ``max_logit_bytes``; with ``spread`` each logit adds its
    pair's spread (``scoring="moments"``)."""
    _, nb, g, hp, _ = launch.shape_args
    qbar = pool_query_blocks(q, kpm, block_size).contiguous()
    kbar = kbar.contiguous()
    per_p = launch.bsz * g * nb * nb * 4
    if spread is not None:  # a head's operands, covariances, fp32 blocks, variances and their roots
        d = q.shape[-1]
        per_p += launch.bsz * ((g + 1) * nb * (4 * d * d + 3 * block_size * d) + 2 * g * nb * nb) * 4
    pc = max(1, min(hp, max_logit_bytes // max(per_p, 1)))
    for p0 in range(0, hp, pc):
        p1 = min(hp, p0 + pc)
        logits = block_logits(qbar, kbar, p0, p1)  # [B, HC, nB, nB]
        if spread is not None:
            logits = _add_spread(spread, q[:, p0 * g : p1 * g], p0, p1, block_size, logits)
        launch.run(logits, launch.no_est, p0 * g, (p1 - p0) * g, 0)


# --------------------------------------------------------------------------- 1. proxy key scores


@triton.jit
def _proxy_pass(  # noqa: PLR0912, PLR0915
    Q,
    K,
    KVALID,
    PIDX,
    PCNT,
    LENS,
    M_OUT,
    L_OUT,
    LSE,
    SCORE,
    H,
    HKV,
    N,
    NSEG_MAX,
    NPROXY,
    lse_sh,
    lse_ss,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kn,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SEGMENT: tl.constexpr,
    SCORE_PASS: tl.constexpr,
    HAS_PAD: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
):
    """One program per (segment, batch*query head). Pass 1 (SCORE_PASS=False): per proxy row, the
    running max / sum of exp2 over the segment's valid keys. Pass 2: per key, the mean over
    proxy rows of exp2(s - lse_row) (the proxy softmax probability)."""
    # Inductor types a Python float argument fp64 (Triton's JIT: fp32): keep the math in fp32 either way
    qk_scale = tl.cast(qk_scale, tl.float32)
    seg = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    kvh = h // (H // HKV)
    if HAS_PAD:
        n_seg = tl.load(LENS + b) // SEGMENT
    else:
        n_seg = N // SEGMENT
    if seg < n_seg:
        rows = tl.arange(0, BLOCK_P)
        if HAS_PAD:
            pcnt = tl.load(PCNT + b)
            r_ok = rows < pcnt
            pidx = tl.load(PIDX + b * BLOCK_P + rows, mask=r_ok, other=0)
        else:  # the last NPROXY positions
            pcnt = NPROXY + b * 0
            r_ok = rows < pcnt
            pidx = tl.where(r_ok, N - NPROXY + rows, 0)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        b64 = b.to(tl.int64)
        q = tl.load(
            Q + b64 * stride_qb + h.to(tl.int64) * stride_qh + pidx[:, None] * stride_qn + offs_d[None, :],
            mask=r_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        k_base = K + b64 * stride_kb + kvh.to(tl.int64) * stride_kh
        if SCORE_PASS:
            lse = tl.load(LSE + (b64 * H + h) * lse_sh + seg * lse_ss + rows, mask=r_ok, other=float("inf"))
            inv_cnt = 1.0 / pcnt.to(tl.float32)
        else:
            m_i = tl.full([BLOCK_P], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_P], dtype=tl.float32)
        for j in tl.static_range(0, SEGMENT, BLOCK_N):
            offs_n = seg * SEGMENT + j + tl.arange(0, BLOCK_N)
            n_ok = (j + tl.arange(0, BLOCK_N)) < SEGMENT
            k = tl.load(
                k_base + offs_n[:, None] * stride_kn + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0
            )
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


@triton.jit
def _segment_lse_chunk(M, L, base, s0, seg_end, rows, NSEG_MAX, BLOCK_P: tl.constexpr, CHUNK_S: tl.constexpr):
    """(offsets, ok, log2-sum-exp2) of segments ``s0 .. s0+CHUNK_S`` of one proxy row block from
    pass 1's running max / sum; segments at or past ``seg_end`` (or without mass) are -inf."""
    segs = s0 + tl.arange(0, CHUNK_S)
    ok = segs < NSEG_MAX
    o = base + segs[:, None] * BLOCK_P + rows[None, :]
    m = tl.load(M + o, mask=ok[:, None], other=float("-inf"))
    total = tl.load(L + o, mask=ok[:, None], other=0.0)
    lse = tl.where((total > 0) & (segs < seg_end)[:, None], m + tl.log2(tl.maximum(total, 1e-30)), float("-inf"))
    return o, ok, lse


@triton.jit
def _lse_combine_kernel(
    M,
    L,
    LENS,
    LSE,
    H,
    N,
    NSEG_MAX,
    SEGMENT: tl.constexpr,
    BLOCK_P: tl.constexpr,
    CHUNK_S: tl.constexpr,
    PER_SEGMENT: tl.constexpr,
    HAS_PAD: tl.constexpr,
):
    """One program per batch*head: each proxy row's log2-sum-exp2 normaliser from the per-segment
    running max / sum of pass 1 -- over the row's complete segments (max first, then the sum of
    exp2 over segments, as torch would), or per segment (``PER_SEGMENT``, causal proxy)."""
    bh = tl.program_id(0)
    b = bh // H
    if HAS_PAD:
        n_seg = tl.load(LENS + b) // SEGMENT
    else:
        n_seg = N // SEGMENT
    rows = tl.arange(0, BLOCK_P)
    base = bh.to(tl.int64) * NSEG_MAX * BLOCK_P
    if PER_SEGMENT:
        s0 = 0
        while s0 < NSEG_MAX:  # (a while loop: the interpreter cannot range() over an argument)
            o, ok, lse = _segment_lse_chunk(M, L, base, s0, n_seg, rows, NSEG_MAX, BLOCK_P, CHUNK_S)
            tl.store(LSE + o, lse, mask=ok[:, None])
            s0 += CHUNK_S
    else:
        mx = tl.full([BLOCK_P], float("-inf"), dtype=tl.float32)
        s0 = 0
        while s0 < NSEG_MAX:  # (a while loop: the interpreter cannot range() over an argument)
            _, _, lse = _segment_lse_chunk(M, L, base, s0, n_seg, rows, NSEG_MAX, BLOCK_P, CHUNK_S)
            mx = tl.maximum(mx, tl.max(lse, 0))
            s0 += CHUNK_S
        mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
        tot = tl.zeros([BLOCK_P], dtype=tl.float32)
        s0 = 0
        while s0 < NSEG_MAX:  # (a while loop: the interpreter cannot range() over an argument)
            _, _, lse = _segment_lse_chunk(M, L, base, s0, n_seg, rows, NSEG_MAX, BLOCK_P, CHUNK_S)
            tot += tl.sum(tl.exp2(lse - mx_safe[None, :]), 0)
            s0 += CHUNK_S
        tl.store(LSE + bh.to(tl.int64) * BLOCK_P + rows, mx_safe + tl.log2(tot))


def key_scores(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    key_padding_mask: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    block_size: int = PBSConfig.block_size,
    segment_size: int = PBSConfig.segment_size,
    causal_proxy: bool = PBSConfig.causal_proxy,
    gqa_permutation: str = PBSConfig.gqa_permutation,
    proxy_blocks: int = PBSConfig.proxy_blocks,
) -> torch.Tensor:
    """The reference's ``key_scores`` (same definition, fp32 ``[B, Hp, N]``) in two Triton passes:
    per-segment softmax statistics of the proxy rows, then per-key mean probabilities.

    ``proxy_blocks > 1``: the proxies come from the reference's ``proxy_queries`` (host-side
    planning, one sync); the same two passes run once per proxy slot, each batch row giving its
    ``j``-th proxy's rows and, as its "length", the end of the segments that proxy sees, and the
    per-key probabilities are averaged over the proxies that see the key."""
    bsz, hq, n, d = q.shape
    hkv = k.shape[1]
    sc = 1.0 / math.sqrt(d) if scale is None else float(scale)
    kpm = key_padding_mask.to(torch.bool) if key_padding_mask is not None else None
    nseg_max = n // segment_size
    out = torch.zeros(bsz, hq, n, dtype=torch.float32, device=q.device)
    geom = _ProxyGeometry(
        nseg_max, max(16, triton.next_power_of_2(block_size)), block_size, segment_size, sc, causal_proxy
    )
    if nseg_max > 0 and n > 0 and proxy_blocks > 1:
        out = _multi_proxy_scores(q, k, out, kpm, proxy_blocks, geom)
    elif nseg_max > 0 and n > 0:
        _last_block_proxy_scores(q, k, out, kpm, geom)
    if gqa_permutation == "kv_head":
        out = out.view(bsz, hkv, hq // hkv, n).mean(dim=2)
    elif gqa_permutation != "query_head":
        raise ValueError(f"gqa_permutation must be 'query_head' or 'kv_head', got {gqa_permutation!r}")
    return out


class _ProxyGeometry(NamedTuple):
    """What the proxy passes of one ``key_scores`` call share."""

    nseg_max: int  # complete segments
    block_p: int  # proxy rows per program (a power of two >= block_size)
    block_size: int
    segment_size: int
    sc: float  # the softmax scale
    causal_proxy: bool


def _multi_proxy_scores(q, k, out, kpm, proxy_blocks: int, geom: _ProxyGeometry) -> torch.Tensor:
    """``proxy_blocks > 1``: the two passes once per proxy slot of the reference's plan, each key's
    probabilities averaged over the proxies that see it."""
    bsz, n, dev = q.shape[0], q.shape[2], q.device
    plan = proxy_queries(
        kpm, bsz, n, block_size=geom.block_size, segment_size=geom.segment_size, proxy_blocks=proxy_blocks, device=dev
    )
    n_slots = max((len(p) for p in plan), default=0)
    kvalid = kpm if kpm is not None else torch.ones(bsz, n, dtype=torch.bool, device=dev)
    kvalid = kvalid.to(torch.int8).contiguous()
    seen_by = torch.zeros(bsz, 1, n, dtype=torch.float32, device=dev)
    for j in range(n_slots):  # slot j: the j-th proxy of every row that has one (the last ones aligned)
        pidx, pcnt, lens = _proxy_slot(plan, j, n_slots, seen_by, geom)
        part = torch.zeros_like(out)
        _proxy_scores(q, k, part, kvalid, pidx, pcnt, lens, True, geom)
        out += part
    return torch.where(seen_by > 0, out / seen_by.clamp_min(1.0), out)


def _proxy_slot(plan, j: int, n_slots: int, seen_by: torch.Tensor, geom: _ProxyGeometry):
    """``(pidx, pcnt, lens)`` of proxy slot ``j`` per batch row (zero rows where a row has no such
    proxy); counts, in ``seen_by``, the keys of the segments each proxy sees."""
    bsz, dev = seen_by.shape[0], seen_by.device
    pidx = torch.zeros(bsz, geom.block_p, dtype=torch.int32, device=dev)
    pcnt = torch.zeros(bsz, dtype=torch.int32, device=dev)
    lens = torch.zeros(bsz, dtype=torch.int32, device=dev)
    for b, proxies in enumerate(plan):
        slot = j - (n_slots - len(proxies))
        if slot < 0:
            continue
        rows, seen = proxies[slot]
        pidx[b, : rows.numel()] = rows.to(torch.int32)
        pcnt[b] = rows.numel()
        lens[b] = seen * geom.segment_size
        seen_by[b, 0, : seen * geom.segment_size] += 1.0
    return pidx, pcnt, lens


def _last_block_proxy_scores(q, k, out, kpm, geom: _ProxyGeometry) -> None:
    """One proxy per row, its last ``block_size`` valid positions, into ``out``; without padding
    the kernels derive lengths and proxies from N."""
    if kpm is None:
        _proxy_scores(q, k, out, out, out, out, out, False, geom)
        return
    bsz, n, dev = q.shape[0], q.shape[2], q.device
    block_size, block_p = geom.block_size, geom.block_p
    lens = effective_lengths(kpm, bsz, n, dev).to(torch.int32).contiguous()
    pos = torch.arange(n, device=dev).expand(bsz, n)
    rank_from_end = kpm.flip(-1).cumsum(-1).flip(-1)  # 1 for the last valid position
    is_proxy = kpm & (rank_from_end <= block_size)
    pcnt = is_proxy.sum(-1).to(torch.int32).contiguous()
    key = torch.where(is_proxy, pos, pos + n)  # proxies first, ascending
    pidx = torch.sort(key, dim=-1).values[:, : min(block_p, n)] % n
    if pidx.shape[1] < block_p:
        pidx = torch.nn.functional.pad(pidx, (0, block_p - pidx.shape[1]))
    pidx = pidx.to(torch.int32).contiguous()
    _proxy_scores(q, k, out, kpm.to(torch.int8).contiguous(), pidx, pcnt, lens, True, geom)


def _proxy_scores(q, k, out, kvalid, pidx, pcnt, lens, has_pad, geom: _ProxyGeometry):
    """The two passes (and the normaliser in between) for one proxy per batch row, into ``out``
    ``[B, Hq, N]`` (only the keys of the row's ``lens // segment_size`` segments are written)."""
    bsz, hq, n, d = q.shape
    hkv = k.shape[1]
    dev = q.device
    nseg_max, block_p, block_size, segment_size, sc, causal_proxy = geom
    m = torch.empty(bsz, hq, nseg_max, block_p, dtype=torch.float32, device=dev)
    total = torch.empty_like(m)  # running sum of exp2 per proxy row and segment
    block_d = max(16, triton.next_power_of_2(d))
    block_n = min(64, max(16, triton.next_power_of_2(segment_size)))
    meta = dict(
        HEAD_DIM=d,
        BLOCK_D=block_d,
        BLOCK_P=block_p,
        BLOCK_N=block_n,
        SEGMENT=segment_size,
        HAS_PAD=has_pad,
        IEEE=q.dtype == torch.float32,
        INTERP=interpreting(),
        num_warps=4 if block_p * block_n <= 128 * 32 else 8,
    )
    # softmax normaliser per proxy row: over all complete segments, or per segment
    if causal_proxy:
        lse = torch.empty_like(m)
        lse_sh, lse_ss = nseg_max * block_p, block_p
    else:
        lse = torch.empty(bsz, hq, block_p, dtype=torch.float32, device=dev)
        lse_sh, lse_ss = block_p, 0
    common = (
        hq,
        hkv,
        n,
        nseg_max,
        min(block_size, n),
        lse_sh,
        lse_ss,
        sc * 1.4426950408889634,
        *q.stride()[:3],
        *k.stride()[:3],
    )
    grid = (nseg_max, bsz * hq)
    _proxy_pass[grid](q, k, kvalid, pidx, pcnt, lens, m, total, m, out, *common, SCORE_PASS=False, **meta)
    _lse_combine_kernel[(bsz * hq,)](
        m,
        total,
        lens,
        lse,
        hq,
        n,
        nseg_max,
        SEGMENT=segment_size,
        BLOCK_P=block_p,
        CHUNK_S=min(16, pow2_at_least(nseg_max)),
        PER_SEGMENT=bool(causal_proxy),
        HAS_PAD=has_pad,
        num_warps=4,
    )
    _proxy_pass[grid](q, k, kvalid, pidx, pcnt, lens, m, total, lse, out, *common, SCORE_PASS=True, **meta)


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
    segment_size: int = PBSConfig.segment_size,
    key_padding_mask: Optional[torch.Tensor] = None,
    permute: bool = PBSConfig.permute,
) -> torch.Tensor:
    """The reference's ``segment_permutation`` (``[B, Hp, N]`` int64) with one Triton program per
    (segment, batch*head): a stable descending sort of the segment's scores."""
    bsz, hp, n = scores.shape
    perm = torch.arange(n, device=scores.device).expand(bsz, hp, n).contiguous()
    if not permute or n // segment_size == 0:
        return perm
    lens = effective_lengths(key_padding_mask, bsz, n, scores.device).to(torch.int32).contiguous()
    block_s = max(16, triton.next_power_of_2(segment_size))
    sc = scores.float().clamp_min(0.0).contiguous()
    _segment_sort_kernel[(n // segment_size, bsz * hp)](sc, lens, perm, n, SEGMENT=segment_size, BLOCK_S=block_s, HP=hp)
    return perm
