"""PBS-Attn, ``backend="triton"``: same signature and result as ``reference.pbs_attention``.

Stages:

1. proxy key scores, 2. segmented permutation, 3. block selection -- on CUDA the Triton kernels
   of ``triton_select`` (identical selections to the reference in the CPU-interpreter tests and
   in ``benchmarks/pbs.py --part check`` on an H200, and about 8.6x faster than the torch stages
   there at 8K); elsewhere (the interpreter) the reference's torch stages.
   ``Tuning(pbs_select="reference"|"triton")`` overrides;
4. attention -- the Triton kernel ``sparseflow::pbs_block_sparse_fwd`` (``triton_attention``).

A config's local window (``sliding_window`` / ``chunk_size``) runs as the reference's: the
selection among the blocks inside each query block's window (the torch stages, or the Triton
selection kernel with the blocks' latest key positions), and the kernel's element mask with the
window's lower bound.

K/V layout for the kernel (``Tuning.pbs_kv_layout`` = ``"permuted"`` | ``"gather"``):

* ``permuted``: one gather pass writes K/V in permuted order, one head per permutation head
  (``[B, Hp, N, D]``); under per-KV-head permutation that is Hkv heads, so K/V are never
  repeated; under per-query-head permutation each query head has its own key order, so the
  permuted copy has Hq heads. The kernel then streams contiguous tiles (TMA on Hopper).
* ``gather``: the kernel reads the original ``[B, Hkv, N, D]`` K/V rows through the
  permutation (no copy, no TMA).

The gather pass is ``triton_gather``'s, shared with the selection and the strided estimates.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from ...config import backend_config
from ...kernels.token_blocks import check_window
from ...selection import Selection
from ...tuning import DEFAULT_TUNING, Tuning
from .block_selection import select_blocks
from .permutation import key_scores, segment_permutation
from .reference import pbs_report
from .triton_attention import block_mask_to_indices, key_positions, pbs_block_sparse_attention
from .triton_gather import permute_kv, permuted_layout
from .config import PBSConfig
from .tail import apply_tail, tail_first_block
from .memory import check_selection_memory

__all__ = ["pbs_attention", "kv_layout", "select_impl"]


def select_impl(device: Optional[torch.device] = None, tuning: Tuning = DEFAULT_TUNING) -> str:
    """``tuning.pbs_select`` resolved for ``device``: ``reference`` (the reference's torch stages
    1-3) or ``triton`` (``triton_select``: Triton proxy scoring, segment sort and the block
    selection that writes the attention's block lists -- for ``scoring="mean"`` one kernel, for
    ``"sampled_rows"`` and ``"antidiagonal"`` after ``triton_estimate``'s one-pass strided
    estimate). ``"auto"``: ``triton`` on CUDA, ``reference`` elsewhere."""
    if tuning.pbs_select != "auto":
        return tuning.pbs_select
    return "triton" if device is not None and device.type == "cuda" else "reference"


def kv_layout(tuning: Tuning = DEFAULT_TUNING) -> str:
    """The attention kernel's K/V layout, ``"permuted"`` or ``"gather"`` (see the module docstring)."""
    return tuning.pbs_kv_layout


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
    tuning: Tuning = DEFAULT_TUNING,
    **fields,
) -> Union[Tensor, Tuple[Tensor, Selection]]:
    """PBS-Attn prefill with the Triton attention kernel. ``q: [B, Hq, N, D]``,
    ``k, v: [B, Hkv, N, D]`` (Nq == Nk); output ``[B, Hq, N, D]`` in ``q.dtype``. ``tuning``:
    the selection implementation, K/V layout and TMA use (:class:`sparseflow.Tuning`)."""
    cfg = backend_config(PBSConfig, config, fields)
    check_selection_memory(q, cfg.block_size)
    _check_inputs(q, k, v, cfg)
    check_window(cfg.sliding_window, cfg.chunk_size, is_causal)
    window = dict(sliding_window=cfg.sliding_window, chunk_size=cfg.chunk_size)
    if key_padding_mask is not None:
        key_padding_mask = key_padding_mask.to(torch.bool)
    kernels = select_impl(q.device, tuning) == "triton"
    bs, n = cfg.block_size, q.shape[2]
    mask_segment = cfg.segment_size if cfg.permute else bs
    with torch.no_grad():
        perm = _permutation(q.detach(), k.detach(), cfg, key_padding_mask, scale, kernels)
        if kernels:
            out, block_mask = select_and_attend(
                q,
                k,
                v,
                perm,
                key_padding_mask=key_padding_mask,
                is_causal=is_causal,
                scale=scale,
                block_size=bs,
                segment_size=cfg.segment_size,
                threshold=cfg.threshold,
                force_sink=cfg.force_sink,
                mask_segment=mask_segment,
                want_mask=return_selection,
                scoring=cfg.scoring,
                antidiagonal_stride=cfg.antidiagonal_stride,
                moments_sd=cfg.moments_sd,
                tuning=tuning,
                dense_from=tail_first_block(n, bs, cfg.dense_tail_blocks),
                **window,
            )
            return _finish(out, block_mask, perm, cfg, key_padding_mask, is_causal, return_selection)
        block_mask = select_blocks(
            q.detach(),
            k.detach(),
            perm,
            key_padding_mask=key_padding_mask,
            is_causal=is_causal,
            scale=scale,
            block_size=bs,
            segment_size=cfg.segment_size,
            threshold=cfg.threshold,
            force_sink=cfg.force_sink,
            scoring=cfg.scoring,
            antidiagonal_stride=cfg.antidiagonal_stride,
            moments_sd=cfg.moments_sd,
            **window,
        )
        out = attention_from_selection(
            q,
            k,
            v,
            perm,
            block_mask,
            key_padding_mask=key_padding_mask,
            is_causal=is_causal,
            scale=scale,
            block_size=bs,
            segment_size=mask_segment,
            layout=tuning.pbs_kv_layout,
            tma=tuning.pbs_tma,
            **window,
        )
        out, block_mask = apply_tail(  # under no_grad like the sparse rows: this backend is forward-only
            out, block_mask, q, k, v, cfg, key_padding_mask=key_padding_mask, is_causal=is_causal, scale=scale
        )
    return _finish(out, block_mask, perm, cfg, key_padding_mask, is_causal, return_selection)


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, cfg: PBSConfig) -> None:
    _, _, n, d = q.shape
    if cfg.gqa_permutation not in ("query_head", "kv_head"):
        raise ValueError(f"gqa_permutation must be 'query_head' or 'kv_head', got {cfg.gqa_permutation!r}")
    if k.shape[2] != n:
        raise ValueError(f"PBS needs Nq == Nk, got Nq={n}, Nk={k.shape[2]}")
    if v.shape[-1] != d:
        raise ValueError(f"the Triton PBS kernel needs v's head dim == q's ({d}), got {v.shape[-1]}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(
            f"the Triton PBS kernel takes float16, bfloat16 or float32 q/k/v, got {q.dtype}; "
            "float64 runs on backend='reference'"
        )


