"""How ``compile`` hooks into ``torch.compile``: the backend that rewrites each captured graph and
hands it to the inner backend, the per-model function compiled, and the compiled call installed
on the model (with its decode state and run-time tally); and the checks of ``torch.compile``'s
own flags (inner backend, mode, dynamic, fullgraph)."""

from __future__ import annotations

import itertools
import types
from typing import Any, Callable, Dict, Optional

import torch
import torch.nn as nn

from . import decode_state
from ._version import __version__
from . import recording as _recording
from .model_marks import DECODE_STATE_ATTR, guard_copies
from .op_schema import OP_CONTRACT
from .passes.rewrite_options import RewriteOptions
from .passes.sdpa_rewrite import rewrite_graph
from .rewrite_report import RewriteReport

__all__ = [
    "INNER_BACKENDS",
    "MODES",
    "RewritingBackend",
    "mode_options",
    "check_compile_flags",
    "install_compiled_call",
]


INNER_BACKENDS = ("inductor", "aot_eager", "eager")


MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def mode_options(mode: Optional[str], inner_backend: str, dynamic) -> Dict[str, Any]:
    """Inductor's settings for a ``torch.compile`` mode (``"reduce-overhead"``: CUDA graphs)."""
    if mode is None:
        return {}
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"mode must be None or one of {list(MODES)}, got {mode!r}")
    if inner_backend != "inductor":
        raise ValueError(f"mode={mode!r} configures Inductor; it needs inner_backend='inductor', got {inner_backend!r}")
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode, dynamic))


def check_compile_flags(inner_backend, dynamic, fullgraph) -> None:
    if not isinstance(inner_backend, str) or inner_backend not in INNER_BACKENDS:
        raise ValueError(f"inner_backend must be one of {list(INNER_BACKENDS)}, got {inner_backend!r}")
    if dynamic is not None and not isinstance(dynamic, bool):
        raise TypeError(f"dynamic must be None, True or False, got {dynamic!r}")
    if not isinstance(fullgraph, bool):
        raise TypeError(f"fullgraph must be a bool, got {fullgraph!r}")


class RewritingBackend:
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

        with torch.compiler.config.patch(cache_key_tag=inductor_cache_tag(torch.compiler.config.cache_key_tag)):
            return compile_fx(gm, example_inputs, config_patches=self.inductor_options)


def inductor_cache_tag(user_tag: str) -> str:
    """The user's cache key tag plus this package's op contract: Inductor's FX graph cache keys
    on the graph, not on a custom op's fake implementation, so code compiled under another
    contract (say, another output layout) would be reused and fail its stride checks."""
    return (
        f"{user_tag}+sparseflow-{__version__}-ops{OP_CONTRACT}"
        if user_tag
        else f"sparseflow-{__version__}-ops{OP_CONTRACT}"
    )


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


def install_compiled_call(
    model: nn.Module, be: "RewritingBackend", rep: RewriteReport, dynamic, fullgraph, cuda_graphs: Optional[str] = None
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
    guard_copies(model)
