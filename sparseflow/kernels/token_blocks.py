"""Plain-PyTorch helpers shared by the token-level block-sparse references (PISA and BSA).

Conventions:

* ``q: [B, Hq, Nq, D]``, ``k, v: [B, Hkv, Nk, D]``, ``G = Hq // Hkv`` query heads per KV head.
  Query heads are grouped with a *view* ``[B, Hkv, G, Nq, D]``; K/V are never repeated.
* Queries are bottom-right aligned: query ``i`` sits at key position ``p_i = i + (Nk - Nq)``.
  Causal (``Nq == Nk``): key ``j`` is visible to query ``i`` iff ``j <= p_i``; non-causal: every
  key is. Keys with ``key_padding_mask[b, j] == False`` are never visible.
  This is captured by the *horizon* ``h_i`` (``p_i`` if causal else ``Nk - 1``): a valid key is
  visible iff its position is ``<= h_i``.
* Leaf block ``c`` holds keys ``[c*C, min((c+1)*C, Nk))``. It is *visible* to query ``i`` iff it
  holds a visible key, i.e. iff its first valid key position is ``<= h_i``.
* Forced blocks: the block holding ``p_i`` ("current"), the one before it (``force_previous``)
  and block 0 (``force_sink``); each is included only if it is visible.
* ``block_indices: [B, Hkv, Nq, K]`` int64, ascending, ``-1`` padded at the end.

Everything here is torch-only and CPU friendly; selection helpers run under ``no_grad`` in the
callers, ``attend_selected_blocks`` is differentiable in q, k and v.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
import torch.utils.checkpoint

from .._config_base import check_window, window_lower_bounds
from ..selection import Selection
from .lasting import build_lasting

__all__ = [
    "num_blocks",
    "selection_width",
    "default_scale",
    "compute_dtype",
    "chunk_rows",
    "group_queries",
    "key_blocks",
    "gather_blocks",
    "query_positions",
    "query_horizons",
    "leaf_first_valid",
    "leaf_block_sums",
    "forced_leaf_blocks",
    "count_visible_blocks",
    "select_top_k",
    "pad_indices",
    "make_selection",
    "attend_selected_blocks",
    "check_window",
    "window_lower_bounds",
    "window_block_indices",
    "restrict_to_window",
]

# Upper bound on the element count of the largest per-chunk intermediate (gathered keys or
# logits). 2**22 fp32 elements = 16 MiB (larger chunks measured slower on CPU).
_CHUNK_BUDGET = 1 << 22


def num_blocks(n: int, block_size: int) -> int:
    return -(-n // block_size)


def selection_width(top_k: int, n_k: int, block_size: int) -> int:
    """Width of a selection ``[.., K]``: ``top_k`` clamped to the leaf blocks that exist (at least
    1), so a ``top_k`` beyond them (the exact mode) costs what selecting every block costs."""
    return max(1, min(int(top_k), num_blocks(n_k, block_size)))


def default_scale(q: torch.Tensor, scale: Optional[float]) -> float:
    return float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp16/bf16/fp32 accumulate in fp32; fp64 (tests, gradcheck) stays fp64."""
    return torch.promote_types(dtype, torch.float32)


