"""The greedy walk over the single-layer table: from the cheapest option per layer towards dense,
each step the upgrade with the largest KL reduction per added cost; and which unmeasured choices
could still change it (:func:`unsettled`)."""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Tuple

from .choices import DENSE_MEASUREMENT, Choice, Measurement


def frontier(options: Mapping[Choice, Measurement]) -> List[Tuple[Choice, Measurement]]:
    """The layer's options no other beats in both cost and KL, cheapest first (dense last). Dense
    wins an exact tie, so a choice at dense's cost and KL never matters (see :func:`unsettled`)."""
    ordered = sorted(options.items(), key=lambda cm: (cm[1].cost, cm[1].kl, not cm[0].dense, cm[0].key))
    out: List[Tuple[Choice, Measurement]] = []
    for c, m in ordered:
        if not out or m.kl < out[-1][1].kl:
            out.append((c, m))
    return out


def greedy_plan(table: Mapping[int, Mapping[Choice, Measurement]], allowed: float) -> List[int]:
    """Per layer, the index into its :func:`frontier`: start from the cheapest option everywhere
    and take the upgrade with the best KL reduction per added cost until the single-layer KLs
    sum to at most ``allowed``. Deterministic, and the upgrade sequence does not depend on
    ``allowed``: a larger ``allowed`` stops earlier on the same walk."""
    return greedy_steps(table, allowed)[0]


def greedy_steps(table: Mapping[int, Mapping[Choice, Measurement]], allowed: float):
    """:func:`greedy_plan`'s walk: ``(picks, steps)``, a step being (every layer's current
    option before it, the KL reduction per added cost of the upgrade it takes)."""
    fronts = {layer: frontier(opts) for layer, opts in table.items()}
    pick = {layer: 0 for layer in fronts}
    total = sum(f[0][1].kl for f in fronts.values())
    steps: List[Tuple[Dict[int, Measurement], float]] = []
    while total > allowed:
        best = None
        for layer, f in sorted(fronts.items()):
            cur = f[pick[layer]][1]
            for j in range(pick[layer] + 1, len(f)):
                gain = cur.kl - f[j][1].kl
                ratio = gain / max(f[j][1].cost - cur.cost, 1e-12)
                if best is None or ratio > best[0]:
                    best = (ratio, layer, j, gain)
        if best is None:
            break
        ratio, layer, j, gain = best
        steps.append(({i: fronts[i][pick[i]][1] for i in fronts}, ratio))
        pick[layer] = j
        total -= gain
    return [pick[layer] for layer in sorted(fronts)], steps


def chosen_options(table, picks) -> List[Tuple[Choice, Measurement]]:
    """Each layer's (choice, measurement) at its :func:`greedy_plan` index."""
    return [frontier(table[layer])[j] for layer, j in enumerate(picks)]


def unsettled(
    table: Mapping[int, Mapping[Choice, Measurement]],
    costs: Mapping[int, Mapping[Choice, float]],
    allowed: float,
    bounds: Optional[Mapping[int, Mapping[Choice, float]]] = None,
) -> List[Tuple[int, Choice]]:
    """The unmeasured (layer, choice) pairs that could make ``greedy_plan(table, allowed)`` differ
    from the whole grid's; none: it is the whole grid's plan. A choice can matter only where it
    could be a layer's cheapest option (the walk's start: its cost is the layer's lowest), or where,
    at some step of the walk, its best possible upgrade (from the layer's current option down to
    its lowest possible KL, at its known cost) is at least as good per added cost as the upgrade
    taken there: otherwise every step takes the same upgrade with or without it. Its lowest
    possible KL is 0, or its ``bounds[layer][choice]`` when given: a lower bound of its KL (a mix's
    KL is its largest over the texts, so one text's KL bounds it). Choices costing at least dense's
    1.0 never matter (dense is on the frontier with KL 0). Returns those of the earliest step that
    has any (the later steps may change once they are measured)."""
    bounds = bounds or {}
    open_ = {
        layer: [(c, cost) for c, cost in opts.items() if c not in table[layer] and cost < DENSE_MEASUREMENT.cost]
        for layer, opts in costs.items()
    }
    if not any(open_.values()):
        return []
    cheapest = {
        layer: min(min(m.cost for m in table[layer].values()), min((cost for _, cost in opts), default=1.0))
        for layer, opts in open_.items()
    }
    hits = [(layer, c) for layer, opts in open_.items() for c, cost in opts if cost <= cheapest[layer]]
    if hits:
        return hits
    for cur, ratio in greedy_steps(table, allowed)[1]:
        hits = [
            (layer, c)
            for layer, opts in open_.items()
            for c, cost in opts
            if cost > cur[layer].cost
            and (cur[layer].kl - bounds.get(layer, {}).get(c, 0.0)) / max(cost - cur[layer].cost, 1e-12) >= ratio
        ]
        if hits:
            return hits
    return []
