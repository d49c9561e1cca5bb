"""Calibrate a loaded model: the dense pass, the single-layer table, the search, the held-out
check and the recipe (:func:`calibrate`; the method is described in :mod:`sparseflow.calibrate`)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..config import AttentionConfig, default_config
from ..eval.evaluate import dense_logits
from .choices import DENSE, Choice, candidate_choices, sparse_spec
from .grid import LazyGrid, measure_all, single_layer_report
from .measure import measure_plan
from .mix import combine_fidelity, mix_key, open_mix
from .plan_search import search
from .progress import Progress
from .recipe import build_recipe
from .session import Session, plan_of_choices
from .texts import Texts, check_disjoint, named_texts, text_kinds

# Share of the KL budget the plan may use on the calibration text. On SmolLM2 (2048 tokens,
# calibrated on prose, checked on code) the same plan's KL on the held-out text was 1.34-2.46x its
# calibration KL, the most at the smallest budgets (docs/results.md, "Calibrated plans"). The CLI
# repeats the value (it imports only the standard library at the top); a test keeps them equal.
DEFAULT_MARGIN = 0.7


@dataclass
class CalibrationResult:
    recipe: Any  # sparseflow.recipes.Recipe
    choices: List[Choice]  # per layer
    calibration: Dict[str, Any]
    heldout: Optional[Dict[str, Any]]
    predicted_cost: float
    steps: List[Dict[str, Any]] = field(default_factory=list)


def check_budget(budget) -> float:
    """``budget`` as a float: a positive, finite mean KL in nats."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not (0.0 < float(budget) < math.inf):
        raise ValueError(f"kl_budget must be a positive, finite number of nats (e.g. 0.01), got {budget!r}")
    return float(budget)


def _default_cost(cost: str) -> str:
    """The cost model ``cost`` names; "auto": the op's time where CUDA is present, else density."""
    if cost == "auto":
        return "time" if torch.cuda.is_available() else "density"
    if cost not in ("density", "time"):
        raise ValueError(f"cost must be auto, density or time, got {cost!r}")
    return cost


