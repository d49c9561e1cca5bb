"""The public entry points: ``compile``, ``export``, ``inspect`` and the rewrite report.

``compile`` rewrites lazily: ``torch.compile`` captures a graph on the first call (and again on
every recompile, e.g. the decode steps of ``generate()``), and our backend rewrites each graph
before handing it on. The model's :class:`RewriteReport` therefore fills up as the model runs;
``inspect`` runs the model once so the report is complete for those inputs.

The verbs live here; what they stand on lives beside them: ``option_checks`` and
``recipe_options`` (the arguments, into the pass's options), ``dynamo_backend`` (the
``torch.compile`` hook-up), ``model_marks`` (what a compiled model carries, and its copies) and
``rewrite_report`` (the report and its tables).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping
from typing import Any, Callable, Dict, Optional, Tuple

import torch
import torch.nn as nn

from . import recording as _recording
from .config import AttentionConfig
from .dynamo_backend import INNER_BACKENDS, RewritingBackend, check_compile_flags, install_compiled_call, mode_options
from .model_marks import CONFIG_ATTR, REPORT_ATTR, check_not_transformed, is_compiled, settings_marker
from .option_checks import check_layers, check_model_context_parallel, check_no_dense_tail
from .passes.rewrite_options import RewriteOptions
from .passes.sdpa_rewrite import rewrite_graph
from .recipe_options import options_with_recipe
from .rewrite_report import LOST_MODEL, InspectionResult, RewriteReport
from .tuning import Tuning, check_tuning

__all__ = ["compile", "export", "inspect", "report", "RewriteReport", "InspectionResult", "INNER_BACKENDS"]

logger = logging.getLogger("sparseflow")


# --------------------------------------------------------------------------- compile


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
    per-model trampoline to ``model._call_impl`` (see ``dynamo_backend._trampoline``). The model is
    marked with ``model._sparseflow_config`` (the settings, as a dict) and ``model._sparseflow_report``; a
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
    check_compile_flags(inner_backend, dynamic, fullgraph)
    inductor_options = mode_options(mode, inner_backend, dynamic)
    compile_flags = dict(inner_backend=inner_backend, mode=mode, dynamic=dynamic, fullgraph=fullgraph)
    _compile_in_place(model, options, recipe_label, inductor_options, **compile_flags)
    return model


def _compile_options(
    model, method, config, backend, filter_fn, skip_layers, layer_configs, recipe, tuning, context_parallel
) -> Tuple[RewriteOptions, Optional[str]]:
    """``compile``'s checked rewrite options and the label of the recipe that applied (None: none)."""
    options, recipe_label = options_with_recipe(
        recipe, model, method, config, backend, filter_fn, skip_layers, layer_configs
    )
    options = dataclasses.replace(
        options, tuning=check_tuning(tuning), context_parallel=check_model_context_parallel(context_parallel)
    )
    if options.context_parallel is not None:
        check_no_dense_tail(options)
    check_layers(model, options)
    return options, recipe_label


def _compile_in_place(
    model, options, recipe_label, inductor_options, *, inner_backend, mode, dynamic, fullgraph
) -> None:
    """Install the compiled call on ``model`` and mark it with its settings and its (empty) report."""
    rep = RewriteReport(
        method=options.config.method, config=options.config.to_dict(), backend=options.backend, recipe=recipe_label
    )
    inductor_graphs = bool(inductor_options.get("triton.cudagraphs"))
    # the ops of a compiled graph that nothing captures may replay their own CUDA graphs (a few
    # launches in place of each call's own: the host cost of a short prefill)
    options = dataclasses.replace(options, op_graphs_in_dynamo=not inductor_graphs)
    install_compiled_call(
        model,
        RewritingBackend(options, inner_backend, rep, inductor_options),
        rep,
        dynamic,
        fullgraph,
        cuda_graphs=mode if inductor_graphs else None,
    )
    setattr(
        model,
        CONFIG_ATTR,
        settings_marker(
            options, inner_backend=inner_backend, mode=mode, dynamic=dynamic, fullgraph=fullgraph, recipe=recipe_label
        ),
    )
    setattr(model, REPORT_ATTR, rep)


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
    check_not_transformed(model)
    if is_compiled(model):
        raise RuntimeError(
            "model already has torch.compile applied (Module.compile); sparseflow.compile would replace "
            "those settings. Pass a model that has not been compiled."
        )


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
    options, recipe_label = options_with_recipe(
        recipe, model, method, config, backend, filter_fn, skip_layers, layer_configs
    )
    options = dataclasses.replace(options, tuning=check_tuning(tuning))
    check_layers(model, options)
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
    setattr(ep, CONFIG_ATTR, settings_marker(options, recipe=recipe_label))
    setattr(ep, REPORT_ATTR, rep)
    return ep


# --------------------------------------------------------------------------- report / inspect


def report(obj) -> RewriteReport:
    """The live :class:`RewriteReport` of a model from :func:`compile` or a program from :func:`export`.
    For a copy of a compiled model (deepcopy, torch.load), which runs dense SDPA again, the report
    says the compilation was lost (and a warning is logged)."""
    rep = getattr(obj, REPORT_ATTR, None)
    if rep is None:
        raise TypeError(
            f"{type(obj).__name__} was not transformed by sparseflow: call sparseflow.compile(model, ...) "
            "or sparseflow.export(model, ...) first"
        )
    if isinstance(obj, nn.Module) and not is_compiled(obj):
        rep.mark_lost(LOST_MODEL)
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
    elif isinstance(model, nn.Module) and getattr(model, REPORT_ATTR, None) is not None:
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
