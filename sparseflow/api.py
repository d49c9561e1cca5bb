"""The public entry points: ``compile``, ``export``, ``inspect`` and the rewrite report.

``compile`` rewrites lazily: ``torch.compile`` captures a graph on the first call (and again on
every recompile, e.g. the decode steps of ``generate()``), and our backend rewrites each graph
before handing it on. The model's :class:`RewriteReport` therefore fills up as the model runs;
``inspect`` runs the model once so the report is complete for those inputs.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import itertools
import types
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from . import decode_state
from . import recording as _recording
from .config import BACKENDS, METHODS, AttentionConfig, default_config
from .methods import spec_for
from .passes.module_tags import layer_index
from .passes.rewrite_entry import RewriteEntry
from .passes.rewrite_options import RewriteOptions
from .passes.sdpa_rewrite import rewrite_graph
from .tuning import Tuning, check_tuning

__all__ = ["compile", "export", "inspect", "report", "RewriteReport", "InspectionResult", "INNER_BACKENDS"]

logger = logging.getLogger("sparseflow")

INNER_BACKENDS = ("inductor", "aot_eager", "eager")
_CONFIG_ATTR = "_sparseflow_config"
_REPORT_ATTR = "_sparseflow_report"
DECODE_STATE_ATTR = "_sparseflow_decode_state"  # the model's DecodeState (PISA pyramids across steps)


# --------------------------------------------------------------------------- report


def _fmt_shape(s) -> str:
    return "-" if s is None else "[" + ",".join(str(x) for x in s) + "]"


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


@dataclass
class RewriteReport:
    """What the rewrite pass did, one entry per attention call site.

    Deduplication: Dynamo may compile a model several times (a new graph for decode steps, a
    recompile for new shapes, a graph per graph break). An entry is identified by
    ``(graph kind, module tag, index of the call among that tag's calls in its graph, target,
    decision)``, so the same call site seen in several graphs is one entry whose ``graphs``
    counts them, while a call site that was rewritten in one graph and skipped in another
    gets one entry per decision. (A graph break *between* two SDPA calls of one module would
    make both index 0 of their graphs and merge them: a limitation we accept.)
    """

    method: str
    config: Dict[str, Any]
    backend: str
    entries: List[RewriteEntry] = field(default_factory=list)
    graphs: int = 0  # graphs the pass has seen
    source: str = "compile"  # "compile" (a model's lazy compilation) or "export" (a program's graph)
    recipe: Optional[str] = None  # the recipe applied (its name, or the path of its file)
    # Set when the report no longer describes what its model runs (a copied model lost its
    # compilation); says so at the top of the text.
    lost: str = ""
    runtime: _recording.RunTally = field(default_factory=dict, repr=False)  # what the ops did, per (tag, method)
    _index: Dict[Tuple, RewriteEntry] = field(default_factory=dict, repr=False, compare=False)
    _warned_no_attention: bool = field(default=False, repr=False, compare=False)

    def add_graph(self, entries: Sequence[RewriteEntry]) -> None:
        self.graphs += 1
        for e in entries:
            key = e.key()
            old = self._index.get(key)
            if old is not None:
                old.graphs += 1
                continue
            self._index[key] = e
            self.entries.append(e)
            self._link_runtime(e)
            if not e.rewritten:
                logger.info("sparseflow: %s at %s kept as is: %s", e.target, e.tag or "<root>", e.reason)
            else:
                logger.debug("sparseflow: %s at %s -> %s", e.target, e.tag or "<root>", e.method)

    def _link_runtime(self, e: RewriteEntry) -> None:
        # the ops count their calls per (tag, method) into self.runtime; the entry reads them live
        if e.rewritten:
            e.runtime = self.runtime.setdefault((e.tag, e.method), e.runtime)

    def __getstate__(self) -> Dict[str, Any]:
        # copy.deepcopy and pickle (torch.save/torch.load of a model) come through here; a model
        # copied that way has lost the compiled call (Module drops _compiled_call_impl).
        state = dict(self.__dict__)
        if self.source == "compile" and not self.lost:
            state["lost"] = _COPIED_REPORT
        return state

    def mark_lost(self, why: str) -> None:
        if self.lost != why:
            logger.warning("sparseflow: %s", why)
        self.lost = why

    def check_attention_found(self) -> None:
        """After a call of the model: warn once when the captured graphs hold no attention call."""
        if self.graphs == 0 or self.entries or self._warned_no_attention:
            return
        self._warned_no_attention = True
        logger.warning("sparseflow: %s", _NO_ATTENTION)

    @property
    def runs_dense(self) -> List[RewriteEntry]:
        """Rewritten entries whose op fell back to dense in every call seen at run time."""
        return [e for e in self.entries if e.runs_dense]

    @property
    def rewritten(self) -> List[RewriteEntry]:
        return [e for e in self.entries if e.rewritten]

    @property
    def skipped(self) -> List[RewriteEntry]:
        return [e for e in self.entries if not e.rewritten]

    @property
    def num_rewritten(self) -> int:
        return len(self.rewritten)

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)

    def counts(self) -> Dict[str, int]:
        return {
            "calls": len(self.entries),
            "rewritten": self.num_rewritten,
            "skipped": self.num_skipped,
            "graphs": self.graphs,
        }

    def tags(self, rewritten: Optional[bool] = None) -> List[str]:
        return [e.tag for e in self.entries if rewritten is None or e.rewritten == rewritten]

    def copy(self) -> "RewriteReport":
        """A snapshot (the live report keeps filling up as the model runs)."""
        new = RewriteReport(
            self.method, dict(self.config), self.backend, source=self.source, lost=self.lost, recipe=self.recipe
        )
        new.graphs = self.graphs
        new.runtime = {k: dict(v) for k, v in self.runtime.items()}
        new._warned_no_attention = self._warned_no_attention
        for e in self.entries:
            e2 = dataclasses.replace(e, notes=list(e.notes), runtime=dict(e.runtime))
            new.entries.append(e2)
            new._index[e2.key()] = e2
            new._link_runtime(e2)
        return new

    def to_dict(self) -> Dict[str, Any]:
        return {
            "method": self.method,
            "config": self.config,
            "backend": self.backend,
            "recipe": self.recipe,
            "counts": self.counts(),
            "runs_dense": len(self.runs_dense),
            "lost": self.lost,
            "entries": [{**dataclasses.asdict(e), "status": e.status} for e in self.entries],
        }

    def _head(self) -> str:
        c = self.counts()
        n_dense = len(self.runs_dense)
        dense = f" ({n_dense} of them run dense at run time)" if n_dense else ""
        counts = f"{c['rewritten']} rewritten{dense}, {c['skipped']} skipped, {c['graphs']} graph(s)"
        head = (
            f"sparseflow rewrite report: method={self.method} backend={self.backend} recipe={self.recipe or 'none'} - "
        )
        if self.lost:
            return f"{head}compilation lost, runs dense SDPA (the compiled original: {counts})\n{self.lost}"
        return head + counts

    def __str__(self) -> str:
        head = self._head()
        if not self.entries and self.graphs:
            return head + f"\n({_NO_ATTENTION})"
        if not self.entries:
            return head + "\n(no attention calls seen yet: the graph is captured on the first call)"
        rows = [
            (
                e.tag or "<root>",
                "-" if e.layer is None else e.layer,
                "lost (runs dense)" if self.lost and e.rewritten else _status_cell(e),
                e.method or "-",
                e.target,
                _fmt_shape(e.q_shape),
                _fmt_shape(e.k_shape),
                e.gqa or "-",
                e.mask,
                e.graphs,
                e.reason or _runtime_reason(e),
            )
            for e in self.entries
        ]
        return (
            head
            + "\n"
            + _table(
                ("module", "layer", "status", "op", "target", "q", "k (to op)", "gqa", "mask", "graphs", "reason"), rows
            )
        )


_NO_ATTENTION = (
    "no scaled_dot_product_attention call found in the captured graph(s): the model computes attention "
    "some other way, so nothing was rewritten; for a Hugging Face model load it with attn_implementation='sdpa'"
)
_COPIED_REPORT = (
    "this report was copied with its model (copy.deepcopy, pickle, torch.save/torch.load): the copy has lost "
    "the sparseflow compilation (torch.nn.Module drops the compiled call when copied) and runs dense SDPA, "
    "so the rewrites listed are not what it runs; call sparseflow.compile on the copy to rewrite it again"
)
_LOST_MODEL = (
    "this model is a copy (copy.deepcopy, pickle, torch.save/torch.load) of a sparseflow-compiled model: "
    "torch.nn.Module drops the compiled call when copied, so it now runs dense SDPA and the rewrites listed "
    "no longer apply; call sparseflow.compile on it to rewrite it again"
)


def _status_cell(e: RewriteEntry) -> str:
    # the table's reason column carries the run-time reasons, so the status stays short
    if not e.dense_calls:
        return e.status
    return "rewritten, runs dense" if e.runs_dense else "rewritten, partly dense"


def _runtime_reason(e: RewriteEntry) -> str:
    dense = e.dense_calls
    if not dense:
        return ""
    return "run time: " + "; ".join(f"{r} ({n} call(s))" for r, n in sorted(dense.items(), key=lambda x: -x[1]))


@dataclass
class InspectionResult:
    """The rewrite report plus what each op call did on one run of the example inputs."""

    report: RewriteReport
    calls: List[_recording.CallRecord]
    output: Any = None

    @property
    def sparse_calls(self) -> List[_recording.CallRecord]:
        return [c for c in self.calls if c.sparse]

    @property
    def dense_calls(self) -> List[_recording.CallRecord]:
        return [c for c in self.calls if not c.sparse]

    def mean_density(self) -> float:
        vals = [c.density for c in self.calls if c.density is not None]
        return float(sum(vals) / len(vals)) if vals else float("nan")

    def __str__(self) -> str:
        rows = [
            (
                c.tag or "<root>",
                c.method,
                "sparse" if c.sparse else "dense",
                c.backend,
                _fmt_shape(c.q_shape),
                _fmt_shape(c.k_shape),
                "-" if c.density is None else f"{c.density:.3f}",
                c.reason,
            )
            for c in self.calls
        ]
        runtime = (
            f"runtime: {len(self.calls)} op call(s), {len(self.sparse_calls)} sparse, "
            f"{len(self.dense_calls)} dense, mean density {self.mean_density():.3f}"
        )
        table = (
            _table(("module", "op", "path", "backend", "q", "k", "density", "reason"), rows)
            if rows
            else "(no op calls)"
        )
        return f"{self.report}\n\n{runtime}\n{table}"


# --------------------------------------------------------------------------- argument checks


def _check_backend(method: str, backend: str, arg: str = "backend") -> None:
    if not isinstance(backend, str):
        raise TypeError(f"{arg} must be a str, got {type(backend).__name__}")
    if backend not in BACKENDS:
        raise ValueError(f"{arg} must be one of {list(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        return
    spec = spec_for(method)
    if not spec.sparse:
        raise ValueError(f"{arg}={backend!r} with method {method!r}: the dense op always runs SDPA; use {arg}='auto'")
    if backend not in spec.backends:
        available = sorted(spec.backends) + ["auto"]
        raise ValueError(f"{arg}={backend!r} is not available for method {method!r}; available: {available}")


def _make_options(method, config, backend, filter_fn, skip_layers, layer_configs) -> RewriteOptions:
    if not isinstance(method, str):
        raise TypeError(f"method must be a str, one of {list(METHODS)}, got {type(method).__name__}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")
    if config is None:
        config = default_config(method)
    elif not isinstance(config, AttentionConfig):
        raise TypeError(
            f"config must be a sparseflow config ({', '.join(c.__name__ for c in METHODS.values())}) "
            f"or None, got {type(config).__name__}"
        )
    elif config.method != method:
        raise ValueError(
            f"config is a {type(config).__name__} (method {config.method!r}) but method={method!r}; "
            f"pass method={config.method!r} or a {METHODS[method].__name__}"
        )
    _check_backend(method, backend)
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(
            f"filter_fn must be a callable taking a module name and returning bool, got {type(filter_fn).__name__}"
        )
    if skip_layers is None:
        skip_layers = ()
    if isinstance(skip_layers, (str, bytes)) or not isinstance(skip_layers, Iterable):
        raise TypeError(f"skip_layers must be an iterable of layer indices, got {type(skip_layers).__name__}")
    skip = []
    for i in skip_layers:
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(f"skip_layers must hold ints, got {i!r}")
        if i < 0:
            raise ValueError(f"skip_layers must hold non-negative layer indices, got {i}")
        skip.append(i)
    per_layer: Dict[int, Optional[AttentionConfig]] = {}
    if layer_configs is not None:
        if not isinstance(layer_configs, Mapping):
            raise TypeError(
                f"layer_configs must be a dict {{layer_index: config or None}}, got {type(layer_configs).__name__}"
            )
        for i, cfg in layer_configs.items():
            if isinstance(i, bool) or not isinstance(i, int):
                raise TypeError(f"layer_configs keys must be int layer indices, got {i!r}")
            if i < 0:
                raise ValueError(f"layer_configs keys must be non-negative layer indices, got {i}")
            if cfg is not None and not isinstance(cfg, AttentionConfig):
                raise TypeError(f"layer_configs[{i}] must be a sparseflow config or None, got {type(cfg).__name__}")
            if cfg is not None:
                _check_backend(cfg.method, backend, arg=f"backend (for layer_configs[{i}], method {cfg.method!r})")
                if i in skip:
                    raise ValueError(f"layer {i} is both in skip_layers and given a config in layer_configs")
            per_layer[i] = cfg
    return RewriteOptions(
        config=config,
        backend=backend,
        filter_fn=filter_fn,
        skip_layers=frozenset(skip),
        layer_configs=per_layer,
    )


def _check_model_context_parallel(context_parallel: Any):
    """The ContextParallel of a model's compile: contiguous shards only, since the model builds its
    positions and masks from its own rows (a zig-zag shard is two runs of positions)."""
    if context_parallel is None:
        return None
    from .context_parallel import ContextParallel, as_context_parallel

    if not isinstance(context_parallel, ContextParallel):
        context_parallel = ContextParallel(as_context_parallel(context_parallel).group, sharding="contiguous")
    if context_parallel.sharding != "contiguous":
        raise ValueError(
            "context_parallel for a model needs sharding='contiguous' (each rank's rows are one run of "
            f"positions), got {context_parallel.sharding!r}; zigzag is for the functional op"
        )
    return context_parallel


def _marker(options: RewriteOptions, **extra) -> Dict[str, Any]:
    from ._version import __version__

    return {
        "sparseflow_version": __version__,
        "method": options.config.method,
        "config": options.config.to_dict(),
        "backend": options.backend,
        "skip_layers": sorted(options.skip_layers),
        "layer_configs": {i: (None if c is None else c.to_dict()) for i, c in options.layer_configs.items()},
        "filter_fn": None
        if options.filter_fn is None
        else getattr(options.filter_fn, "__qualname__", repr(options.filter_fn)),
        "tuning": options.tuning.to_dict(),
        "context_parallel": None if options.context_parallel is None else options.context_parallel.sharding,
        **extra,
    }


def _layer_indices(model: nn.Module) -> List[int]:
    """The layer indices the model's module names hold (the first integer of each path, as the
    pass numbers its call sites)."""
    found = {layer_index(name) for name, _ in model.named_modules()}
    return sorted(i for i in found if i is not None)


def _describe_layers(layers: Sequence[int]) -> str:
    if not layers:
        return "the model has no numbered layers (no module name holds an integer, as in model.layers.3)"
    if list(layers) == list(range(len(layers))):
        return f"the model has {len(layers)} layers (0..{len(layers) - 1})"
    return f"the model's layer indices are {list(layers)}"


def _check_layers(model: nn.Module, options: RewriteOptions) -> None:
    """skip_layers / layer_configs must name layers the model has: a typo would otherwise be a
    silent no-op (the layer stays sparse, or keeps the default config)."""
    if not options.skip_layers and not options.layer_configs:
        return
    layers = set(_layer_indices(model))
    for arg, given in (("skip_layers", options.skip_layers), ("layer_configs", options.layer_configs)):
        bad = sorted(i for i in given if i not in layers)
        if bad:
            raise ValueError(
                f"{arg} names layers {bad} that the model does not have: {_describe_layers(sorted(layers))}"
            )


def _check_not_transformed(model: nn.Module) -> None:
    # A marked module whose compiled call is gone (a deepcopy or unpickled copy: Module drops
    # _compiled_call_impl when pickled) runs plain SDPA again and may be compiled afresh.
    for name, mod in model.named_modules():
        marker = mod.__dict__.get(_CONFIG_ATTR)
        if marker is not None and _is_compiled(mod):
            where = "this model" if not name else f"its submodule {name!r}"
            raise RuntimeError(
                f"sparseflow.compile: {where} was already transformed by sparseflow "
                f"(method={marker.get('method')!r}); refusing to transform it twice. Start from the original model."
            )


# --------------------------------------------------------------------------- recipes


_AUTO = "auto"


def _model_config(model: nn.Module):
    """A transformers config (``model.config`` with a ``model_type``), or None."""
    cfg = getattr(model, "config", None)
    return cfg if getattr(cfg, "model_type", None) is not None else None


def _is_auto(recipe) -> bool:
    return isinstance(recipe, str) and recipe.strip().lower() == _AUTO


def _recipe_for(recipe, model: nn.Module, method: str):
    """The recipe that applies to ``model`` for ``method``, or None. "auto" skips (logged) a
    recipe lacking ``method``; an explicit one lacking it, or not fitting the model, raises."""
    from .recipes import resolve_recipe

    model_config = _model_config(model)
    rec = resolve_recipe(recipe, model_config)
    auto = _is_auto(recipe)
    if rec is None:
        if auto:
            why = (
                "no shipped recipe fits this model"
                if model_config is not None
                else "the model has no transformers config"
            )
            logger.info("sparseflow: recipe='auto': %s; using the %s settings given", why, method)
        return None
    if method not in rec.configs:
        if auto:
            logger.info(
                "sparseflow: recipe='auto': %r fits the model but has no %r settings (it covers %s); not applied",
                rec.label,
                method,
                rec.methods,
            )
            return None
        raise ValueError(
            f"recipe {rec.label!r} has no {method!r} settings; it covers {rec.methods}: pass one of "
            "those methods, or recipe=None"
        )
    if model_config is not None:
        if not auto:
            rec.check_model(model_config)
    else:
        logger.info(
            "sparseflow: recipe %r: the model has no transformers config, so its model checks are skipped", rec.label
        )
    return rec


def _model_layer_count(model: nn.Module) -> Optional[int]:
    n = getattr(_model_config(model), "num_hidden_layers", None)
    if isinstance(n, int):
        return n
    layers = _layer_indices(model)
    return layers[-1] + 1 if layers else None


def _apply_recipe(rec, model: nn.Module, method: str, config, skip_layers, layer_configs):
    """``(config, layer_configs)`` with the recipe merged in: its config for ``method`` unless the
    user gave one, its per-layer overrides on top of that base, its dense layers as None; the
    layers the user names in ``skip_layers`` / ``layer_configs`` keep the user's setting."""
    base = config if config is not None else rec.config_for(method)
    n_layers = _model_layer_count(model)
    if n_layers is not None:
        rec.check_layers(n_layers)
    from_recipe: Dict[int, Optional[AttentionConfig]] = {i: None for i in rec.dense_layers}
    from_recipe.update(rec.layer_configs_for(method, base, n_layers))
    user = set(skip_layers) | set(layer_configs)
    kept = {i: c for i, c in sorted(from_recipe.items()) if i not in user}
    logger.info(
        "sparseflow: recipe %r applied: %s %s%s, dense layers %s, %d per-layer override(s)",
        rec.label,
        method,
        base.to_json(),
        " (the config given)" if config is not None else "",
        [i for i, c in kept.items() if c is None],
        sum(c is not None for c in kept.values()),
    )
    return base, {**kept, **layer_configs}


