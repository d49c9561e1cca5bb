"""The search for the cheapest plan on the greedy walk whose measured whole-model KL fits the
calibration target: each round's measurement corrects the allowed single-layer KL sum."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .choices import DENSE, Choice
from .greedy import chosen_options, greedy_plan
from .mix import Mix, measure_mix_plan
from .progress import Progress

GROW_BELOW = 0.8  # a passing plan this far under the budget leaves room for a cheaper one


def search(
    s: Mix,
    table,
    budget: float,
    *,
    safety: float,
    progress: Progress,
    say: Callable[[str], None],
    max_rounds: int = 8,
    settle: Optional[Callable[[float], None]] = None,
) -> Tuple[List[Choice], Dict[str, Any], float, List[Dict[str, Any]]]:
    """The cheapest plan found on the greedy walk whose measured whole-model KL is within
    ``budget`` (all-dense at worst). Returns (choices per layer, its calibration fidelity,
    predicted cost, the steps taken). The walk is one family of plans, cheaper as the allowed
    single-layer KL sum grows; the sum predicts the measured KL only roughly (layers interact, and
    in bf16 every sparse layer adds a rounding floor), so each measurement corrects the allowed
    sum (:func:`_next_allowed`): shrunk while the plan is over budget, grown while it is under
    ``GROW_BELOW`` of it, bisected once a plan on each side is known. ``settle(allowed)``: fills
    ``table`` with what the walk at ``allowed`` needs (:meth:`LazyGrid.settle`) before each round."""
    allowed = budget * safety
    steps: List[Dict[str, Any]] = []
    best: Optional[Tuple[float, List[Choice], Dict[str, Any]]] = None  # (cost, choices, fidelity)
    bounds = _Bracket()
    seen: Dict[Tuple[str, ...], Tuple[float, float]] = {}  # plan -> (predicted, measured KL)
    for _ in range(max_rounds):
        if settle is not None:
            settle(allowed)
        picks = greedy_plan(table, allowed)
        chosen = chosen_options(table, picks)
        choices = [c for c, _ in chosen]
        key = tuple(c.key for c in choices)
        if key not in seen:
            predicted = sum(m.kl for _, m in chosen)
            fid = _measured_plan(s, choices, progress)
            cost = sum(m.cost for _, m in chosen) / len(chosen)
            seen[key] = (predicted, fid["mean_kl"])
            steps.append({"allowed": allowed, "predicted_kl": predicted, "measured_kl": fid["mean_kl"], "cost": cost})
            say(
                f"plan at allowed KL sum {allowed:.5f}: predicted {predicted:.5f}, measured {fid['mean_kl']:.5f}, "
                f"cost {cost:.3f}, {sum(c.dense for i, c in enumerate(choices) if i not in s.windows)} dense layer(s)"
            )
            if fid["mean_kl"] <= budget and (best is None or cost < best[0]):
                best = (cost, choices, fid)
        predicted, measured = seen[key]
        bounds.add(allowed, measured <= budget)
        cheapest = all(j == 0 for j in picks)  # the walk's first plan: nothing cheaper to try
        allowed = _next_allowed(allowed, predicted, measured, budget, safety, bounds, cheapest)
        if allowed is None:
            break
    if best is not None:
        return best[1], best[2], best[0], steps
    chosen = [DENSE] * s.n_layers
    say(f"no plan on the walk met KL <= {budget} within {max_rounds} rounds: every layer dense")
    return chosen, _measured_plan(s, chosen, progress), 1.0, steps


@dataclass
class _Bracket:
    """The largest allowed sum whose plan fit the budget, and the smallest whose plan did not."""

    fits: Optional[float] = None
    over: Optional[float] = None

    def add(self, allowed: float, fits: bool) -> None:
        if fits:
            self.fits = allowed if self.fits is None else max(self.fits, allowed)
        else:
            self.over = allowed if self.over is None else min(self.over, allowed)


def _next_allowed(
    allowed: float,
    predicted: float,
    measured: float,
    budget: float,
    safety: float,
    bounds: _Bracket,
    cheapest: bool,
) -> Optional[float]:
    """The allowed single-layer KL sum of :func:`search`'s next round, after the plan at
    ``allowed`` predicted ``predicted`` and measured ``measured``; None: stop."""
    if measured <= budget and (measured >= GROW_BELOW * budget or cheapest):
        return None  # close enough to the budget, or the walk has no cheaper plan
    if bounds.fits is not None and bounds.over is not None:
        if bounds.over <= bounds.fits * 1.01:
            return None  # the bracket has closed
        return math.sqrt(bounds.fits * bounds.over)
    if measured <= budget:  # grow by the headroom the measurement shows, at most 4x a round
        return allowed * min(4.0, max(1.25, safety * budget / max(measured, 1e-12)))
    if predicted <= 0.0:
        return None
    # shrink by the measured/predicted ratio, and at least a little, so each round moves
    return min(allowed * 0.9, predicted * budget / measured * safety)


def _measured_plan(s: Mix, chosen: Sequence[Choice], progress: Progress) -> Dict[str, Any]:
    """:func:`measure_mix_plan` of ``chosen`` (its worst text's KL), from the progress file where present."""
    key = "|".join(c.key for c in chosen)
    if key not in progress.plans:
        progress.plans[key] = measure_mix_plan(s, chosen)
        progress.save()
    return progress.plans[key]