def group_queries(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[B, Hq, Nq, D]`` -> view ``[B, Hkv, G, Nq, D]`` (query head ``h`` uses KV head ``h // G``)."""
    return q.unflatten(1, (num_kv_heads, q.shape[1] // num_kv_heads))


def _window_block_span(positions: torch.Tensor, n_k: int, block_size: int, sliding_window: int, chunk_size: int):
    """``(first block, block count)`` of each query's window ``[lo, min(p, Nk - 1)]`` (count 0
    where it holds no key)."""
    lo = window_lower_bounds(positions, sliding_window, chunk_size)
    hi = positions.clamp_max(n_k - 1)
    first = torch.div(lo, block_size, rounding_mode="floor")
    last = torch.div(hi.clamp_min(0), block_size, rounding_mode="floor")
    count = torch.where(hi >= lo, last - first + 1, torch.zeros_like(first))
    return first, count


def window_block_indices(
    n_q: int, n_k: int, block_size: int, sliding_window: int, chunk_size: int, device=None
) -> torch.Tensor:
    """``[1, 1, Nq, K]`` int32: the ascending ids of the blocks each query's causal local window
    touches, ``-1`` padded, ``K`` the most any query touches (at least 1): a window's selection with
    no selection pass, for any batch and KV head (expand it). Read-only: the lists depend on the
    arguments alone, so a model's windowed layers share one tensor per length instead of each
    building it (a host cost above the kernel's own at 8K)."""
    check_window(sliding_window, chunk_size, True)
    device = torch.device("cpu" if device is None else device)
    key = (n_q, n_k, block_size, sliding_window, chunk_size, device)
    ids = _WINDOW_LISTS.get(key)
    if ids is not None:
        return ids
    if not _may_keep(device):
        return _build_window_block_indices(*key)
    ids = build_lasting(lambda: _build_window_block_indices(*key), device)
    if len(_WINDOW_LISTS) >= _WINDOW_LISTS_KEPT:
        _WINDOW_LISTS.pop(next(iter(_WINDOW_LISTS)))
    _WINDOW_LISTS[key] = ids
    return ids


# (n_q, n_k, block_size, sliding_window, chunk_size, device) -> window_block_indices' tensor; a few
# lengths a process serves, each a few MB at most (Nq x K int32)
_WINDOW_LISTS: Dict[Tuple, torch.Tensor] = {}
_WINDOW_LISTS_KEPT = 16


def _may_keep(device: torch.device) -> bool:
    # never a tensor allocated inside a CUDA graph capture (it would live in the graph's private
    # pool) or a traced call's; meta tensors hold nothing worth keeping
    if device.type == "meta" or torch.compiler.is_compiling():
        return False
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _build_window_block_indices(
    n_q: int, n_k: int, block_size: int, sliding_window: int, chunk_size: int, device: torch.device
) -> torch.Tensor:
    span = (n_k, block_size, sliding_window, chunk_size)
    # the width from the positions on the host (a few integer ops a query): no device sync
    _, host_count = _window_block_span(query_positions(n_q, n_k), *span)
    width = max(1, int(host_count.max())) if n_q else 1
    first, count = _window_block_span(query_positions(n_q, n_k, device), *span)
    slot = torch.arange(width, device=device, dtype=torch.long)
    ids = torch.where(slot < count[:, None], first[:, None] + slot, torch.full_like(slot, -1))
    return ids.to(torch.int32).view(1, 1, n_q, width)


def restrict_to_window(
    block_indices: torch.Tensor, n_k: int, block_size: int, sliding_window: int, chunk_size: int
) -> torch.Tensor:
    """A selection ``[B, Hkv, Nq, K]`` without the blocks that lie wholly outside each query's
    causal local window: the kept ids in their order, then ``-1`` (same shape and dtype)."""
    check_window(sliding_window, chunk_size, True)
    n_q = block_indices.shape[2]
    first, count = _window_block_span(
        query_positions(n_q, n_k, block_indices.device), n_k, block_size, sliding_window, chunk_size
    )
    ids = block_indices.long()
    keep = (ids >= first[:, None]) & (ids < (first + count)[:, None])
    # a stable sort on "dropped" moves the kept ids to the front in their order
    order = (~keep).to(torch.int8).sort(dim=-1, stable=True).indices
    kept = torch.where(keep, ids, torch.full_like(ids, -1)).gather(-1, order)
    return kept.to(block_indices.dtype)


def chunk_rows(n_rows: int, per_row: int) -> int:
    """Query rows per chunk so that ``rows * per_row`` stays within the budget."""
    return max(1, min(max(n_rows, 1), _CHUNK_BUDGET // max(per_row, 1)))


def query_positions(n_q: int, n_k: int, device=None) -> torch.Tensor:
    """``[Nq]`` int64: key position of each query (bottom-right aligned)."""
    return torch.arange(n_q, device=device, dtype=torch.long) + (n_k - n_q)


def query_horizons(n_q: int, n_k: int, *, is_causal: bool, device=None) -> torch.Tensor:
    """``[Nq]`` int64: the last key position each query may see (padding aside)."""
    if is_causal:
        return query_positions(n_q, n_k, device)
    return torch.full((n_q,), n_k - 1, dtype=torch.long, device=device)


def leaf_first_valid(
    key_padding_mask: Optional[torch.Tensor], batch: int, n_k: int, block_size: int, device=None
) -> torch.Tensor:
    """``[B, nB]`` int64: position of the first valid key of each leaf block, ``Nk`` if none."""
    nb = num_blocks(n_k, block_size)
    pos = torch.arange(nb * block_size, device=device, dtype=torch.long)
    pos = pos.unsqueeze(0).expand(batch, -1)
    valid = pos < n_k
    if key_padding_mask is not None:
        kpm = torch.zeros(batch, nb * block_size, dtype=torch.bool, device=device)
        kpm[:, :n_k] = key_padding_mask.to(device=device, dtype=torch.bool)
        valid = valid & kpm
    first = torch.where(valid, pos, torch.full_like(pos, n_k))
    return first.view(batch, nb, block_size).amin(-1)


def leaf_block_sums(k: torch.Tensor, block_size: int, key_padding_mask: Optional[torch.Tensor] = None) -> tuple:
    """Per leaf block: ``(sum of valid keys [B, Hkv, nB, D] in compute dtype, valid count [B, nB])``."""
    b, hkv, n_k, d = k.shape
    nb = num_blocks(n_k, block_size)
    kf = k.to(compute_dtype(k.dtype))
    if key_padding_mask is not None:
        valid = key_padding_mask.to(device=k.device, dtype=torch.bool)
        # where, not a 0/1 product: a padded key holding NaN/inf must not reach any sum
        kf = torch.where(valid[:, None, :, None], kf, torch.zeros((), dtype=kf.dtype, device=kf.device))
        counts = valid.to(torch.long)
    else:
        counts = torch.ones(b, n_k, dtype=torch.long, device=k.device)
    pad = nb * block_size - n_k
    if pad:
        kf = torch.nn.functional.pad(kf, (0, 0, 0, pad))
        counts = torch.nn.functional.pad(counts, (0, pad))
    sums = kf.view(b, hkv, nb, block_size, d).sum(3)
    return sums, counts.view(b, nb, block_size).sum(-1)


def forced_leaf_blocks(
    positions: torch.Tensor,
    horizons: torch.Tensor,
    first_valid: torch.Tensor,
    *,
    block_size: int,
    force_sink: bool,
    force_previous: bool,
) -> torch.Tensor:
    """``[B, Nq, 3]`` int64: (current, previous, sink) leaf block of each query, ``-1`` where the
    block is not forced, does not exist, is not visible, or duplicates an earlier entry."""
    b, nb = first_valid.shape
    n_q = positions.shape[0]
    cur = torch.where(
        (positions >= 0) & (positions < nb * block_size),
        torch.div(positions, block_size, rounding_mode="floor"),
        torch.full_like(positions, -1),
    )
    none = torch.full_like(cur, -1)
    prev = torch.where(cur >= 1, cur - 1, none) if force_previous else none
    sink = torch.where(cur != 0, torch.zeros_like(cur), none) if force_sink else none
    if force_sink and force_previous:
        sink = torch.where(prev == 0, none, sink)
    forced = torch.stack([cur, prev, sink], -1).unsqueeze(0).expand(b, n_q, 3)
    fv = first_valid.gather(1, forced.clamp_min(0).reshape(b, -1)).view(b, n_q, 3)
    visible = (forced >= 0) & (fv <= horizons.view(1, n_q, 1))
    return torch.where(visible, forced, torch.full_like(forced, -1))


def count_visible_blocks(first_valid: torch.Tensor, horizons: torch.Tensor) -> torch.Tensor:
    """``[B, Nq]`` int64: number of leaf blocks visible to each query."""
    b = first_valid.shape[0]
    srt = first_valid.sort(-1).values.contiguous()
    h = horizons.view(1, -1).expand(b, -1).contiguous()
    return torch.searchsorted(srt, h, right=True)


def window_first_blocks(positions: torch.Tensor, block_size: int, sliding_window: int, chunk_size: int) -> torch.Tensor:
    """``[Nq]`` int64: the first leaf block each query's local window reaches (0 without a window).
    A top-K method inside a window chooses among the visible blocks from there on."""
    lo = window_lower_bounds(positions, sliding_window, chunk_size)
    return torch.div(lo, block_size, rounding_mode="floor")


def count_window_blocks(
    first_valid: torch.Tensor, horizons: torch.Tensor, first_blocks: torch.Tensor, n_k: int
) -> torch.Tensor:
    """``[B, Nq]`` int64: the visible leaf blocks from ``first_blocks`` on (a causal window; all 0
    without one: every visible block). The blocks before a query's window end before its
    position, so they are visible exactly when they hold a valid key (``first_valid < Nk``): those
    are counted off the visible ones."""
    b = first_valid.shape[0]
    before = torch.nn.functional.pad((first_valid < n_k).long().cumsum(-1), (1, 0))  # non-empty blocks < j
    idx = first_blocks.clamp(0, before.shape[1] - 1).view(1, -1).expand(b, -1)
    return count_visible_blocks(first_valid, horizons) - before.gather(1, idx)


def select_top_k(
    cand: torch.Tensor,
    valid: torch.Tensor,
    forced: torch.Tensor,
    scores: Optional[torch.Tensor],
    k: int,
) -> tuple:
    """Keep, per row, the forced candidates plus the best-scoring others, ``k`` in total.

    ``cand [..., M]`` node ids, ascending among the valid entries; ``valid``/``forced`` bool
    ``[..., M]``; ``scores`` float ``[..., M]`` (ignored for forced/invalid entries; ``None``
    when every row has at most ``k`` valid candidates). Ties go to the lower id (stable sort over
    ascending ids). Returns ``(ids, ok)`` of width ``min(k, M)``: ids ascending with ``-1`` after
    the kept ones, ``ok`` marking kept entries. Rows with ``<= k`` valid candidates keep them all.
    """
    m = cand.shape[-1]
    if scores is None:
        scores = torch.zeros(cand.shape, dtype=torch.float32, device=cand.device)
    big = torch.finfo(scores.dtype).max
    key = torch.nan_to_num(scores, nan=-big, posinf=big, neginf=-big).clamp(-big, big)
    key = torch.where(forced, torch.full_like(key, math.inf), key)
    key = torch.where(valid, key, torch.full_like(key, -math.inf))
    width = min(k, m)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :width]
    ids = cand.gather(-1, order)
    ok = valid.gather(-1, order)
    sentinel = torch.iinfo(torch.long).max
    ids = torch.where(ok, ids, torch.full_like(ids, sentinel)).sort(-1).values
    ok = ids != sentinel
    return torch.where(ok, ids, torch.full_like(ids, -1)), ok


def gather_blocks(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Row gather per (batch, KV head): ``table [B, Hkv, n, *rest]``, ``ids [B, Hkv, Q, M]``
    (in range) -> ``[B, Hkv, Q, M, *rest]``. Copies whole rows (index_select), differentiable."""
    b, hkv, n = table.shape[:3]
    rest = table.shape[3:]
    base = (torch.arange(b * hkv, device=ids.device) * n).view(b, hkv, 1, 1)
    flat = (ids + base).reshape(-1)
    rows = table.reshape(b * hkv * n, -1).index_select(0, flat)
    return rows.view(*ids.shape, *rest)


def key_blocks(t: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[B, H, Nk, D]`` -> ``[B, H, nB, C, D]`` (zero padded at the end)."""
    b, h, n, d = t.shape
    nb = num_blocks(n, block_size)
    pad = nb * block_size - n
    if pad:
        t = torch.nn.functional.pad(t, (0, 0, 0, pad))
    return t.reshape(b, h, nb, block_size, d)


def pad_indices(ids: torch.Tensor, k: int) -> torch.Tensor:
    if ids.shape[-1] >= k:
        return ids
    return torch.nn.functional.pad(ids, (0, k - ids.shape[-1]), value=-1)


def make_selection(
    method: str,
    block_indices: torch.Tensor,
    n_visible: torch.Tensor,
    *,
    num_query_heads: int,
    block_size: int,
    is_causal: bool,
    num_keys: int,
    key_padding_mask: Optional[torch.Tensor],
    sliding_window: int = 0,
    chunk_size: int = 0,
) -> Selection:
    """Wrap a token-level selection. Density per query = #selected / #visible blocks, averaged
    over the query tokens that see at least one block; a batch row where no query sees any block
    gets density 0 (nothing was computed). ``sliding_window`` / ``chunk_size``: the call's local
    window, which the selection carries (its key masks stay inside it)."""
    b, hkv, n_q, _ = block_indices.shape
    selected = (block_indices >= 0).sum(-1).to(torch.float32)  # [B, Hkv, Nq]
    vis = n_visible.to(torch.float32)[:, None, :]  # [B, 1, Nq]
    has = vis > 0
    ratio = torch.where(has, selected / vis.clamp_min(1.0), torch.zeros_like(selected))
    n_valid = has.sum(-1).to(torch.float32)  # [B, 1]
    density = ratio.sum(-1) / n_valid.clamp_min(1.0)  # [B, Hkv]
    density = density.repeat_interleave(num_query_heads // hkv, dim=1).to(torch.float32)
    return Selection(
        method=method,
        density=density,
        block_size=block_size,
        is_causal=is_causal,
        num_keys=num_keys,
        block_indices=block_indices,
        key_padding_mask=key_padding_mask,
        sliding_window=sliding_window,
        chunk_size=chunk_size,
    )


def selection_for_indices(
    method: str,
    block_indices: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    key_padding_mask: Optional[torch.Tensor],
    is_causal: bool,
    block_size: int,
    sliding_window: int = 0,
    chunk_size: int = 0,
) -> Selection:
    """The :class:`Selection` the token-level references report for ``block_indices`` (density:
    selected / visible blocks per token, those of its local window when it has one), for the fast
    backends that compute the same indices."""
    n_q, n_k = q.shape[2], k.shape[2]
    first_valid = leaf_first_valid(key_padding_mask, q.shape[0], n_k, block_size, q.device)
    horizons = query_horizons(n_q, n_k, is_causal=is_causal, device=q.device)
    first_blocks = window_first_blocks(query_positions(n_q, n_k, q.device), block_size, sliding_window, chunk_size)
    n_visible = count_window_blocks(first_valid, horizons, first_blocks, n_k)
    return make_selection(
        method,
        block_indices,
        n_visible,
        num_query_heads=q.shape[1],
        block_size=block_size,
        is_causal=is_causal,
        num_keys=n_k,
        key_padding_mask=key_padding_mask,
        sliding_window=sliding_window,
        chunk_size=chunk_size,
    )


def attend_selected_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_indices: torch.Tensor,
    *,
    key_padding_mask: Optional[torch.Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    block_size: int,
    sliding_window: int = 0,
    chunk_size: int = 0,
) -> torch.Tensor:
    """Softmax attention of each query token over the valid, visible keys of its own key blocks.

    ``block_indices [B, Hkv, Nq, K]`` (``-1`` = unused slot) is shared by the ``G`` query heads
    of a KV head. Keys of the selected blocks are gathered per query (memory
    ``O(chunk * K * C * D)``, looping over query chunks), masked element-wise by causality
    (``j <= p_i``), the local window (``j >= lo(p_i)``, :func:`window_lower_bounds`; causal only),
    padding and the end of the sequence, and attended in fp32 (fp64 for fp64 inputs). A query with no visible key outputs 0. Differentiable in q, k, v by plain autograd;
    each chunk is recomputed in backward (activation checkpointing), so training memory stays
    ``O(chunk)`` plus the inputs.
    Returns ``[B, Hq, Nq, Dv]`` in ``q.dtype``.
    """
    b, hq, n_q, d = q.shape
    _, hkv, n_k, dv = v.shape
    g = hq // hkv
    kk = block_indices.shape[-1]
    c = block_size
    sc = default_scale(q, scale)
    cdt = compute_dtype(q.dtype)
    dev = q.device
    check_window(sliding_window, chunk_size, is_causal)
    if n_k == 0 or n_q == 0 or b == 0:
        return (q.new_zeros(b, hq, n_q, dv) + 0 * q.sum() + 0 * k.sum() + 0 * v.sum()).to(q.dtype)
    qg = group_queries(q, hkv)
    kb = key_blocks(k.to(cdt), c)  # [B, Hkv, nB, C, D]
    vb = key_blocks(v.to(cdt), c)
    horizons = query_horizons(n_q, n_k, is_causal=is_causal, device=dev)
    floors = window_lower_bounds(query_positions(n_q, n_k, dev), sliding_window, chunk_size)
    offs = torch.arange(c, device=dev, dtype=torch.long)
    kpm = None if key_padding_mask is None else key_padding_mask.to(device=dev, dtype=torch.bool)
    # With finite keys and values the gathered copies need no zeroing (half the time on the CPU):
    # a hidden entry's logit is masked to -inf, its probability is exactly 0, and 0 times a finite
    # number is 0, forward and backward alike. A NaN or inf anywhere (in padding, say) zeroes them.
    finite = dev.type != "meta" and bool(torch.isfinite(kb).all()) and bool(torch.isfinite(vb).all())

    def chunk(qc, kb_, vb_, idx, hz, lo):
        """``qc [B, Hkv, G, n, D]``, ``idx [B, Hkv, n, K]``, ``hz, lo [n]`` -> ``[B, Hkv, G, n, Dv]``."""
        n = idx.shape[2]
        safe = idx.clamp_min(0)
        pos = (safe[..., None] * c + offs).flatten(-2)  # [B, Hkv, n, K*C]
        ok = (idx >= 0).repeat_interleave(c, dim=-1) & (pos < n_k) & (pos <= hz[:, None]) & (pos >= lo[:, None])
        if kpm is not None:
            ok = ok & kpm.gather(1, torch.where(ok, pos, 0).flatten(1)).view_as(pos)
        ks = gather_blocks(kb_, safe).view(b, hkv, n, kk * c, d)
        vs = gather_blocks(vb_, safe).view(b, hkv, n, kk * c, dv)
        if not finite:  # hidden keys and values out of every product, backward's too (0 times NaN is NaN)
            zero = torch.zeros((), dtype=ks.dtype, device=dev)
            ks = torch.where(ok[..., None], ks, zero)
            vs = torch.where(ok[..., None], vs, zero)
        logits = torch.einsum("bhgnd,bhnjd->bhgnj", qc.to(cdt), ks) * sc
        logits = logits.masked_fill(~ok[:, :, None], -math.inf)
        mx = logits.detach().amax(-1, keepdim=True)
        mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
        p = torch.exp(logits - mx)  # masked entries: exp(-inf) = 0
        denom = p.sum(-1, keepdim=True)
        num = torch.einsum("bhgnj,bhnjd->bhgnd", p, vs)
        return num / torch.where(denom > 0, denom, torch.ones_like(denom))

    # Under autograd, recompute each chunk in backward instead of keeping its gathered keys,
    # values and probabilities: memory stays O(chunk) in training too.
    recompute = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    outs = []
    step = chunk_rows(n_q, b * hkv * kk * c * max(d, dv, g))
    for s in range(0, n_q, step):
        e = min(n_q, s + step)
        args = (qg[:, :, :, s:e], kb, vb, block_indices[:, :, s:e, :], horizons[s:e], floors[s:e])
        if recompute:
            outs.append(torch.utils.checkpoint.checkpoint(chunk, *args, use_reentrant=False))
        else:
            outs.append(chunk(*args))
    out = torch.cat(outs, dim=3)  # [B, Hkv, G, Nq, Dv]
    return out.flatten(1, 2).to(q.dtype)


def check_index_dtype(index_dtype) -> None:
    """A selector's ``index_dtype``: ``torch.long`` (the contract) or ``torch.int32`` (the
    kernels' own), else a ValueError naming it."""
    if index_dtype not in (torch.long, torch.int32):
        raise ValueError(f"index_dtype must be torch.long or torch.int32, got {index_dtype!r}")
