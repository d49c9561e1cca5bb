"""The dense tail of a PBS prefill (``PBSConfig.dense_tail_blocks``), shared by every backend.

The last query blocks attend every visible key (every key of their rows' windows, under a local
window); the reported selection marks those rows' blocks as kept, so its key mask and density
describe what ran. The Triton backend's selection kernel
keeps those blocks itself, so its attention kernel computes the rows in the same launch as the
sparse ones (``triton_select``'s ``dense_from``). The other backends, and the Triton backend with
the torch selection, call :func:`apply_tail`: SDPA over every visible key replaces the tail rows.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..._config_base import window_lower_bounds


def tail_first_block(n: int, block_size: int, tail_blocks: int) -> int:
    """The first query block of the dense tail (the number of blocks when there is none)."""
    n_blocks = -(-n // block_size)
    return n_blocks if tail_blocks <= 0 else max(0, n_blocks - tail_blocks)


def tail_start(n: int, block_size: int, tail_blocks: int) -> int:
    """The first query row of the dense tail (``n`` when there is none)."""
    return n if tail_blocks <= 0 else tail_first_block(n, block_size, tail_blocks) * block_size


def _dense_rows(q_tail, k, v, start, key_padding_mask, is_causal, scale, fp32, window=(0, 0)) -> Tensor:
    b, hq, t, _ = q_tail.shape
    n = k.shape[2]
    dev = q_tail.device
    mask = None
    if is_causal:
        rows, keys = torch.arange(start, start + t, device=dev)[:, None], torch.arange(n, device=dev)[None, :]
        visible = keys <= rows
        if window != (0, 0):
            visible = visible & (keys >= window_lower_bounds(rows, *window))
        mask = visible[None, None].expand(b, 1, t, n)
    if key_padding_mask is not None:
        padding = key_padding_mask.to(torch.bool)[:, None, None, :]
        mask = padding.expand(b, 1, t, n) if mask is None else mask & padding
    if fp32:  # at least float32 (the reference's accumulation); float64 stays float64
        wide = torch.promote_types(q_tail.dtype, torch.float32)
        q_tail, k, v = q_tail.to(wide), k.to(wide), v.to(wide)
    rows = F.scaled_dot_product_attention(q_tail, k, v, attn_mask=mask, scale=scale, enable_gqa=hq != k.shape[1])
    return rows if mask is None else rows.masked_fill(~mask.any(-1, keepdim=True), 0.0)


def mark_tail(block_mask: Optional[Tensor], tail_blocks: int) -> Optional[Tensor]:
    """``block_mask`` ``[B, Hq, nQB, nKB]`` with the tail's query blocks keeping every key block
    (visibility is applied wherever a block mask is read: the key mask and the density)."""
    if block_mask is None or tail_blocks <= 0:
        return block_mask
    marked = block_mask.clone()
    marked[:, :, max(0, marked.shape[2] - tail_blocks) :, :] = True
    return marked


def apply_tail(out, block_mask, q, k, v, cfg, *, key_padding_mask, is_causal, scale, fp32: bool = False):
    """``(out, block_mask)`` with ``cfg.dense_tail_blocks`` applied to both (a backend's last step):
    the tail rows of ``out`` replaced by dense attention over the visible keys (inside each row's
    window when ``cfg`` has one; rows that see no key are zero, as the sparse kernels leave them)
    and the tail's blocks marked kept. ``fp32``: compute the rows in at least float32 (the
    reference's accumulation)."""
    n = q.shape[2]
    start = tail_start(n, cfg.block_size, cfg.dense_tail_blocks)
    if start >= n:
        return out, block_mask
    window = (cfg.sliding_window, cfg.chunk_size)  # (causal only: the backends check it)
    rows = _dense_rows(q[:, :, start:], k, v, start, key_padding_mask, is_causal, scale, fp32, window)
    out = torch.cat([out[:, :, :start], rows.to(out.dtype)], dim=2)
    return out, mark_tail(block_mask, cfg.dense_tail_blocks)
