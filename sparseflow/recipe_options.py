"""Recipes in ``compile`` and ``export``: pick the recipe that applies to the model and method
("auto", a shipped name or a file; skipped with an INFO log or refused when it does not fit) and
merge its settings under the user's own, into the pass's RewriteOptions."""

from __future__ import annotations

import dataclasses
import logging
from typing import Dict, Optional

import torch.nn as nn

from .config import AttentionConfig
from .option_checks import layer_indices, make_options
from .passes.rewrite_options import RewriteOptions

__all__ = ["options_with_recipe"]

logger = logging.getLogger("sparseflow")


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
        return rec.fitted(model_config)  # "auto" chose a fitting one; an explicit one is checked here
    logger.info(
        "sparseflow: recipe %r: the model has no transformers config, so its model checks are skipped", rec.label
    )
    n_layers = _model_layer_count(model)
    return rec if n_layers is None else rec.fitted_to_layers(n_layers)


def _model_layer_count(model: nn.Module) -> Optional[int]:
    n = getattr(_model_config(model), "num_hidden_layers", None)
    if isinstance(n, int):
        return n
    layers = layer_indices(model)
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


def options_with_recipe(recipe, model, method, config, backend, filter_fn, skip_layers, layer_configs):
    """``(RewriteOptions, recipe label or None)``: the user's arguments are checked first, exactly
    as without a recipe, then the recipe (if one applies) is merged in."""
    options = make_options(method, config, backend, filter_fn, skip_layers, layer_configs)
    rec = _recipe_for(recipe, model, method)
    if rec is None:
        return options, None
    skip = sorted(options.skip_layers)  # the checked copy: skip_layers may be a one-shot iterator
    user_layers = dict(options.layer_configs)

    def merged(band) -> RewriteOptions:
        base, layers = _apply_recipe(band, model, method, config, skip, user_layers)
        return make_options(method, base, backend, filter_fn, skip, layers)

    longer = tuple((tokens, merged(band)) for tokens, band in rec.bands_for(method))
    return dataclasses.replace(merged(rec), longer=longer), rec.label
