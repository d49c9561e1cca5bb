"""What an attention op computed: its block selection and the density it reached.

Torch-only and shared by every method, so the reference implementations, the kernels and the
tests speak one format. Two selection shapes exist:

* block-level over a key layout (PBS): ``block_mask[b, h, qb, kb]`` says whether query block
  ``qb`` of head ``h`` attends key block ``kb`` of the *permuted* key order, and
  ``permutation[b, hp, j]`` gives the original position of the key at permuted slot ``j``;
* token-level (PISA, BSA): ``block_indices[b, hkv, t, :]`` lists the leaf blocks (original key
  order, ascending, ``-1`` padded) that query token ``t`` of KV group ``hkv`` attends.

``density`` is always ``[B, Hq]`` float32: computed block pairs (PBS) or blocks per token
(PISA/BSA), divided by the causally visible ones, counting only blocks that hold at least one
key the query may see (inside its local window, when the call had one).

A selection made inside a local window carries it (``sliding_window``, ``chunk_size``): its key
masks hold only the keys of each query's window, as the attention computed them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ._config_base import check_window, window_lower_bounds

__all__ = ["Selection", "visible_key_mask"]


def visible_key_mask(
    n_q: int,
    n_k: int,
    *,
    is_causal: bool,
    key_padding_mask: Optional[torch.Tensor] = None,
    batch: int = 1,
    device=None,
    sliding_window: int = 0,
    chunk_size: int = 0,
) -> torch.Tensor:
    """``[B, Nq, Nk]`` bool: key j is visible to query i (causal needs Nq == Nk), inside its local
    window when one is given (``sliding_window`` / ``chunk_size``, AttentionConfig's meaning)."""
    check_window(sliding_window, chunk_size, is_causal)
    if is_causal:
        if n_q != n_k:
            raise ValueError(f"causal visibility needs Nq == Nk, got Nq={n_q}, Nk={n_k}")
        base = torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril()
    else:
        base = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
    if sliding_window or chunk_size:
        base = base & _window_rows(torch.arange(n_q, device=device), n_k, sliding_window, chunk_size)
    base = base.unsqueeze(0).expand(batch, n_q, n_k)
    if key_padding_mask is not None:
        base = base & key_padding_mask[:, None, :].to(torch.bool)
    return base


def _window_rows(positions: torch.Tensor, n_k: int, sliding_window: int, chunk_size: int) -> torch.Tensor:
    """``[len(positions), Nk]`` bool: key j is at or after the window's lower bound of each query
    position (the causal side is the caller's)."""
    lo = window_lower_bounds(positions, sliding_window, chunk_size)
    return torch.arange(n_k, device=positions.device)[None, :] >= lo[:, None]


@dataclass(frozen=True)
class Selection:
    """The selection one op call made. Tensors live on the op's device."""

    method: str
    density: torch.Tensor  # [B, Hq] float32
    block_size: int
    is_causal: bool
    num_keys: int
    # PBS (block-level over permuted keys)
    block_mask: Optional[torch.Tensor] = None  # [B, Hq, nQB, nKB] bool
    permutation: Optional[torch.Tensor] = None  # [B, Hp, Nk] int64, Hp in {Hq, Hkv}
    # PISA / BSA (token-level over original keys)
    block_indices: Optional[torch.Tensor] = None  # [B, Hkv, Nq, K] int64, -1 padded
    key_padding_mask: Optional[torch.Tensor] = None  # [B, Nk] bool, True = valid key
    sliding_window: int = 0  # the call's local window (0: none): the key masks stay inside it
    chunk_size: int = 0

    @property
    def mean_density(self) -> float:
        return float(self.density.float().mean())

    def key_mask(self, num_query_heads: int) -> torch.Tensor:
        """Dense ``[B, Hq, Nq, Nk]`` bool over *original* key positions: the keys each query
        attends under this selection, causality and padding included. For tests and
        diagnostics on small shapes (it is quadratic in memory)."""
        if self.block_mask is not None:
            return self._key_mask_from_blocks(num_query_heads)
        if self.block_indices is not None:
            return self._key_mask_from_indices(num_query_heads)
        raise ValueError(f"selection of method {self.method!r} carries no blocks")

    def row_keys(self, query: int, num_query_heads: int) -> torch.Tensor:
        """``[B, Hq, Nk]`` bool over *original* key positions: the keys query ``query`` attends,
        causality and padding included; row ``query`` of :meth:`key_mask`, in linear memory (for
        diagnostics at long lengths, e.g. whether the last prompt token still sees a needle)."""
        n_q = self.block_indices.shape[2] if self.block_indices is not None else self.num_keys  # PBS: Nq == Nk
        if not (0 <= query < n_q):
            raise ValueError(f"query must be in [0, {n_q}), got {query}")
        if self.block_mask is not None:
            keys = self._row_from_blocks(query, num_query_heads)
        elif self.block_indices is not None:
            keys = self._row_from_indices(query, num_query_heads)
        else:
            raise ValueError(f"selection of method {self.method!r} carries no blocks")
        visible = torch.ones(self.num_keys, dtype=torch.bool, device=keys.device)
        if self.is_causal:
            visible[query + 1 :] = False
        if self.sliding_window or self.chunk_size:
            pos = torch.tensor([query + self.num_keys - n_q], device=keys.device)
            visible &= _window_rows(pos, self.num_keys, self.sliding_window, self.chunk_size)[0]
        keys = keys & visible
        if self.key_padding_mask is not None:
            keys = keys & self.key_padding_mask[:, None, :].to(torch.bool)
        return keys

    def _visibility(self) -> dict:
        """The :func:`visible_key_mask` arguments of this selection's call."""
        return dict(
            is_causal=self.is_causal,
            key_padding_mask=self.key_padding_mask,
            sliding_window=self.sliding_window,
            chunk_size=self.chunk_size,
        )

    def _row_from_blocks(self, query: int, hq: int) -> torch.Tensor:
        bm, perm = self.block_mask, self.permutation
        slot_block = torch.arange(self.num_keys, device=bm.device) // self.block_size
        per_slot = bm[:, :, query // self.block_size, :][..., slot_block]  # [B, Hq, Nk] by permuted slot
        perm_q = perm.repeat_interleave(hq // perm.shape[1], dim=1)  # [B, Hq, Nk]
        return torch.zeros_like(per_slot).scatter_(-1, perm_q, per_slot)

    def _row_from_indices(self, query: int, hq: int) -> torch.Tensor:
        idx = self.block_indices[:, :, query, :]  # [B, Hkv, K]
        n_blocks = -(-self.num_keys // self.block_size)
        blocks = torch.zeros(*idx.shape[:2], n_blocks + 1, dtype=torch.bool, device=idx.device)
        blocks.scatter_(-1, torch.where(idx < 0, torch.full_like(idx, n_blocks), idx), True)
        key_block = torch.arange(self.num_keys, device=idx.device) // self.block_size
        return blocks[..., key_block].repeat_interleave(hq // idx.shape[1], dim=1)

    def _key_mask_from_blocks(self, hq: int) -> torch.Tensor:
        bm, perm = self.block_mask, self.permutation
        b, _, nqb, nkb = bm.shape
        n_k = self.num_keys
        n_q = n_k  # PBS selections are made for prefill, Nq == Nk
        bs = self.block_size
        q_block = torch.arange(n_q, device=bm.device) // bs  # [Nq]
        slot_block = torch.arange(n_k, device=bm.device) // bs  # [Nk] block of permuted slot
        # rows: [B, Hq, Nq, nKB] -> per permuted slot
        per_q = bm[:, :, q_block, :]  # [B, Hq, Nq, nKB]
        per_slot = per_q[..., slot_block]  # [B, Hq, Nq, Nk] indexed by permuted slot
        group = hq // perm.shape[1]
        perm_q = perm.repeat_interleave(group, dim=1)  # [B, Hq, Nk]
        out = torch.zeros_like(per_slot)
        out.scatter_(-1, perm_q[:, :, None, :].expand_as(per_slot), per_slot)
        vis = visible_key_mask(n_q, n_k, batch=b, device=bm.device, **self._visibility())
        return out & vis[:, None]

    def _key_mask_from_indices(self, hq: int) -> torch.Tensor:
        idx = self.block_indices
        b, hkv, n_q, _ = idx.shape
        n_k = self.num_keys
        n_blocks = -(-n_k // self.block_size)
        blocks = torch.zeros(b, hkv, n_q, n_blocks + 1, dtype=torch.bool, device=idx.device)
        safe = torch.where(idx < 0, torch.full_like(idx, n_blocks), idx)
        blocks.scatter_(-1, safe, True)
        blocks = blocks[..., :n_blocks]
        key_block = torch.arange(n_k, device=idx.device) // self.block_size
        per_key = blocks[..., key_block]  # [B, Hkv, Nq, Nk]
        per_key = per_key.repeat_interleave(hq // hkv, dim=1)
        vis = visible_key_mask(n_q, n_k, batch=b, device=idx.device, **self._visibility())
        return per_key & vis[:, None]
