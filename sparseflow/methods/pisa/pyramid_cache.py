"""PISA decoding with a KV cache: an incrementally maintained pyramid.

Imported lazily; this module imports Triton.

``PyramidCache`` holds every level of the pyramid for a fixed capacity (its levels are those of
the capacity, so the table never moves as tokens arrive; nodes past the current length hold no
key and are dropped by the walk, which therefore selects exactly what a pyramid built for the
current length selects). ``append`` adds one key per (batch, KV head): one kernel launch updates
the leaf and its ``O(log N)`` ancestors (sum, count, mean, first valid position).
``select`` runs the per-token walk (``triton_select_per_token``) for the new query token(s)
against it: ``O(g * beam * K * log(N / C))`` per token (``beam``: the walk keeps ``beam * top_k``
nodes above the leaves, as ``PISAConfig.beam``). ``decode_step`` = append + select + attention
over the selected blocks (``token_sparse_triton``), on the growing k/v of the caller.

``decode_step_static`` is the same step on preallocated KV buffers of the capacity, its length in
an int32 device tensor that the kernels read: no host sync and the same launches at every length
(append + K/V write in one, the walk, the split-K attention and its merge), so a CUDA graph
captured once replays every step.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ...tuning import DEFAULT_TUNING, Tuning
from ...kernels.token_blocks import selection_width
from ...kernels.token_sparse_decode_triton import decode_splits, token_sparse_decode_fwd
from ...kernels.token_sparse_triton import token_sparse_attention
from .reference import check_beam
from .triton_select import auto_on_cuda, build_pyramid, pyramid_tables
from .triton_select_common import SCORE_CODES
from .triton_select_per_token import _pisa_select_fwd
from .config import PISAConfig

__all__ = ["PyramidCache"]


@triton.jit
def _add_key(
    kn,
    sums_ptr,
    cnt_ptr,
    summ_ptr,
    nfv_ptr,
    lvl_off_ptr,
    lvl_span_ptr,
    lv,
    b,
    h,
    offs_d,
    d_ok,
    stride_sb,
    stride_sh,
    stride_st,
    pos,
    T,
    C: tl.constexpr,
):
    """Adds the fp32 key ``kn`` of position ``pos`` to its node of level ``lv`` (sum, count, mean,
    first valid position)."""
    span = tl.load(lvl_span_ptr + lv)
    u = (pos // C) // span
    node = tl.load(lvl_off_ptr + lv) + u
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


@triton.jit
def _append_kernel(
    knew_ptr,
    sums_ptr,
    cnt_ptr,
    summ_ptr,
    nfv_ptr,
    lvl_off_ptr,
    lvl_span_ptr,
    stride_nb,
    stride_nh,
    stride_sb,
    stride_sh,
    stride_st,
    pos,
    T,
    HKV,
    C: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
):
    lv = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    offs_d = tl.arange(0, DP)
    d_ok = offs_d < D
    kn = tl.load(knew_ptr + b * stride_nb + h * stride_nh + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    _add_key(
        kn,
        sums_ptr,
        cnt_ptr,
        summ_ptr,
        nfv_ptr,
        lvl_off_ptr,
        lvl_span_ptr,
        lv,
        b,
        h,
        offs_d,
        d_ok,
        stride_sb,
        stride_sh,
        stride_st,
        pos,
        T,
        C,
    )


@triton.jit
def _append_static_kernel(
    knew_ptr,
    vnew_ptr,
    kbuf_ptr,
    vbuf_ptr,
    held_ptr,
    len_ptr,
    bad_ptr,
    sums_ptr,
    cnt_ptr,
    summ_ptr,
    nfv_ptr,
    lvl_off_ptr,
    lvl_span_ptr,
    stride_nb,
    stride_nh,
    stride_wb,
    stride_wh,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_sb,
    stride_sh,
    stride_st,
    T,
    HKV,
    CAP,
    C: tl.constexpr,
    D: tl.constexpr,
    DP: tl.constexpr,
):
    """``_append_kernel`` with the position read on the device (``len_ptr[0] - 1``) that also
    writes the new key / value into slot ``pos`` of the KV buffers and marks it held (the level-0
    programs). A position outside the buffer writes nothing and raises the ``bad_ptr`` flag instead."""
    lv = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # 64-bit offsets: batch x head strides of the buffers pass 2**31 elements
    b = bh // HKV
    h = bh % HKV
    pos = tl.load(len_ptr) - 1
    in_range = (pos >= 0) & (pos < CAP)
    if (lv == 0) & (bh == 0):
        tl.store(bad_ptr, tl.where(in_range, 0, 1).to(tl.uint8))
    if in_range:
        offs_d = tl.arange(0, DP)
        d_ok = offs_d < D
        k_raw = tl.load(knew_ptr + b * stride_nb + h * stride_nh + offs_d, mask=d_ok, other=0.0)
        if lv == 0:
            tl.store(kbuf_ptr + b * stride_kb + h * stride_kh + pos * stride_kn + offs_d, k_raw, mask=d_ok)
            v_raw = tl.load(vnew_ptr + b * stride_wb + h * stride_wh + offs_d, mask=d_ok, other=0.0)
            tl.store(vbuf_ptr + b * stride_vb + h * stride_vh + pos * stride_vn + offs_d, v_raw, mask=d_ok)
            if h == 0:
                tl.store(held_ptr + b * CAP + pos, 1)
        _add_key(
            k_raw.to(tl.float32),
            sums_ptr,
            cnt_ptr,
            summ_ptr,
            nfv_ptr,
            lvl_off_ptr,
            lvl_span_ptr,
            lv,
            b,
            h,
            offs_d,
            d_ok,
            stride_sb,
            stride_sh,
            stride_st,
            pos,
            T,
            C,
        )


class PyramidCache:
    """Pyramid of one layer's keys for decoding (no padding; batch rows share a length).

    ``PyramidCache(k_prompt, capacity=..., block_size=64, branching=2)`` builds it from the
    prompt's keys ``[B, Hkv, N0, D]``; ``append(k_new [B, Hkv, 1, D])`` adds one token."""

    def __init__(
        self,
        k: torch.Tensor,
        *,
        capacity: int,
        block_size: int = PISAConfig.block_size,
        branching: int = PISAConfig.branching,
    ):
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
        # decode_step_static: the buffer slots that hold a key (its attention's key mask, set by its
        # append, so a slot never written is never read) and its out-of-range flag
        self._held = self._held_mask(n0).unsqueeze(0).repeat(b, 1)
        self._bad = torch.zeros(1, dtype=torch.uint8, device=dev)
        self._static = False
        if n0:
            # the prompt's pyramid (its own levels), copied into the capacity's levels
            summ, nfv, sizes, lvl_off, _ = build_pyramid(k, block_size=block_size, branching=branching)
            n_leaves0 = sizes[0]
            for lv in range(len(self.sizes)):
                dst = offs[lv]
                span = branching**lv
                n_here = -(-n_leaves0 // span)
                if lv < len(sizes):
                    src = int(lvl_off[lv])
                    m = summ[:, :, src : src + n_here]
                    f = nfv[:, src : src + n_here]
                else:  # levels above the prompt's root: node 0 holds everything
                    top = int(lvl_off[len(sizes) - 1])
                    m, f = summ[:, :, top : top + 1], nfv[:, top : top + 1]
                cnt = self._counts(n0, lv, n_here, b, dev)
                self.summ[:, :, dst : dst + n_here] = m
                self.sums[:, :, dst : dst + n_here] = m * cnt[:, None, :, None].to(m.dtype)
                self.count[:, dst : dst + n_here] = cnt
                self.first_valid[:, dst : dst + n_here] = torch.where(cnt > 0, f, torch.full_like(f, 2**31 - 1))

    def _held_mask(self, n: int) -> torch.Tensor:
        """int8 ``[capacity]``: 1 on the first ``n`` slots."""
        return (torch.arange(self.capacity, device=self.sums.device) < n).to(torch.int8)

    def _counts(self, n, lv, n_nodes, b, dev):
        span_keys = self.block_size * self.branching**lv
        starts = torch.arange(n_nodes, device=dev, dtype=torch.int64) * span_keys
        return (n - starts).clamp(0, span_keys).to(torch.int32).unsqueeze(0).expand(b, n_nodes).contiguous()

    def append(self, k_new: torch.Tensor) -> None:
        """Add the key of position ``length`` (``k_new [B, Hkv, 1, D]``): one launch, O(log N)."""
        self._check_eager()
        if self.length >= self.capacity:
            raise ValueError(f"the cache is full (capacity {self.capacity}); build a larger one")
        b, hkv, _, d = k_new.shape
        _append_kernel[(len(self.sizes), b * hkv)](
            k_new,
            self.sums,
            self.count,
            self.summ,
            self.first_valid,
            self.lvl_off,
            self.lvl_span,
            k_new.stride(0),
            k_new.stride(1),
            self.sums.stride(0),
            self.sums.stride(1),
            self.sums.stride(2),
            self.length,
            self.sums.shape[2],
            hkv,
            C=self.block_size,
            D=d,
            DP=max(16, triton.next_power_of_2(d)),
        )
        self.length += 1

    def select(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        *,
        top_k: int = PISAConfig.top_k,
        score: str = PISAConfig.score,
        scale: Optional[float] = None,
        force_sink: bool = PISAConfig.force_sink,
        force_previous: bool = PISAConfig.force_previous,
        beam: int = PISAConfig.beam,
        tuning: Tuning = DEFAULT_TUNING,
    ) -> torch.Tensor:
        """Selection ``[B, Hkv, Nq, min(top_k, #blocks)]`` for the last ``Nq`` positions (``k`` = all cached
        keys); ``tuning``: the walk's launch settings."""
        self._check_eager()
        if k.shape[2] != self.length:
            raise ValueError(f"k holds {k.shape[2]} keys but the pyramid {self.length}")
        width = selection_width(top_k, self.length, self.block_size)  # at most the blocks that hold a key
        return self._walk(q, k, None, width, score, scale, force_sink, force_previous, beam, tuning)

    @staticmethod
    def _split_leaves(tuning: Tuning, q: torch.Tensor, length: Optional[torch.Tensor]) -> bool:
        """Whether the walk splits its leaf level off: ``pisa_walk="leaf_pairs"``, or ``"auto"`` in
        the graph-capturable step on CUDA (three launches a step instead of one: at 128K tokens,
        K=32, an H100 replayed the step in 93 us against the per-token walk's 194, while an eager
        step, bound by the host, took longer)."""
        if tuning.pisa_walk == "leaf_pairs":
            return True
        return length is not None and auto_on_cuda(tuning, q)

    def _walk(self, q, k, length, width, score, scale, force_sink, force_previous, beam, tuning):
        """The fused walk over this pyramid (``length``: None, or the device length of a KV buffer ``k``);
        :meth:`_split_leaves` splits its leaf level off (``triton_select_leaf_split``) where there
        are leaves to score (LSE or mean + var/2, more leaf blocks than ``width``)."""
        check_beam(beam)
        if score not in SCORE_CODES:
            raise ValueError(f"score must be one of {list(SCORE_CODES)}, got {score!r}")
        sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        # the pyramid and the walk's rules, the same in both walks' ops
        pyramid = (self.summ, self.first_valid, self.lvl_off, self.lvl_span, sc, True, SCORE_CODES[score])
        rules = (self.block_size, self.branching, width, bool(force_sink), bool(force_previous), int(beam))
        if self._split_leaves(tuning, q, length) and score != "mean" and self.sizes[0] > width:
            from .triton_select_leaf_split import pisa_select_leaf_split_fwd

            return pisa_select_leaf_split_fwd(q, k, *pyramid, *rules, tuning.pisa_warps, length, tuning.pisa_scores)
        return _pisa_select_fwd(
            q,
            k,
            None,
            *pyramid,
            *rules,
            tuning.pisa_warps,
            tuning.pisa_leaf_bytes,
            length,
            PISAConfig.sliding_window,  # decoding walks without a window
            PISAConfig.chunk_size,
            tuning.pisa_scores,
        )

    def decode_step(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        top_k: int = PISAConfig.top_k,
        score: str = PISAConfig.score,
        scale: Optional[float] = None,
        force_sink: bool = PISAConfig.force_sink,
        force_previous: bool = PISAConfig.force_previous,
        append: bool = True,
        beam: int = PISAConfig.beam,
        tuning: Tuning = DEFAULT_TUNING,
    ):
        """One decoding step: ``k``/``v`` hold every key including the new one (``[B, Hkv, N, D]``);
        appends the new key (unless ``append=False``: already in), selects for ``q [B, Hq, 1, D]``
        and attends. Returns ``(out [B, Hq, 1, D], block indices [B, Hkv, 1, top_k])``."""
        if append:
            self.append(k[:, :, -1:])
        idx = self.select(
            q,
            k,
            top_k=top_k,
            score=score,
            scale=scale,
            force_sink=force_sink,
            force_previous=force_previous,
            beam=beam,
            tuning=tuning,
        )
        # the tiled kernel (checked on the H200, with a backward); decode_step_static's split-K
        # kernel replaces it here once that has run on a GPU too
        out = token_sparse_attention(q, k, v, idx, is_causal=True, scale=scale, block_size=self.block_size)
        return out, idx

    # ----------------------------------------------------------------- graph-capturable decoding

    def static_buffers(self, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(k_buf, v_buf, length)`` for :meth:`decode_step_static`: the cache's keys / values
        ``k``, ``v [B, Hkv, length, D]`` copied into zeroed buffers of the capacity, and ``length``
        (int32 ``[1]`` on their device) = the keys they hold."""
        self._check_eager()  # after static steps the host length no longer counts the pyramid's keys
        if k.shape[2] != self.length or v.shape[2] != self.length:
            raise ValueError(f"k and v must hold the cache's {self.length} keys, got {k.shape[2]} and {v.shape[2]}")
        k_buf = k.new_zeros(*k.shape[:2], self.capacity, k.shape[3])
        v_buf = v.new_zeros(*v.shape[:2], self.capacity, v.shape[3])
        k_buf[:, :, : self.length] = k
        v_buf[:, :, : self.length] = v
        # eager appends since the prompt grew the cache: the attention's key mask must follow
        self._held.copy_(self._held_mask(self.length))
        return k_buf, v_buf, torch.full((1,), self.length, dtype=torch.int32, device=k.device)

    def decode_step_static(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        length: torch.Tensor,
        *,
        top_k: int = PISAConfig.top_k,
        score: str = PISAConfig.score,
        scale: Optional[float] = None,
        force_sink: bool = PISAConfig.force_sink,
        force_previous: bool = PISAConfig.force_previous,
        beam: int = PISAConfig.beam,
        tuning: Tuning = DEFAULT_TUNING,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """:meth:`decode_step` on preallocated buffers, with every per-step value on the device: no
        host sync and the same launches at every length, so one CUDA graph replays every step.

        ``length`` (int32 ``[1]``, see :meth:`static_buffers`) counts the keys *with* the new one:
        the caller advances it in place (``length += 1``, inside the graph too) before each step.
        The step writes ``k_new`` / ``v_new [B, Hkv, 1, D]`` into slot ``length - 1`` of ``k_buf`` /
        ``v_buf [B, Hkv, capacity, D]`` and into the pyramid, selects for ``q [B, Hq, 1, D]`` and
        attends over the first ``length`` keys (a slot no step or prompt wrote is never read). Returns
        ``(out, idx [B, Hkv, 1, selection_width(top_k, capacity)])``: the selection of
        :meth:`decode_step`, padded with ``-1``. The length moves forward one key per step (the
        pyramid adds each key it is given: a rewound length would count keys twice). A length
        outside ``[1, capacity]`` cannot raise without a host sync: it leaves the cache unchanged and
        the output NaN. The cache's host ``length`` stops following: once driven this way, its eager
        methods refuse it."""
        self._check_static(q, k_new, v_new, k_buf, v_buf, length)
        self._static = True
        self._append_static(k_new, v_new, k_buf, v_buf, length)
        width = selection_width(top_k, self.capacity, self.block_size)  # blocks not yet filled are never selected
        idx = self._walk(q, k_buf, length, width, score, scale, force_sink, force_previous, beam, tuning)
        return self._attend_static(q, k_buf, v_buf, idx, scale), idx

    def _append_static(self, k_new, v_new, k_buf, v_buf, length) -> None:
        """One launch: the new key into the pyramid, the new key / value into slot ``length - 1``."""
        b, hkv, _, d = k_buf.shape
        _append_static_kernel[(len(self.sizes), b * hkv)](
            k_new,
            v_new,
            k_buf,
            v_buf,
            self._held,
            length,
            self._bad,
            self.sums,
            self.count,
            self.summ,
            self.first_valid,
            self.lvl_off,
            self.lvl_span,
            k_new.stride(0),
            k_new.stride(1),
            v_new.stride(0),
            v_new.stride(1),
            k_buf.stride(0),
            k_buf.stride(1),
            k_buf.stride(2),
            v_buf.stride(0),
            v_buf.stride(1),
            v_buf.stride(2),
            self.sums.stride(0),
            self.sums.stride(1),
            self.sums.stride(2),
            self.sums.shape[2],
            hkv,
            self.capacity,
            C=self.block_size,
            D=d,
            DP=max(16, triton.next_power_of_2(d)),
        )

    def _attend_static(self, q, k_buf, v_buf, idx, scale) -> torch.Tensor:
        """Attention of the one query row over its selected blocks' held slots, split over the
        blocks (two launches; the merge writes NaN after an out-of-range length)."""
        sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
        # the splits depend on the shapes only: the same launches at every length
        splits = decode_splits(idx.shape[0] * idx.shape[1], idx.shape[-1], q.device)
        return token_sparse_decode_fwd(
            q.contiguous(), k_buf, v_buf, idx, self._held, self._bad, sc, self.block_size, True, splits
        )

    def _check_eager(self) -> None:
        if self._static:
            raise ValueError(
                "this PyramidCache is driven by decode_step_static (its length lives in the caller's "
                "device tensor): keep calling decode_step_static, or build a new cache for eager steps"
            )

    def _check_static(self, q, k_new, v_new, k_buf, v_buf, length) -> None:
        """The shapes, dtypes and devices :meth:`decode_step_static` needs (host metadata only)."""
        b, hkv, _, d = self.sums.shape
        if not isinstance(length, torch.Tensor) or length.dtype != torch.int32 or length.numel() != 1:
            got = f"{length.dtype} {list(length.shape)}" if isinstance(length, torch.Tensor) else type(length).__name__
            raise TypeError(
                f"length must be an int32 tensor of one element (the keys held, the new one included; "
                f"see static_buffers), got {got}"
            )
        one, buf = (b, hkv, 1, d), (b, hkv, self.capacity, d)
        for name, t, want in (
            ("q", q, (b, "Hq", 1, d)),
            ("k_new", k_new, one),
            ("v_new", v_new, one),
            ("k_buf", k_buf, buf),
            ("v_buf", v_buf, buf),
            ("length", length, None),
        ):
            if want is not None and (t.dim() != 4 or any(w != g for w, g in zip(want, t.shape) if w != "Hq")):
                raise ValueError(
                    f"{name} must be [{', '.join(map(str, want))}] (batch, heads, tokens, head dim), "
                    f"got {list(t.shape)}"
                )
            if t.device != self.sums.device:
                raise ValueError(f"{name} must be on the cache's device {self.sums.device}, got {t.device}")
            if want is not None and (
                t.dtype != k_buf.dtype or t.dtype not in (torch.float16, torch.bfloat16, torch.float32)
            ):
                raise TypeError(
                    f"q, k_new, v_new, k_buf and v_buf must share one dtype of fp16 / bf16 / fp32, "
                    f"got {name} {t.dtype} with k_buf {k_buf.dtype}"
                )
        if q.shape[1] % hkv:
            raise ValueError(f"q's heads must be a multiple of the {hkv} KV heads, got {q.shape[1]}")
        if not (k_buf.is_contiguous() and v_buf.is_contiguous()) or k_new.stride(3) != 1 or v_new.stride(3) != 1:
            raise ValueError(
                "k_buf and v_buf must be contiguous, and k_new / v_new contiguous in their last dim "
                "(a strided buffer would be copied whole at every step)"
            )