def _options_with_recipe(recipe, model, method, config, backend, filter_fn, skip_layers, layer_configs):
    """``(RewriteOptions, recipe label or None)``: the user's arguments are checked first, exactly
    as without a recipe, then the recipe (if one applies) is merged in."""
    options = _make_options(method, config, backend, filter_fn, skip_layers, layer_configs)
    rec = _recipe_for(recipe, model, method)
    if rec is None:
        return options, None
    skip = sorted(options.skip_layers)  # the checked copy: skip_layers may be a one-shot iterator
    base, merged = _apply_recipe(rec, model, method, config, skip, dict(options.layer_configs))
    return _make_options(method, base, backend, filter_fn, skip, merged), rec.label


# --------------------------------------------------------------------------- compile


class _Backend:
    """The torch.compile backend: rewrite the Dynamo graph, then hand it to the inner backend."""

    def __init__(
        self,
        options: RewriteOptions,
        inner: str,
        report: RewriteReport,
        inductor_options: Optional[Dict[str, Any]] = None,
    ):
        self.options, self.inner, self.report = options, inner, report
        self.inductor_options = dict(inductor_options or {})

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        entries = rewrite_graph(gm, self.options, graph_kind="dynamo")
        self.report.add_graph(entries)
        if self.inner == "eager":
            return gm.forward
        if self.inner == "aot_eager":
            from torch._dynamo.backends.registry import lookup_backend

            return lookup_backend("aot_eager")(gm, example_inputs)
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs, config_patches=self.inductor_options)


