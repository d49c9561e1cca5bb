"""PBS-Attn in plain PyTorch: the oracle the Triton and Flex backends are checked against.

Pipeline (every stage is a separately testable function):

1. :func:`key_scores` -- proxy importance of every key, fp32 ``[B, Hp, N]``.
2. :func:`segment_permutation` -- per complete segment, keys sorted by descending score (stable);
   segment order kept, the tail stays in place. ``permutation[b, hp, j]`` = original position of
   the key at permuted slot ``j``.
3. :func:`select_blocks` -- ``block_mask[b, h, qb, kb]`` over *permuted* key blocks: threshold
   selection over the candidate blocks plus the forced ones (own segment / tail region, sink).
4. :func:`permuted_block_attention` -- softmax attention of every query over the keys of its
   selected permuted blocks, element mask by original position (``orig_pos(k) <= pos(q)`` when
   causal), key padding applied, zeros for a query that sees no key. Differentiable in q, k, v.

Conventions and decisions (where the method leaves room):

* ``N = Nq = Nk``; blocks are ``[i*bs, min((i+1)*bs, N))`` for queries and permuted key slots
  alike, ``nB = ceil(N / bs)``. Because ``segment_size % block_size == 0`` no block straddles a
  segment boundary.
* **Effective length per batch row.** With a key padding mask, row ``b``'s segment structure is
  built on ``L_b = 1 + (last valid position)`` (``N`` without a mask, 0 for an all-padded row):
  its complete segments are the first ``floor(L_b / S)`` segments and everything from
  ``floor(L_b / S) * S`` on is its tail (the "region" after the last complete segment). Trailing
  padding is therefore never sorted as if it were a complete segment, and a right-padded row
  selects exactly what the unpadded, truncated sequence selects. Without trailing padding
  ``L_b = N`` (the plain rule).
* **Region** of a block in row ``b``: its segment index if it lies in a complete segment, else
  ``floor(L_b / S)`` (the tail). Causal candidates of query block ``I``: valid key blocks of a
  strictly smaller region; non-causal: valid key blocks of any other region. A key block is valid
  when it holds at least one valid (non-padded) key.
* **Proxy**: the last ``block_size`` valid positions of the row (fewer if fewer exist); their
  softmax runs over the valid keys of the complete segments, no causal mask inside the proxy.
  ``causal_proxy=True`` normalises per segment. A row with no proxy row or no complete segment
  scores 0 everywhere (identity permutation). Tail keys score 0.
* **Causality.** With ``causal_proxy=True`` the output is causal in keys and values: the output
  at query ``i`` depends on no key or value after ``i``: a segment's permutation depends on its own keys and the proxy queries only, a
  query block's candidates are earlier regions (its own region is forced whole, and the element
  mask hides its later keys). It still depends on *later queries*: the proxy rows are the last
  valid positions, and the block mean ``q̄_I`` pools the later rows of ``i``'s block. So the
  result is not causal at model level (a later token changes earlier outputs), and next-token
  KL over prompt positions measures prefill, where the proxy has seen each position's future.
  ``causal_proxy=False`` is not causal in keys either (the proxy softmax spans all segments).
* **Several proxies** (``proxy_blocks = P > 1``, see :func:`proxy_queries`): with ``m`` valid
  query blocks (blocks holding a valid position) ``V[0] < ... < V[m-1]``, proxy ``j = 1..P`` is
  block ``V[ceil(j*m/P) - 1]`` (the block that ends the first ``j/P`` of them; duplicates
  dropped when ``m < P``), its rows being the block's valid positions. The last one (``j = P``)
  is replaced by the single proxy above (last ``block_size`` valid positions, every complete
  segment). An earlier proxy in region ``r`` sees only the complete segments ``< r`` (it cannot
  look ahead; a proxy of region 0 sees nothing and drops out). Each proxy computes its own mean
  probabilities exactly as the single proxy does (softmax over the valid keys it sees, per
  segment with ``causal_proxy``), and a key's score is the mean over the proxies that see it.
  With ``causal_proxy`` a segment's scores thus depend on its own keys only (which proxies see
  it depends on positions and padding, not on key values), so the selection stays causal in
  keys, as with one proxy.
  Visibility is per segment, so all keys of a segment are averaged over the same proxies and
  the in-segment order is a fair comparison. Every complete-segment key is seen by the last
  proxy; keys no proxy sees (tail, padding) keep score 0. ``P = 1`` is the single proxy, bit
  for bit.
* **Pooling**: a query block's mean is over its valid positions (valid = key_padding_mask, as
  Nq == Nk); a query block with no valid position falls back to the mean over all its
  positions, so padded query rows still get an ordinary (finite) selection and the exact mode
  equals dense attention on every row. A key block's mean is over its valid keys.
* **scoring="mean"**: block logit ``q̄_I · k̄_J · scale`` (= the mean over all valid (q, k) pairs of
  the block of ``q·k·scale``); block probability = softmax of the logits over the candidates.
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
* **Threshold**: candidates sorted by probability, descending, ties to the lower block index;
  keep the smallest prefix whose cumulative mass reaches ``threshold`` (a block is kept iff the
  mass of the blocks before it is ``< threshold``; fp32). ``threshold >= 1`` keeps every
  candidate (exact mode, no floating-point cut-off).
* **Forced** (not counted toward the threshold): every block of the query block's own region
  and, with ``force_sink``, the permuted block holding the row's first valid token (token 0
  without padding; with left padding the first real token, the attention sink).
* **Density** ``[B, Hq]``: selected block pairs holding at least one visible (query, key)
  element divided by all block pairs holding one, in the permuted layout; visibility is
  ``visible_key_mask`` (causality and key padding; every query row counts, as in
  ``Selection.key_mask``). A row with no visible pair has density 1. The exact mode gives 1.0.
* **Local window** (``sliding_window`` W / ``chunk_size`` C of the config; causal only): query
  ``i`` sees key ``j`` iff ``lo(i) <= j <= i`` with ``lo`` of
  :func:`~sparseflow.kernels.token_blocks.window_lower_bounds` (sliding: ``i - W < j``; chunked:
  ``j`` in ``i``'s chunk). ``lo`` rises with the position, so the keys the queries of block ``I``
  see under the window are ``[lo(I*bs), last query of I]``, and a permuted key block is *inside
  the window* of query block ``I`` when it holds a valid key at or after ``lo(I*bs)``
  (:func:`window_blocks`; the causal side is the region rule's, as without a window). The
  selection is made among those blocks only: candidates and forced blocks (own region, sink)
  outside the window are dropped, and the block probabilities are the distribution over the
  candidates inside the window (the threshold is a share of the in-window mass). The
  permutation does not depend on the window. The attention masks every key element-wise by its
  original position (``lo(i) <= orig_pos(k) <= i``), so at ``threshold >= 1`` the output is the
  exact window's. The dense tail attends every key of its rows' windows; the density counts
  the block pairs inside the window.
* Selection is computed without gradient; the attention is differentiable in q, k and v.
* GQA is native: K/V are never repeated; per-query-head permutations index the shared KV head.
"""

