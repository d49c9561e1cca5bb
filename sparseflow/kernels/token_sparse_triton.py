"""Attention over per-token selected key blocks (PISA and BSA selections) in Triton, forward and
backward: the Triton counterpart of ``token_blocks.attend_selected_blocks``.

Imported lazily; this module imports Triton.

Contract: ``block_indices [B, Hkv, Nq, K]`` (``-1`` = unused) is shared by the ``G`` query heads
of a KV head; K/V keep their ``Hkv`` heads (native GQA, never repeated). Query ``i`` sits at key
position ``p_i = i + Nk - Nq`` and sees key ``j`` iff ``j``'s block is among its selected ones,
``j < Nk``, the key is valid (padding) and, causally, ``j <= p_i``; a local window (causal only;
``sliding_window``, ``chunk_size``, 0 = none) also bounds it below: ``j >= lo(p_i)``, the larger of
``p_i - sliding_window + 1`` and ``p_i``'s chunk start ``(p_i // chunk_size) * chunk_size``
(``token_blocks.window_lower_bounds``). A query that sees no key outputs 0.

Schedule. The forward tiles queries by ``forward_token_tile(G, D)`` tokens and runs the ``G``
query heads of a KV head in the same program (rows = tokens x heads; the heads share their
token's blocks); a tile loops over the union of its tokens' blocks (``tile_block_lists``),
loading each key block once for the whole tile and group, and tests membership per row against
the row's own ``K`` block ids kept in registers -- no selection table or score matrix is
written. A list is ascending, so the blocks every row of the tile sees whole (all keys in range,
causally before the tile's first row and, with a window, at or after the window start of its last
row, the highest) are a run of it; they run without per-key tests (a row mask and one fused
multiply-add a logit), the one or two on either side of the run with them. Without a window (a
compile-time flag) the run leads the list and the kernel is the windowless one. The backward tiles
``BLOCK_M`` tokens per query head and runs one program per (query tile, query head) for dq, and
one per (key block, KV head) for dk/dv over the query tiles whose union holds that block (the
transposed lists, in CSR form), looping over the ``G`` query heads of the group.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from ._triton_env import interpreting
from .pdl import pdl_launch, pdl_start
from .token_blocks import check_window

__all__ = ["tile_block_lists", "transpose_lists", "token_sparse_attention", "BLOCK_M"]

BLOCK_M = 64
_LOG2E = 1.4426950408889634


def _p2(x: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(int(x)))


# --------------------------------------------------------------------------- block lists (torch)


# most entries one tile's lists kernel sorts in registers (next_pow2(block_m) * next_pow2(K)); above, torch
_LISTS_KERNEL_MAX = 4096


def tile_block_lists(
    block_indices: torch.Tensor, block_m: int, n_blocks: int, pdl: bool = False
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``[B, Hkv, Nq, K]`` -> (``num [B, Hkv, nQT]`` int32, ``lists [B, Hkv, nQT, block_m*K]``
    int32): each query tile's distinct selected blocks, ascending, then filler ``n_blocks + 1``.
    On a GPU (and under the interpreter) one Triton program per tile builds its list; elsewhere
    :func:`tile_block_lists_torch`, the same result. ``pdl``: the program is launched as a link
    of a programmatic-dependent chain (kernels.pdl)."""
    kk = block_indices.shape[-1]
    if block_indices.shape[2] == 1:  # decoding: one row, one tile of its own ids
        block_m = 1
    on_device = block_indices.device.type == "cuda" or interpreting()
    fits = kk > 0 and _p2(block_m, 1) * _p2(kk, 1) <= _LISTS_KERNEL_MAX
    if on_device and fits and block_indices.shape[2] > 0:
        sel = block_indices.to(torch.int32).contiguous()
        return torch.ops.sparseflow.token_tile_lists(sel, int(block_m), int(n_blocks), bool(pdl))
    return tile_block_lists_torch(block_indices, block_m, n_blocks)