_TRAMPOLINES = itertools.count()


def _trampoline(model: nn.Module) -> Callable:
    """The function ``compile`` hands to ``torch.compile``: it calls ``model._call_impl`` (hooks
    and forward, all inlined by Dynamo), exactly what ``Module.compile`` compiles, but

    * its code object is fresh per model, so each model has its own Dynamo cache: models of one
      class compiled with different settings neither evict nor reuse each other's graphs, and
      compiling many models in one process never exhausts ``torch._dynamo.config.recompile_limit``
      (with ``Module.compile`` all of them share the cache of the class's forward);
    * the compiled frame starts outside torch's files, so a bare ``torch.nn`` module
      (``nn.TransformerEncoderLayer``, ``nn.MultiheadAttention``) is traced instead of skipped.
    """

    def sparseflow_call(*args, **kwargs):
        return model._call_impl(*args, **kwargs)

    code = sparseflow_call.__code__.replace(co_name=f"sparseflow_call_{next(_TRAMPOLINES)}")
    fn = types.FunctionType(code, sparseflow_call.__globals__, code.co_name, None, sparseflow_call.__closure__)
    fn.__qualname__ = code.co_name
    return fn


def compile(
    model: nn.Module,
    method: str = "pbs",
    config: Optional[AttentionConfig] = None,
    backend: str = "auto",
    *,
    filter_fn: Optional[Callable[[str], bool]] = None,
    skip_layers: Iterable[int] = (),
    layer_configs: Optional[Mapping[int, Optional[AttentionConfig]]] = None,
    inner_backend: str = "inductor",
    dynamic: Optional[bool] = None,
    fullgraph: bool = False,
    recipe: Any = "auto",
    tuning: Optional[Tuning] = None,
    context_parallel: Any = None,
    mode: Optional[str] = None,
) -> nn.Module:
    """Compile ``model`` in place with a ``torch.compile`` backend that rewrites every SDPA call
    into the ``method`` op, and return the same model.

    ``model(...)`` and ``model.generate()`` (which calls ``self(...)``) run the rewritten graph.
    The rewrite happens when Dynamo captures a graph (first call, recompiles); the report
    (:func:`report`) fills up then. ``config`` must be a config of ``method`` (default config when
    None). ``backend`` picks the op implementation ("auto", "reference", "triton", "flex").
    ``filter_fn(tag)`` returning False, ``skip_layers`` and ``layer_configs[i] = None`` keep a call
    as SDPA; ``layer_configs[i] = cfg`` uses ``cfg`` (any method) for layer ``i`` (the first integer
    in the module path). ``inner_backend``: "inductor", "aot_eager" or "eager" compiles the
    rewritten graph. ``dynamic`` and ``fullgraph`` go to ``torch.compile``; ``mode`` is
    ``torch.compile``'s (``"reduce-overhead"``: the compiled graph replays from CUDA graphs, which
    the sparse ops allow: they keep their counts on the device), Inductor only.

    Like ``Module.compile`` this sets ``model._compiled_call_impl``; the function compiled is a
    per-model trampoline to ``model._call_impl`` (see ``_trampoline``). The model is marked with
    ``model._sparseflow_config`` (the settings, as a dict) and ``model._sparseflow_report``; a
    marked, still-compiled model (or one with such a submodule) is refused, as is a model that
    already went through ``torch.compile``. A deep copy (or ``torch.load``) of a compiled model is
    uncompiled again (``Module`` drops the compiled call when copied): it runs dense SDPA, its report
    says the compilation was lost, and it may be compiled afresh.

    ``recipe``: a shipped recipe name (``sparseflow recipes``), the path of a recipe ``.json`` file,
    ``"auto"`` (default: the shipped recipe whose model checks accept ``model.config``, if any) or
    None (no recipe). A recipe that applies gives its config for ``method`` (unless ``config`` is
    passed, which then is the base its per-layer overrides apply to), its dense layers and its
    per-layer overrides; ``skip_layers`` / ``layer_configs`` win for the layers they name. An
    explicit recipe that lacks ``method`` or does not fit the model raises ValueError; "auto"
    skips such a recipe with an INFO log. The report's ``recipe`` says which one applied.

    ``tuning``: launch options of the Triton backends (:class:`sparseflow.Tuning`; None: the
    defaults), carried by every rewritten call.

    ``context_parallel``: a 1-D DeviceMesh, a ProcessGroup or a ``sparseflow.ContextParallel`` with
    ``sharding="contiguous"``. Each rank then calls the model on its contiguous shard of the prompt
    (its ``input_ids`` rows with the global ``position_ids``) and gets its rows of the output; every
    attention call is context parallel (see :mod:`sparseflow.context_parallel_op`; inference only).

    ``skip_layers`` / ``layer_configs`` must name layers the model has (ValueError otherwise). After
    the first call, a model whose graphs hold no SDPA call (e.g. ``attn_implementation="eager"``)
    gets a warning. Each rewritten entry of the report shows the calls whose op fell back to dense
    at run time, with the reasons.
    """
    _check_compilable(model)
    options, recipe_label = _compile_options(
        model, method, config, backend, filter_fn, skip_layers, layer_configs, recipe, tuning, context_parallel
    )
    _check_compile_flags(inner_backend, dynamic, fullgraph)
    inductor_options = _mode_options(mode, inner_backend, dynamic)
    compile_flags = dict(inner_backend=inner_backend, mode=mode, dynamic=dynamic, fullgraph=fullgraph)
    _compile_in_place(model, options, recipe_label, inductor_options, **compile_flags)
    return model


