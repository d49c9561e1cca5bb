"""PBS reference, stages 1-2: the key permutation.

:func:`key_scores` gives the proxy importance of every key, fp32 ``[B, Hp, N]``;
:func:`segment_permutation` sorts the keys of every complete segment by descending score
(stable), keeping segment order and the tail in place: ``permutation[b, hp, j]`` is the
original position of the key at permuted slot ``j``. :func:`config_permutation` runs both for a
config. Conventions shared by every stage are in :mod:`.reference`'s docstring.

* **Proxy**: the last ``block_size`` valid positions of the row (fewer if fewer exist); their
  softmax runs over the valid keys of the complete segments, no causal mask inside the proxy.
  ``causal_proxy=True`` normalises per segment. A row with no proxy row or no complete segment
  scores 0 everywhere (identity permutation). Tail keys score 0.
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
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .config import PBSConfig
from .reference_common import effective_lengths, num_blocks, safe_softmax, softmax_scale

__all__ = [
    "proxy_queries",
    "key_scores",
    "segment_permutation",
    "config_permutation",
]

_NEG_INF = float("-inf")


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
    n_blocks = num_blocks(n, block_size)
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
    sc = softmax_scale(scale, d)
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
        probs = safe_softmax(logits.view(p, n_seg, segment_size)).view(p, lc)
    else:
        probs = safe_softmax(logits)
    return probs.mean(dim=0)


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


def config_permutation(
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
