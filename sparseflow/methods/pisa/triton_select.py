"""PISA selection in Triton: the pyramid build, then one of three walks that select the same blocks.

Imported lazily (``backend="triton"``); this module imports Triton.

* ``build_pyramid``: two kernels. The first sums the valid keys of every leaf block (``C`` keys)
  and records its valid-key count and first valid position; the second fills every upper node of
  every level at once from the leaf sums (a node's summary is the mean of all valid keys under
  it, as in the reference). All levels live in one ``[B, Hkv, T, D]`` fp32 table, leaves first.
* ``pisa_select``: the pyramid, then the coarse-to-fine walk ``Tuning.pisa_walk`` picks:
  ``"per_token"``, one program per query token (``triton_select_per_token``, which also serves
  decoding); ``"scan"`` (and ``"auto"`` on CUDA), the node scores from a scan by query tiles, a
  walk by rows of queries as the middle stage and the leaves scored by pairs grouped per leaf
  (``triton_select_scan``); ``"leaf_pairs"`` (and ``"auto"`` on CUDA where the scan's table
  does not fit), the scan without its node table: the per-token kernel scores the nodes above
  the leaves and the leaves are scored by pairs (``triton_select_pairs``); ``"tiled"``, the walk by tiles of consecutive queries
  (``triton_select_tiled``). A shape the chosen walk does not cover runs per token (logged).
  Each walk runs a local window (``sliding_window`` / ``chunk_size``, the reference's walk inside
  each query's window: ``HAS_WINDOW`` kernels).

What the walks share is ``triton_select_common``'s. The scan and the tiled walk are imported
where they are picked, so that a test may swap their ops and launch settings on their modules.

With ``Tuning.pisa_scores="fp32"`` (the default) all three walks score in fp32 and select
exactly the reference's blocks, ties included. ``"bf16"`` / ``"tf32"`` round both operands of
every q . summary dot (the node levels above the leaves, and the leaves of ``score="mean"``) to
that format (``triton_select_common._round_bits``) with fp32 accumulation; the leaf level's LSE
over the raw 16-bit keys stays exact. The selection then keeps within the selection contract
(``tolerance_check``; docs/methods.md, "PISA's selection contract") with that precision's
``delta``, which the tests check on the walks' own traces (``triton_trace``).
"""

from __future__ import annotations

import logging
import math
from typing import List, Optional, Tuple

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from ...kernels.block_summaries_triton import leaf_sums
from ...kernels.token_blocks import check_index_dtype, check_window, selection_width
from ...tuning import DEFAULT_TUNING, Tuning
from .reference import check_beam
from ...kernels._triton_env import interpreting
from .config import PISAConfig
from .triton_select_common import SCORE_CODES, _p2, candidate_width, walk_summaries
from .triton_select_per_token import _pisa_select_fwd

__all__ = ["build_pyramid", "pisa_select", "level_sizes", "pyramid_tables"]

_log = logging.getLogger("sparseflow")


