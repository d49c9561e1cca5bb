"""Fidelity of a sparse model against its dense original on the same tokens."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import torch

__all__ = ["Fidelity", "compare_logits", "row_kl"]


@dataclass(frozen=True)
class Fidelity:
    positions: int
    mean_kl: float  # mean over positions of KL(dense || sparse) of the next-token distribution, nats
    p99_kl: float
    top1_agreement: float  # fraction of positions whose argmax agrees
    ppl_dense: float
    ppl_sparse: float

    @property
    def ppl_delta(self) -> float:
        return self.ppl_sparse - self.ppl_dense

    def to_dict(self) -> dict:
        return {**asdict(self), "ppl_delta": self.ppl_delta}


def row_kl(
    log_p_dense: torch.Tensor, log_p_sparse: torch.Tensor, p_dense: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """KL(dense || sparse) per row of ``[T, V]`` log-probabilities (``p_dense``: their exp, when
    the caller keeps it), clamped at 0 against rounding."""
    if log_p_dense.dim() != 2 or log_p_sparse.shape != log_p_dense.shape:
        raise ValueError(
            f"log_p_dense and log_p_sparse must both be [T, V], got {tuple(log_p_dense.shape)} and "
            f"{tuple(log_p_sparse.shape)}"
        )
    if p_dense is not None and p_dense.shape != log_p_dense.shape:
        raise ValueError(f"p_dense must be {tuple(log_p_dense.shape)} like log_p_dense, got {tuple(p_dense.shape)}")
    p = log_p_dense.exp() if p_dense is None else p_dense
    return (p * (log_p_dense - log_p_sparse)).sum(-1).clamp_min(0.0)


def compare_logits(dense: torch.Tensor, sparse: torch.Tensor, targets: torch.Tensor) -> Fidelity:
    """``dense, sparse: [T, V]`` logits at the same positions; ``targets: [T]`` next tokens."""
    if dense.shape != sparse.shape or dense.dim() != 2:
        raise ValueError(
            f"dense and sparse logits must both be [T, V], got {tuple(dense.shape)} and {tuple(sparse.shape)}"
        )
    if targets.shape != dense.shape[:1]:
        raise ValueError(f"targets must be [T]={dense.shape[0]}, got {tuple(targets.shape)}")
    sparse, targets = sparse.to(dense.device), targets.to(dense.device)
    lp_d = torch.log_softmax(dense.double(), dim=-1)
    lp_s = torch.log_softmax(sparse.double(), dim=-1)
    kl = row_kl(lp_d, lp_s)
    nll_d = -lp_d.gather(-1, targets[:, None]).squeeze(-1)
    nll_s = -lp_s.gather(-1, targets[:, None]).squeeze(-1)
    return Fidelity(
        positions=int(dense.shape[0]),
        mean_kl=float(kl.mean()),
        p99_kl=float(torch.quantile(kl, 0.99)) if kl.numel() > 1 else float(kl.max()),
        top1_agreement=float((dense.argmax(-1) == sparse.argmax(-1)).double().mean()),
        ppl_dense=float(nll_d.mean().exp()),
        ppl_sparse=float(nll_s.mean().exp()),
    )