def _compile_options(
    model, method, config, backend, filter_fn, skip_layers, layer_configs, recipe, tuning, context_parallel
) -> Tuple[RewriteOptions, Optional[str]]:
    """``compile``'s checked rewrite options and the label of the recipe that applied (None: none)."""
    options, recipe_label = _options_with_recipe(
        recipe, model, method, config, backend, filter_fn, skip_layers, layer_configs
    )
    options = dataclasses.replace(
        options, tuning=check_tuning(tuning), context_parallel=_check_model_context_parallel(context_parallel)
    )
    if options.context_parallel is not None:
        _check_no_dense_tail(options)
    _check_layers(model, options)
    return options, recipe_label


def _check_no_dense_tail(options: RewriteOptions) -> None:
    """Context parallelism does not run PBS's dense tail: refused when the model is compiled,
    not at its first forward."""
    configs = {"config": options.config, **{f"layer_configs[{i}]": c for i, c in options.layer_configs.items()}}
    for where, cfg in configs.items():
        if cfg is not None and getattr(cfg, "dense_tail_blocks", 0):
            raise ValueError(
                f"context_parallel does not run dense_tail_blocks={cfg.dense_tail_blocks} ({where}); "
                "use dense_tail_blocks=0 with context_parallel"
            )


def _compile_in_place(
    model, options, recipe_label, inductor_options, *, inner_backend, mode, dynamic, fullgraph
) -> None:
    """Install the compiled call on ``model`` and mark it with its settings and its (empty) report."""
    rep = RewriteReport(
        method=options.config.method, config=options.config.to_dict(), backend=options.backend, recipe=recipe_label
    )
    _install_compiled_call(
        model,
        _Backend(options, inner_backend, rep, inductor_options),
        rep,
        dynamic,
        fullgraph,
        cuda_graphs=mode if inductor_options.get("triton.cudagraphs") else None,
    )
    setattr(
        model,
        _CONFIG_ATTR,
        _marker(
            options, inner_backend=inner_backend, mode=mode, dynamic=dynamic, fullgraph=fullgraph, recipe=recipe_label
        ),
    )
    setattr(model, _REPORT_ATTR, rep)


