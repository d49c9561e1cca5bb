"""The ops' ``attn_mask``: SDPA's mask, checked, described and folded into what the sparse ops take.

``attn_mask`` means exactly what it means to ``F.scaled_dot_product_attention``: a bool tensor
(True = attend) or an additive float tensor (float32 or the query's dtype) of 2 to 4 dims that
broadcasts to ``[B, Hq, Nq, Nk]`` with dims aligned from the right -- ``[Nq, Nk]`` is one mask for
every batch row and head, never a per-batch key padding. sparseflow's key padding is the SDPA form
``[B, 1, 1, Nk]`` bool (True = valid key). With ``is_causal=True`` a mask is intersected with
causality (what SDPA's CPU kernel computes; its math and CUDA kernels refuse the pair), so key
padding and causality travel together without building an ``[Nq, Nk]`` mask.

The sparse ops understand causality and key padding. :func:`analyse_mask` folds a mask whose
visibility is exactly key padding, causal, or ``causal & key_padding`` into
``(is_causal, key_padding_mask [B, Nk])``; any other mask is reported as unsupported, with the
reason, so the caller runs dense attention and logs why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from .kernels.token_blocks import window_lower_bounds

__all__ = ["MaskAnalysis", "analyse_mask", "check_mask", "describe_mask", "with_causality", "FORMS"]

FORMS = (
    "a bool (True = attend) or additive float mask broadcastable to [B, Hq, Nq, Nk] with 2 to 4 dims, "
    "as SDPA takes it: [Nq, Nk], [Hq or 1, Nq, Nk], [B or 1, Hq or 1, Nq or 1, Nk]; "
    "key padding is [B, 1, 1, Nk] bool (a [B, Nk] key-padding mask kpm goes in as kpm[:, None, None, :])"
)


@dataclass(frozen=True)
class MaskAnalysis:
    supported: bool
    is_causal: bool = False
    key_padding_mask: Optional[torch.Tensor] = None  # [B, Nk] bool, True = valid; None = all valid
    reason: str = ""
    sliding_window: int = 0  # a causal local window the mask holds (AttentionConfig's meaning)
    chunk_size: int = 0


def window_mask(n_q: int, n_k: int, sliding_window: int, chunk_size: int, device) -> torch.Tensor:
    """``[Nq, Nk]`` bool: causal (bottom-right aligned) and the local window -- what a windowed
    call computes, for the paths that run it as a dense mask."""
    p = torch.arange(n_q, device=device)[:, None] + (n_k - n_q)
    j = torch.arange(n_k, device=device)[None, :]
    return (j <= p) & (j >= window_lower_bounds(p, sliding_window, chunk_size))


# --------------------------------------------------------------------------- checks


def check_mask(attn_mask: torch.Tensor, target: Sequence, query_dtype: torch.dtype) -> None:
    """Raise a ValueError naming ``attn_mask`` and the accepted forms unless SDPA would take this
    mask for ``target = (B, Hq, Nq, Nk)``. Works on fake tensors (trace-time errors)."""
    dtype = attn_mask.dtype
    if dtype != torch.bool and dtype not in (torch.float32, query_dtype):
        raise ValueError(
            f"attn_mask must be bool or an additive float mask of float32 or the query's dtype ({query_dtype}), "
            f"got dtype {dtype}; accepted: {FORMS}"
        )
    shape = tuple(attn_mask.shape)
    want = f"[B, Hq, Nq, Nk] = {list(target)}"
    if not 2 <= len(shape) <= 4:
        raise ValueError(
            f"attn_mask must have 2 to 4 dims broadcastable to {want}, got shape {shape}; accepted: {FORMS}"
        )
    for size, full in zip(reversed(shape), reversed(tuple(target))):
        if not (size == 1 or size == full):
            raise ValueError(f"attn_mask of shape {shape} is not broadcastable to {want}; accepted: {FORMS}")


def with_causality(attn_mask: torch.Tensor, n_q: int, n_k: int) -> torch.Tensor:
    """``attn_mask`` intersected with SDPA's (top-left aligned) causal mask."""
    causal = torch.ones(n_q, n_k, dtype=torch.bool, device=attn_mask.device).tril()
    if attn_mask.dtype == torch.bool:
        return attn_mask & causal
    return attn_mask.masked_fill(~causal, float("-inf"))


# --------------------------------------------------------------------------- description


def _dim_labels(shape: Sequence) -> Tuple[str, ...]:
    """SDPA's name of each (right-aligned) dim, or "1" where the size is provably 1."""
    names = ("B", "H", "Nq", "Nk")[4 - len(shape) :]
    return tuple("1" if size == 1 else name for size, name in zip(shape, names))


