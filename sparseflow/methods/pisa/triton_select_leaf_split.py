"""PISA's decoding walk with its leaf level split off (``Tuning(pisa_walk="leaf_pairs")`` in
``PyramidCache``'s decoding steps).

At decode the per-token walk runs one program per (query, KV head): a handful of programs on a
GPU of a hundred-odd SMs, each scoring its ``CW`` candidate leaves (``C`` raw keys each) in
chunks, one after the other, after the levels above. The leaves are most of the bytes (at K=32,
64 candidate leaves of 64 keys against 128 summaries a level). Here the walk stops at the leaf
candidates (``LEAF_OUT``, as in the scan walk), one program per (query, chunk of ``LC``
candidates, batch x KV head) scores the chunks side by side, and the scan's keep
(``triton_select_scan._leaf_keep_kernel``) writes each query's ``top_k``. Three launches
instead of one, each reading the device length (``length``) where the walk does, so a CUDA
graph still replays every step.

The leaf scores are the per-token walk's own arithmetic (the same dot and reduction over the
same keys), so the selection is the per-token walk's (tests/methods/pisa/test_pisa_decode_leaf_split.py).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from ...kernels._triton_env import interpreting
from .triton_select import level_sizes
from .triton_select_common import _p2, candidate_width, scores_mode, walk_args, walk_meta, window_args
from .triton_select_per_token import _launch, _leaf_scores, _pisa_select_kernel, no_scan_args
from .triton_select_scan import LAUNCH, _leaf_keep_kernel, queries_per_program

__all__ = ["pisa_select_leaf_split_fwd", "leaf_split_walk", "leaves_per_program", "pyramid_leaves"]


def pyramid_leaves(total_nodes: int, branching: int) -> int:
    """The leaf count of the pyramid of ``total_nodes`` nodes (its levels' sizes summed, leaves
    first: ``triton_select.level_sizes``), which grows with the leaves: found by bisection."""
    lo, hi = 1, max(1, total_nodes)
    while lo < hi:
        mid = (lo + hi) // 2
        if sum(level_sizes(mid, branching)) < total_nodes:
            lo = mid + 1
        else:
            hi = mid
    return lo


def leaves_per_program(cw: int, cp: int) -> int:
    """Candidate leaves one program scores: about 256 keys (a power of two dividing ``cw``)."""
    return max(1, min(cw, 256 // cp))


@triton.jit
def _leaf_split_kernel(
    q_ptr,
    k_ptr,
    cand_ptr,
    score_ptr,
    len_ptr,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_cbh,
    stride_cn,
    Nq,
    Nk,
    HKV,
    qk_scale,
    HAS_LEN: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    SCORE: tl.constexpr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    C: tl.constexpr,
    CP: tl.constexpr,
    CW: tl.constexpr,
    TOPK: tl.constexpr,
    LC: tl.constexpr,
    IEEE: tl.constexpr,
    I64_ROWS: tl.constexpr,
):
    """Program (query ``i``, chunk, batch x KV head): the chunk's ``LC`` candidate slots of the
    query's row in ``cand`` (``[B*Hkv, Nq, CW]``: -1 invalid, ``id | 2**30`` forced), each scored
    one (valid, unforced, in a row with more than ``TOPK`` valid) gets the walk's leaf score,
    stored at its slot of ``score`` (``cand``'s layout)."""
    qk_scale = tl.cast(qk_scale, tl.float32)
    if HAS_LEN:  # a preallocated KV buffer of capacity Nk holding len_ptr[0] keys
        Nk = tl.minimum(tl.load(len_ptr), Nk)
    i = tl.program_id(0)
    bh = tl.program_id(2).to(tl.int64)  # 64-bit offsets: batch x head strides pass 2**31 elements
    b = bh // HKV
    hkv = bh % HKV
    row = bh * stride_cbh + i.to(tl.int64) * stride_cn
    n_valid = tl.sum((tl.load(cand_ptr + row + tl.arange(0, CW)) >= 0).to(tl.int32), axis=0)
    sub = tl.program_id(1) * LC + tl.arange(0, LC)
    enc = tl.load(cand_ptr + row + sub)
    l_ok = (enc >= 0) & (enc < (1 << 30)) & (n_valid > TOPK)
    if tl.sum(l_ok.to(tl.int32), axis=0) > 0:
        hz = i + Nk - Nq if IS_CAUSAL else Nk - 1  # the query's position (bottom-right aligned)
        offs_d = tl.arange(0, DP)
        d_ok = offs_d < D
        offs_g = tl.arange(0, GP)
        g_ok = offs_g < G
        q_rows = q_ptr + b * stride_qb + (hkv * G + offs_g)[:, None] * stride_qh + i.to(tl.int64) * stride_qn
        q_raw = tl.load(q_rows + offs_d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        k_base = k_ptr + b * stride_kb + hkv * stride_kh
        leaf = tl.where(l_ok, enc, 0)
        # the per-token walk's own leaf scores (no key padding at decode: q_ptr stands in for the mask)
        score = _leaf_scores(
            q_raw,
            k_base,
            q_ptr,
            b,
            leaf,
            l_ok,
            Nk,
            hz,
            stride_kn,
            qk_scale,
            g_ok,
            offs_d,
            d_ok,
            GP,
            C,
            CP,
            LC,
            SCORE,
            False,
            IEEE,
            I64_ROWS,
        )
        tl.store(score_ptr + row + sub, score, mask=l_ok)


@triton_op("sparseflow::pisa_select_leaf_split_fwd", mutates_args={})
def pisa_select_leaf_split_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
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
    length: Optional[torch.Tensor] = None,
    scores: str = "fp32",
) -> torch.Tensor:
    return leaf_split_walk(
        q,
        k,
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
        length,
        scores,
    )


def leaf_split_walk(
    q: torch.Tensor,
    k: torch.Tensor,
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
    length: Optional[torch.Tensor] = None,
    scores: str = "fp32",
) -> torch.Tensor:
    """The body of :func:`pisa_select_leaf_split_fwd`: the per-token walk's arguments (no key
    padding; ``length``: None, or the int32 device length of a KV buffer ``k``), ``[B, Hkv, Nq,
    top_k]`` int32. ``score`` must be LSE or mean + var/2 (PISA-1 scores its leaves by their
    summaries in the walk: nothing to split off)."""
    if score == 1:
        raise ValueError("the leaf-split walk scores raw keys at the leaves: score='mean' walks per token")
    n_leaves = pyramid_leaves(summ.shape[2], branching)  # a cache's pyramid is its capacity's
    if n_leaves <= top_k:  # the walk keeps every leaf without writing a candidate: nothing to split
        raise ValueError(f"the leaf-split walk needs more leaf blocks than top_k={top_k}, got {n_leaves}")
    b, hq, n_q, d = q.shape
    hkv = k.shape[1]
    out = torch.empty(b, hkv, n_q, top_k, dtype=torch.int32, device=q.device)
    if n_q == 0:
        return out
    cw = candidate_width(beam, top_k, branching)
    meta = walk_meta(
        q, k, None, summ, lvl_span, is_causal, score, force_sink, force_previous, block_size, branching, top_k, beam
    )
    cand = torch.empty(b * hkv, n_q, cw, dtype=torch.int32, device=q.device)
    leaf_scores = torch.empty(b * hkv, n_q, cw, dtype=torch.float32, device=q.device)
    group = hq // hkv
    len_arg = nfv if length is None else length  # nfv: a placeholder, never read
    args = walk_args(q, k, None, summ, nfv, lvl_off, lvl_span, out, scale)
    wrap_triton(_pisa_select_kernel)[(n_q, b * hkv)](
        *args[:8],
        len_arg,  # the length pointer follows out_ptr
        *args[8:],
        **{**no_scan_args(nfv), "cand_ptr": cand, "stride_cbh": cand.stride(0), "stride_cn": cand.stride(1)},
        **meta,
        GP=_p2(group, 16),
        CW=cw,
        LC=1,  # the leaf scoring's settings: LEAF_OUT leaves it to the split
        IEEE_KEYS=False,
        HAS_LEN=length is not None,
        LEAF_OUT=True,
        **window_args(0, 0),  # decoding walks without a window
        SCORES=scores_mode(scores),
        num_warps=_launch(cw, warps)[0],
    )
    lc = leaves_per_program(cw, meta["CP"])
    wrap_triton(_leaf_split_kernel)[(n_q, cw // lc, b * hkv)](
        q,
        k,
        cand,
        leaf_scores,
        len_arg,
        *q.stride()[:3],
        *k.stride()[:3],
        cand.stride(0),
        cand.stride(1),
        n_q,
        k.shape[2],
        hkv,
        scale,
        HAS_LEN=length is not None,
        IS_CAUSAL=is_causal,
        SCORE=score,
        G=group,
        GP=_p2(group, 16),
        D=d,
        DP=meta["DP"],
        C=block_size,
        CP=meta["CP"],
        CW=cw,
        TOPK=top_k,
        LC=lc,
        IEEE=q.dtype == torch.float32 or interpreting(),
        I64_ROWS=meta["I64_ROWS"],
        num_warps=4,
    )
    # the keep's tile: no more queries than the call has (a decoding step has one; a [BQ, CW, CW]
    # compare over empty rows is what a prefill tile's size costs it)
    bq = min(queries_per_program(group, LAUNCH["keep_rows"]), _p2(n_q, 1))
    wrap_triton(_leaf_keep_kernel)[(triton.cdiv(n_q, bq), b * hkv)](
        cand,
        leaf_scores,
        out,
        cand.stride(0),
        cand.stride(1),
        *out.stride()[:3],
        n_q,
        hkv,
        TOPK=top_k,
        KP=meta["KP"],
        CW=cw,
        BQ=bq,
        num_warps=4,
    )
    return out


@pisa_select_leaf_split_fwd.register_fake
def _(
    q,
    k,
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
    length=None,
    scores="fp32",
):
    return q.new_empty(q.shape[0], k.shape[1], q.shape[2], top_k, dtype=torch.int32)