def _check_compilable(model) -> None:
    """Refuse what ``compile`` cannot take: a non-module, a torch.compile wrapper, a model already
    compiled or transformed (its settings would be silently replaced)."""
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        raise TypeError(
            "model is a torch.compile wrapper (OptimizedModule); pass the original module "
            "(model._orig_mod): sparseflow.compile compiles it itself"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _check_not_transformed(model)
    if _is_compiled(model):
        raise RuntimeError(
            "model already has torch.compile applied (Module.compile); sparseflow.compile would replace "
            "those settings. Pass a model that has not been compiled."
        )


MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _mode_options(mode: Optional[str], inner_backend: str, dynamic) -> Dict[str, Any]:
    """Inductor's settings for a ``torch.compile`` mode (``"reduce-overhead"``: CUDA graphs)."""
    if mode is None:
        return {}
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"mode must be None or one of {list(MODES)}, got {mode!r}")
    if inner_backend != "inductor":
        raise ValueError(f"mode={mode!r} configures Inductor; it needs inner_backend='inductor', got {inner_backend!r}")
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode, dynamic))


def _check_compile_flags(inner_backend, dynamic, fullgraph) -> None:
    if not isinstance(inner_backend, str) or inner_backend not in INNER_BACKENDS:
        raise ValueError(f"inner_backend must be one of {list(INNER_BACKENDS)}, got {inner_backend!r}")
    if dynamic is not None and not isinstance(dynamic, bool):
        raise TypeError(f"dynamic must be None, True or False, got {dynamic!r}")
    if not isinstance(fullgraph, bool):
        raise TypeError(f"fullgraph must be a bool, got {fullgraph!r}")


