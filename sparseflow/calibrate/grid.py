"""The single-layer table the search walks: the whole grid measured (:func:`measure_all`), or only
what the search can need (:class:`LazyGrid`), and the report of what was skipped and why."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

from .choices import DENSE, DENSE_MEASUREMENT, Choice, Measurement, Table
from .greedy import unsettled
from .mix import Mix, choice_costs, kl_bound, measure_entry, screen_entry, screens
from .progress import Progress
from .session import grid_size


def measure_all(s: Mix, choices: Sequence[Choice], progress: Progress, say: Callable[[str], None]) -> Table:
    """Every (layer, choice) single-layer measurement, from the progress file where present."""
    table = stored_measurements(s, choices, progress)
    todo = [(layer, c) for layer in range(s.n_layers) for c in s.layer_choices(layer, choices)]
    for i, (layer, choice) in enumerate(todo):
        if choice not in table[layer]:
            table[layer][choice] = measure_entry(s, layer, choice, progress, say, f"[{i + 1}/{len(todo)}]")
    return table


def stored_measurements(s: Mix, choices: Sequence[Choice], progress: Progress) -> Table:
    """Dense, and the measurements of ``choices`` the progress file holds, per layer."""
    table: Table = {}
    for layer in range(s.n_layers):
        table[layer] = {DENSE: DENSE_MEASUREMENT}
        for choice in s.layer_choices(layer, choices):
            got = progress.layers.get(f"{layer}:{choice.key}")
            if got is not None:
                table[layer][choice] = Measurement(**got)
    return table


@dataclass
class LazyGrid:
    """The choice grid measured on demand: every choice's cost is known first (its selection's
    density, or its time), and :meth:`settle` measures only the choices that could change the
    greedy walk at an allowed KL sum (see :func:`unsettled`), so the plan is the one the whole
    grid gives. On a mix of texts a choice is first measured on the first text alone (a
    screen): that KL bounds the mix's from below, and a choice the bound settles is never
    measured on the other texts."""

    s: Mix
    choices: List[Choice]
    progress: Progress
    say: Callable[[str], None]
    table: Table = field(default_factory=dict)
    costs: Dict[int, Dict[Choice, float]] = field(default_factory=dict)
    bounds: Dict[int, Dict[Choice, float]] = field(default_factory=dict)  # unmeasured choices' KL lower bounds
    measured: int = 0  # measurements made by this process (a screen counts as one)

    def __post_init__(self):
        self.table = stored_measurements(self.s, self.choices, self.progress)
        self.costs = choice_costs(self.s, self.choices, self.progress, self.say)
        self.bounds = {
            layer: {
                c: bound
                for c in opts
                if c not in self.table[layer] and (bound := kl_bound(self.s, layer, c, self.progress)) > 0.0
            }
            for layer, opts in self.costs.items()
        }

    def settle(self, allowed: float) -> None:
        while True:
            todo = unsettled(self.table, self.costs, allowed, self.bounds)
            if not todo:
                return
            for layer, choice in todo:
                self.measured += 1
                label, cost = f"[measured {self.measured}]", self.costs[layer][choice]
                if screens(self.s) and choice not in self.bounds[layer]:
                    self.bounds[layer][choice] = screen_entry(
                        self.s, layer, choice, self.progress, self.say, label, cost
                    )
                    continue
                self.table[layer][choice] = measure_entry(self.s, layer, choice, self.progress, self.say, label, cost)
                self.bounds[layer].pop(choice, None)

    def skipped(self) -> List[Dict[str, Any]]:
        """The choices never measured, each with its cost and why the plan cannot need it."""
        out = []
        for layer, costs in self.costs.items():
            for choice, cost in costs.items():
                if choice not in self.table[layer]:
                    reason = skip_reason(cost, screened=choice in self.bounds[layer])
                    out.append({"layer": layer, "choice": choice.key, "cost": cost, "reason": reason})
        return out


def skip_reason(cost: float, screened: bool = False) -> str:
    """Why an unmeasured choice of this cost cannot be in the plan (``screened``: measured on the
    first text only, whose KL bounds the mix's)."""
    if cost >= DENSE_MEASUREMENT.cost:
        return "dominated by dense: costs at least as much, and dense has KL 0"
    if screened:
        return (
            "cannot change the plan: measured on the first text only; at that KL (a lower bound of the "
            "mix's) its KL reduction per added cost stays below the upgrade the greedy walk takes at every step"
        )
    return (
        "cannot change the plan: even at KL 0 its KL reduction per added cost stays below the upgrade "
        "the greedy walk takes at every step"
    )


def single_layer_report(s: Mix, choices: Sequence[Choice], table: Table, grid: Optional[LazyGrid]) -> Dict[str, Any]:
    """How many of the grid's single-layer choices were measured, and which were skipped and why."""
    total = grid_size(s, choices)
    skipped = [] if grid is None else grid.skipped()
    reasons: Dict[str, int] = {}
    for row in skipped:
        reasons[row["reason"]] = reasons.get(row["reason"], 0) + 1
    summary = f"measured {total - len(skipped)} of {total} single-layer choice(s)"
    if skipped:
        summary += "; skipped " + "; ".join(f"{n} ({why})" for why, n in reasons.items())
    return {
        "grid": total,
        "measured": total - len(skipped),
        "pruned": grid is not None,
        "skipped_reasons": reasons,
        "skipped": skipped,
        "summary": summary,
    }
