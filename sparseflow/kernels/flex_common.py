"""Shared FlexAttention plumbing for the ``backend="flex"`` implementations (PBS, PISA, BSA).

Every flex backend turns its method's selection into a :class:`BlockMask` built *directly from
block indices* (``BlockMask.from_kv_blocks``; never ``create_block_mask``, which without
compilation materialises an ``N x N`` mask) plus a ``mask_mod`` that does the element-level
test inside partial blocks, then runs the **compiled** ``flex_attention``.

Why compiled only: eager ``flex_attention`` ignores a BlockMask's block lists (it evaluates the
``mask_mod`` densely), so an eager result is dense attention restricted by ``mask_mod`` alone --
not the selection. :func:`flex_attention_compiled` refuses to run whenever the call would not go
through the compiler (``TORCHDYNAMO_DISABLE``, ``torch.compiler.set_stance("force_eager")``) and
is compiled with ``fullgraph=True``, so a failed or over-limit compilation raises instead of
silently running eagerly.

Facts measured on torch 2.13 CPU (see ``tests/methods/test_flex.py``):

* compiled CPU flex takes fp32, bf16 and fp16 (fp64 is rejected with a ``ValueError`` naming the
  dtype), any head dim tried (16..256, including 80 and 96), any (Q, KV) block size pair, and
  lengths that are not a multiple of the block size (partial last blocks are exact);
* it is inference only (no backward, no lse), and rejects any ``requires_grad`` input even under
  ``no_grad``: a direct CPU call that would be differentiated raises; otherwise q/k/v are detached
  first (through the op the forward runs flex, the backward goes through the reference);
* with Inductor's 8-float vectors (AVX2-only CPUs) the q @ k^T micro-GEMM is wrong for key tiles
  that are not a multiple of 16 at head dims below 24, so those head dims are zero-padded (see
  :func:`cpu_qk_head_dim`); AVX-512 never takes that path;
* the CPU kernel tiles by the BlockMask's block sizes and applies ``mask_mod`` to partial blocks
  only; on CUDA the Triton kernel indexes the block lists by ``h % H_mask``, so the lists are
  always expanded to ``Hq`` heads (never broadcast from ``Hkv``);
* ``dynamic=True`` fails to build on CPU (C++ codegen error), so the callable is compiled with
  ``dynamic=False``. Every new (shape, dtype, block size) compiles again (5-25 s on a busy
  2-core CPU); to
  bound the number of compilations the sequence is padded to a bucketed number of blocks (see
  :func:`bucketed_length`), and the Dynamo recompile limit is raised for these calls only;
* rows that see no key come back as 0 (never NaN), on CPU and (by the flex kernel's
  ``l_i == 0`` rule) on CUDA.

On CUDA (reasoned from torch's flex lowering, not measured here): :func:`flex_plan` picks forward
tiles that divide the block sizes, pads head dims below 16, and falls back to the reference
(logged) where Inductor would have no valid kernel.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Callable, Dict, NamedTuple, Optional, Sequence, Tuple

import torch

from .token_blocks import window_lower_bounds

__all__ = [
    "FLEX_DTYPES",
    "RECOMPILE_LIMIT",
    "SELECTION_TABLE_BUDGET",
    "check_flex_inputs",
    "flex_attention_compiled",
    "compiled_flex_attention",
    "bucketed_length",
    "pad_seq",
    "block_lists",
    "FlexPlan",
    "cuda_flex_plan",
    "cuda_head_dim",
    "flex_plan",
    "needs_grad",
    "cpu_qk_head_dim",
    "kv_tile_lengths",
    "pad_head_dim",
    "default_scale",
    "gather_rows",
    "token_block_attention",
    "token_selection",
]

# dtypes compiled flex accepts on every device it runs on (CPU: fp32/bf16/fp16; CUDA: the same).
FLEX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Per-token selection tables up to this many bytes are bool [B, Hkv, Nq, nKB] (one gather per
# score in mask_mod, ~25% faster on CPU); larger ones are packed into int32 bitsets (8x smaller).
SELECTION_TABLE_BUDGET = 1 << 28

# Compilations allowed per process for the flex callable (Dynamo's default is 8 per code object;
# every distinct (shape, dtype, block size, mask kind) needs one).
RECOMPILE_LIMIT = 256

_log = logging.getLogger("sparseflow")
_lock = threading.Lock()
_compiled: Optional[Callable] = None


def compiled_flex_attention() -> Callable:
    """The process-wide ``torch.compile(flex_attention, dynamic=False, fullgraph=True)``, created
    lazily on first use (importing sparseflow must not touch the compiler)."""
    global _compiled
    if _compiled is None:
        with _lock:
            if _compiled is None:
                from torch.nn.attention.flex_attention import flex_attention

                _compiled = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    return _compiled


def _compiler_disabled_reason() -> str:
    """Why a torch.compile'd callable would run eagerly right now ("" when it would compile)."""
    import torch._dynamo as dynamo

    if getattr(dynamo.config, "disable", False):
        return "TorchDynamo is disabled (TORCHDYNAMO_DISABLE / torch._dynamo.config.disable)"
    try:
        from torch._dynamo.eval_frame import _stance

        if _stance.stance not in ("default",):
            return f"torch.compiler stance is {_stance.stance!r}"
    except ImportError:  # pragma: no cover - older torch
        pass
    if torch.compiler.is_compiling():
        return "called from inside a torch.compile trace"
    return ""