def _install_compiled_call(
    model: nn.Module, be: "_Backend", rep: RewriteReport, dynamic, fullgraph, cuda_graphs: Optional[str] = None
) -> None:
    """Set ``model._compiled_call_impl`` to the rewriting compilation, run with the model's own
    decode state and the report's run-time tally (what Module.compile(backend=be, dynamic=...,
    fullgraph=...) does, with a per-model trampoline in place of self._call_impl: see _trampoline).
    ``cuda_graphs``: the mode when Inductor replays the graph from CUDA graphs."""
    compiled = torch.compile(_trampoline(model), backend=be, dynamic=dynamic, fullgraph=fullgraph)
    state = decode_state.DecodeState()

    def sparseflow_forward(*args, **kwargs):
        if cuda_graphs is not None and _recording.active_capture() is not None:
            # a replayed CUDA graph runs the kernels without the ops' Python, which is what records
            raise RuntimeError(
                f"sparseflow.capture() cannot record a model compiled with mode={cuda_graphs!r}: its CUDA graph "
                "replays skip the code that records each call. Compile with mode=None or 'default' to record, "
                "or call the model outside capture()"
            )
        # the model's PISA decode state (per-layer pyramids across generate() steps) and the
        # report's run-time tally are active only while this model runs: no process-global state.
        # Under Inductor's CUDA graphs there is no decode state: a replay runs no op's Python, so
        # it would not keep the pyramids, and a pyramid built while Inductor warms up would stay
        # in its memory pool (each decode step then builds its pyramid afresh)
        with decode_state.active(state if cuda_graphs is None else None), _recording.tallying(rep.runtime):
            out = compiled(*args, **kwargs)
        rep.check_attention_found()
        return out

    model._compiled_call_impl = sparseflow_forward
    setattr(model, DECODE_STATE_ATTR, state)
    model.__dict__[_COPY_GUARD_ATTR] = _CopyGuard(model)


