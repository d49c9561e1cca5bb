"""Hypothesis strategies for attention problems that break kernels: odd lengths, GQA group 3,
head dims 32-256, padding. ``hypothesis`` is imported here only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from hypothesis import strategies as st

__all__ = ["AttentionProblem", "attention_problems"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class AttentionProblem:
    batch: int
    hkv: int
    group: int
    n: int
    d: int
    dtype: str
    seed: int
    pad: int  # keys/queries padded away at the right end of the last batch row (0: none)

    @property
    def hq(self) -> int:
        return self.hkv * self.group

    def tensors(self, device="cpu"):
        g = torch.Generator().manual_seed(self.seed)
        dt = _DTYPES[self.dtype]
        q = torch.randn(self.batch, self.hq, self.n, self.d, generator=g).to(device, dt)
        k = torch.randn(self.batch, self.hkv, self.n, self.d, generator=g).to(device, dt)
        v = torch.randn(self.batch, self.hkv, self.n, self.d, generator=g).to(device, dt)
        return q, k, v

    def key_padding_mask(self, device="cpu") -> Optional[torch.Tensor]:
        if not self.pad:
            return None
        m = torch.ones(self.batch, self.n, dtype=torch.bool, device=device)
        m[-1, self.n - self.pad :] = False
        return m

    def __str__(self) -> str:  # readable hypothesis reports
        return f"B{self.batch}-Hq{self.hq}-Hkv{self.hkv}-N{self.n}-D{self.d}-{self.dtype}-pad{self.pad}-seed{self.seed}"


@st.composite
def attention_problems(
    draw,
    *,
    min_n: int = 1,
    max_n: int = 300,
    head_dims=(32, 48, 64, 80, 128, 256),
    dtypes=("float32", "bfloat16", "float16"),
    max_batch: int = 2,
    padding: bool = True,
):
    n = draw(st.integers(min_n, max_n))
    d = draw(st.sampled_from(head_dims))
    pad = draw(st.integers(0, n)) if padding and draw(st.booleans()) else 0
    return AttentionProblem(
        batch=draw(st.integers(1, max_batch)),
        hkv=draw(st.integers(1, 2)),
        group=draw(st.sampled_from((1, 2, 3))),
        n=n,
        d=d,
        dtype=draw(st.sampled_from(dtypes)),
        seed=draw(st.integers(0, 2**31 - 1)),
        pad=pad,
    )