def check_flex_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise a clear error for what compiled flex cannot do (so nothing runs eagerly or wrongly)."""
    if q.dtype not in FLEX_DTYPES:
        raise ValueError(
            f"backend='flex' does not support dtype {q.dtype} (compiled FlexAttention takes "
            f"{', '.join(str(d) for d in FLEX_DTYPES)}); use backend='reference' for {q.dtype}"
        )
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"backend='flex' runs on cpu and cuda, got device {q.device}")
    if q.device.type == "cpu" and needs_grad(q, k, v):
        raise NotImplementedError(_CPU_NO_BACKWARD)
    if q.device.type == "cpu":
        from torch._inductor.kernel.flex.flex_cpu import check_cpu_supported

        if not check_cpu_supported():
            raise NotImplementedError(
                "backend='flex' needs a CPU with AVX2 (compiled FlexAttention is not supported on "
                "this CPU / platform); use backend='reference'"
            )


def flex_attention_compiled(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask,
    *,
    scale: float,
    enable_gqa: bool,
    kernel_options: Optional[Dict] = None,
) -> torch.Tensor:
    """Run the compiled flex_attention; raises rather than ever running the eager path."""
    reason = _compiler_disabled_reason()
    if reason:
        raise RuntimeError(
            f"backend='flex' needs compiled FlexAttention, but {reason}: eager FlexAttention ignores "
            "the block lists and would silently compute the wrong attention; use backend='reference'"
        )
    q, k, v = _cpu_inference_inputs(q, k, v)
    dv = v.shape[-1]
    if q.device.type == "cpu":
        qk_dim = cpu_qk_head_dim(q.shape[-1], kv_tile_lengths(k.shape[2], block_mask.BLOCK_SIZE[1]))
    else:
        qk_dim = cuda_head_dim(q.shape[-1])
        v = pad_head_dim(v, cuda_head_dim(dv))
    q, k = pad_head_dim(q, qk_dim), pad_head_dim(k, qk_dim)
    fn = compiled_flex_attention()
    import torch._dynamo as dynamo

    limit = max(RECOMPILE_LIMIT, dynamo.config.recompile_limit)
    acc = max(4 * RECOMPILE_LIMIT, dynamo.config.accumulated_recompile_limit)
    with dynamo.config.patch(recompile_limit=limit, accumulated_recompile_limit=acc):
        out = fn(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa, kernel_options=kernel_options)
    return out if out.shape[-1] == dv else out[..., :dv]


def _cpu_inference_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """On the CPU, q/k/v detached (flex refuses any ``requires_grad`` input on the CPU, even under
    ``no_grad``, where the op's forward runs); a call that would be differentiated raises."""
    if q.device.type != "cpu" or not any(t.requires_grad for t in (q, k, v)):
        return q, k, v
    if needs_grad(q, k, v):
        raise NotImplementedError(_CPU_NO_BACKWARD)
    return q.detach(), k.detach(), v.detach()


_CPU_NO_BACKWARD = (
    "backend='flex' on CPU is inference-only (compiled FlexAttention has no CPU backward); "
    "run under torch.no_grad(), detach q/k/v, or use backend='reference' for gradients"
)


def kv_tile_lengths(kv_len: int, kv_block: int) -> Tuple[int, ...]:
    """The key counts the CPU flex kernel multiplies per step: full tiles of ``kv_block`` (capped
    at ``kv_len``) and, when ``kv_len`` is not a multiple, the shorter last tile."""
    tile = min(kv_block, kv_len)
    tail = kv_len % tile
    return (tile, tail) if tail else (tile,)


def cpu_qk_head_dim(head_dim: int, kv_tiles: Tuple[int, ...]) -> int:
    """Head dim at which q/k enter the CPU flex kernel (zero-padded: the scores are unchanged).

    torch 2.13's CPU q @ k^T micro-GEMM handles a key tile in chunks of 16 columns; for a chunk
    narrower than 16 whose width is a multiple of the vector length it takes a path that still
    computes and stores 16 columns when ``head_dim`` is a multiple of the vector length below 24.
    The extra columns read keys past the tile and overwrite the next score row and, on the last
    row, the running row maxima. That happens when Inductor's vector is 8 floats (an AVX2-only
    CPU, or ``ATEN_CPU_CAPABILITY=avx2``), never with AVX-512's 16, e.g. for 8-key blocks at head
    dim 16. A head dim of 24 or more always takes the correct path whatever the vector length, so
    small head dims are padded (to 32) whenever some key tile is not a multiple of 16."""
    if head_dim >= 24 or all(t % 16 == 0 for t in kv_tiles):
        return head_dim
    return 32


def pad_head_dim(t: torch.Tensor, d: int) -> torch.Tensor:
    """``t [..., D]`` zero-padded to ``[..., d]`` (no copy when ``D == d``)."""
    return t if t.shape[-1] == d else torch.nn.functional.pad(t, (0, d - t.shape[-1]))


# --------------------------------------------------------------------------- shapes


def bucketed_length(n: int, block: int) -> int:
    """Length ``>= n`` the flex call runs at: a multiple of ``block`` whose block count is rounded
    up to at most 4 steps per octave (1..8 blocks exactly, then 8, 10, 12, 14, 16, 20, 24, 28, 32,
    40, ...), so the number of distinct compiled shapes grows with log(N), not N. The padding
    costs a copy of q/k/v (O(N·D)); padded key slots are masked, padded query tiles select no
    block and are sliced off."""
    nb = max(1, -(-n // block))
    if nb > 8:
        step = 1 << (nb.bit_length() - 3)  # 4 steps per power of two
        nb = -(-nb // step) * step
    return nb * block


def pad_seq(t: torch.Tensor, n: int, dim: int = 2, value=0) -> torch.Tensor:
    """Pad ``t`` along ``dim`` to length ``n`` with ``value`` (no copy when already ``n``)."""
    cur = t.shape[dim]
    if cur == n:
        return t
    shape = list(t.shape)
    shape[dim] = n - cur
    return torch.cat([t, t.new_full(shape, value)], dim=dim)


def block_lists(mask: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``mask [B, H, nQ, nK]`` bool -> (``num [B, H, nQ]`` int32, ``indices [B, H, nQ, nK]`` int32):
    the selected key blocks of each query tile, ascending, followed by the unselected ones
    (ignored by flex because of ``num``)."""
    num = mask.sum(-1, dtype=torch.int32)
    order = torch.sort((~mask).to(torch.uint8), dim=-1, stable=True).indices
    return num, order.to(torch.int32)


def needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether the flex call will be differentiated (then the BlockMask needs its q-block lists)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class FlexPlan(NamedTuple):
    """How a flex call runs: Triton ``kernel_options`` (None: flex's defaults), or, when
    ``fallback`` is non-empty, why the method's reference attention runs instead."""

    kernel_options: Optional[Dict]
    fallback: str = ""


def cuda_head_dim(d: int) -> int:
    """Head dim the Triton flex kernel runs at: its ``tl.dot`` needs every dimension >= 16, so
    smaller q/k (and v) head dims are zero-padded to 16 (scores unchanged, output sliced)."""
    return max(int(d), 16)


def cuda_flex_plan(
    q_block: int, kv_block: int, head_dim: int, *, needs_grad: bool, bwd_tiles: Sequence[Tuple[int, int, int, int]] = ()
) -> FlexPlan:
    """The decision for the CUDA flex kernel at sparse block sizes ``(q_block, kv_block)`` and the
    (padded, :func:`cuda_head_dim`) ``head_dim``.

    Forward: flex needs Triton tiles >= 16 that divide the block sizes (``Q_BLOCK % BLOCK_M ==
    0``, ``KV_BLOCK % BLOCK_N == 0``): powers of two up to 128 x 64 (64 x 32 above head dim 128).
    Backward (``needs_grad``): Inductor keeps only the backward configs ``(BLOCK_M1, BLOCK_N1,
    BLOCK_M2, BLOCK_N2)`` -- ``bwd_tiles``, from torch's own table -- whose tiles divide the block
    sizes, checked before any ``bwd_`` kernel option applies; with none left it raises
    ``NoValidChoicesError`` (e.g. bf16 at head dim 16 on sm90 wants 64, blocks are 16). Then, and
    for block sizes that are not multiples of 16, the plan falls back to the reference."""
    if q_block % 16 or kv_block % 16:
        return FlexPlan(
            None,
            f"the Triton flex kernel needs block sizes that are multiples of 16, got "
            f"q_block={q_block}, kv_block={kv_block}",
        )
    if needs_grad and not any(
        q_block % m1 == 0 and q_block % m2 == 0 and kv_block % n1 == 0 and kv_block % n2 == 0
        for m1, n1, m2, n2 in bwd_tiles
    ):
        return FlexPlan(
            None,
            f"no flex backward config of this torch/GPU (tiles {list(bwd_tiles)}) divides "
            f"q_block={q_block}, kv_block={kv_block} at head dim {head_dim}",
        )
    if q_block % 128 == 0 and kv_block % 128 == 0:
        return FlexPlan(None)  # every default forward config (tiles <= 128) divides them
    big = head_dim <= 128

    def pow2_divisor(x: int, cap: int) -> int:
        return min(x & -x, cap)  # largest power of two dividing x (>= 16 here), capped

    # forward tiles only ("fwd_" prefix): the backward keeps its own configs (checked above)
    return FlexPlan(
        {
            "fwd_BLOCK_M": pow2_divisor(q_block, 128 if big else 64),
            "fwd_BLOCK_N": pow2_divisor(kv_block, 64 if big else 32),
        }
    )


def cuda_bwd_tiles(head_dim: int, dtype: torch.dtype) -> Tuple[Tuple[int, int, int, int], ...]:
    """The flex backward tiles Inductor would try on this GPU (its config table; queried on CUDA)."""
    try:
        from torch._inductor.choices import InductorChoices

        confs = InductorChoices().get_flex_attention_bwd_configs(head_dim, dtype, "cuda")
        return tuple((c.block_m1, c.block_n1, c.block_m2, c.block_n2) for c in confs)
    except (ImportError, AttributeError):  # the table moved: the largest default tiles
        return ((128, 128, 128, 128),)


def flex_plan(
    device: torch.device, q_block: int, kv_block: int, head_dim: int, dtype: torch.dtype, *, needs_grad: bool
) -> FlexPlan:
    """:func:`cuda_flex_plan` on CUDA; on the CPU the kernel tiles by the block sizes (no options)."""
    if device.type != "cuda":
        return FlexPlan(None)
    d = cuda_head_dim(head_dim)
    tiles = cuda_bwd_tiles(d, dtype) if needs_grad else ()
    plan = cuda_flex_plan(q_block, kv_block, d, needs_grad=needs_grad, bwd_tiles=tiles)
    if plan.fallback:
        _log.warning("sparseflow backend='flex' runs the reference attention instead: %s", plan.fallback)
    return plan


def default_scale(d: int, scale: Optional[float]) -> float:
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x [B, Hx, N, D]``, ``index [B, Hi, L]`` (values in ``[0, N)``; ``Hi`` a multiple of ``Hx``,
    index head ``i`` reading ``x`` head ``i // (Hi // Hx)``) -> ``[B, Hi, L, D]`` in one copy
    (no repeated K/V is materialised first)."""
    b, hx, n, d = x.shape
    hi, length = index.shape[1], index.shape[2]
    src_head = torch.arange(hi, device=index.device) // (hi // hx)  # [Hi]
    base = (torch.arange(b, device=index.device)[:, None] * hx + src_head[None, :]) * n  # [B, Hi]
    flat = (index + base[:, :, None]).reshape(-1)
    return x.reshape(b * hx * n, d).index_select(0, flat).view(b, hi, length, d)


# --------------------------------------------------------------------------- token-level selections


def _tile_counts(idx: torch.Tensor, n_blocks: int, q_tile: int) -> torch.Tensor:
    """``idx [B, Hkv, Nq_pad, K]`` (-1 = unused; padded rows all -1) -> ``[B, Hkv, nQT, nKB]``
    int32: how many query rows of each tile selected each key block."""
    b, hkv, nq, kk = idx.shape
    nqt = nq // q_tile
    safe = torch.where(idx < 0, torch.full_like(idx, n_blocks), idx).view(b, hkv, nqt, q_tile * kk)
    counts = torch.zeros(b, hkv, nqt, n_blocks + 1, dtype=torch.int32, device=idx.device)
    counts.scatter_add_(-1, safe, torch.ones_like(safe, dtype=torch.int32))
    return counts[..., :n_blocks]


def _selection_table(idx: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """``idx [B, Hkv, Nq, K]`` (-1 = unused) -> ``[B, Hkv, Nq, nKB]`` bool: block selected."""
    b, hkv, nq, kk = idx.shape
    table = torch.zeros(b, hkv, nq, n_blocks + 1, dtype=torch.bool, device=idx.device)
    table.scatter_(-1, torch.where(idx < 0, torch.full_like(idx, n_blocks), idx), True)
    return table[..., :n_blocks].contiguous()


def _selection_bits(idx: torch.Tensor, n_words: int) -> torch.Tensor:
    """``idx [B, Hkv, Nq, K]`` (ascending-or-not, distinct, -1 = unused) -> ``[B, Hkv, Nq, W]``
    int32 bitset: bit ``c % 32`` of word ``c // 32`` set iff block ``c`` is selected."""
    b, hkv, nq, kk = idx.shape
    safe = idx.clamp_min(0)
    word = torch.where(idx < 0, torch.full_like(idx, n_words), safe // 32)
    bit = torch.where(idx < 0, torch.zeros_like(idx), torch.bitwise_left_shift(torch.ones_like(idx), safe % 32))
    words = torch.zeros(b, hkv, nq, n_words + 1, dtype=torch.int64, device=idx.device)
    words.scatter_add_(-1, word, bit)  # blocks are distinct: add == or
    words = words[..., :n_words]
    # two's complement wrap of bit 31 into int32
    words = torch.where(words >= (1 << 31), words - (1 << 32), words)
    return words.to(torch.int32).contiguous()


def token_block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_indices: torch.Tensor,
    *,
    key_padding_mask: Optional[torch.Tensor],
    is_causal: bool,
    scale: Optional[float],
    block_size: int,
    q_tile: Optional[int] = None,
    kv_tile: Optional[int] = None,
    sliding_window: int = 0,
    chunk_size: int = 0,
) -> torch.Tensor:
    """Attention of each query token over its own selected key blocks (PISA/BSA selections) with
    compiled FlexAttention; the flex counterpart of ``token_blocks.attend_selected_blocks``.
    ``sliding_window`` / ``chunk_size``: a causal local window (AttentionConfig's meaning) that
    bounds each query's keys from below, element-wise.

    ``block_indices [B, Hkv, Nq, K]`` int64 (``-1`` = unused) is shared by the ``G`` query heads
    of a KV head; K/V keep their ``Hkv`` heads (``enable_gqa``). The BlockMask tiles queries by
    ``q_tile`` rows and keys by ``kv_tile`` columns (defaults: ``block_size`` both; ``kv_tile``
    must be a multiple of ``block_size``): a tile's block list is the union of its rows'
    selections. A key tile that every real row of the query tile selected entirely, whose keys
    are all valid and (causal) all visible to the tile's first query, is a full block (no
    mask_mod); the others are partial, where ``mask_mod`` tests membership per token in a
    ``[B, Hkv, Nq, nKB]`` bool table of the selection (or, above ``SELECTION_TABLE_BUDGET``
    bytes, an int32 bitset of it: ``Nq·nKB/8`` bytes per KV head), plus causality
    (``kv <= q + Nk - Nq``) and key padding. Queries bottom-right aligned as in token_blocks. A
    query with no visible key outputs 0. Returns ``[B, Hq, Nq, Dv]`` in ``q.dtype``.

    On CUDA both tiles are rounded up to multiples of 16 (the Triton kernel's smallest tile) and,
    with gradients, of 128 (the largest tile of flex's default backward configs, which must
    divide the sparse block sizes). Where :func:`flex_plan` still finds no valid kernel the
    reference (``token_blocks.attend_selected_blocks``, same result) runs, logged."""
    check_flex_inputs(q, k, v)
    bsz, hq, n_q, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    c = int(block_size)
    qt = c if q_tile is None else int(q_tile)
    kt = c if kv_tile is None else int(kv_tile)
    if kt % c:
        raise ValueError(f"kv_tile must be a multiple of block_size={c}, got kv_tile={kt}")
    dev = q.device
    # decided before the no_grad block below, inside which needs_grad() is always False
    grad = needs_grad(q, k, v)
    if dev.type == "cuda":
        qt, kt = (math.lcm(t, 128 if grad else 16) for t in (qt, kt))
    plan = flex_plan(dev, qt, kt, d, q.dtype, needs_grad=grad)
    if plan.fallback:
        from .token_blocks import attend_selected_blocks

        return attend_selected_blocks(
            q,
            k,
            v,
            block_indices,
            key_padding_mask=key_padding_mask,
            is_causal=is_causal,
            scale=scale,
            block_size=c,
            sliding_window=sliding_window,
            chunk_size=chunk_size,
        )
    with torch.no_grad():
        bm = _token_block_mask(
            block_indices,
            key_padding_mask,
            q.shape,
            k.shape,
            block_size=c,
            q_tile=qt,
            kv_tile=kt,
            is_causal=is_causal,
            grad=grad,
            device=dev,
            window=(sliding_window, chunk_size),
        )
    nq_pad, nk_pad = bm.seq_lengths
    qp = pad_seq(q, nq_pad).contiguous()
    kp = pad_seq(k, nk_pad).contiguous()
    vp = pad_seq(v, nk_pad).contiguous()
    out = flex_attention_compiled(
        qp,
        kp,
        vp,
        bm,
        scale=default_scale(d, scale),
        enable_gqa=g > 1,
        kernel_options=plan.kernel_options,
    )
    return out[:, :, :n_q].to(q.dtype)


def _token_block_mask(
    block_indices,
    key_padding_mask,
    q_shape,
    k_shape,
    *,
    block_size: int,
    q_tile: int,
    kv_tile: int,
    is_causal: bool,
    grad: bool,
    device,
    window: Tuple[int, int] = (0, 0),
):
    """The BlockMask of token_block_attention over the padded lengths (``seq_lengths``): per
    ``(q_tile, kv_tile)`` tile, full where no mask_mod is needed, partial where any row selected
    a leaf block of it; the mask_mod reads the selection table (or its bitset)."""
    from torch.nn.attention.flex_attention import BlockMask

    bsz, hq, n_q, _ = q_shape
    hkv, n_k = k_shape[1], k_shape[2]
    g, c, qt, kt = hq // hkv, block_size, q_tile, kv_tile
    offset = n_k - n_q
    nq_pad = bucketed_length(n_q, qt)
    nk_pad = bucketed_length(n_k, kt)
    nkb = nk_pad // c
    idx = pad_seq(block_indices.to(device=device, dtype=torch.long), nq_pad, dim=2, value=-1)
    packed = bsz * hkv * nq_pad * nkb > SELECTION_TABLE_BUDGET
    if packed:
        table = _selection_bits(idx, -(-nkb // 32))  # [B, Hkv, Nq_pad, W] int32
    else:
        table = _selection_table(idx, nkb)  # [B, Hkv, Nq_pad, nKB] bool
    key_ok, kpm_ext = _key_validity(key_padding_mask, bsz, n_k, nk_pad, is_causal, device)
    full, partial = _full_and_partial_tiles(idx, key_ok, n_q, offset, c, qt, kt, is_causal)
    if window != (0, 0):  # a key tile is whole only if every real row's window starts at or before it
        last_q = (torch.arange(full.shape[2], device=device) * qt + qt - 1).clamp_max(n_q - 1) + offset
        first_key = torch.arange(full.shape[3], device=device) * kt
        whole = first_key[None, :] >= window_lower_bounds(last_q, *window)[:, None]
        partial = partial | (full & ~whole[None, None])
        full = full & whole[None, None]
    kv_num, kv_idx = block_lists(partial)
    full_num, full_idx = block_lists(full)
    head_map = torch.arange(hq, device=device) // g
    kv_num, kv_idx, full_num, full_idx = (t[:, head_map].contiguous() for t in (kv_num, kv_idx, full_num, full_idx))
    mask_mod = _token_mask_mod(table, kpm_ext, g=g, c=c, offset=offset, is_causal=is_causal, packed=packed)
    if window != (0, 0):
        mask_mod = _windowed(mask_mod, offset, *window)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=(qt, kt),
        mask_mod=mask_mod,
        seq_lengths=(nq_pad, nk_pad),
        compute_q_blocks=grad,
    )


def _key_validity(key_padding_mask, bsz: int, n_k: int, nk_pad: int, is_causal: bool, device):
    """``(key_ok [B, Nk_pad], kpm_ext)``: which padded key slots hold a valid key, and the key
    validity table the mask_mod reads (None where it needs none)."""
    key_ok = torch.arange(nk_pad, device=device) < n_k
    kpm_ext = None
    if key_padding_mask is not None or (not is_causal and nk_pad > n_k):
        # key validity table: padding and (non-causal) the slots past Nk. Causal needs no
        # table for those slots: only padded query rows (sliced off) can reach them.
        kpm = (
            key_padding_mask if key_padding_mask is not None else torch.ones(bsz, n_k, dtype=torch.bool, device=device)
        )
        kpm_ext = pad_seq(kpm.to(device=device, dtype=torch.bool), nk_pad, dim=1, value=False)
        key_ok = key_ok[None, :] & kpm_ext  # [B, Nk_pad]
    else:
        key_ok = key_ok[None, :].expand(bsz, nk_pad)
    return key_ok, kpm_ext


def _full_and_partial_tiles(idx, key_ok, n_q: int, offset: int, c: int, qt: int, kt: int, is_causal: bool):
    """``(full, partial)`` ``[B, Hkv, nQT, nKT]`` bool: a key tile is full for a query tile when
    every real row selected all its leaf blocks, all its keys are valid and (causal) visible to
    the tile's first row; partial when some row selected some leaf of it and it is not full."""
    bsz, hkv, nq_pad, _ = idx.shape
    nk_pad = key_ok.shape[1]
    dev = idx.device
    nkt, nqt = nk_pad // kt, nq_pad // qt
    counts = _tile_counts(idx, nk_pad // c, qt).view(bsz, hkv, nqt, nkt, kt // c)  # rows selecting each leaf
    # real query rows per tile
    rows = (n_q - torch.arange(nqt, device=dev) * qt).clamp(0, qt).to(torch.int32)  # [nQT]
    tile_all_valid = key_ok.reshape(bsz, nkt, kt).all(-1)  # [B, nKT]
    r = rows[None, None, :, None]
    full = ((counts == r[..., None]).all(-1)) & (r > 0) & tile_all_valid[:, None, None, :]
    if is_causal:
        last_key = torch.arange(nkt, device=dev) * kt + kt - 1  # [nKT]
        first_q = torch.arange(nqt, device=dev) * qt + offset  # [nQT] horizon of the tile's first row
        full = full & (last_key[None, :] <= first_q[:, None])[None, None]
    partial = (counts > 0).any(-1) & ~full
    return full, partial


def _token_mask_mod(table, kpm_ext, *, g: int, c: int, offset: int, is_causal: bool, packed: bool):
    """mask_mod for token-level selections, one closure per (table kind, causal, padding) variant.
    Only tensors and shape-determined ints are captured, so lengths that share a padded bucket
    share the compiled kernel (a captured int such as Nk would be guarded on and recompile)."""

    if packed:

        def member(b, h, q_idx, kv_idx):
            blk = kv_idx // c
            word = table[b, h // g, q_idx, blk // 32]
            return ((word >> (blk % 32)) & 1) != 0
    else:

        def member(b, h, q_idx, kv_idx):
            return table[b, h // g, q_idx, kv_idx // c]

    if is_causal and kpm_ext is not None:

        def mask_mod(b, h, q_idx, kv_idx):
            return member(b, h, q_idx, kv_idx) & (kv_idx <= q_idx + offset) & kpm_ext[b, kv_idx]
    elif is_causal:

        def mask_mod(b, h, q_idx, kv_idx):
            return member(b, h, q_idx, kv_idx) & (kv_idx <= q_idx + offset)
    elif kpm_ext is not None:

        def mask_mod(b, h, q_idx, kv_idx):
            return member(b, h, q_idx, kv_idx) & kpm_ext[b, kv_idx]
    else:

        def mask_mod(b, h, q_idx, kv_idx):
            return member(b, h, q_idx, kv_idx)

    return mask_mod


def token_selection(
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
):
    """The :class:`Selection` the token-level references report for ``block_indices``."""
    from .token_blocks import selection_for_indices

    return selection_for_indices(
        method,
        block_indices,
        q,
        k,
        key_padding_mask=key_padding_mask,
        is_causal=is_causal,
        block_size=block_size,
        sliding_window=sliding_window,
        chunk_size=chunk_size,
    )


def _windowed(mask_mod, offset: int, sliding_window: int, chunk_size: int):
    """``mask_mod`` with the local window's lower bound on the key (queries at ``q + offset``)."""

    def windowed(b, h, q_idx, kv_idx):
        p = q_idx + offset
        ok = mask_mod(b, h, q_idx, kv_idx)
        if sliding_window:
            ok = ok & (kv_idx > p - sliding_window)
        if chunk_size:
            ok = ok & (kv_idx >= (p // chunk_size) * chunk_size)
        return ok

    return windowed