# A model copied with copy.deepcopy, pickle or torch.save/torch.load loses its compiled call
# (Module.__getstate__ drops it) and runs dense SDPA. The guard in its __dict__ is rebuilt with the
# copy, before the copy's state is set, and gives the copy a call of its own: the first call
# warns that the compilation was lost, then the copy runs as the plain module it now is. (A
# forward hook would do the same, but any hook turns off nn.TransformerEncoderLayer's fused path.)
_COPY_GUARD_ATTR = "_sparseflow_copy_guard"


class _CopyGuard:
    __slots__ = ("model",)

    def __init__(self, model: nn.Module):
        self.model = model

    def __reduce__(self):
        return (_guarded_copy, (self.model,))


def _guarded_copy(model: nn.Module) -> _CopyGuard:
    # Module.__setstate__ keeps a _compiled_call_impl already in the copy's __dict__
    model.__dict__["_compiled_call_impl"] = functools.partial(_lost_compilation_call, model)
    return _CopyGuard(model)


def _lost_compilation_call(model: nn.Module, *args, **kwargs):
    model._compiled_call_impl = None
    rep = getattr(model, _REPORT_ATTR, None)
    if rep is not None:
        rep.lost = _LOST_MODEL
    warnings.warn(f"sparseflow: {_LOST_MODEL}", RuntimeWarning, stacklevel=3)
    return model._call_impl(*args, **kwargs)


