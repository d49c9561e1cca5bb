"""Measurements against the dense model: one layer running one choice (:func:`measure_layer`,
kept in the progress file by :func:`measure_entry`), and a whole plan (:func:`measure_plan`)."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ..eval.evaluate import evaluate_plans, last_logits
from ..eval.fidelity import row_kl
from ..hf import apply_plan
from ..recording import capture
from .choices import Choice, Measurement, estimate_overhead
from .costs import layer_cost, layer_density
from .inputs import start_at
from .progress import Progress
from .session import Session, single_layer_plan

logger = logging.getLogger("sparseflow")


def measure_layer(s: Session, layer: int, choice: Choice, cost: Optional[float] = None) -> Measurement:
    """KL vs dense with only ``layer`` running ``choice``, its density and predicted cost
    (``cost``: the choice's cost when known already, from :func:`choice_cost`)."""
    cfg = choice.config(s.base)
    apply_plan(s.model, single_layer_plan(s, layer, cfg))
    try:
        with start_at(s.model, layer, s.hidden[layer]), capture(keep_selections=False) as cap:
            logits = last_logits(s.model, s.input_ids, s.keep)
    finally:
        s.model.set_attn_implementation("sdpa")
    kl, top1 = dense_reference(s).compare(logits)
    density = layer_density(cap, layer)
    measured_cost = density + estimate_overhead(cfg) if s.cost == "density" else None
    if cost is None:
        cost = measured_cost if measured_cost is not None else layer_cost(s, layer, cfg, density)
    elif measured_cost is not None and abs(measured_cost - cost) > 1e-6:
        logger.warning(
            "sparseflow calibrate: layer %d %s: density %.6f measured in the model, %.6f from its "
            "selection alone; the model's is kept",
            layer,
            choice.key,
            density,
            cost - estimate_overhead(cfg),
        )
        cost = measured_cost
    return Measurement(kl=kl, top1=top1, density=density, cost=cost)


class DenseReference:
    """The dense side of :func:`sparseflow.eval.fidelity.compare_logits` (fp64 log-probabilities,
    probabilities, argmax), computed once for all measurements: :meth:`compare` gives the same
    mean KL and top-1 agreement, row chunk by row chunk so the fp64 work stays in cache."""

    def __init__(self, dense: torch.Tensor, chunk: int = 32):
        self.log_probs = torch.log_softmax(dense.double(), dim=-1)
        self.probs = self.log_probs.exp()
        self.argmax = dense.argmax(-1)
        self.chunk = chunk

    def compare(self, sparse: torch.Tensor) -> Tuple[float, float]:
        """``(mean KL(dense || sparse), top-1 agreement)`` of ``sparse`` logits ``[T, V]``."""
        if sparse.shape != self.log_probs.shape:
            raise ValueError(f"sparse logits must be {tuple(self.log_probs.shape)}, got {tuple(sparse.shape)}")
        sparse = sparse.to(self.log_probs.device)
        kl = torch.empty(sparse.shape[0], dtype=torch.float64, device=sparse.device)
        for i in range(0, sparse.shape[0], self.chunk):
            rows = slice(i, i + self.chunk)
            lp_s = torch.log_softmax(sparse[rows].double(), dim=-1)
            kl[rows] = row_kl(self.log_probs[rows], lp_s, self.probs[rows])
        top1 = (self.argmax == sparse.argmax(-1)).double().mean()
        return float(kl.mean()), float(top1)


def dense_reference(s: Session) -> DenseReference:
    if s.reference is None:
        s.reference = DenseReference(s.dense)
    return s.reference


def measure_entry(
    s: Session,
    layer: int,
    choice: Choice,
    progress: Progress,
    say: Callable[[str], None],
    label: str,
    cost: Optional[float] = None,
) -> Measurement:
    """One single-layer measurement, kept in the progress file at once."""
    t0 = time.perf_counter()
    m = measure_layer(s, layer, choice, cost=cost)
    progress.layers[f"{layer}:{choice.key}"] = m.to_dict()
    progress.save()
    say(
        f"{label} layer {layer} {choice.key}: KL {m.kl:.5f}, top-1 {m.top1:.3f}, "
        f"density {m.density:.3f}, cost {m.cost:.3f} ({time.perf_counter() - t0:.1f} s)"
    )
    return m


def measure_plan(
    s: Session, plan, input_ids: Optional[torch.Tensor] = None, dense: Optional[torch.Tensor] = None
) -> Dict[str, Any]:
    """Whole-model fidelity and density of ``plan`` (calibration text unless given)."""
    ids = s.input_ids if input_ids is None else input_ids
    r = evaluate_plans(s.model, ids, [plan], eval_positions=s.keep, dense=s.dense if dense is None else dense)[0]
    return {
        "mean_kl": r.fidelity.mean_kl,
        "p99_kl": r.fidelity.p99_kl,
        "top1": r.fidelity.top1_agreement,
        "ppl_dense": r.fidelity.ppl_dense,
        "ppl_sparse": r.fidelity.ppl_sparse,
        "density": r.density,
        "density_per_layer": r.density_per_layer,
        "tokens": int(ids.shape[1]),
        "positions": s.keep,
    }
