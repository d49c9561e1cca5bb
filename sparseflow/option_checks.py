"""Check the rewrite arguments ``compile`` and ``export`` take (method, config, backend,
skip_layers, layer_configs, filter_fn, context_parallel) and build the pass's RewriteOptions from
them: a wrong argument raises here, with what was expected, before anything is compiled."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Dict, List, Optional, Sequence

import torch.nn as nn

from .config import BACKENDS, METHODS, AttentionConfig, default_config
from .methods import spec_for
from .passes.module_tags import layer_index
from .passes.rewrite_options import RewriteOptions

__all__ = [
    "check_backend",
    "make_options",
    "check_model_context_parallel",
    "check_no_dense_tail",
    "layer_indices",
    "check_layers",
]


def check_backend(method: str, backend: str, arg: str = "backend") -> None:
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


def make_options(method, config, backend, filter_fn, skip_layers, layer_configs) -> RewriteOptions:
    config = _method_config(method, config)
    check_backend(method, backend)
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(
            f"filter_fn must be a callable taking a module name and returning bool, got {type(filter_fn).__name__}"
        )
    skip = _skip_layers(skip_layers)
    return RewriteOptions(
        config=config,
        backend=backend,
        filter_fn=filter_fn,
        skip_layers=frozenset(skip),
        layer_configs=_layer_configs(layer_configs, backend, skip),
    )


def _method_config(method, config) -> AttentionConfig:
    """``config`` (None: the method's default) after checking it is ``method``'s."""
    if not isinstance(method, str):
        raise TypeError(f"method must be a str, one of {list(METHODS)}, got {type(method).__name__}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")
    if config is None:
        return default_config(method)
    if not isinstance(config, AttentionConfig):
        raise TypeError(
            f"config must be a sparseflow config ({', '.join(c.__name__ for c in METHODS.values())}) "
            f"or None, got {type(config).__name__}"
        )
    if config.method != method:
        raise ValueError(
            f"config is a {type(config).__name__} (method {config.method!r}) but method={method!r}; "
            f"pass method={config.method!r} or a {METHODS[method].__name__}"
        )
    return config


def _layer_index(i, name: str) -> int:
    """``i`` as a layer index, else the error naming ``name`` (what holds it)."""
    if isinstance(i, bool) or not isinstance(i, int):
        raise TypeError(f"{name} must be int layer indices, got {i!r}")
    if i < 0:
        raise ValueError(f"{name} must be non-negative layer indices, got {i}")
    return i


def _skip_layers(skip_layers) -> List[int]:
    if skip_layers is None:
        return []
    if isinstance(skip_layers, (str, bytes)) or not isinstance(skip_layers, Iterable):
        raise TypeError(f"skip_layers must be an iterable of layer indices, got {type(skip_layers).__name__}")
    return [_layer_index(i, "skip_layers entries") for i in skip_layers]


def _layer_configs(layer_configs, backend, skip: List[int]) -> Dict[int, Optional[AttentionConfig]]:
    if layer_configs is None:
        return {}
    if not isinstance(layer_configs, Mapping):
        raise TypeError(
            f"layer_configs must be a dict {{layer_index: config or None}}, got {type(layer_configs).__name__}"
        )
    per_layer: Dict[int, Optional[AttentionConfig]] = {}
    for i, cfg in layer_configs.items():
        _layer_index(i, "layer_configs keys")
        if cfg is not None and not isinstance(cfg, AttentionConfig):
            raise TypeError(f"layer_configs[{i}] must be a sparseflow config or None, got {type(cfg).__name__}")
        if cfg is not None:
            check_backend(cfg.method, backend, arg=f"backend (for layer_configs[{i}], method {cfg.method!r})")
            if i in skip:
                raise ValueError(f"layer {i} is both in skip_layers and given a config in layer_configs")
        per_layer[i] = cfg
    return per_layer


def check_model_context_parallel(context_parallel: Any):
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


def check_no_dense_tail(options: RewriteOptions) -> None:
    """Context parallelism does not run PBS's dense tail: refused when the model is compiled,
    not at its first forward."""
    configs = {}
    for tokens, band in ((0, options), *options.longer):
        at = f" (the recipe's settings from {tokens} keys)" if tokens else ""
        configs[f"config{at}"] = band.config
        configs.update({f"layer_configs[{i}]{at}": c for i, c in band.layer_configs.items()})
    for where, cfg in configs.items():
        if cfg is not None and getattr(cfg, "dense_tail_blocks", 0):
            raise ValueError(
                f"context_parallel does not run dense_tail_blocks={cfg.dense_tail_blocks} ({where}); "
                "use dense_tail_blocks=0 with context_parallel"
            )


def layer_indices(model: nn.Module) -> List[int]:
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


def check_layers(model: nn.Module, options: RewriteOptions) -> None:
    """skip_layers / layer_configs must name layers the model has: a typo would otherwise be a
    silent no-op (the layer stays sparse, or keeps the default config)."""
    if not options.skip_layers and not options.layer_configs:
        return
    layers = set(layer_indices(model))
    for arg, given in (("skip_layers", options.skip_layers), ("layer_configs", options.layer_configs)):
        bad = sorted(i for i in given if i not in layers)
        if bad:
            raise ValueError(
                f"{arg} names layers {bad} that the model does not have: {_describe_layers(sorted(layers))}"
            )