def _is_compiled(mod: nn.Module) -> bool:
    """Whether ``mod`` still holds a compiled call (a copy's first-call warning is not one)."""
    impl = mod._compiled_call_impl
    return impl is not None and not (isinstance(impl, functools.partial) and impl.func is _lost_compilation_call)


# --------------------------------------------------------------------------- export


def _has_sparseflow_ops(gm: torch.fx.GraphModule) -> bool:
    return any(
        n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "sparseflow"
        for n in gm.graph.nodes
    )


def export(
    model: nn.Module,
    args: Tuple[Any, ...],
    kwargs: Optional[Dict[str, Any]] = None,
    *,
    method: str,
    config: Optional[AttentionConfig] = None,
    backend: str = "auto",
    filter_fn: Optional[Callable[[str], bool]] = None,
    skip_layers: Iterable[int] = (),
    layer_configs: Optional[Mapping[int, Optional[AttentionConfig]]] = None,
    recipe: Any = "auto",
    tuning: Optional[Tuning] = None,
) -> "torch.export.ExportedProgram":
    """``torch.export.export(model, args, kwargs)``, SDPA kept (``run_decompositions({})``), every
    SDPA node rewritten into the ``method`` op (K/V repeated for GQA folded back to native GQA,
    masks passed through for the op to recognise at run time). Returns the ExportedProgram; its
    report is ``sparseflow.report(program)``. Hugging Face models need ``use_cache=False`` in
    ``kwargs`` (DynamicCache is not a pytree type). ``recipe`` and ``tuning`` work as in :func:`compile`."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        model = model._orig_mod
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple of positional inputs, got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict or None, got {type(kwargs).__name__}")
    options, recipe_label = _options_with_recipe(
        recipe, model, method, config, backend, filter_fn, skip_layers, layer_configs
    )
    options = dataclasses.replace(options, tuning=check_tuning(tuning))
    _check_layers(model, options)
    ep = torch.export.export(model, args, kwargs)
    ep = ep.run_decompositions({})
    gm = ep.graph_module
    rep = RewriteReport(
        method=options.config.method,
        config=options.config.to_dict(),
        backend=options.backend,
        source="export",
        recipe=recipe_label,
    )
    entries = rewrite_graph(gm, options, graph_kind="export")
    if not entries and _has_sparseflow_ops(gm):
        raise RuntimeError(
            "sparseflow.export: the model's graph already holds sparseflow ops and no SDPA: it was "
            "already transformed; refusing to transform it twice"
        )
    rep.add_graph(entries)
    rep.check_attention_found()
    setattr(ep, _CONFIG_ATTR, _marker(options, recipe=recipe_label))
    setattr(ep, _REPORT_ATTR, rep)
    return ep


# --------------------------------------------------------------------------- report / inspect


def report(obj) -> RewriteReport:
    """The live :class:`RewriteReport` of a model from :func:`compile` or a program from :func:`export`.
    For a copy of a compiled model (deepcopy, torch.load), which runs dense SDPA again, the report
    says the compilation was lost (and a warning is logged)."""
    rep = getattr(obj, _REPORT_ATTR, None)
    if rep is None:
        raise TypeError(
            f"{type(obj).__name__} was not transformed by sparseflow: call sparseflow.compile(model, ...) "
            "or sparseflow.export(model, ...) first"
        )
    if isinstance(obj, nn.Module) and not _is_compiled(obj):
        rep.mark_lost(_LOST_MODEL)
    return rep


def inspect(model, *example_inputs, **example_kwargs) -> InspectionResult:
    """Run a sparseflow-compiled model (or exported program) once on the example inputs, under
    ``torch.no_grad()`` and ``sparseflow.capture()``, and return the rewrite report (a snapshot)
    with what every op call did: sparse or dense and why, density.

    Raises TypeError for a model sparseflow has not transformed: ``inspect`` never compiles or
    copies a model behind the user's back; call ``sparseflow.compile`` first."""
    if isinstance(model, torch.export.ExportedProgram):
        rep = report(model)
        runner = model.module()
    elif isinstance(model, nn.Module) and getattr(model, _REPORT_ATTR, None) is not None:
        rep = report(model)
        runner = model
    else:
        raise TypeError(
            f"sparseflow.inspect needs a model returned by sparseflow.compile (or a program from "
            f"sparseflow.export), got an untransformed {type(model).__name__}; call "
            "sparseflow.compile(model, method=...) first"
        )
    with torch.no_grad(), _recording.capture() as cap, _recording.tallying(rep.runtime):
        out = runner(*example_inputs, **example_kwargs)
    if rep.graphs == 0:
        logger.warning(
            "sparseflow.inspect: no graph was captured, so nothing was rewritten: the model ran "
            "uncompiled (Dynamo skipped its frame, was disabled, or hit torch._dynamo.config.recompile_limit)"
        )
    return InspectionResult(report=rep.copy(), calls=list(cap.calls), output=out)
