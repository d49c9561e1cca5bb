"""What a choice costs, known before its KL: the density of its selection on the layer's own q/k/v
plus the estimate overhead (``cost="density"``), or the op's time over dense SDPA's there
(``cost="time"``); in units of one dense attention call of the layer."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..config import AttentionConfig, DenseConfig
from ..eval.evaluate import layer_of_tag
from ..methods import spec_for
from ..methods.registry import load_target
from ..ops import attention
from ..recording import capture
from .choices import Choice, estimate_overhead
from .inputs import all_layer_qkv, each_layer_qkv, layer_qkv
from .progress import Progress
from .session import Session, grid_size

logger = logging.getLogger("sparseflow")


def layer_density(cap, layer: int) -> float:
    """The mean selection density of ``layer``'s calls in a capture (1.0: none ran sparse)."""
    vals = [c.density for c in cap.calls if layer_of_tag(c.tag) == layer and c.density is not None]
    return float(sum(vals) / len(vals)) if vals else 1.0


def layer_cost(s: Session, layer: int, cfg: AttentionConfig, density: float) -> float:
    if s.cost == "density":
        return density + estimate_overhead(cfg)
    return timed_cost(s, layer, cfg)


def timed_cost(s: Session, layer: int, cfg: AttentionConfig, reps: int = 3) -> float:
    """The op's time on the layer's own q/k/v over dense SDPA's (``cost="time"``)."""
    if s.timing is None or s.timing[0] != layer:  # the layer's q/k/v and dense time, once per layer
        q, k, v = layer_qkv(s, layer)
        dense = _median_time(lambda: attention(q, k, v, config=DenseConfig(), is_causal=True), reps)
        s.timing = (layer, (q, k, v), max(dense, 1e-9))
    _, (q, k, v), dense = s.timing
    return _median_time(lambda: attention(q, k, v, config=cfg, is_causal=True, backend=s.backend), reps) / dense


def _median_time(fn: Callable[[], Any], reps: int) -> float:
    cuda = torch.cuda.is_available()
    with torch.no_grad():
        fn()  # warm-up: compilation, autotuning, allocator
        times = []
        for _ in range(reps):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def choice_cost(s: Session, layer: int, choice: Choice) -> float:
    """The cost :func:`measure_layer` will give ``choice`` at ``layer``, known before the KL is:
    the op's time (``cost="time"``), or the density of its selection on the layer's q/k/v plus
    the estimate overhead."""
    return layer_costs(s, layer, [choice])[choice]


def layer_costs(s: Session, layer: int, choices: Sequence[Choice]) -> Dict[Choice, float]:
    """:func:`choice_cost` of each of ``choices`` at ``layer``."""
    cfgs = {c: c.config(s.base) for c in choices}
    if s.cost == "time":
        return {c: timed_cost(s, layer, cfg) for c, cfg in cfgs.items()}
    densities = selection_densities(s, layer, list(cfgs.values()))
    return {c: d + estimate_overhead(cfg) for (c, cfg), d in zip(cfgs.items(), densities)}


def selection_densities(s: Session, layer: int, cfgs: Sequence[AttentionConfig]) -> List[float]:
    """The op's measured density of each config on the layer's q/k/v. On the reference path a
    method with ``selection_densities`` in its spec computes the selections only (no attention),
    sharing what the configs share; that shortcut is checked against the op once."""
    if layer not in s.qkv:
        all_layer_qkv(s)
    q, k, _, scale = s.qkv[layer]
    reference_path = q.device.type == "cpu" and s.backend in ("auto", "reference")
    shortcut = _shortcut_of(cfgs)
    if s.fast_density is False or not reference_path or shortcut is None:
        return [_op_density(s, layer, cfg) for cfg in cfgs]
    fast = shortcut(q, k, cfgs, scale)
    if s.fast_density is None:
        s.fast_density = fast[0] == _op_density(s, layer, cfgs[0])
        if not s.fast_density:
            logger.info(
                "sparseflow calibrate: the method's selection-only densities do not give the op's density here; "
                "every choice's density comes from the op"
            )
            return [_op_density(s, layer, cfg) for cfg in cfgs]
    return fast


def _shortcut_of(cfgs: Sequence[AttentionConfig]) -> Optional[Callable]:
    """The ``selection_densities`` function of the configs' one method, or None (several methods,
    or a method without one)."""
    methods = {cfg.method for cfg in cfgs}
    if len(methods) != 1:
        return None
    target = spec_for(methods.pop()).selection_densities
    return None if target is None else load_target(target)


def _op_density(s: Session, layer: int, cfg: AttentionConfig) -> float:
    q, k, v, scale = s.qkv[layer]
    with capture(keep_selections=False) as cap, torch.no_grad():
        attention(
            q, k, v, config=cfg, is_causal=True, scale=scale, backend=s.backend, tag=f"model.layers.{layer}.self_attn"
        )
    return layer_density(cap, layer)


def choice_costs(
    s: Session, choices: Sequence[Choice], progress: Progress, say: Callable[[str], None]
) -> Dict[int, Dict[Choice, float]]:
    """Every (layer, choice) cost (:func:`choice_cost`), from the progress file where present."""
    t0 = time.perf_counter()
    missing = {
        layer: [c for c in s.layer_choices(layer, choices) if f"{layer}:{c.key}" not in progress.costs]
        for layer in range(s.n_layers)
    }

    def fill(layer: int) -> None:
        if missing[layer]:
            t_layer = time.perf_counter()
            progress.costs.update({f"{layer}:{c.key}": v for c, v in layer_costs(s, layer, missing[layer]).items()})
            progress.save()
            say(
                f"costs: layer {layer + 1}/{s.n_layers}, {len(missing[layer])} choice(s)"
                f" ({time.perf_counter() - t_layer:.1f} s)"
            )

    if s.cost == "density" and any(missing.values()):
        each_layer_qkv(s, lambda layer, qkv: _with_qkv(s, layer, qkv, fill))  # one layer's q/k/v alive at a time
    else:
        for layer in range(s.n_layers):
            fill(layer)
    say(f"costs of {grid_size(s, choices)} choice(s) ({time.perf_counter() - t0:.1f} s)")
    return {
        layer: {c: float(progress.costs[f"{layer}:{c.key}"]) for c in s.layer_choices(layer, choices)}
        for layer in range(s.n_layers)
    }


def _with_qkv(s: Session, layer: int, qkv: Tuple, fn: Callable[[int], None]) -> None:
    s.qkv[layer] = qkv
    try:
        fn(layer)
    finally:
        del s.qkv[layer]