def describe_mask(shape: Sequence, dtype: torch.dtype) -> str:
    """What a mask of this (fake) shape and dtype is to the op, for rewrite reports. ``shape``
    holds ints, or strings for symbolic sizes (never taken to be 1)."""
    labels = _dim_labels(shape)
    form = f"SDPA's [{', '.join(labels)}]"
    if len(shape) < 4 or labels[0] == "1":
        form += " (one mask for every batch row)"
    name = str(dtype).replace("torch.", "")
    values = "" if dtype == torch.bool else "when every entry is 0 or -inf, "
    padding_form = labels[-2] == "1" and (len(labels) < 3 or labels[-3] == "1")
    if padding_form:
        what = f"key padding (broadcast over queries): runtime-recognised {values}else dense"
    else:
        what = (
            f"runtime-recognised by value {values}(causal / key padding / causal + key padding run sparse, "
            "anything else dense, logged)"
        )
    return f"{name} {list(shape)} as {form}: {what}"


# --------------------------------------------------------------------------- analysis


def _as_bool(mask: torch.Tensor) -> Optional[torch.Tensor]:
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point():
        # Additive masks are folded only when every entry is exactly 0 or -inf: any other value
        # (finite "large negative", a bias) changes the result and is not a visibility mask.
        zero = mask == 0
        if bool((zero | torch.isneginf(mask)).all()):
            return zero
    return None


def _padding_or_none(kpm: torch.Tensor, batch: int, n_k: int) -> Optional[torch.Tensor]:
    kpm = kpm.expand(batch, n_k)
    return None if bool(kpm.all()) else kpm.contiguous()


def _per_batch_rows(mask: torch.Tensor) -> Tuple[Optional[torch.Tensor], str]:
    """The mask right-aligned to 4-D with its head dim removed: ``[B or 1, Nq or 1, Nk or 1]``."""
    m = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    if m.shape[1] != 1 and not bool((m == m[:, :1]).all()):
        return None, "attn_mask that differs between heads"
    return m[:, 0], ""


def analyse_mask(attn_mask: Optional[torch.Tensor], is_causal: bool, batch: int, n_q: int, n_k: int) -> MaskAnalysis:
    """Fold an SDPA mask (with the call's ``is_causal``) into ``(is_causal, key_padding_mask)``."""
    if attn_mask is None:
        return MaskAnalysis(True, is_causal=is_causal)
    mask = _as_bool(attn_mask)
    if mask is None:
        return MaskAnalysis(False, reason=f"attn_mask of dtype {attn_mask.dtype} with values other than 0/-inf")
    rows, reason = _per_batch_rows(mask)
    if rows is None:
        return MaskAnalysis(False, reason=reason)
    if rows.shape[1] == 1:  # one row for every query: key padding, with the call's causality
        return MaskAnalysis(True, is_causal=is_causal, key_padding_mask=_padding_or_none(rows[:, 0], batch, n_k))
    rows = rows.expand(rows.shape[0], n_q, n_k)
    if is_causal:
        rows = with_causality(rows, n_q, n_k)
    if bool((rows == rows[:, :1]).all()):  # every query row alike: key padding
        return MaskAnalysis(True, is_causal=False, key_padding_mask=_padding_or_none(rows[:, 0], batch, n_k))
    if n_q == n_k:
        kpm = rows[:, -1]  # the last query sees every key that is valid
        if bool((rows == with_causality(kpm[:, None, :], n_q, n_k)).all()):
            return MaskAnalysis(True, is_causal=True, key_padding_mask=_padding_or_none(kpm, batch, n_k))
        window = _causal_window(rows)
        if window is not None:
            kpm, sliding, chunk = window
            return MaskAnalysis(
                True,
                is_causal=True,
                key_padding_mask=_padding_or_none(kpm, batch, n_k),
                sliding_window=sliding,
                chunk_size=chunk,
            )
    return MaskAnalysis(
        False, reason=f"attn_mask of shape {tuple(attn_mask.shape)} that is neither causal nor key padding"
    )


def _causal_window(rows: torch.Tensor) -> Optional[Tuple[torch.Tensor, int, int]]:
    """``(key padding [B, N], sliding_window, chunk_size)`` when the square ``rows [B, N, N]`` are
    exactly causal & key padding & one local window, else None. A valid key is visible at least
    to its own query, so the padding is the keys any query sees; the window is read from the
    valid keys the mask hides below the diagonal, then the whole mask is checked against it."""
    n = rows.shape[-1]
    kpm = rows.any(dim=1)
    hidden = with_causality(kpm[:, None, :], n, n) & ~rows  # valid, causally visible, masked
    if not bool(hidden.any()) or bool((rows & ~with_causality(kpm[:, None, :], n, n)).any()):
        return None
    j = torch.arange(n, device=rows.device)
    last_hidden = torch.where(hidden, j, -1).amax(dim=(0, 2))  # per query: its window starts after it
    p = torch.nonzero(last_hidden >= 0)[:, 0]
    sliding = int((p - last_hidden[p]).min())  # the query whose window is tightest: W = p - (start - 1)
    first = int(p[0])
    chunk = int(last_hidden[first]) + 1  # the first query that loses a key starts the second chunk
    for window in ((sliding, 0), (0, chunk)):
        want = with_causality(kpm[:, None, :], n, n) & (j[None, :] >= window_lower_bounds(j[:, None], *window))
        if bool((rows == want).all()):
            return kpm, window[0], window[1]
    return None
