"""PISA decoding with a KV cache: an incrementally maintained pyramid.

Imported lazily; this module imports Triton.

``PyramidCache`` holds every level of the pyramid for a fixed capacity (its levels are those of
the capacity, so the table never moves as tokens arrive; nodes past the current length hold no
key and are dropped by the walk, which therefore selects exactly what a pyramid built for the
current length selects). ``append`` adds one key per (batch, KV head): one kernel launch updates
the leaf and its ``O(log N)`` ancestors (sum, count, mean, first valid position).
``select`` runs the fused walk of ``triton_select`` for the new query token(s) against it:
``O(g * beam * K * log(N / C))`` per token (``beam``: the walk keeps ``beam * top_k`` nodes above
the leaves, as ``PISAConfig.beam``). ``decode_step`` = append + select + attention over the
selected blocks (``token_sparse_triton``).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ...tuning import DEFAULT_TUNING, Tuning
from ...kernels.token_blocks import selection_width
from ...kernels.token_sparse_triton import token_sparse_attention
from .reference import check_beam
from .triton_select import SCORE_CODES, _pisa_select_fwd, build_pyramid, pyramid_tables
from .config import PISAConfig

__all__ = ["PyramidCache"]


@triton.jit
def _append_kernel(
    knew_ptr, sums_ptr, cnt_ptr, summ_ptr, nfv_ptr, lvl_off_ptr, lvl_span_ptr,
    stride_nb, stride_nh,
    stride_sb, stride_sh, stride_st,
    pos, T, HKV,
    C: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
):
    lv = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    offs_d = tl.arange(0, DP)
    d_ok = offs_d < D
    span = tl.load(lvl_span_ptr + lv)
    u = (pos // C) // span
    node = tl.load(lvl_off_ptr + lv) + u
    kn = tl.load(knew_ptr + b * stride_nb + h * stride_nh + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    row = b * stride_sb + h * stride_sh + node * stride_st + offs_d
    s = tl.load(sums_ptr + row, mask=d_ok, other=0.0) + kn
    # no padding: the node holds every position from its start to pos (computed, not read back,
    # so the programs of the other KV heads never race on the shared count)
    c = tl.minimum(pos + 1 - u * span * C, span * C)
    tl.store(sums_ptr + row, s, mask=d_ok)
    tl.store(summ_ptr + row, s / c.to(tl.float32), mask=d_ok)
    if h == 0:
        tl.store(cnt_ptr + b * T + node, c)
        tl.store(nfv_ptr + b * T + node, tl.minimum(tl.load(nfv_ptr + b * T + node), pos))


class PyramidCache:
    """Pyramid of one layer's keys for decoding (no padding; batch rows share a length).

    ``PyramidCache(k_prompt, capacity=..., block_size=64, branching=2)`` builds it from the
    prompt's keys ``[B, Hkv, N0, D]``; ``append(k_new [B, Hkv, 1, D])`` adds one token."""

    def __init__(self, k: torch.Tensor, *, capacity: int, block_size: int = PISAConfig.block_size,
                 branching: int = PISAConfig.branching):
        b, hkv, n0, d = k.shape
        if capacity < n0:
            raise ValueError(f"capacity must be >= the prompt length {n0}, got {capacity}")
        self.block_size, self.branching, self.capacity = int(block_size), int(branching), int(capacity)
        self.length = n0
        n_leaves = max(1, -(-capacity // block_size))
        dev = k.device
        self.sizes, offs, self.lvl_off, self.lvl_span = pyramid_tables(n_leaves, branching, dev)
        total = offs[-1]
        self.sums = torch.zeros(b, hkv, total, d, dtype=torch.float32, device=dev)
        self.summ = torch.zeros_like(self.sums)
        self.count = torch.zeros(b, total, dtype=torch.int32, device=dev)
        self.first_valid = torch.full((b, total), 2**31 - 1, dtype=torch.int32, device=dev)
        if n0:
            # the prompt's pyramid (its own levels), copied into the capacity's levels
            summ, nfv, sizes, lvl_off, _ = build_pyramid(k, block_size=block_size, branching=branching)
            n_leaves0 = sizes[0]
            for lv in range(len(self.sizes)):
                dst = offs[lv]
                span = branching ** lv
                n_here = -(-n_leaves0 // span)
                if lv < len(sizes):
                    src = int(lvl_off[lv])
                    m = summ[:, :, src:src + n_here]
                    f = nfv[:, src:src + n_here]
                else:  # levels above the prompt's root: node 0 holds everything
                    top = int(lvl_off[len(sizes) - 1])
                    m, f = summ[:, :, top:top + 1], nfv[:, top:top + 1]
                cnt = self._counts(n0, lv, n_here, b, dev)
                self.summ[:, :, dst:dst + n_here] = m
                self.sums[:, :, dst:dst + n_here] = m * cnt[:, None, :, None].to(m.dtype)
                self.count[:, dst:dst + n_here] = cnt
                self.first_valid[:, dst:dst + n_here] = torch.where(cnt > 0, f, torch.full_like(f, 2**31 - 1))

    def _counts(self, n, lv, n_nodes, b, dev):
        span_keys = self.block_size * self.branching ** lv
        starts = torch.arange(n_nodes, device=dev, dtype=torch.int64) * span_keys
        return (n - starts).clamp(0, span_keys).to(torch.int32).unsqueeze(0).expand(b, n_nodes).contiguous()

    def append(self, k_new: torch.Tensor) -> None:
        """Add the key of position ``length`` (``k_new [B, Hkv, 1, D]``): one launch, O(log N)."""
        if self.length >= self.capacity:
            raise ValueError(f"the cache is full (capacity {self.capacity}); build a larger one")
        b, hkv, _, d = k_new.shape
        _append_kernel[(len(self.sizes), b * hkv)](
            k_new, self.sums, self.count, self.summ, self.first_valid, self.lvl_off, self.lvl_span,
            k_new.stride(0), k_new.stride(1),
            self.sums.stride(0), self.sums.stride(1), self.sums.stride(2),
            self.length, self.sums.shape[2], hkv,
            C=self.block_size, D=d, DP=max(16, triton.next_power_of_2(d)),
        )
        self.length += 1

    def select(self, q: torch.Tensor, k: torch.Tensor, *, top_k: int = PISAConfig.top_k,
               score: str = PISAConfig.score, scale: Optional[float] = None,
               force_sink: bool = PISAConfig.force_sink, force_previous: bool = PISAConfig.force_previous,
               beam: int = PISAConfig.beam, tuning: Tuning = DEFAULT_TUNING) -> torch.Tensor:
        """Selection ``[B, Hkv, Nq, min(top_k, #blocks)]`` for the last ``Nq`` positions (``k`` = all cached
        keys); ``tuning``: the walk's launch settings."""
        check_beam(beam)
        if score not in SCORE_CODES:
            raise ValueError(f"score must be one of {list(SCORE_CODES)}, got {score!r}")
        if k.shape[2] != self.length:
            raise ValueError(f"k holds {k.shape[2]} keys but the pyramid {self.length}")
        sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        top_k = selection_width(top_k, self.length, self.block_size)  # at most the blocks that hold a key
        idx = _pisa_select_fwd(q, k, None, self.summ, self.first_valid, self.lvl_off, self.lvl_span, sc, True,
                               SCORE_CODES[score], self.block_size, self.branching, top_k,
                               bool(force_sink), bool(force_previous), int(beam),
                               tuning.pisa_warps, tuning.pisa_leaf_bytes)
        return idx

    def decode_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, top_k: int = PISAConfig.top_k,
                    score: str = PISAConfig.score, scale: Optional[float] = None,
                    force_sink: bool = PISAConfig.force_sink, force_previous: bool = PISAConfig.force_previous,
                    append: bool = True, beam: int = PISAConfig.beam, tuning: Tuning = DEFAULT_TUNING):
        """One decoding step: ``k``/``v`` hold every key including the new one (``[B, Hkv, N, D]``);
        appends the new key (unless ``append=False``: already in), selects for ``q [B, Hq, 1, D]``
        and attends. Returns ``(out [B, Hq, 1, D], block indices [B, Hkv, 1, top_k])``."""
        if append:
            self.append(k[:, :, -1:])
        idx = self.select(q, k, top_k=top_k, score=score, scale=scale, force_sink=force_sink,
                          force_previous=force_previous, beam=beam, tuning=tuning)
        out = token_sparse_attention(q, k, v, idx, is_causal=True, scale=scale, block_size=self.block_size)
        return out, idx