def tile_block_lists_torch(
    block_indices: torch.Tensor, block_m: int, n_blocks: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`tile_block_lists` in torch ops (two sorts per tile row)."""
    b, hkv, n_q, kk = block_indices.shape
    nqt = -(-n_q // block_m)
    pad = nqt * block_m - n_q
    idx = block_indices
    if pad:
        idx = torch.nn.functional.pad(idx, (0, 0, 0, pad), value=-1)
    big = n_blocks + 1
    if n_q == 1:  # decoding: one row, whose block ids are already distinct -- one small sort
        s = block_indices.reshape(b, hkv, 1, kk).to(torch.int32)
        s = torch.where(s < 0, torch.full_like(s, big), s).sort(-1).values
        return (s < big).sum(-1, dtype=torch.int32).contiguous(), s.contiguous()
    s = idx.reshape(b, hkv, nqt, block_m * kk).to(torch.int32)
    s = torch.where(s < 0, torch.full_like(s, big), s).sort(-1).values
    dup = torch.zeros_like(s, dtype=torch.bool)
    dup[..., 1:] = s[..., 1:] == s[..., :-1]
    s = torch.where(dup, torch.full_like(s, big), s).sort(-1).values
    num = (s < big).sum(-1, dtype=torch.int32)
    return num.contiguous(), s.contiguous()


def transpose_lists(num: torch.Tensor, lists: torch.Tensor, n_blocks: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """CSR of the query tiles that hold each key block: (``start [B, Hkv, nKB + 1]`` int32 offsets
    into ``tiles [B, Hkv, P]`` int32, tiles ascending per block)."""
    b, hkv, nqt, width = lists.shape
    slot = torch.arange(width, device=lists.device, dtype=torch.int32)
    ok = slot.view(1, 1, 1, -1) < num[..., None]
    qt = torch.arange(nqt, device=lists.device, dtype=torch.int64).view(1, 1, -1, 1).expand_as(lists)
    blk = torch.where(ok, lists.to(torch.int64), torch.full_like(qt, n_blocks))
    key = (blk * nqt + qt).reshape(b, hkv, -1)
    order = key.sort(-1).values
    tiles = (order % nqt).to(torch.int32)
    counts = torch.zeros(b, hkv, n_blocks + 1, dtype=torch.int64, device=lists.device)
    counts.scatter_add_(-1, blk.reshape(b, hkv, -1), torch.ones_like(key))
    start = torch.zeros(b, hkv, n_blocks + 1, dtype=torch.int64, device=lists.device)
    start[..., 1:] = counts[..., :n_blocks].cumsum(-1)
    return start.to(torch.int32).contiguous(), tiles.contiguous()


# --------------------------------------------------------------------------- kernels


@triton.jit
def _distinct_combine(f1, l1, c1, f2, l2, c2):
    """Scan combine of adjacent sorted runs summarised as (first, last, distinct real ids): a value
    spanning the seam counts once; filler (marked ``-1`` by the caller) counts never."""
    return f1, l2, c1 + c2 - ((l1 == f2) & (f2 >= 0)).to(tl.int32)


@triton.jit
def _tile_lists_kernel(
    sel_ptr,
    num_ptr,
    lists_ptr,
    stride_sb,
    stride_sh,
    stride_sn,
    Nq,
    HKV,
    NQT,
    BIG,
    WIDTH,
    BLOCK_T: tl.constexpr,
    BLOCK_TP: tl.constexpr,
    TOPK: tl.constexpr,
    KP: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One program per (query tile of ``BLOCK_T`` rows, any count, batch x KV head): the tile's
    selected ids sorted, each distinct one stored at its rank (duplicates store the same value to
    the same slot), then filler up to ``WIDTH``."""
    pdl_start(PDL)
    qt = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    ar_t = tl.arange(0, BLOCK_TP)
    rows = qt * BLOCK_T + ar_t
    offs_k = tl.arange(0, KP)
    ok = ((ar_t < BLOCK_T) & (rows < Nq))[:, None] & (offs_k < TOPK)[None, :]
    ids = tl.load(
        sel_ptr + b * stride_sb + h * stride_sh + rows[:, None] * stride_sn + offs_k[None, :], mask=ok, other=-1
    )
    # unused slots (-1) and rows past Nq sort last as BIG
    srt = tl.sort(tl.reshape(tl.where(ids >= 0, ids, BIG), [BLOCK_TP * KP]), 0)
    real = srt < BIG
    marked = tl.where(real, srt, -1)  # filler never counts in the scan
    _, _, rank = tl.associative_scan((marked, marked, real.to(tl.int32)), 0, _distinct_combine)
    out = lists_ptr + (bh.to(tl.int64) * NQT + qt) * WIDTH
    tl.store(out + rank - 1, srt, mask=real)
    count = tl.max(rank, 0)  # the ranks never decrease: the last is the number of distinct ids
    slots = tl.arange(0, BLOCK_TP * KP)
    tl.store(out + slots, tl.full([BLOCK_TP * KP], 0, tl.int32) + BIG, mask=(slots >= count) & (slots < WIDTH))
    tl.store(num_ptr + bh * NQT + qt, count)


@triton_op("sparseflow::token_tile_lists", mutates_args={})
def token_tile_lists(
    sel: torch.Tensor, block_m: int, n_blocks: int, pdl: bool = False
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The launch behind :func:`tile_block_lists` (``sel [B, Hkv, Nq, K]`` int32)."""
    b, hkv, n_q, kk = sel.shape
    nqt = -(-n_q // block_m)
    width = block_m * kk
    num = torch.empty(b, hkv, nqt, dtype=torch.int32, device=sel.device)
    lists = torch.empty(b, hkv, nqt, width, dtype=torch.int32, device=sel.device)
    if nqt == 0 or b * hkv == 0:
        return num, lists
    wrap_triton(_tile_lists_kernel)[(nqt, b * hkv)](
        sel,
        num,
        lists,
        sel.stride(0),
        sel.stride(1),
        sel.stride(2),
        n_q,
        hkv,
        nqt,
        n_blocks + 1,
        width,
        BLOCK_T=block_m,
        BLOCK_TP=_p2(block_m, 1),
        TOPK=kk,
        KP=_p2(kk, 1),
        num_warps=4,
        **pdl_launch(sel, pdl),
    )
    return num, lists


@token_tile_lists.register_fake
def _(sel, block_m, n_blocks, pdl=False):
    b, hkv, n_q, kk = sel.shape
    nqt = -(-n_q // block_m)
    return sel.new_empty(b, hkv, nqt, dtype=torch.int32), sel.new_empty(b, hkv, nqt, block_m * kk, dtype=torch.int32)


@triton.jit
def _scores(
    q,
    k_t,
    kb,
    sel,
    rows_hz,
    rows_lo,
    kpm_ptr,
    b,
    Nk,
    offs_c,
    qk_scale,
    C: tl.constexpr,
    HAS_KPM: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    IEEE: tl.constexpr,
):
    """log2-scaled logits of a query tile against key block ``kb`` and the element mask."""
    s = _logits(q, k_t, IEEE) * qk_scale
    return s, _visible(kb, sel, rows_hz, rows_lo, kpm_ptr, b, Nk, offs_c, C, HAS_KPM, IS_CAUSAL, HAS_WINDOW, False)


@triton.jit
def _logits(q, k_t, IEEE: tl.constexpr):
    """The unscaled logits ``q @ k_t`` in fp32."""
    if IEEE:
        return tl.dot(q.to(tl.float32), k_t.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(q, k_t)


@triton.jit
def _selected_rows(kb, sel):
    """The tile's rows that listed key block ``kb`` among their selected blocks."""
    return tl.sum((sel == kb).to(tl.int32), axis=1) > 0


@triton.jit
def _keys_in_range(kpos, offs_c, Nk, C: tl.constexpr, WHOLE: tl.constexpr):
    """A key block's slots that hold a key: within its ``C`` (the padded width may be wider) and
    before ``Nk`` (``WHOLE``: the caller knows the whole block is)."""
    if WHOLE:
        return offs_c < C
    else:
        return (offs_c < C) & (kpos < Nk)


@triton.jit
def _window_lo(pos, W, CHUNK, HAS_WINDOW: tl.constexpr):
    """The first key position a row at ``pos`` sees under its local window
    (``token_blocks.window_lower_bounds``): within the last ``W`` keys up to ``pos`` and in its
    ``CHUNK``-key chunk (0 = no such bound); 0 without a window."""
    lo = tl.zeros_like(pos)
    if HAS_WINDOW:
        lo = tl.maximum(lo, tl.where(W > 0, pos - W + 1, 0))
        at = tl.maximum(pos, 0)  # a row before every key sees none anyway: keep the remainder non-negative
        lo = tl.maximum(lo, tl.where(CHUNK > 0, at - at % tl.maximum(CHUNK, 1), 0))
    return lo


@triton.jit
def _visible(
    kb,
    sel,
    rows_hz,
    rows_lo,
    kpm_ptr,
    b,
    Nk,
    offs_c,
    C: tl.constexpr,
    HAS_KPM: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    WHOLE: tl.constexpr,
):
    """Which rows see which keys of block ``kb``: the rows that selected it, at its valid keys
    (in range, not padding), causally the keys at or before each row's position and, with a
    window, at or after each row's window start ``rows_lo``. ``WHOLE``: the caller knows every key
    of the block is in range and inside every row's causal window (:func:`_whole_blocks`), so only
    the selection and the padding are tested."""
    kpos = kb * C + offs_c
    ok = _selected_rows(kb, sel)[:, None] & _keys_in_range(kpos, offs_c, Nk, C, WHOLE)[None, :]
    if IS_CAUSAL and not WHOLE:
        ok = ok & (kpos[None, :] <= rows_hz[:, None])
    if HAS_WINDOW and not WHOLE:
        ok = ok & (kpos[None, :] >= rows_lo[:, None])
    if HAS_KPM:
        ok = ok & (tl.load(kpm_ptr + b * Nk + kpos, mask=kpos < Nk, other=0) != 0)[None, :]
    return ok


@triton.jit
def _whole_blocks(list_row, n, first_hz, Nk, C: tl.constexpr, LWP: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """How many of a tile's ``n`` listed blocks (ascending) lie wholly in range and, causally, at
    or before the tile's first row (``first_hz``, the lowest position of its rows): the leading
    blocks that need no per-key range or causal test (with a window, those from
    :func:`_blocks_below_window`'s count on need no window test either)."""
    last = Nk // C - 1  # the last block whose keys are all in range
    if IS_CAUSAL:
        last = tl.minimum(last, tl.where(first_hz >= 0, (first_hz + 1) // C - 1, -1))
    ar = tl.arange(0, LWP)
    ids = tl.load(list_row + ar, mask=ar < n, other=last + 1)
    return tl.sum((ids <= last).to(tl.int32), axis=0)


@triton.jit
def _blocks_below_window(list_row, n, tile_lo, C: tl.constexpr, LWP: tl.constexpr):
    """How many of a tile's ``n`` listed blocks (ascending) start before ``tile_lo``, the highest
    window start among its rows (the last row's: the starts never decrease along the rows): the
    leading blocks some row sees only in part, or not at all, which need the per-key window test.
    A block from there on holds no key below any row's window start."""
    first_whole = (tile_lo + C - 1) // C  # the first block whose first key is at or after tile_lo
    ar = tl.arange(0, LWP)
    ids = tl.load(list_row + ar, mask=ar < n, other=first_whole)
    return tl.sum((ids < first_whole).to(tl.int32), axis=0)


@triton.jit
def _loadable_keys(kpm_ptr, b, Nk, kpos, kv_ok, HAS_KPM: tl.constexpr):
    """The in-range slots that also hold a valid key: padded keys/values are never loaded, so a
    NaN there cannot reach a product (probability 0 times NaN is NaN)."""
    if HAS_KPM:
        kv_ok = kv_ok & (tl.load(kpm_ptr + b * Nk + kpos, mask=kv_ok, other=0) != 0)
    return kv_ok


@triton.jit
def _fwd_block(
    acc,
    l_i,
    m_i,
    kb_ptr,
    q,
    sel,
    hz,
    rows_lo,
    k_base,
    v_base,
    stride_kn,
    stride_vn,
    kpm_ptr,
    b,
    Nk,
    offs_c,
    offs_d,
    d_ok,
    qk_scale,
    C: tl.constexpr,
    CP: tl.constexpr,
    HAS_KPM: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    IEEE: tl.constexpr,
    WHOLE: tl.constexpr,
):
    """The online-softmax update of a tile's rows with key block ``*kb_ptr`` (``WHOLE``: see
    :func:`_visible`)."""
    kb = tl.load(kb_ptr)
    kpos = kb.to(tl.int64) * C + offs_c  # 64-bit: a key position times a row stride can pass 2**31 elements
    kv_ok = _loadable_keys(kpm_ptr, b, Nk, kpos, _keys_in_range(kpos, offs_c, Nk, C, WHOLE), HAS_KPM)
    # a block's keys are C consecutive rows: its first row's offset (a scalar) plus offsets the
    # same for every block
    k_t = tl.load(
        k_base + kb.to(tl.int64) * C * stride_kn + (offs_c.to(tl.int64)[None, :] * stride_kn + offs_d[:, None]),
        mask=kv_ok[None, :] & d_ok[:, None],
        other=0.0,
    )
    if WHOLE and not HAS_KPM and C == CP:
        # every key of the block is real and seen by the rows that selected it: a row mask, no
        # per-key one (the other rows' logits stay finite and get no weight)
        s = _logits(q, k_t, IEEE)
        rows_on = _selected_rows(kb, sel)
    else:
        ok = _visible(kb, sel, hz, rows_lo, kpm_ptr, b, Nk, offs_c, C, HAS_KPM, IS_CAUSAL, HAS_WINDOW, WHOLE)
        s = tl.where(ok, _logits(q, k_t, IEEE), float("-inf"))
        rows_on = tl.full([s.shape[0]], True, tl.int1)
    vt = tl.load(
        v_base + kb.to(tl.int64) * C * stride_vn + (offs_c.to(tl.int64)[:, None] * stride_vn + offs_d[None, :]),
        mask=kv_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    return _online_softmax_scaled(acc, l_i, m_i, s, rows_on, qk_scale, vt, IEEE)


@triton.jit
def _fwd_blocks(
    acc,
    l_i,
    m_i,
    list_row,
    start,
    end,
    step_args,
    C: tl.constexpr,
    CP: tl.constexpr,
    HAS_KPM: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    IEEE: tl.constexpr,
    WHOLE: tl.constexpr,
    INTERP: tl.constexpr,
):
    """:func:`_fwd_block` over the listed blocks ``start`` to ``end`` (``WHOLE``: all seen whole).
    The compile-time arguments go one by one: a tuple of them would reach the callee as values."""
    if INTERP:
        # the CPU interpreter cannot take a loaded scalar as a range bound (NumPy >= 2.3 calls
        # int() on a 1-element array); a while loop visits the same blocks
        j = start
        while j < end:
            acc, l_i, m_i = _fwd_block(
                acc, l_i, m_i, list_row + j, *step_args, C, CP, HAS_KPM, IS_CAUSAL, HAS_WINDOW, IEEE, WHOLE
            )
            j += 1
    else:
        # a for loop, so the compiler pipelines the next block's loads behind this one's math
        for j in range(start, end):
            acc, l_i, m_i = _fwd_block(
                acc, l_i, m_i, list_row + j, *step_args, C, CP, HAS_KPM, IS_CAUSAL, HAS_WINDOW, IEEE, WHOLE
            )
    return acc, l_i, m_i


@triton.jit
def _online_softmax_scaled(acc, l_i, m_i, s, rows_on, qk_scale, vt, IEEE: tl.constexpr):
    """:func:`online_softmax_step` on unscaled logits ``s`` (-inf where masked) of the rows
    ``rows_on``: the others' maxima are left alone and their exponentials subtract +inf, so their
    finite logits get no weight (a NaN or infinite logit, from a key the row does not select but
    dense attention would see, still reaches it). The scale (positive, log2 units) multiplies the row maxima
    only and joins each logit's subtraction in one fused multiply-add, so no logit is scaled on
    its own."""
    m_new = tl.maximum(m_i, tl.where(rows_on, tl.max(s, axis=1) * qk_scale, float("-inf")))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(tl.fma(s, qk_scale, -tl.where(rows_on, m_safe, float("inf"))[:, None]))
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, vt.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
    return acc, l_i, m_new


@triton.jit
def online_softmax_step(acc, l_i, m_i, s, vt, IEEE: tl.constexpr):
    """Fold one tile into the rows' running ``(acc, l, m)``: ``s`` the tile's log2-scaled logits
    (-inf where a row does not see the key), ``vt`` its values. Returns the new ``(acc, l, m)``."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, vt.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
    return acc, l_i, m_new


@triton.jit
def _fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    sel_ptr,
    num_ptr,
    list_ptr,
    kpm_ptr,
    o_ptr,
    lse_ptr,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_sb,
    stride_sh,
    stride_sn,
    stride_ob,
    stride_oh,
    stride_on,
    Nq,
    Nk,
    HQ,
    HKV,
    LW,
    qk_scale,
    W,
    CHUNK,
    G: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    C: tl.constexpr,
    CP: tl.constexpr,
    TOPK: tl.constexpr,
    KP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    R: tl.constexpr,
    LWP: tl.constexpr,
    HAS_KPM: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One program per (tile of ``BLOCK_T`` query tokens, batch x KV head). Its ``R`` rows are
    the tile's tokens times the group's ``G`` query heads, packed (row ``i * G + g``: head ``g``
    of token ``i``; the rest idle), which share the token's selection: each key block of the
    tile's union is loaded once for the whole group."""
    pdl_start(PDL)
    # Inductor types a Python float argument fp64 (Triton's JIT: fp32): keep the math in fp32 either way
    qk_scale = tl.cast(qk_scale, tl.float32)
    qt = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # 64-bit offsets: batch x head strides pass 2**31 elements at long contexts
    b = bh // HKV
    hkv = bh % HKV
    nqt = tl.num_programs(0)
    r = tl.arange(0, R)
    tok = qt * BLOCK_T + r // G
    h = hkv * G + r % G
    row_ok = (r < BLOCK_T * G) & (tok < Nq)
    hz = tok + Nk - Nq
    offs_d = tl.arange(0, DP)
    offs_c = tl.arange(0, CP)
    offs_k = tl.arange(0, KP)
    d_ok = offs_d < D
    q_rows = q_ptr + b * stride_qb + h * stride_qh + tok.to(tl.int64) * stride_qn
    q = tl.load(q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    sel = tl.load(
        sel_ptr + b * stride_sb + hkv * stride_sh + tok[:, None] * stride_sn + offs_k[None, :],
        mask=row_ok[:, None] & (offs_k[None, :] < TOPK),
        other=-1,
    )
    m_i = tl.full([R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([R], dtype=tl.float32)
    acc = tl.zeros([R, DP], dtype=tl.float32)
    lst = bh * nqt + qt
    n = tl.load(num_ptr + lst)
    k_base = k_ptr + b * stride_kb + hkv * stride_kh
    v_base = v_ptr + b * stride_vb + hkv * stride_vh
    win_lo = _window_lo(hz, W, CHUNK, HAS_WINDOW)
    step_args = (
        q,
        sel,
        hz,
        win_lo,
        k_base,
        v_base,
        stride_kn,
        stride_vn,
        kpm_ptr,
        b,
        Nk,
        offs_c,
        offs_d,
        d_ok,
        qk_scale,
    )
    list_row = list_ptr + lst * LW
    # the blocks every row sees whole skip the per-key range, causal and window tests: a run of the
    # list from n_below (0 without a window) to n_whole, all but the last one or two of a causal
    # tile's list and, with a window, the first one or two
    n_whole = _whole_blocks(list_row, n, qt * BLOCK_T + Nk - Nq, Nk, C, LWP, IS_CAUSAL)
    n_below = 0
    if HAS_WINDOW:
        # the tile's highest window start bounds the whole blocks below (its idle rows aside)
        n_below = _blocks_below_window(list_row, n, tl.max(tl.where(row_ok, win_lo, 0), axis=0), C, LWP)
        # a block below the last row's window start and past the first row's position runs once, tested
        n_whole = tl.maximum(n_whole, n_below)
        acc, l_i, m_i = _fwd_blocks(
            acc, l_i, m_i, list_row, 0, n_below, step_args, C, CP, HAS_KPM, IS_CAUSAL, HAS_WINDOW, IEEE, False, INTERP
        )
    acc, l_i, m_i = _fwd_blocks(
        acc, l_i, m_i, list_row, n_below, n_whole, step_args, C, CP, HAS_KPM, IS_CAUSAL, HAS_WINDOW, IEEE, True, INTERP
    )
    acc, l_i, m_i = _fwd_blocks(
        acc, l_i, m_i, list_row, n_whole, n, step_args, C, CP, HAS_KPM, IS_CAUSAL, HAS_WINDOW, IEEE, False, INTERP
    )
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    o_rows = o_ptr + b * stride_ob + h * stride_oh + tok.to(tl.int64) * stride_on
    tl.store(o_rows[:, None] + offs_d[None, :], out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    # log2-domain LSE per row (+inf where the row sees nothing, so backward's p is 0 there)
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("inf"))
    tl.store(lse_ptr + (b * HQ + h) * Nq + tok, lse, mask=row_ok)


@triton.jit
def _bwd_dq_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    sel_ptr,
    num_ptr,
    list_ptr,
    kpm_ptr,
    lse_ptr,
    delta_ptr,
    dq_ptr,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_sb,
    stride_sh,
    stride_sn,
    Nq,
    Nk,
    HQ,
    HKV,
    LW,
    qk_scale,
    sm_scale,
    W,
    CHUNK,
    G: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    C: tl.constexpr,
    CP: tl.constexpr,
    TOPK: tl.constexpr,
    KP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_KPM: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    IEEE: tl.constexpr,
):
    # Inductor types a Python float argument fp64 (Triton's JIT: fp32): keep the math in fp32 either way
    qk_scale = tl.cast(qk_scale, tl.float32)
    sm_scale = tl.cast(sm_scale, tl.float32)
    qt = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # 64-bit offsets: batch x head strides pass 2**31 elements at long contexts
    b = bh // HQ
    h = bh % HQ
    hkv = h // G
    nqt = tl.num_programs(0)
    rows = qt * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < Nq
    hz = rows + Nk - Nq
    win_lo = _window_lo(hz, W, CHUNK, HAS_WINDOW)
    offs_d = tl.arange(0, DP)
    offs_c = tl.arange(0, CP)
    offs_k = tl.arange(0, KP)
    d_ok = offs_d < D
    qo = b * stride_qb + h * stride_qh + rows.to(tl.int64)[:, None] * stride_qn + offs_d[None, :]
    m2 = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + qo, mask=m2, other=0.0)
    do = tl.load(do_ptr + qo, mask=m2, other=0.0)
    lse = tl.load(lse_ptr + (b * HQ + h) * Nq + rows, mask=row_ok, other=float("inf"))
    delta = tl.load(delta_ptr + (b * HQ + h) * Nq + rows, mask=row_ok, other=0.0)
    sel = tl.load(
        sel_ptr + b * stride_sb + hkv * stride_sh + rows[:, None] * stride_sn + offs_k[None, :],
        mask=row_ok[:, None] & (offs_k[None, :] < TOPK),
        other=-1,
    )
    dq = tl.zeros([BLOCK_M, DP], dtype=tl.float32)
    lst = (b * HKV + hkv) * nqt + qt
    n = tl.load(num_ptr + lst)
    k_base = k_ptr + b * stride_kb + hkv * stride_kh
    v_base = v_ptr + b * stride_vb + hkv * stride_vh
    j = 0
    while j < n:
        kb = tl.load(list_ptr + lst * LW + j)
        kpos = kb.to(tl.int64) * C + offs_c  # 64-bit: a key position times a row stride can pass 2**31 elements
        kv_ok = _loadable_keys(kpm_ptr, b, Nk, kpos, _keys_in_range(kpos, offs_c, Nk, C, False), HAS_KPM)
        k_t = tl.load(
            k_base + kpos[None, :] * stride_kn + offs_d[:, None], mask=kv_ok[None, :] & d_ok[:, None], other=0.0
        )
        v_t = tl.load(
            v_base + kpos[None, :] * stride_vn + offs_d[:, None], mask=kv_ok[None, :] & d_ok[:, None], other=0.0
        )
        s, ok = _scores(
            q, k_t, kb, sel, hz, win_lo, kpm_ptr, b, Nk, offs_c, qk_scale, C, HAS_KPM, IS_CAUSAL, HAS_WINDOW, IEEE
        )
        p = tl.where(ok, tl.exp2(s - lse[:, None]), 0.0)
        if IEEE:
            dp = tl.dot(do.to(tl.float32), v_t.to(tl.float32), input_precision="ieee")
        else:
            dp = tl.dot(do, v_t)
        ds = p * (dp - delta[:, None])
        if IEEE:
            dq += tl.dot(ds, tl.trans(k_t).to(tl.float32), input_precision="ieee")
        else:
            dq += tl.dot(ds.to(k_t.dtype), tl.trans(k_t))
        j += 1
    tl.store(dq_ptr + qo, (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=m2)


@triton.jit
def _bwd_dkdv_kernel(  # noqa: PLR0915
    q_ptr,
    k_ptr,
    v_ptr,
    do_ptr,
    sel_ptr,
    start_ptr,
    tiles_ptr,
    kpm_ptr,
    lse_ptr,
    delta_ptr,
    dk_ptr,
    dv_ptr,
    stride_qb,
    stride_qh,
    stride_qn,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_sb,
    stride_sh,
    stride_sn,
    Nq,
    Nk,
    HQ,
    HKV,
    NKB,
    PW,
    qk_scale,
    sm_scale,
    W,
    CHUNK,
    G: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    C: tl.constexpr,
    CP: tl.constexpr,
    TOPK: tl.constexpr,
    KP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HAS_KPM: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    IEEE: tl.constexpr,
):
    # Inductor types a Python float argument fp64 (Triton's JIT: fp32): keep the math in fp32 either way
    qk_scale = tl.cast(qk_scale, tl.float32)
    sm_scale = tl.cast(sm_scale, tl.float32)
    kb = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # 64-bit offsets: batch x head strides pass 2**31 elements at long contexts
    b = bh // HKV
    hkv = bh % HKV
    offs_d = tl.arange(0, DP)
    offs_c = tl.arange(0, CP)
    offs_k = tl.arange(0, KP)
    offs_m = tl.arange(0, BLOCK_M)
    d_ok = offs_d < D
    kpos = kb.to(tl.int64) * C + offs_c  # 64-bit: a key position times a row stride can pass 2**31 elements
    kv_ok = _keys_in_range(kpos, offs_c, Nk, C, False)  # the stores: padded keys get their zero gradient too
    kv_load = _loadable_keys(kpm_ptr, b, Nk, kpos, kv_ok, HAS_KPM)
    k_t = tl.load(
        k_ptr + b * stride_kb + hkv * stride_kh + kpos[None, :] * stride_kn + offs_d[:, None],
        mask=kv_load[None, :] & d_ok[:, None],
        other=0.0,
    )
    v_t = tl.load(
        v_ptr + b * stride_vb + hkv * stride_vh + kpos[None, :] * stride_vn + offs_d[:, None],
        mask=kv_load[None, :] & d_ok[:, None],
        other=0.0,
    )
    dk = tl.zeros([CP, DP], dtype=tl.float32)
    dv = tl.zeros([CP, DP], dtype=tl.float32)
    csr = (b * HKV + hkv) * (NKB + 1) + kb
    lo = tl.load(start_ptr + csr)
    hi = tl.load(start_ptr + csr + 1)
    t = lo
    while t < hi:
        qt = tl.load(tiles_ptr + (b * HKV + hkv) * PW + t)
        rows = qt * BLOCK_M + offs_m
        row_ok = rows < Nq
        hz = rows + Nk - Nq
        win_lo = _window_lo(hz, W, CHUNK, HAS_WINDOW)
        sel = tl.load(
            sel_ptr + b * stride_sb + hkv * stride_sh + rows[:, None] * stride_sn + offs_k[None, :],
            mask=row_ok[:, None] & (offs_k[None, :] < TOPK),
            other=-1,
        )
        for g in range(G):
            h = hkv * G + g
            qo = b * stride_qb + h * stride_qh + rows.to(tl.int64)[:, None] * stride_qn + offs_d[None, :]
            m2 = row_ok[:, None] & d_ok[None, :]
            q = tl.load(q_ptr + qo, mask=m2, other=0.0)
            do = tl.load(do_ptr + qo, mask=m2, other=0.0)
            lse = tl.load(lse_ptr + (b * HQ + h) * Nq + rows, mask=row_ok, other=float("inf"))
            delta = tl.load(delta_ptr + (b * HQ + h) * Nq + rows, mask=row_ok, other=0.0)
            s, ok = _scores(
                q, k_t, kb, sel, hz, win_lo, kpm_ptr, b, Nk, offs_c, qk_scale, C, HAS_KPM, IS_CAUSAL, HAS_WINDOW, IEEE
            )
            p = tl.where(ok & row_ok[:, None], tl.exp2(s - lse[:, None]), 0.0)  # [BM, CP]
            if IEEE:
                dv += tl.dot(tl.trans(p), do.to(tl.float32), input_precision="ieee")
                dp = tl.dot(do.to(tl.float32), v_t.to(tl.float32), input_precision="ieee")
                ds = p * (dp - delta[:, None])
                dk += tl.dot(tl.trans(ds), q.to(tl.float32), input_precision="ieee")
            else:
                dv += tl.dot(tl.trans(p.to(do.dtype)), do)
                dp = tl.dot(do, v_t)
                ds = p * (dp - delta[:, None])
                dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
        t += 1
    so = b * stride_kb + hkv * stride_kh + kpos[:, None] * stride_kn + offs_d[None, :]
    m2 = kv_ok[:, None] & d_ok[None, :]
    tl.store(dk_ptr + so, (dk * sm_scale).to(dk_ptr.dtype.element_ty), mask=m2)
    tl.store(dv_ptr + so, dv.to(dv_ptr.dtype.element_ty), mask=m2)


# --------------------------------------------------------------------------- ops


# rows of a forward program (query tokens x the group's heads) and its launch; on real SmolLM2
# layers at 8K on an H200 64 rows beat 48, 96 and 128, 3 stages beat 2 by 4-5%, and 8 warps are
# slower than 4. From head dim 256 (Gemma 3's sliding windows on an H100, 8K-128K) 128 rows on
# 8 warps take 0.57x the time of 64 on 4: each key block loaded serves twice the rows
FWD_ROWS = 64
_FWD_LAUNCH = dict(num_warps=4, num_stages=3)
FWD_WIDE_HEAD_DIM = 256
_FWD_WIDE = dict(rows=128, num_warps=8)
# each stage past the first holds one more key block and value block in shared memory: the most
# bytes such a pair may take for 3 stages, and for 2 (sm_90 compiles: 64 x 64 bf16 blocks at 3
# stages take 56 KiB; 128 x 128 fp32 ones 320 KiB at 3 and 192 at 2, of the H200's 227 KiB a
# program; 128 keys x 256 dims in bf16 288 KiB at 2 and 96 at 1)
_FWD_STAGE_PAIR_BYTES = {3: 32 * 1024, 2: 64 * 1024}


def _pair_bytes(head_dim: int, block_size: int, elem_bytes: int) -> int:
    return 2 * _p2(block_size) * _p2(head_dim) * elem_bytes


def _wide(head_dim: int, block_size: int, elem_bytes: int) -> bool:
    """The wide forward launch (``_FWD_WIDE``): from head dim 256, for 16-bit blocks whose key /
    value pair fits 2 stages (the shape it was timed on: bf16, 64-key blocks). A wider pair (fp32,
    or 128-key blocks) with 128 rows would pass the shared memory of a Hopper program."""
    fits = _pair_bytes(head_dim, block_size, elem_bytes) <= _FWD_STAGE_PAIR_BYTES[2]
    return _p2(head_dim) >= FWD_WIDE_HEAD_DIM and elem_bytes == 2 and fits


def _fwd_launch(k: torch.Tensor, block_size: int) -> dict:
    """``_FWD_LAUNCH`` (8 warps for the wide launch: :func:`_wide`) with its stages capped where a
    key/value block pair is large."""
    pair_bytes = _pair_bytes(k.shape[-1], block_size, k.element_size())
    stages = next((s for s, most in _FWD_STAGE_PAIR_BYTES.items() if pair_bytes <= most), 1)
    wide = _wide(k.shape[-1], block_size, k.element_size())
    warps = _FWD_WIDE["num_warps"] if wide else _FWD_LAUNCH["num_warps"]
    return dict(_FWD_LAUNCH, num_warps=warps, num_stages=min(stages, _FWD_LAUNCH["num_stages"]))


def forward_token_tile(group: int, head_dim: int, block_size: int, elem_bytes: int) -> int:
    """Query tokens per forward program for a GQA group of ``group`` query heads, ``head_dim``,
    key blocks of ``block_size`` and ``elem_bytes``-byte elements: as many as fill ``FWD_ROWS``
    rows of tokens x heads packed (21 tokens in 63 rows for a group of 3; 128 rows for the wide
    launch, :func:`_wide`), at least one token. The block lists and the kernel must agree on it."""
    rows = _FWD_WIDE["rows"] if _wide(head_dim, block_size, elem_bytes) else FWD_ROWS
    return max(1, rows // group)


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its head dim is contiguous (all the kernels need), else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _fwd_meta(q, k, block_size, top_k):
    g = q.shape[1] // k.shape[1]
    tokens = forward_token_tile(g, q.shape[-1], block_size, k.element_size())
    return dict(_meta(q, k, block_size, top_k), BLOCK_T=tokens, R=_p2(tokens * g), INTERP=interpreting())


def _has_window(sliding_window: int, chunk_size: int) -> bool:
    """Whether the kernels compile the window's lower bound in (without one they are unchanged)."""
    return bool(sliding_window or chunk_size)


def _meta(q, k, block_size, top_k):
    d = q.shape[-1]
    ieee = q.dtype == torch.float32 or interpreting()  # the interpreter's 16-bit dot is unreliable
    return dict(
        G=q.shape[1] // k.shape[1],
        D=d,
        DP=_p2(d),
        C=block_size,
        CP=_p2(block_size),
        TOPK=top_k,
        KP=_p2(top_k, 1),
        IEEE=ieee,
    )


@triton_op("sparseflow::token_sparse_fwd", mutates_args={})
def token_sparse_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sel: torch.Tensor,
    num: torch.Tensor,
    lists: torch.Tensor,
    kpm: Optional[torch.Tensor],
    scale: float,
    block_size: int,
    is_causal: bool,
    pdl: bool = False,
    sliding_window: int = 0,
    chunk_size: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor]:
    b, hq, n_q, d = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    out = torch.empty_like(q)
    lse = torch.empty(b, hq, n_q, dtype=torch.float32, device=q.device)
    if n_q == 0:
        return out, lse
    nqt = num.shape[2]
    meta = _fwd_meta(q, k, block_size, sel.shape[-1])
    tokens = meta["BLOCK_T"]
    if n_q > 1 and nqt != -(-n_q // tokens):  # lists of another tile would attend the wrong blocks
        raise ValueError(
            f"the block lists tile {nqt} query tiles, the forward {-(-n_q // tokens)} of {tokens} tokens: "
            "build them with tile_block_lists(sel, forward_token_tile(...)) for this call"
        )
    wrap_triton(_fwd_kernel)[(nqt, b * hkv)](
        q,
        k,
        v,
        sel,
        num,
        lists,
        kpm if kpm is not None else num,
        out,
        lse,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        sel.stride(0),
        sel.stride(1),
        sel.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        n_q,
        n_k,
        hq,
        hkv,
        lists.shape[-1],
        scale * _LOG2E,
        sliding_window,
        chunk_size,
        HAS_KPM=kpm is not None,
        IS_CAUSAL=is_causal,
        HAS_WINDOW=_has_window(sliding_window, chunk_size),
        **_fwd_launch(k, block_size),
        **meta,
        LWP=_p2(lists.shape[-1], 1),
        **pdl_launch(q, pdl),
    )
    return out, lse


@token_sparse_fwd.register_fake
def _(q, k, v, sel, num, lists, kpm, scale, block_size, is_causal, pdl=False, sliding_window=0, chunk_size=0):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@triton_op("sparseflow::token_sparse_bwd", mutates_args={})
def token_sparse_bwd(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    sel: torch.Tensor,
    num: torch.Tensor,
    lists: torch.Tensor,
    start: torch.Tensor,
    tiles: torch.Tensor,
    kpm: Optional[torch.Tensor],
    scale: float,
    block_size: int,
    is_causal: bool,
    sliding_window: int = 0,
    chunk_size: int = 0,
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, hq, n_q, _ = q.shape
    hkv, n_k = k.shape[1], k.shape[2]
    do = grad_out.contiguous()
    delta = (do.float() * out.float()).sum(-1).contiguous()  # [B, Hq, Nq]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    # the arguments both kernels take in the same places
    ins, sizes = (q, k, v, do, sel), (n_q, n_k, hq, hkv)
    scalars = (scale * _LOG2E, scale, sliding_window, chunk_size)
    common = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *sel.stride()[:3])
    flags = dict(
        HAS_KPM=kpm is not None,
        IS_CAUSAL=is_causal,
        HAS_WINDOW=_has_window(sliding_window, chunk_size),
        num_warps=4,
        num_stages=2,
        BLOCK_M=BLOCK_M,
        **_meta(q, k, block_size, sel.shape[-1]),
    )
    kpm_arg = kpm if kpm is not None else num
    wrap_triton(_bwd_dq_kernel)[(num.shape[2], b * hq)](
        *ins, num, lists, kpm_arg, lse, delta, dq, *common, *sizes, lists.shape[-1], *scalars, **flags
    )
    n_kb = start.shape[-1] - 1
    wrap_triton(_bwd_dkdv_kernel)[(n_kb, b * hkv)](
        *ins, start, tiles, kpm_arg, lse, delta, dk, dv, *common, *sizes, n_kb, tiles.shape[-1], *scalars, **flags
    )
    return dq, dk, dv


@token_sparse_bwd.register_fake
def _(
    grad_out,
    q,
    k,
    v,
    out,
    lse,
    sel,
    num,
    lists,
    start,
    tiles,
    kpm,
    scale,
    block_size,
    is_causal,
    sliding_window=0,
    chunk_size=0,
):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, sel, num, lists, kpm, scale, block_size, is_causal, _pdl, sliding_window, chunk_size = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, sel, num, lists, *([kpm] if kpm is not None else []))
    ctx.has_kpm = kpm is not None
    ctx.args = (scale, block_size, is_causal, sliding_window, chunk_size)  # (pdl: the forward's launch only)


def _backward(ctx, grad_out, grad_lse):
    saved = ctx.saved_tensors
    q, k, v, out, lse, sel, num, lists = saved[:8]
    kpm = saved[8] if ctx.has_kpm else None
    block_size = ctx.args[1]
    n_kb = max(1, -(-k.shape[2] // block_size))
    if lists.shape[-1] != BLOCK_M * sel.shape[-1]:
        # the backward tiles BLOCK_M tokens per query head; the forward's lists tile fewer
        with torch.no_grad():
            num, lists = tile_block_lists(sel, BLOCK_M, n_kb)
    start, tiles = transpose_lists(num, lists, n_kb)
    # the backward kernels index do / dq with q's strides and dk / dv with k's / v's, which
    # empty_like (and the contiguous do) follow only for contiguous tensors; the forward read the
    # caller's views in place
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    dq, dk, dv = token_sparse_bwd(grad_out, q, k, v, out, lse, sel, num, lists, start, tiles, kpm, *ctx.args)
    return dq, dk, dv, *([None] * 10)  # none for sel ... chunk_size


token_sparse_fwd.register_autograd(_backward, setup_context=_setup)


def token_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_indices: torch.Tensor,
    *,
    key_padding_mask: Optional[torch.Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    block_size: int,
    pdl: bool = False,
    sliding_window: int = 0,
    chunk_size: int = 0,
) -> torch.Tensor:
    """``attend_selected_blocks``'s contract (differentiable in q, k, v) on the Triton kernels.
    ``pdl``: the forward's kernels launch as links of a programmatic-dependent chain (kernels.pdl).
    ``sliding_window`` / ``chunk_size`` (causal only; 0 = none): each query also sees only the keys
    of its local window, element-wise, whatever blocks it selected (``token_blocks.window_block_indices``
    builds a window's own lists, ``restrict_to_window`` drops the selected blocks it cannot see)."""
    b, hq, n_q, d = q.shape
    check_window(sliding_window, chunk_size, is_causal)
    if v.shape[-1] != d:
        raise ValueError(f"the Triton token-sparse kernel needs v's head dim == q's ({d}), got {v.shape[-1]}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"the Triton token-sparse kernel takes fp16, bf16 or fp32, got {q.dtype}")
    if b == 0 or n_q == 0 or k.shape[2] == 0:  # nothing to attend: the empty / zero result, autograd-connected
        return q.new_zeros(b, hq, n_q, d) + 0 * q.sum() + 0 * k.sum() + 0 * v.sum()
    sc = 1.0 / math.sqrt(d) if scale is None else float(scale)
    n_kb = max(1, -(-k.shape[2] // block_size))
    with torch.no_grad():
        sel = block_indices.to(device=q.device, dtype=torch.int32).contiguous()
        tokens = forward_token_tile(hq // k.shape[1], d, block_size, k.element_size())
        num, lists = tile_block_lists(sel, tokens, n_kb, pdl)
        kpm = None if key_padding_mask is None else key_padding_mask.to(device=q.device, dtype=torch.int8).contiguous()
    # the kernel reads any row strides (a model's [B, N, H, D] memory seen as [B, H, N, D] needs no copy)
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    flags = (int(block_size), bool(is_causal), bool(pdl), int(sliding_window), int(chunk_size))
    out, _ = token_sparse_fwd(q, k, v, sel, num, lists, kpm, sc, *flags)
    return out