def _permutation(qd: Tensor, kd: Tensor, cfg: PBSConfig, key_padding_mask, scale, kernels: bool) -> Tensor:
    """The key permutation ``[B, Hp, N]`` (identity without ``cfg.permute``), by the Triton
    selection kernels (``kernels``) or the reference."""
    bsz, hq, n = qd.shape[:3]
    if not cfg.permute:
        hp = hq if cfg.gqa_permutation == "query_head" else kd.shape[1]
        return torch.arange(n, device=qd.device).expand(bsz, hp, n).clone()
    if kernels:
        from . import triton_select as _sel

        score_fn, perm_fn = _sel.key_scores, _sel.segment_permutation
    else:
        score_fn, perm_fn = key_scores, segment_permutation
    scores = score_fn(
        qd,
        kd,
        key_padding_mask=key_padding_mask,
        scale=scale,
        block_size=cfg.block_size,
        segment_size=cfg.segment_size,
        causal_proxy=cfg.causal_proxy,
        gqa_permutation=cfg.gqa_permutation,
        proxy_blocks=cfg.proxy_blocks,
    )
    return perm_fn(scores, segment_size=cfg.segment_size, key_padding_mask=key_padding_mask)


def select_and_attend(
    q,
    k,
    v,
    perm,
    *,
    key_padding_mask,
    is_causal,
    scale,
    block_size,
    segment_size,
    threshold,
    force_sink,
    mask_segment,
    want_mask,
    scoring=PBSConfig.scoring,
    antidiagonal_stride=PBSConfig.antidiagonal_stride,
    moments_sd=PBSConfig.moments_sd,
    tuning: Tuning = DEFAULT_TUNING,
    dense_from: Optional[int] = None,
    sliding_window: int = PBSConfig.sliding_window,
    chunk_size: int = PBSConfig.chunk_size,
    owned: Optional[Tensor] = None,
):
    """Stages 2-4 on the Triton kernels: ``(out, block mask or None)``. Query blocks from
    ``dense_from`` on (the dense tail) keep every visible key block, so the attention kernel
    computes their rows exactly, in the same launch as the sparse ones. ``sliding_window`` /
    ``chunk_size``: the selection inside the local window, the kernel's mask with its bound.
    ``owned`` (bool per query block): only those blocks are computed, the others' lists emptied
    (a context-parallel rank's share; their output rows are left for the caller to drop)."""
    window = dict(sliding_window=sliding_window, chunk_size=chunk_size)
    from .triton_select import select_block_lists

    has_pad = key_padding_mask is not None and not bool(key_padding_mask.all())
    kpm = key_padding_mask if has_pad else None
    gather = kv_layout(tuning) == "gather"
    # the strided estimates stream the permuted keys and the moments pool them: written even when
    # the attention gathers
    reads_keys = scoring != "mean" and float(threshold) < 1.0
    # one launch: permuted K/V (unless the kernel gathers), pooled key blocks, positions, sink
    lay = permuted_layout(
        k,
        None if gather else v,
        perm,
        key_padding_mask=kpm,
        block_size=block_size,
        write_kv=reads_keys or not gather,
        pool=True,
        positions=True,
        sink=force_sink,
    )
    kv_num, kv_full, kv_idx, block_mask = select_block_lists(
        q,
        lay.k,
        perm,
        key_padding_mask=kpm,
        is_causal=is_causal,
        scale=scale,
        block_size=block_size,
        segment_size=segment_size,
        threshold=threshold,
        force_sink=force_sink,
        mask_segment=mask_segment,
        return_block_mask=want_mask,
        layout=lay,
        scoring=scoring,
        antidiagonal_stride=antidiagonal_stride,
        moments_sd=moments_sd,
        moments_product=tuning.pbs_moments_product,
        padding_checked=True,
        dense_from=dense_from,
        **window,
    )
    if owned is not None:
        kv_num, kv_full = kv_num * owned.to(kv_num.dtype), kv_full * owned.to(kv_full.dtype)
    kk, vv = (k, v) if gather else (lay.k, lay.v)
    out = pbs_block_sparse_attention(
        q,
        kk,
        vv,
        lay.kpos,
        kv_num,
        kv_full,
        kv_idx,
        scale=scale,
        block_size=block_size,
        is_causal=is_causal,
        has_padding=has_pad,
        gather=gather,
        tma=tuning.pbs_tma,
        **window,
    )
    return out, block_mask


