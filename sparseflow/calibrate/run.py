"""Calibrate a loaded model: the dense pass, the single-layer table, the search, the held-out
check and the recipe (:func:`calibrate`; the method is described in :mod:`sparseflow.calibrate`)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ..config import AttentionConfig, default_config
from ..eval.evaluate import dense_logits
from ..hf import local_windows
from .choices import Choice, candidate_choices, sparse_spec
from .grid import LazyGrid, measure_all, single_layer_report
from .inputs import layer_inputs
from .measure import measure_plan
from .plan_search import search
from .progress import Progress, progress_key
from .recipe import build_recipe
from .session import Session, plan_of_choices

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
    input_ids: torch.Tensor,
    method: str,
    kl_budget: float,
    *,
    base: Optional[AttentionConfig] = None,
    eval_positions: int = 512,
    heldout_ids: Optional[torch.Tensor] = None,
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
    :mod:`sparseflow.calibrate`). ``input_ids``: ``[1, N]`` calibration tokens, fidelity over the last
    ``eval_positions`` predictions; ``heldout_ids``: tokens the plan is checked on afterwards.
    ``progress_path``: the JSON file single-layer results are kept in (resume). ``prune``:
    measure only the choices the search can need (:class:`LazyGrid`; the same plan), else all.
    ``margin``: the share of ``kl_budget`` the plan may use on the calibration text."""
    budget = check_budget(kl_budget)
    n = input_ids.shape[1]
    base = _checked_base(method, base, safety, eval_positions, n)
    check_share(margin, "margin")
    say = say or (lambda msg: None)
    choices = list(choices) if choices is not None else candidate_choices(method, base)
    model.set_attn_implementation("sdpa")
    say(f"dense pass: logits of the last {eval_positions} positions and every layer's input ({n} tokens)")
    t_dense = time.perf_counter()
    s = Session(
        model=model,
        input_ids=input_ids,
        keep=eval_positions,
        method=method,
        base=base,
        backend=backend,
        cost=_default_cost(cost),
        dense=dense_logits(model, input_ids, eval_positions, cache_dir=cache_dir),
        windows=local_windows(model.config),
    )
    if s.windows:
        say(f"{len(s.windows)} windowed layer(s) run inside their local window, not calibrated: {sorted(s.windows)}")
    s.hidden = layer_inputs(model, input_ids)
    say(f"dense pass done ({time.perf_counter() - t_dense:.1f} s)")
    progress = Progress(None if progress_path is None else Path(progress_path), progress_key(s))
    grid = LazyGrid(s, choices, progress, say) if prune else None
    table = grid.table if grid is not None else measure_all(s, choices, progress, say)
    chosen, calib, pred_cost, steps = search(
        s,
        table,
        budget * margin,
        safety=safety,
        progress=progress,
        say=say,
        settle=None if grid is None else grid.settle,
    )
    single = single_layer_report(s, choices, table, grid)
    say(single["summary"])
    heldout = None
    if heldout_ids is not None:
        say(f"held-out check on {heldout_ids.shape[1]} tokens")
        ho_dense = dense_logits(model, heldout_ids, eval_positions, cache_dir=cache_dir)
        heldout = measure_plan(s, plan_of_choices(s, chosen), input_ids=heldout_ids, dense=ho_dense)
    measured = {
        "budget": budget,
        "method": method,
        "text": text,
        "heldout_text": heldout_text,
        "cost_model": s.cost,
        # the dtype every KL and time above was measured in (a plan's fidelity is that dtype's)
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "device": str(next(model.parameters()).device),
        "backend": backend,
        "safety": safety,
        "margin": margin,
        "calibration_target": budget * margin,
        "calibration": calib,
        "heldout": heldout,
        "predicted_cost": pred_cost,
        "search": steps,
        "per_layer": [{"layer": i, "choice": c.key, **table[i][c].to_dict()} for i, c in enumerate(chosen)],
        "single_layer": single,
        "windowed_layers": {str(i): {"sliding_window": w, "chunk_size": c} for i, (w, c) in sorted(s.windows.items())},
        **(extra or {}),
    }
    rname = name or f"calibrated-{model.config.model_type}-{method}"
    recipe = build_recipe(s, chosen, name=rname, measured=measured)
    return CalibrationResult(
        recipe=recipe, choices=chosen, calibration=calib, heldout=heldout, predicted_cost=pred_cost, steps=steps
    )


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