def level_sizes(n_leaves: int, branching: int) -> List[int]:
    """Node counts per level, leaves first, root (1 node) last."""
    sizes = [max(1, n_leaves)]
    while sizes[-1] > 1:
        sizes.append(-(-sizes[-1] // branching))
    return sizes


# --------------------------------------------------------------------------- pyramid


@triton.jit
def _node_kernel(
    sums_ptr,
    lcnt_ptr,
    lfv_ptr,
    summ_ptr,
    nfv_ptr,
    lvl_off_ptr,
    lvl_span_ptr,
    stride_sb,
    stride_sh,
    stride_st,
    stride_mb,
    stride_mh,
    stride_mt,
    n_leaves,
    T,
    HKV,
    Nk,
    N_LEVELS: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
    BL: tl.constexpr,
):
    """One program per node of every level (leaves included): summary = sum of its leaves'
    key sums / their valid-key count; first valid position = min over its leaves. The top
    levels' nodes, which sum the most leaves, start first (the launch's last wave holds leaves)."""
    t = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # 64-bit offsets: batch x head strides pass 2**31 elements at long contexts
    b = bh // HKV
    h = bh % HKV
    lv = 0
    for i in range(1, N_LEVELS):
        lv = tl.where(t >= tl.load(lvl_off_ptr + i), i, lv)
    u = t - tl.load(lvl_off_ptr + lv)
    span = tl.load(lvl_span_ptr + lv)
    first_leaf = u * span
    offs_d = tl.arange(0, DP)
    offs_l = tl.arange(0, BL)
    acc = tl.zeros([DP], dtype=tl.float32)
    cnt = 0
    fv = Nk
    l0 = 0
    while l0 < span:  # (while: the interpreter cannot range() over a runtime bound)
        leaf = first_leaf + l0 + offs_l
        ok = (l0 + offs_l < span) & (leaf < n_leaves)
        s = tl.load(
            # 64-bit: a leaf index times its row stride can pass 2**31 elements
            sums_ptr + b * stride_sb + h * stride_sh + leaf.to(tl.int64)[:, None] * stride_st + offs_d[None, :],
            mask=ok[:, None] & (offs_d[None, :] < D),
            other=0.0,
        )
        acc += tl.sum(s, axis=0)
        cnt += tl.sum(tl.load(lcnt_ptr + b * n_leaves + leaf, mask=ok, other=0), axis=0)
        fv = tl.minimum(fv, tl.min(tl.load(lfv_ptr + b * n_leaves + leaf, mask=ok, other=Nk), axis=0))
        l0 += BL
    mean = acc / tl.maximum(cnt, 1).to(tl.float32)
    row = summ_ptr + b * stride_mb + h * stride_mh + t.to(tl.int64) * stride_mt  # 64-bit: node id x row stride
    tl.store(row + offs_d, mean, mask=offs_d < D)
    if h == 0:
        tl.store(nfv_ptr + b * T + t, fv)


def pyramid_tables(n_leaves: int, branching: int, device) -> Tuple[List[int], List[int], torch.Tensor, torch.Tensor]:
    """Layout of every level in one table, leaves first: (node counts per level, level offsets
    (length levels + 1), the offsets and the leaf spans ``g**level`` as int32 tensors)."""
    sizes = level_sizes(n_leaves, branching)
    offs = [0]
    for s in sizes:
        offs.append(offs[-1] + s)
    return sizes, offs, *_device_tables(max(1, n_leaves), branching, len(sizes), device)


def _device_tables(n_leaves: int, branching: int, levels: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """The level offsets and leaf spans computed on ``device`` (a host list copied there would be
    a pageable copy: a host sync, and no CUDA-graph capture). Level ``i`` has
    ``ceil(n_leaves / g**i)`` nodes (repeated ceil-division), the same as :func:`level_sizes`.
    On a GPU (and under the interpreter) one Triton program writes both (torch takes nine small
    launches, a measurable share of a short layer's selection)."""
    if torch.device(device).type == "cuda" or interpreting():
        return torch.ops.sparseflow.pisa_level_tables(n_leaves, branching, levels, torch.device(device))
    return _device_tables_torch(n_leaves, branching, levels, device)


def _device_tables_torch(n_leaves: int, branching: int, levels: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`_device_tables` in torch ops."""
    span = torch.pow(branching, torch.arange(levels, device=device, dtype=torch.int64))
    counts = torch.div(n_leaves + span - 1, span, rounding_mode="floor").clamp_min(1)
    offs = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    # spans of the top levels exceed int32 only for absurd lengths; clamp
    return offs.to(torch.int32), span.clamp_max(2**30).to(torch.int32)


@triton.jit
def _level_tables_kernel(offs_ptr, span_ptr, n_leaves, branching, levels, LP: tl.constexpr):
    """``offs[i]`` (``i <= levels``): the nodes of the levels below ``i``; ``span[i]`` (``i <
    levels``): ``branching**i`` clamped to 2**30. Spans saturate at 2**31 while they are
    multiplied (every level at or above ``n_leaves`` has one node either way)."""
    ar = tl.arange(0, LP)
    span = tl.full([LP], 1, tl.int64)
    for lv in range(1, LP):  # LP (> levels) is a constant bound: the interpreter needs one
        span = tl.where(ar >= lv, tl.minimum(span * branching, 1 << 31), span)
    counts = tl.where(ar < levels, tl.maximum((n_leaves + span - 1) // span, 1), 0)
    tl.store(offs_ptr + ar, (tl.cumsum(counts, axis=0) - counts).to(tl.int32), mask=ar <= levels)
    tl.store(span_ptr + ar, tl.minimum(span, 1 << 30).to(tl.int32), mask=ar < levels)


@triton_op("sparseflow::pisa_level_tables", mutates_args={})
def _level_tables(
    n_leaves: int, branching: int, levels: int, device: torch.device
) -> Tuple[torch.Tensor, torch.Tensor]:
    offs = torch.empty(levels + 1, dtype=torch.int32, device=device)
    span = torch.empty(levels, dtype=torch.int32, device=device)
    wrap_triton(_level_tables_kernel)[(1,)](offs, span, n_leaves, branching, levels, LP=_p2(levels + 1, 16))
    return offs, span


@_level_tables.register_fake
def _(n_leaves, branching, levels, device):
    return (
        torch.empty(levels + 1, dtype=torch.int32, device=device),
        torch.empty(levels, dtype=torch.int32, device=device),
    )


_NODE_LEAVES = 128  # most leaves a pyramid node's program sums at a time


@triton_op("sparseflow::pisa_pyramid_nodes", mutates_args={})
def _pisa_nodes(
    sums: torch.Tensor,
    cnt: torch.Tensor,
    lfv: torch.Tensor,
    lvl_off: torch.Tensor,
    lvl_span: torch.Tensor,
    n_k: int,
    total_nodes: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    b, hkv, n_leaves, d = sums.shape
    summ = torch.empty(b, hkv, total_nodes, d, dtype=torch.float32, device=sums.device)
    nfv = torch.empty(b, total_nodes, dtype=torch.int32, device=sums.device)
    wrap_triton(_node_kernel)[(total_nodes, b * hkv)](
        sums,
        cnt,
        lfv,
        summ,
        nfv,
        lvl_off,
        lvl_span,
        sums.stride(0),
        sums.stride(1),
        sums.stride(2),
        summ.stride(0),
        summ.stride(1),
        summ.stride(2),
        n_leaves,
        total_nodes,
        hkv,
        n_k,
        N_LEVELS=lvl_span.shape[0],
        D=d,
        DP=_p2(d, 16),
        # the top node sums every leaf: its loads, one block of leaves after another, bound the
        # launch's time, so a block is wide (the lower levels' programs mask most of it off)
        BL=min(_NODE_LEAVES, _p2(n_leaves, 16)),
    )
    return summ, nfv


@_pisa_nodes.register_fake
def _(sums, cnt, lfv, lvl_off, lvl_span, n_k, total_nodes):
    b, hkv, _, d = sums.shape
    return (sums.new_empty(b, hkv, total_nodes, d), cnt.new_empty(b, total_nodes))


def build_pyramid(k: torch.Tensor, *, block_size: int, branching: int, key_padding_mask: Optional[torch.Tensor] = None):
    """``(summaries [B, Hkv, T, D] fp32, first_valid [B, T] int32, sizes, lvl_off, lvl_span)``:
    every level's node means (leaves first), each node's first valid key position (``Nk`` if
    none), the node counts per level and the level offsets / leaf spans as int32 tensors."""
    n_leaves = max(1, -(-k.shape[2] // block_size))
    sizes, _, lvl_off, lvl_span = pyramid_tables(n_leaves, branching, k.device)
    kpm = None if key_padding_mask is None else key_padding_mask.to(device=k.device, dtype=torch.int8).contiguous()
    sums, cnt, lfv = leaf_sums(k, kpm, block_size)
    summ, nfv = _pisa_nodes(sums, cnt, lfv, lvl_off, lvl_span, k.shape[2], sum(sizes))
    return summ, nfv, sizes, lvl_off, lvl_span


# --------------------------------------------------------------------------- selection


def pisa_select(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    key_padding_mask: Optional[torch.Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    block_size: int = PISAConfig.block_size,
    top_k: int = PISAConfig.top_k,
    branching: int = PISAConfig.branching,
    score: str = PISAConfig.score,
    force_sink: bool = PISAConfig.force_sink,
    force_previous: bool = PISAConfig.force_previous,
    beam: int = PISAConfig.beam,
    tuning: Tuning = DEFAULT_TUNING,
    index_dtype: torch.dtype = torch.long,
    sliding_window: int = PISAConfig.sliding_window,
    chunk_size: int = PISAConfig.chunk_size,
) -> torch.Tensor:
    """The reference's ``pisa_select`` contract in Triton: ``[B, Hkv, Nq, top_k]`` int64 leaf
    block ids per query token, ascending, ``-1`` padded; ``beam`` as in the reference (the walk
    keeps ``beam * top_k`` nodes above the leaves). ``tuning``: the walk's launch settings
    (``pisa_walk``: per-token, scan, leaf-pairs or tiled walk, ``pisa_warps``, ``pisa_leaf_bytes``) and score
    precision (``pisa_scores``).
    ``index_dtype``: ``torch.int32`` returns the kernel's own ids (what the attention kernel
    reads), saving a conversion each way. ``sliding_window`` / ``chunk_size``: the reference's
    walk inside each query's local window; every walk runs it."""
    check_beam(beam)
    check_index_dtype(index_dtype)
    check_window(sliding_window, chunk_size, is_causal)
    if score not in SCORE_CODES:
        raise ValueError(f"score must be one of {list(SCORE_CODES)}, got {score!r}")
    if branching < 2:
        raise ValueError(f"branching must be >= 2, got {branching}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"the Triton PISA selection takes fp16, bf16 or fp32 q/k, got {q.dtype}")
    b, hq, n_q, d = q.shape
    n_k = k.shape[2]
    top_k = selection_width(top_k, n_k, block_size)
    if n_k == 0 or b == 0:
        return torch.full((b, k.shape[1], n_q, top_k), -1, dtype=index_dtype, device=q.device)
    sc = 1.0 / math.sqrt(d) if scale is None else float(scale)
    with torch.no_grad():
        kc = k.detach()
        summ, nfv, _, lvl_off, lvl_span = build_pyramid(
            kc, block_size=block_size, branching=branching, key_padding_mask=key_padding_mask
        )
        kpm = None if key_padding_mask is None else key_padding_mask.to(device=q.device, dtype=torch.int8).contiguous()
        args = (
            q.detach(),
            kc,
            kpm,
            walk_summaries(summ, tuning.pisa_scores),
            nfv,
            lvl_off,
            lvl_span,
            sc,
            bool(is_causal),
            SCORE_CODES[score],
            int(block_size),
            int(branching),
            int(top_k),
            bool(force_sink),
            bool(force_previous),
            int(beam),
        )
        # the window last and positional in every walk's op (as the tests' spies pass it on)
        window = (int(sliding_window), int(chunk_size))
        if _use_scan_walk(tuning, q, k, summ, SCORE_CODES[score], block_size, top_k, beam, branching):
            from .triton_select_scan import pisa_select_scan_fwd

            idx = pisa_select_scan_fwd(*args, tuning.pdl, *window, tuning.pisa_scores)
        elif _use_pairs_walk(tuning, q, k, block_size, top_k, beam, branching):
            from .triton_select_pairs import pisa_select_pairs_fwd

            idx = pisa_select_pairs_fwd(*args, tuning.pisa_warps, tuning.pdl, *window, tuning.pisa_scores)
        elif _use_tiled_walk(tuning, hq // k.shape[1], beam, top_k, branching):
            from .triton_select_tiled import pisa_select_tiled_fwd

            idx = pisa_select_tiled_fwd(*args, tuning.pisa_warps, None, *window, tuning.pisa_scores)
        else:
            idx = _pisa_select_fwd(*args, tuning.pisa_warps, tuning.pisa_leaf_bytes, None, *window, tuning.pisa_scores)
    return idx.to(index_dtype)


def _use_tiled_walk(tuning: Tuning, group: int, beam: int, top_k: int, branching: int) -> bool:
    """Whether ``tuning.pisa_walk`` asks for the tiled walk and it covers the shape (``"auto"``
    never picks it); a shape it does not cover is logged."""
    if tuning.pisa_walk != "tiled":
        return False
    from .triton_select_tiled import tiled_covers

    why = tiled_covers(group, beam, top_k, branching)
    if why is not None:
        _log.info("PISA selection: pisa_walk='tiled' runs the per-token walk: %s", why)
    return why is None


def auto_on_cuda(tuning: Tuning, q: torch.Tensor) -> bool:
    """Whether ``pisa_walk="auto"`` may pick a walk timed on the GPU: compiled CUDA calls only
    (the interpreter and the CPU walk per token)."""
    return tuning.pisa_walk == "auto" and q.is_cuda and not interpreting()


def _use_pairs_walk(tuning: Tuning, q, k, block_size: int, top_k: int, beam: int, branching: int) -> bool:
    """Whether ``tuning.pisa_walk`` asks for the leaf-pairs walk (``"leaf_pairs"``, or ``"auto"``
    on CUDA where the scan does not cover the call: its node table grows as ``N**2``. On an H100
    the leaf pairs took 0.45x the per-token walk's time at 256K and 1M tokens in bf16, and
    SmolLM2's whole forward at 128K 0.27x) and it covers the call; a call it does not cover is
    logged."""
    auto = auto_on_cuda(tuning, q)
    if tuning.pisa_walk != "leaf_pairs" and not auto:
        return False
    from .triton_select_pairs import pairs_walk_covers

    why = pairs_walk_covers(q, k, block_size, top_k, beam, branching)
    if why is not None:
        _log.log(
            logging.DEBUG if auto else logging.INFO,
            "PISA selection: pisa_walk=%r runs the per-token walk: %s",
            tuning.pisa_walk,
            why,
        )
    return why is None


def _use_scan_walk(
    tuning: Tuning, q, k, summ, score: int, block_size: int, top_k: int, beam: int, branching: int
) -> bool:
    """Whether ``tuning.pisa_walk`` asks for the scan walk (``"scan"``, or ``"auto"`` on CUDA:
    faster than the per-token walk at every shape timed on an H200) and
    it covers the call; a call it does not cover runs per token, logged."""
    auto = auto_on_cuda(tuning, q)
    if tuning.pisa_walk != "scan" and not auto:
        return False
    from .triton_select_scan import scan_covers, table_shape

    n_leaves = max(1, -(-k.shape[2] // block_size))
    rows, n_q, cols, _ = table_shape(q.shape[0], k.shape[1], q.shape[2], n_leaves, summ.shape[2], score)
    cw = candidate_width(beam, top_k, branching)
    why = scan_covers(n_leaves, top_k, 4 * rows * n_q * cols, rows * n_q * cw)
    if why is not None:
        _log.log(
            logging.DEBUG if auto else logging.INFO,
            "PISA selection: pisa_walk=%r runs the per-token walk: %s",
            tuning.pisa_walk,
            why,
        )
    return why is None