def _finish(out, block_mask, perm, cfg, key_padding_mask, is_causal, return_selection):
    if not return_selection:
        return out
    return out, pbs_report(block_mask, perm, cfg, key_padding_mask=key_padding_mask, is_causal=is_causal)


def attention_from_selection(
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
    segment_size: int = PBSConfig.segment_size,
    layout: Optional[str] = None,
    tma: bool = True,
    sliding_window: int = PBSConfig.sliding_window,
    chunk_size: int = PBSConfig.chunk_size,
) -> Tensor:
    """Step 4 alone: the Triton kernel over a given permutation ``[B, Hp, N]`` and block mask
    ``[B, Hq, nB, nB]`` (the reference's ``permuted_block_attention`` contract, local window
    included; forward only). ``layout`` (default ``Tuning().pbs_kv_layout``) and ``tma`` as in
    :class:`sparseflow.Tuning`."""
    window = dict(sliding_window=sliding_window, chunk_size=chunk_size)
    layout = kv_layout() if layout is None else layout
    n = q.shape[2]
    has_pad = key_padding_mask is not None and not bool(key_padding_mask.all())
    kpos = key_positions(permutation, key_padding_mask if has_pad else None)
    kv_num, kv_full, kv_idx = block_mask_to_indices(
        block_mask,
        num_keys=n,
        block_size=block_size,
        segment_size=segment_size,
        is_causal=is_causal,
        has_padding=has_pad,
        **window,
    )
    if layout == "gather":
        kk, vv, gather = k, v, True
    else:
        kk, vv, gather = permute_kv(k, permutation), permute_kv(v, permutation), False
    return pbs_block_sparse_attention(
        q,
        kk,
        vv,
        kpos,
        kv_num,
        kv_full,
        kv_idx,
        scale=scale,
        block_size=block_size,
        is_causal=is_causal,
        has_padding=has_pad,
        gather=gather,
        tma=tma,
        **window,
    )
