"""What the rewrite pass is told to do: the config to rewrite each call into, per layer, and
which calls to keep as SDPA."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, List, Mapping, Optional, Tuple

from ..config import AttentionConfig, DenseConfig
from ..length_bands import band_for
from ..tuning import DEFAULT_TUNING, Tuning

__all__ = ["RewriteOptions", "options_for_call"]


@dataclass(frozen=True)
class RewriteOptions:
    """What to rewrite into. ``layer_configs[i]`` overrides ``config`` for layer ``i`` (any method;
    ``None`` keeps that layer's SDPA untouched); ``skip_layers`` keeps those layers untouched;
    ``filter_fn(tag) -> bool`` keeps a call untouched when it returns False."""

    config: AttentionConfig
    backend: str = "auto"
    filter_fn: Optional[Callable[[str], bool]] = None
    skip_layers: frozenset = frozenset()
    layer_configs: Mapping[int, Optional[AttentionConfig]] = field(default_factory=dict)
    tuning: Tuning = DEFAULT_TUNING  # launch options of the Triton backends, carried by every op call
    # a sparseflow.ContextParallel: every call becomes context parallel, and a call the user keeps
    # as SDPA runs as the dense op instead (see passes/context_parallel_rewrite.py)
    context_parallel: Any = None
    # whether a call rewritten into a Dynamo graph may replay its own CUDA graph: true only where
    # nothing captures the compiled graph (sparseflow.compile without Inductor's CUDA graphs);
    # a graph that Inductor captures must hold no op-level graph (see Tuning.traced)
    op_graphs_in_dynamo: bool = False
    # a recipe's settings for longer prompts: ``((tokens, options), ...)``, tokens increasing; a
    # call with at least ``tokens`` keys takes that band's config, layer_configs and skip_layers
    longer: Tuple[Tuple[int, "RewriteOptions"], ...] = ()

    def for_keys(self, n_keys) -> Tuple["RewriteOptions", int]:
        """``(options, tokens)``: the options a call with ``n_keys`` keys is rewritten with, and
        where its band starts (0: these options). ``n_keys`` symbolic in a Dynamo graph gets a
        guard: a length in another band compiles anew."""
        start, band = band_for(self.longer, n_keys, self)
        if start == 0:
            return self, 0
        chosen = dataclasses.replace(
            self, config=band.config, layer_configs=band.layer_configs, skip_layers=band.skip_layers, longer=()
        )
        return chosen, start

    def call_tuning(self, graph_kind: str) -> Tuning:
        """The tuning a rewritten call of a ``graph_kind`` graph carries: an exported program runs
        eagerly and keeps it whole, as does a Dynamo graph that nothing captures."""
        if graph_kind == "export" or self.op_graphs_in_dynamo:
            return self.tuning
        return self.tuning.traced()

    def resolve(self, tag: str, layer: Optional[int]) -> Tuple[Optional[AttentionConfig], str]:
        cfg, why = self._resolve(tag, layer)
        if cfg is None and self.context_parallel is not None:
            return DenseConfig(), ""
        return cfg, why

    def _resolve(self, tag: str, layer: Optional[int]) -> Tuple[Optional[AttentionConfig], str]:
        if layer is not None and layer in self.skip_layers:
            return None, f"layer {layer} is in skip_layers"
        if layer is not None and layer in self.layer_configs and self.layer_configs[layer] is None:
            return None, f"layer_configs[{layer}] is None (SDPA kept)"
        if self.filter_fn is not None and not self.filter_fn(tag):
            return None, f"filter_fn({tag!r}) returned False"
        if layer is not None and layer in self.layer_configs:
            return self.layer_configs[layer], ""
        return self.config, ""


def options_for_call(options: RewriteOptions, n_keys, notes: List[str]) -> RewriteOptions:
    """The options one call with ``n_keys`` keys is rewritten with (:meth:`RewriteOptions.for_keys`),
    its band noted in ``notes``. (``sparseflow.export`` traces static lengths only: a symbolic
    length is Dynamo's, which keeps the guard the choice adds.)"""
    if not options.longer:
        return options
    chosen, start = options.for_keys(n_keys)
    if start:
        notes.append(f"the recipe's settings for {start} keys or more")
    return chosen