from __future__ import annotations

import math
from typing import List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from ...config import backend_config
from ...kernels.token_blocks import check_window, window_lower_bounds
from ...selection import Selection
from .config import PBSConfig
from .tail import apply_tail
from .memory import check_selection_memory

__all__ = [
    "pbs_attention",
    "pbs_selection",
    "pbs_selections",
    "pbs_report",
    "effective_lengths",
    "proxy_queries",
    "key_scores",
    "segment_permutation",
    "block_regions",
    "block_probabilities",
    "candidate_blocks",
    "forced_blocks",
    "threshold_blocks",
    "select_blocks",
    "window_blocks",
    "block_last_keys",
    "permuted_block_attention",
    "selection_density",
]

_NEG_INF = float("-inf")


# --------------------------------------------------------------------------- small helpers


def _scale(scale: Optional[float], d: int) -> float:
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


def _num_blocks(n: int, block_size: int) -> int:
    return -(-n // block_size)


def _safe_softmax(x: Tensor, dim: int = -1) -> Tensor:
    """Softmax that returns zeros (not NaN) for a slice whose entries are all -inf."""
    empty = torch.isneginf(x.amax(dim=dim, keepdim=True))
    return torch.softmax(x, dim=dim).masked_fill(empty, 0.0)


def effective_lengths(key_padding_mask: Optional[Tensor], batch: int, n: int, device=None) -> Tensor:
    """``[B]`` int64: ``1 + last valid position`` per row (``N`` without a mask, 0 if all padded)."""
    if key_padding_mask is None:
        return torch.full((batch,), n, dtype=torch.int64, device=device)
    pos = torch.arange(1, n + 1, device=key_padding_mask.device)
    return torch.where(key_padding_mask.bool(), pos, torch.zeros_like(pos)).amax(dim=-1)


def _first_valid(key_padding_mask: Optional[Tensor], batch: int, n: int, device) -> Tensor:
    """``[B]`` int64: first valid position per row, -1 for an all-padded row."""
    if key_padding_mask is None:
        return torch.zeros(batch, dtype=torch.int64, device=device)
    kpm = key_padding_mask.bool()
    first = kpm.to(torch.int8).argmax(dim=-1)
    return torch.where(kpm.any(dim=-1), first, torch.full_like(first, -1))


def _padded_permutation(permutation: Tensor, n_blocks: int, block_size: int) -> Tensor:
    """``[B, Hp, nB*bs]``: the permutation with -1 in the slots past N (partial last block)."""
    b, hp, n = permutation.shape
    total = n_blocks * block_size
    if total == n:
        return permutation.contiguous()
    pad = permutation.new_full((b, hp, total - n), -1)
    return torch.cat([permutation, pad], dim=-1)


def _valid_positions(key_padding_mask: Optional[Tensor], batch: int, n: int, device) -> Tensor:
    if key_padding_mask is None:
        return torch.ones(batch, n, dtype=torch.bool, device=device)
    return key_padding_mask.bool()


# --------------------------------------------------------------------------- 1. key importance


def proxy_queries(
    key_padding_mask: Optional[Tensor],
    batch: int,
    n: int,
    *,
    block_size: int = PBSConfig.block_size,
    segment_size: int = PBSConfig.segment_size,
    proxy_blocks: int = PBSConfig.proxy_blocks,
    device=None,
) -> List[List[Tuple[Tensor, int]]]:
    """The proxies of every batch row: ``out[b]`` is a list of ``(rows, n_seen)``, ``rows`` the
    proxy's query positions (int64, ascending) and ``n_seen`` the number of leading complete
    segments it scores (its keys are ``[0, n_seen * segment_size)``). Earlier proxies first; the
    last entry is the paper's proxy (the last ``block_size`` valid positions, every complete
    segment). Proxies that would see no segment or hold no row are left out, so a row with no
    complete segment or no valid position has an empty list. See the module docstring."""
    if isinstance(proxy_blocks, bool) or not isinstance(proxy_blocks, int) or proxy_blocks < 1:
        raise ValueError(f"proxy_blocks must be an int >= 1, got {proxy_blocks!r}")
    if device is None:
        device = key_padding_mask.device if key_padding_mask is not None else None
    lengths = effective_lengths(key_padding_mask, batch, n, device).tolist()
    n_blocks = _num_blocks(n, block_size)
    out: List[List[Tuple[Tensor, int]]] = []
    for b in range(batch):
        n_seg = lengths[b] // segment_size
        proxies: List[Tuple[Tensor, int]] = []
        if n_seg == 0:
            out.append(proxies)
            continue
        if key_padding_mask is None:
            valid_pos = None
            last = torch.arange(max(0, n - block_size), n, device=device)
            vblocks = list(range(n_blocks))
        else:
            valid_pos = key_padding_mask[b].bool().nonzero().squeeze(1)
            last = valid_pos[-block_size:]
            vblocks = sorted(set((valid_pos // block_size).tolist()))
        if last.numel() == 0:
            out.append(proxies)
            continue
        m = len(vblocks)
        if proxy_blocks > 1 and m > 1:
            picks = sorted({vblocks[(j * m + proxy_blocks - 1) // proxy_blocks - 1] for j in range(1, proxy_blocks)})
            for blk in picks:
                if blk == vblocks[-1]:
                    continue  # the last valid block: the paper's proxy below stands for it
                seen = min((blk * block_size) // segment_size, n_seg)  # its region: segments before it
                if seen == 0:
                    continue
                rows = torch.arange(blk * block_size, min(n, (blk + 1) * block_size), device=device)
                if valid_pos is not None:
                    rows = rows[key_padding_mask[b, rows].bool()]
                proxies.append((rows, seen))
        proxies.append((last, n_seg))
        out.append(proxies)
    return out


@torch.no_grad()
def key_scores(
    q: Tensor,
    k: Tensor,
    *,
    key_padding_mask: Optional[Tensor] = None,
    scale: Optional[float] = None,
    block_size: int = PBSConfig.block_size,
    segment_size: int = PBSConfig.segment_size,
    causal_proxy: bool = PBSConfig.causal_proxy,
    gqa_permutation: str = PBSConfig.gqa_permutation,
    proxy_blocks: int = PBSConfig.proxy_blocks,
) -> Tensor:
    """Proxy importance per key, fp32 ``[B, Hp, N]`` (Hp = Hq for ``"query_head"``, Hkv for
    ``"kv_head"``, where the group's query-head scores are averaged).

    Proxy rows: the last ``block_size`` valid query positions of each row. Score of key ``j`` of a
    complete segment: mean over proxy rows of softmax(q_proxy · kᵀ · scale) over the valid keys of
    all complete segments (per segment with ``causal_proxy``). Padded and tail keys score 0.

    ``proxy_blocks = P > 1``: the proxies of :func:`proxy_queries` (P query blocks spread evenly
    over the valid query blocks, the last one the proxy above); an earlier proxy scores only the
    complete segments strictly before its own segment, each proxy's mean probabilities are
    computed as above over the keys it sees, and a key's score is their mean over the proxies
    that see it. ``P = 1`` is bit-identical to the single proxy."""
    bsz, hq, n, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    sc = _scale(scale, d)
    proxies = proxy_queries(
        key_padding_mask,
        bsz,
        n,
        block_size=block_size,
        segment_size=segment_size,
        proxy_blocks=proxy_blocks,
        device=q.device,
    )
    out = torch.zeros(bsz, hq, n, dtype=torch.float32, device=q.device)
    for b in range(bsz):
        if not proxies[b]:
            continue
        n_seg = proxies[b][-1][1]  # the last proxy sees every complete segment
        lc = n_seg * segment_size
        key_ok = None if key_padding_mask is None else key_padding_mask[b, :lc].bool()
        # how many proxies see each complete-segment key (visibility is per whole segment)
        seen_by = torch.zeros(lc, dtype=torch.float32, device=q.device)
        for _, ns in proxies[b]:
            seen_by[: ns * segment_size] += 1.0
        for kvh in range(hkv):
            kc = k[b, kvh, :lc].float()  # [Lc, D]
            for h in range(kvh * g, (kvh + 1) * g):  # one query head at a time: O(bs * N) memory
                if len(proxies[b]) == 1:  # the single proxy (P = 1): unchanged arithmetic
                    out[b, h, :lc] = _proxy_probs(
                        q[b, h], kc, proxies[b][0][0], key_ok, n_seg, segment_size, sc, causal_proxy
                    )
                    continue
                acc = torch.zeros(lc, dtype=torch.float32, device=q.device)
                for rows, ns in proxies[b]:
                    lj = ns * segment_size
                    acc[:lj] += _proxy_probs(
                        q[b, h],
                        kc[:lj],
                        rows,
                        None if key_ok is None else key_ok[:lj],
                        ns,
                        segment_size,
                        sc,
                        causal_proxy,
                    )
                out[b, h, :lc] = acc / seen_by
    if gqa_permutation == "kv_head":
        out = out.view(bsz, hkv, g, n).mean(dim=2)
    elif gqa_permutation != "query_head":
        raise ValueError(f"gqa_permutation must be 'query_head' or 'kv_head', got {gqa_permutation!r}")
    return out


def _proxy_probs(
    qh: Tensor,
    kc: Tensor,
    rows: Tensor,
    key_ok: Optional[Tensor],
    n_seg: int,
    segment_size: int,
    sc: float,
    causal_proxy: bool,
) -> Tensor:
    """``[n_seg * S]``: one proxy's mean probability per key of the first ``n_seg`` segments."""
    p = rows.numel()
    lc = kc.shape[0]
    qp = qh.index_select(0, rows).float()  # [P, D]
    logits = torch.matmul(qp, kc.t()) * sc  # [P, Lc]
    if key_ok is not None:
        logits.masked_fill_(~key_ok, _NEG_INF)
    if causal_proxy:
        probs = _safe_softmax(logits.view(p, n_seg, segment_size)).view(p, lc)
    else:
        probs = _safe_softmax(logits)
    return probs.mean(dim=0)


# --------------------------------------------------------------------------- 2. permutation


@torch.no_grad()
def segment_permutation(
    scores: Tensor,
    *,
    segment_size: int = PBSConfig.segment_size,
    key_padding_mask: Optional[Tensor] = None,
    permute: bool = PBSConfig.permute,
) -> Tensor:
    """``[B, Hp, N]`` int64 original positions per permuted slot: inside every complete segment
    (of the row's effective length) keys sorted by descending score, stable; segment order kept;
    the tail in place. ``permute=False`` gives the identity (the MeanPooling baseline)."""
    bsz, hp, n = scores.shape
    perm = torch.arange(n, device=scores.device).expand(bsz, hp, n).clone()
    if not permute:
        return perm
    lengths = effective_lengths(key_padding_mask, bsz, n, scores.device).tolist()
    for b in range(bsz):
        n_seg = lengths[b] // segment_size
        lc = n_seg * segment_size
        if lc == 0:
            continue
        s = scores[b, :, :lc].reshape(hp, n_seg, segment_size)
        order = torch.sort(s, dim=-1, descending=True, stable=True).indices
        base = torch.arange(n_seg, device=scores.device)[:, None] * segment_size
        perm[b, :, :lc] = (order + base).reshape(hp, lc)
    return perm


# --------------------------------------------------------------------------- 3. block selection


def block_regions(
    key_padding_mask: Optional[Tensor], batch: int, n: int, *, block_size: int, segment_size: int, device=None
) -> Tensor:
    """``[B, nB]`` int64: the region of each block (segment index, or ``floor(L_b/S)`` = tail)."""
    n_blocks = _num_blocks(n, block_size)
    lengths = effective_lengths(key_padding_mask, batch, n, device)
    start = torch.arange(n_blocks, device=lengths.device) * block_size
    seg = start // segment_size
    return torch.minimum(seg[None, :], (lengths // segment_size)[:, None])


def _hp_of(hq: int, hp: int) -> Tensor:
    return torch.arange(hq) // (hq // hp)


@torch.no_grad()
def candidate_blocks(
    permutation: Tensor,
    hq: int,
    *,
    key_padding_mask: Optional[Tensor] = None,
    is_causal: bool = True,
    block_size: int = PBSConfig.block_size,
    segment_size: int = PBSConfig.segment_size,
) -> Tensor:
    """``[B, Hq, nB, nB]`` bool: key block ``J`` (permuted) is a scored candidate of query block ``I``."""
    bsz, hp, n = permutation.shape
    region = block_regions(
        key_padding_mask, bsz, n, block_size=block_size, segment_size=segment_size, device=permutation.device
    )
    rq, rk = region[:, :, None], region[:, None, :]
    cand = (rk < rq) if is_causal else (rk != rq)  # [B, nB, nB]
    kvalid = _key_block_valid(permutation, key_padding_mask, block_size)  # [B, Hp, nB]
    kvalid = kvalid[:, _hp_of(hq, hp).to(permutation.device)]  # [B, Hq, nB]
    return cand[:, None] & kvalid[:, :, None, :]


def _key_block_valid(permutation: Tensor, key_padding_mask: Optional[Tensor], block_size: int) -> Tensor:
    bsz, hp, n = permutation.shape
    nb = _num_blocks(n, block_size)
    if key_padding_mask is None:
        return torch.ones(bsz, hp, nb, dtype=torch.bool, device=permutation.device)
    kpm = key_padding_mask.bool()
    valid_slot = torch.gather(kpm[:, None, :].expand(bsz, hp, n), 2, permutation)  # [B, Hp, N]
    pad = valid_slot.new_zeros(bsz, hp, nb * block_size - n)
    return torch.cat([valid_slot, pad], dim=-1).view(bsz, hp, nb, block_size).any(dim=-1)


def block_last_keys(permutation: Tensor, key_padding_mask: Optional[Tensor], block_size: int) -> Tensor:
    """``[B, Hp, nB]`` int64: the latest original position of a valid key in each permuted block
    (-1 where it holds none)."""
    bsz, hp, n = permutation.shape
    nb = _num_blocks(n, block_size)
    ok = _slot_validity(permutation, key_padding_mask, nb, block_size)
    pos = _padded_permutation(permutation, nb, block_size)
    return torch.where(ok, pos, torch.full_like(pos, -1)).view(bsz, hp, nb, block_size).amax(dim=-1)


def query_block_window_starts(n: int, block_size: int, sliding_window: int, chunk_size: int, device=None) -> Tensor:
    """``[nB]`` int64: the window's lower bound of each query block's first query, the earliest
    key any query of the block sees (the bound rises with the position)."""
    starts = torch.arange(_num_blocks(n, block_size), device=device) * block_size
    return window_lower_bounds(starts, sliding_window, chunk_size)


@torch.no_grad()
def window_blocks(
    permutation: Tensor,
    hq: int,
    *,
    key_padding_mask: Optional[Tensor] = None,
    block_size: int = PBSConfig.block_size,
    sliding_window: int = PBSConfig.sliding_window,
    chunk_size: int = PBSConfig.chunk_size,
) -> Optional[Tensor]:
    """``[B, Hq, nB, nB]`` bool: permuted key block ``J`` is inside the local window of query
    block ``I`` -- it holds a valid key at or after the window's lower bound of ``I``'s first
    query (see the module docstring); None without a window (every block is)."""
    if not (sliding_window or chunk_size):
        return None
    n = permutation.shape[2]
    last = block_last_keys(permutation, key_padding_mask, block_size)  # [B, Hp, nB]
    lo = query_block_window_starts(n, block_size, sliding_window, chunk_size, permutation.device)  # [nB]
    inside = last[:, :, None, :] >= lo[None, None, :, None]  # [B, Hp, nB, nB]
    return inside[:, _hp_of(hq, permutation.shape[1]).to(permutation.device)]


@torch.no_grad()
def forced_blocks(
    permutation: Tensor,
    hq: int,
    *,
    key_padding_mask: Optional[Tensor] = None,
    block_size: int = PBSConfig.block_size,
    segment_size: int = PBSConfig.segment_size,
    force_sink: bool = PBSConfig.force_sink,
) -> Tensor:
    """``[B, Hq, nB, nB]`` bool: own region of every query block, plus the sink block."""
    bsz, hp, n = permutation.shape
    dev = permutation.device
    nb = _num_blocks(n, block_size)
    region = block_regions(key_padding_mask, bsz, n, block_size=block_size, segment_size=segment_size, device=dev)
    forced = (region[:, :, None] == region[:, None, :])[:, None].expand(bsz, hq, nb, nb).clone()
    if force_sink:
        first = _first_valid(key_padding_mask, bsz, n, dev)  # [B]
        has = first >= 0
        slot = (permutation == first.clamp_min(0)[:, None, None]).to(torch.int8).argmax(dim=-1)  # [B, Hp]
        sink_block = (slot // block_size)[:, _hp_of(hq, hp).to(dev)]  # [B, Hq]
        onehot = torch.nn.functional.one_hot(sink_block, nb).bool() & has[:, None, None]  # [B, Hq, nB]
        forced |= onehot[:, :, None, :]
    return forced


@torch.no_grad()
def threshold_blocks(probs: Tensor, candidates: Tensor, threshold: float) -> Tensor:
    """Keep, per query block, the smallest prefix of candidates (sorted by probability, descending,
    ties to the lower index) whose cumulative mass reaches ``threshold``; all of them if
    ``threshold >= 1``. ``probs``/``candidates``: ``[..., nKB]``. Returns bool ``[..., nKB]``."""
    if float(threshold) >= 1.0:
        return candidates.clone()
    key = torch.where(candidates, probs.float(), torch.full_like(probs, -1.0, dtype=torch.float32))
    sorted_p, order = torch.sort(key, dim=-1, descending=True, stable=True)
    sorted_cand = torch.gather(candidates, -1, order)
    mass = torch.where(sorted_cand, sorted_p, torch.zeros_like(sorted_p))
    before = torch.cumsum(mass, dim=-1) - mass  # exclusive prefix sum
    keep_sorted = sorted_cand & (before < float(threshold))
    keep = torch.zeros_like(candidates)
    keep.scatter_(-1, order, keep_sorted)
    return keep


def _query_validity(valid: Tensor, block_size: int) -> Tensor:
    """``[B, nB*bs]`` bool: the query positions a block is pooled over -- its valid positions, or
    all of its (in-range) positions when it has none."""
    bsz, n = valid.shape
    nb = _num_blocks(n, block_size)
    total = nb * block_size
    vb = torch.cat([valid, valid.new_zeros(bsz, total - n)], dim=-1).view(bsz, nb, block_size)
    exists = torch.cat([valid.new_ones(bsz, n), valid.new_zeros(bsz, total - n)], dim=-1).view(bsz, nb, block_size)
    return torch.where(vb.any(dim=-1, keepdim=True), vb, exists).reshape(bsz, total)


def _query_block_means(q: Tensor, valid: Tensor, block_size: int) -> Tensor:
    """fp32 ``[B, H, nB, D]``: block means of q ``[B, H, N, D]`` (see :func:`_query_validity`)."""
    bsz, h, n, d = q.shape
    nb = _num_blocks(n, block_size)
    total = nb * block_size
    use = _query_validity(valid, block_size).view(bsz, 1, nb, block_size, 1)
    qf = torch.nn.functional.pad(q.float(), (0, 0, 0, total - n)).view(bsz, h, nb, block_size, d)
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
    chunk_blocks: int = 16,
) -> Tensor:
    """fp32 ``[B, Hq, nB, nB]``: each query block's distribution over its candidate key blocks
    (zeros elsewhere; all zeros for a query block without candidates). See the module docstring
    for the exact definition of both scorings."""
    bsz, hq, n, d = q.shape
    hp = permutation.shape[1]
    sc = _scale(scale, d)
    nb = _num_blocks(n, block_size)
    valid = _valid_positions(key_padding_mask, bsz, n, q.device)
    qvalid_eff = _query_validity(valid, block_size)  # [B, total]
    perm_p = _padded_permutation(permutation, nb, block_size)  # [B, Hp, total]
    # validity of every permuted slot, per (b, hp)
    kvalid_slot = torch.gather(
        torch.cat([valid, valid.new_zeros(bsz, 1)], dim=-1)[:, None, :].expand(bsz, hp, n + 1),
        2,
        torch.where(perm_p < 0, torch.full_like(perm_p, n), perm_p),
    )  # [B, Hp, total]
    out = torch.zeros(bsz, hq, nb, nb, dtype=torch.float32, device=q.device)
    if scoring == "mean":
        return _mean_block_probabilities(q, k, perm_p, kvalid_slot, valid, candidates, out, sc, block_size)
    if scoring == "sampled_rows":
        return _sampled_row_probabilities(
            q, k, perm_p, kvalid_slot, qvalid_eff, candidates, out, sc, block_size, antidiagonal_stride, chunk_blocks
        )
    if scoring != "antidiagonal":
        raise ValueError(f"scoring must be 'mean', 'antidiagonal' or 'sampled_rows', got {scoring!r}")
    if block_size % antidiagonal_stride:
        raise ValueError(f"antidiagonal_stride must divide block_size={block_size}, got {antidiagonal_stride}")
    return _antidiagonal_probabilities(
        q, k, perm_p, kvalid_slot, qvalid_eff, candidates, out, sc, block_size, antidiagonal_stride, chunk_blocks
    )


def _mean_block_probabilities(q, k, perm_p, kvalid_slot, valid, candidates, out, sc, block_size):
    """``scoring="mean"``: softmax over the candidates of the block-mean logits ``q̄_I · k̄_J · scale``."""
    bsz, hq, n, d = q.shape
    hkv, hp = k.shape[1], perm_p.shape[1]
    nb = out.shape[-1]
    total = nb * block_size
    hq_per_hp, g = hq // hp, hq // hkv
    qbar = _query_block_means(q, valid, block_size)  # [B, Hq, nB, D]
    for b in range(bsz):
        for p in range(hp):
            kv_head = (p * hq_per_hp) // g
            kp = _permuted_keys(k[b, kv_head], perm_p[b, p].clamp_min(0), total)
            use = kvalid_slot[b, p].view(nb, block_size, 1)
            kbar = torch.where(use, kp.view(nb, block_size, d), 0.0).sum(1) / use.sum(1).clamp_min(1)  # [nB, D]
            heads = slice(p * hq_per_hp, (p + 1) * hq_per_hp)
            logits = torch.matmul(qbar[b, heads], kbar.t()) * sc  # [hpp, nB, nB]
            logits = logits.masked_fill(~candidates[b, heads], _NEG_INF)
            out[b, heads] = _safe_softmax(logits)
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
                    prob = _safe_softmax(logit.masked_fill(~col_ok, _NEG_INF))
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
                    prob = _safe_softmax(logit.masked_fill(~col_ok, _NEG_INF))
                    mass = prob.view(i1 - i0, r, nb, block_size).sum(-1)  # [c, r, nB]
                    ok = row_ok[i0:i1] & col_ok.view(i1 - i0, r, total).any(-1)  # [c, r]
                    mass = torch.where(ok[..., None], mass, 0.0)  # (a padded NaN row's mass is NaN)
                    out[b, h, i0:i1] = mass.sum(1) / ok.sum(1).clamp_min(1)[:, None].float()
    return out


@torch.no_grad()
def select_blocks(
    q: Tensor,
    k: Tensor,
    permutation: Tensor,
    *,
    key_padding_mask: Optional[Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    block_size: int = PBSConfig.block_size,
    segment_size: int = PBSConfig.segment_size,
    threshold: float = PBSConfig.threshold,
    force_sink: bool = PBSConfig.force_sink,
    scoring: str = PBSConfig.scoring,
    antidiagonal_stride: int = PBSConfig.antidiagonal_stride,
    sliding_window: int = PBSConfig.sliding_window,
    chunk_size: int = PBSConfig.chunk_size,
) -> Tensor:
    """``[B, Hq, nB, nB]`` bool over permuted key blocks: threshold selection among the
    candidates, plus the forced blocks (own region, sink); with a local window (causal only)
    both among the blocks inside the window (:func:`window_blocks`)."""
    return _threshold_selections(
        q,
        k,
        permutation,
        [threshold],
        key_padding_mask=key_padding_mask,
        is_causal=is_causal,
        scale=scale,
        block_size=block_size,
        segment_size=segment_size,
        force_sink=force_sink,
        scoring=scoring,
        antidiagonal_stride=antidiagonal_stride,
        sliding_window=sliding_window,
        chunk_size=chunk_size,
    )[0]


def _threshold_selections(
    q,
    k,
    permutation,
    thresholds,
    *,
    key_padding_mask,
    is_causal,
    scale,
    block_size,
    segment_size,
    force_sink,
    scoring,
    antidiagonal_stride,
    sliding_window=PBSConfig.sliding_window,
    chunk_size=PBSConfig.chunk_size,
) -> List[Tensor]:
    """:func:`select_blocks` at each of ``thresholds``; the block probabilities (which do not
    depend on the threshold) are computed once."""
    check_window(sliding_window, chunk_size, is_causal)
    hq = q.shape[1]
    geo = dict(key_padding_mask=key_padding_mask, block_size=block_size, segment_size=segment_size)
    cand = candidate_blocks(permutation, hq, is_causal=is_causal, **geo)
    forced = forced_blocks(permutation, hq, force_sink=force_sink, **geo)
    inside = window_blocks(
        permutation,
        hq,
        key_padding_mask=key_padding_mask,
        block_size=block_size,
        sliding_window=sliding_window,
        chunk_size=chunk_size,
    )
    if inside is not None:  # the selection is made inside the window: the probabilities too
        cand, forced = cand & inside, forced & inside
    probs = None
    out = []
    for threshold in thresholds:
        if float(threshold) >= 1.0:
            out.append(cand | forced)
            continue
        if probs is None:
            probs = block_probabilities(
                q,
                k,
                permutation,
                cand,
                key_padding_mask=key_padding_mask,
                scale=scale,
                block_size=block_size,
                scoring=scoring,
                antidiagonal_stride=antidiagonal_stride,
            )
        out.append(threshold_blocks(probs, cand, threshold) | forced)
    return out


# --------------------------------------------------------------------------- 4. attention


def _slot_validity(permutation: Tensor, key_padding_mask: Optional[Tensor], n_blocks: int, block_size: int) -> Tensor:
    """``[B, Hp, nB*bs]`` bool: the permuted slot holds a real (in range, not padded) key."""
    bsz, hp, n = permutation.shape
    perm_p = _padded_permutation(permutation, n_blocks, block_size)
    ok = perm_p >= 0
    if key_padding_mask is not None:
        kpm_ext = torch.cat([key_padding_mask.bool(), key_padding_mask.new_zeros(bsz, 1).bool()], dim=-1)
        idx = torch.where(ok, perm_p, torch.full_like(perm_p, n))
        ok = ok & torch.gather(kpm_ext[:, None, :].expand(bsz, hp, n + 1), 2, idx)
    return ok


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
    sc = _scale(scale, d)
    nb = _num_blocks(n, block_size)
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
        perm_p = _padded_permutation(permutation, nb, block_size)  # [B, Hp, total], -1 past N
        slot_ok = _slot_validity(permutation, key_padding_mask, nb, block_size)  # [B, Hp, total]
        kmax = perm_p.view(bsz, hp, nb, block_size).amax(dim=-1)  # latest original key per block
    rows: List[Tensor] = []
    for b in range(bsz):
        groups = [_group_attention(q, k, v, block_mask, perm_p, slot_ok, kmax, b, kvh, geo) for kvh in range(hkv)]
        rows.append(torch.cat(groups, dim=0))
    return torch.stack(rows, dim=0).to(q.dtype)


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


# --------------------------------------------------------------------------- 5. density


@torch.no_grad()
def selection_density(
    block_mask: Tensor,
    permutation: Tensor,
    *,
    key_padding_mask: Optional[Tensor] = None,
    is_causal: bool = True,
    block_size: int = PBSConfig.block_size,
    sliding_window: int = PBSConfig.sliding_window,
    chunk_size: int = PBSConfig.chunk_size,
) -> Tensor:
    """``[B, Hq]`` float32: selected block pairs with a visible element / block pairs with one;
    under a local window the pairs whose key block is inside the query block's window
    (:func:`window_blocks`)."""
    bsz, hq, nb, _ = block_mask.shape
    hp, n = permutation.shape[1], permutation.shape[2]
    dev = block_mask.device
    perm_p = _padded_permutation(permutation, nb, block_size)  # [B, Hp, total]
    big = n + 1
    slot_ok = perm_p >= 0
    if key_padding_mask is not None:
        kpm_ext = torch.cat([key_padding_mask.bool(), key_padding_mask.new_zeros(bsz, 1).bool()], dim=-1)
        slot_ok &= torch.gather(
            kpm_ext[:, None, :].expand(bsz, hp, n + 1), 2, torch.where(perm_p < 0, torch.full_like(perm_p, n), perm_p)
        )
    kmin = torch.where(slot_ok, perm_p, torch.full_like(perm_p, big)).view(bsz, hp, nb, block_size).amin(-1)
    kmin = kmin[:, _hp_of(hq, hp).to(dev)]  # [B, Hq, nB]
    qmax = (torch.arange(nb, device=dev) * block_size + block_size - 1).clamp_max(n - 1)  # [nB]
    if is_causal:
        vis = kmin[:, :, None, :] <= qmax[None, None, :, None]
    else:
        vis = (kmin < big)[:, :, None, :].expand(bsz, hq, nb, nb)
    inside = window_blocks(
        permutation,
        hq,
        key_padding_mask=key_padding_mask,
        block_size=block_size,
        sliding_window=sliding_window,
        chunk_size=chunk_size,
    )
    if inside is not None:
        vis = vis & inside
    num = (block_mask & vis).sum(dim=(-1, -2)).float()
    den = vis.sum(dim=(-1, -2)).float()
    return torch.where(den > 0, num / den.clamp_min(1.0), torch.ones_like(num))


# --------------------------------------------------------------------------- the op


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
    """PBS-Attn prefill, plain PyTorch. ``q: [B, Hq, N, D]``, ``k, v: [B, Hkv, N, D]``; output
    ``[B, Hq, N, Dv]`` in ``q.dtype``. With ``return_selection`` also returns the
    :class:`Selection` (block mask over permuted key blocks, permutation, density)."""
    cfg = backend_config(PBSConfig, config, fields)
    check_selection_memory(q, cfg.block_size)
    check_window(cfg.sliding_window, cfg.chunk_size, is_causal)
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.to(torch.bool)
    perm, block_mask = pbs_selection(q, k, cfg, key_padding_mask=key_padding_mask, is_causal=is_causal, scale=scale)
    out = permuted_block_attention(
        q,
        k,
        v,
        perm,
        block_mask,
        key_padding_mask=key_padding_mask,
        is_causal=is_causal,
        scale=scale,
        block_size=cfg.block_size,
        sliding_window=cfg.sliding_window,
        chunk_size=cfg.chunk_size,
    )
    out, block_mask = apply_tail(
        out, block_mask, q, k, v, cfg, key_padding_mask=key_padding_mask, is_causal=is_causal, scale=scale, fp32=True
    )
    if not return_selection:
        return out
    return out, pbs_report(block_mask, perm, cfg, key_padding_mask=key_padding_mask, is_causal=is_causal)


def pbs_report(
    block_mask: Tensor, permutation: Tensor, cfg: PBSConfig, *, key_padding_mask: Optional[Tensor], is_causal: bool
) -> Selection:
    """The :class:`Selection` a PBS call reports (every backend's): its block mask over permuted
    key blocks, the permutation, the density and the call's local window."""
    window = dict(sliding_window=cfg.sliding_window, chunk_size=cfg.chunk_size)
    density = selection_density(
        block_mask,
        permutation,
        key_padding_mask=key_padding_mask,
        is_causal=is_causal,
        block_size=cfg.block_size,
        **window,
    )
    return Selection(
        method="pbs",
        density=density,
        block_size=cfg.block_size,
        is_causal=is_causal,
        num_keys=permutation.shape[2],
        block_mask=block_mask,
        permutation=permutation,
        key_padding_mask=key_padding_mask,
        **window,
    )


@torch.no_grad()
def pbs_selection(
    q: Tensor,
    k: Tensor,
    cfg: PBSConfig,
    *,
    key_padding_mask: Optional[Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
) -> Tuple[Tensor, Tensor]:
    """``(permutation [B, Hp, N], block_mask [B, Hq, nB, nB])`` of :func:`pbs_attention`: what it
    selects (inside ``cfg``'s local window when it has one), without the attention (its density
    is :func:`selection_density` of the two)."""
    perm, masks = pbs_selections(
        q, k, cfg, [cfg.threshold], key_padding_mask=key_padding_mask, is_causal=is_causal, scale=scale
    )
    return perm, masks[0]


@torch.no_grad()
def pbs_selections(
    q: Tensor,
    k: Tensor,
    cfg: PBSConfig,
    thresholds: Sequence[float],
    *,
    key_padding_mask: Optional[Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
) -> Tuple[Tensor, List[Tensor]]:
    """:func:`pbs_selection` of ``cfg`` at each of ``thresholds`` (``cfg.threshold`` unused): one
    permutation and one set of block probabilities for all of them."""
    if cfg.gqa_permutation not in ("query_head", "kv_head"):
        raise ValueError(f"gqa_permutation must be 'query_head' or 'kv_head', got {cfg.gqa_permutation!r}")
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.to(torch.bool)
    qd, kd = q.detach(), k.detach()
    perm = _pbs_permutation(qd, kd, cfg, key_padding_mask, scale)
    masks = _threshold_selections(
        qd,
        kd,
        perm,
        thresholds,
        key_padding_mask=key_padding_mask,
        is_causal=is_causal,
        scale=scale,
        block_size=cfg.block_size,
        segment_size=cfg.segment_size,
        force_sink=cfg.force_sink,
        scoring=cfg.scoring,
        antidiagonal_stride=cfg.antidiagonal_stride,
        sliding_window=cfg.sliding_window,
        chunk_size=cfg.chunk_size,
    )
    return perm, masks


def _pbs_permutation(
    q: Tensor, k: Tensor, cfg: PBSConfig, key_padding_mask: Optional[Tensor], scale: Optional[float]
) -> Tensor:
    """The key permutation of ``cfg``: sorted by proxy score per segment, or the identity."""
    bsz, hq, n, _ = q.shape
    if not cfg.permute:
        hp = hq if cfg.gqa_permutation == "query_head" else k.shape[1]
        return torch.arange(n, device=q.device).expand(bsz, hp, n).clone()
    scores = key_scores(
        q,
        k,
        key_padding_mask=key_padding_mask,
        scale=scale,
        block_size=cfg.block_size,
        segment_size=cfg.segment_size,
        causal_proxy=cfg.causal_proxy,
        gqa_permutation=cfg.gqa_permutation,
        proxy_blocks=cfg.proxy_blocks,
    )
    return segment_permutation(scores, segment_size=cfg.segment_size, key_padding_mask=key_padding_mask)