def calibrate(
    model,
    input_ids: Texts,
    method: str,
    kl_budget: float,
    *,
    base: Optional[AttentionConfig] = None,
    eval_positions: int = 512,
    heldout_ids: Optional[Texts] = None,
    choices: Optional[Sequence[Choice]] = None,
    safety: float = 0.8,
    margin: float = DEFAULT_MARGIN,
    cost: str = "auto",
    backend: str = "auto",
    progress_path=None,
    cache_dir=None,
    name: Optional[str] = None,
    text: str = "",
    heldout_text: str = "",
    say: Optional[Callable[[str], None]] = None,
    extra: Optional[Dict[str, Any]] = None,
    prune: bool = True,
) -> CalibrationResult:
    """Calibrate a per-layer plan of ``method`` for a transformers causal LM (see
    :mod:`sparseflow.calibrate`). ``input_ids``: ``[1, N]`` calibration tokens (named ``text``), or
    a mapping of text name to tokens (a mix, :mod:`.mix`: the plan's KL is its worst text's);
    fidelity over the last ``eval_positions`` predictions. ``heldout_ids``: the same for the texts
    the plan is checked on afterwards (none of them a calibration text). ``progress_path``: the
    JSON file single-layer results are kept in (resume). ``prune``: measure only the choices the
    search can need (:class:`LazyGrid`; the same plan), else all. ``margin``: the share of
    ``kl_budget`` the plan may use on the calibration text."""
    budget = check_budget(kl_budget)
    ids = named_texts(input_ids, text or "calibration", "input_ids")
    heldout = None if heldout_ids is None else named_texts(heldout_ids, heldout_text or "heldout", "heldout_ids")
    check_disjoint(ids, heldout or {}, "heldout_ids")
    base = _checked_base(method, base, safety, eval_positions, min(t.shape[1] for t in ids.values()))
    check_share(margin, "margin")
    say = say or (lambda msg: None)
    choices = list(choices) if choices is not None else candidate_choices(method, base)
    kinds = text_kinds(list(ids) + list(heldout or {}))
    model.set_attn_implementation("sdpa")
    t_dense = time.perf_counter()
    cost = _default_cost(cost)
    mix = open_mix(
        model, ids, kinds, cache_dir, say, keep=eval_positions, method=method, base=base, backend=backend, cost=cost
    )
    if mix.windows:
        say(
            f"{len(mix.windows)} windowed layer(s) run inside their local window, not calibrated: {sorted(mix.windows)}"
        )
    say(f"dense passes done ({time.perf_counter() - t_dense:.1f} s)")
    progress = Progress(None if progress_path is None else Path(progress_path), mix_key(mix))
    grid = LazyGrid(mix, choices, progress, say) if prune else None
    table = grid.table if grid is not None else measure_all(mix, choices, progress, say)
    chosen, calib, pred_cost, steps = search(
        mix, table, budget * margin, safety=safety, progress=progress, say=say,
        settle=None if grid is None else grid.settle,
    )  # fmt: skip
    searched = chosen
    chosen, ran_dense = dense_where_run_dense(searched, calib.get("density_per_layer") or (), mix.windows)
    if ran_dense:
        say(
            f"layers {ran_dense} ran dense in the plan's measurement (backend {backend!r} chose dense SDPA, or "
            "every block was kept): written as dense layers, so the recipe runs what was measured on any backend"
        )
    single = single_layer_report(mix, choices, table, grid)
    say(single["summary"])
    held = None if heldout is None else heldout_check(mix.first, chosen, heldout, kinds, cache_dir, say)
    measured = {
        "budget": budget,
        "method": method,
        "text": ",".join(ids),
        "heldout_text": ",".join(heldout or {}),
        "kinds": kinds,
        "constraint": "worst text" if len(ids) > 1 else "the text",
        "cost_model": mix.first.cost,
        # the dtype every KL and time above was measured in (a plan's fidelity is that dtype's)
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "device": str(next(model.parameters()).device),
        "backend": backend,
        "safety": safety,
        "margin": margin,
        "calibration_target": budget * margin,
        "calibration": calib,
        "heldout": held,
        "predicted_cost": pred_cost,
        "search": steps,
        # what the search chose per layer (a layer in ran_dense is written dense)
        "per_layer": [{"layer": i, "choice": c.key, **table[i][c].to_dict()} for i, c in enumerate(searched)],
        "ran_dense": ran_dense,
        "single_layer": single,
        "windowed_layers": {
            str(i): {"sliding_window": w, "chunk_size": c} for i, (w, c) in sorted(mix.windows.items())
        },
        **(extra or {}),
    }
    rname = name or f"calibrated-{model.config.model_type}-{method}"
    recipe = build_recipe(mix.first, chosen, name=rname, measured=measured)
    return CalibrationResult(
        recipe=recipe, choices=chosen, calibration=calib, heldout=held, predicted_cost=pred_cost, steps=steps
    )


def dense_where_run_dense(chosen, density_per_layer, windows) -> Tuple[List[Choice], List[int]]:
    """``(choices, layers)``: ``chosen`` with every sparse choice whose layer ran dense in the plan's
    measurement (density 1: ``backend="auto"`` found dense SDPA faster there, or every block was
    kept) made dense, and those layers. Written as they are, a recipe run with a forced sparse
    backend would run those layers sparse, which the calibration never measured."""
    ran = [
        i
        for i, (c, d) in enumerate(zip(chosen, density_per_layer))
        if not c.dense and i not in windows and d is not None and d >= 1.0
    ]
    return [DENSE if i in ran else c for i, c in enumerate(chosen)], ran


def heldout_check(s: Session, chosen, heldout: Dict[str, torch.Tensor], kinds, cache_dir, say) -> Dict[str, Any]:
    """The plan's fidelity on each held-out text (:func:`combine_fidelity`: worst KL, each text's own)."""
    per = {}
    for text, ids in heldout.items():
        say(f"held-out check on {ids.shape[1]} tokens of {text}")
        dense = dense_logits(s.model, ids, s.keep, cache_dir=cache_dir)
        per[text] = measure_plan(s, plan_of_choices(s, chosen), input_ids=ids, dense=dense)
    return combine_fidelity(per, kinds)


def check_share(value, name: str) -> None:
    """Refuse a share (``safety``, ``margin``) outside (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 < value <= 1.0):
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")


def _checked_base(
    method: str, base: Optional[AttentionConfig], safety: float, eval_positions: int, n: int
) -> AttentionConfig:
    """The base config of ``method`` (its default when None), after checking the arguments."""
    sparse_spec(method, "method")
    check_share(safety, "safety")
    if not (1 <= eval_positions < n):
        raise ValueError(f"eval_positions must be in [1, {n - 1}], got {eval_positions}")
    base = base or default_config(method)
    if base.method != method:
        raise ValueError(f"base config is for {base.method!r}, not {method!r}")
    return base
