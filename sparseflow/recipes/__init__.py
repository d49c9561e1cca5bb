"""Named, validated sparse-attention configurations per model family.

A :class:`Recipe` says, for one model family, which config each method uses (block sizes,
thresholds, K), which layers stay dense, and what it was measured to reach. Recipes are looked up
by name (:func:`get_recipe`, :func:`list_recipes`) and turned into a per-layer
:class:`sparseflow.hf.Plan` for a concrete model with :meth:`Recipe.plan`, which checks that the
model belongs to the family.

Importing this package imports neither transformers nor any recipe's model.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..config import METHODS, AttentionConfig

__all__ = ["Recipe", "RecipeError", "get_recipe", "list_recipes", "RECIPE_MODULES"]

# name -> module defining ``RECIPE`` (imported on first use)
RECIPE_MODULES: Dict[str, str] = {
    "smollm2": "sparseflow.recipes.smollm2",
    "smollm2-code": "sparseflow.recipes.smollm2_code",
}


class RecipeError(ValueError):
    """A recipe that does not exist, is malformed, or does not fit the model."""


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    model_types: Tuple[str, ...]  # transformers ``config.model_type`` values it applies to
    configs: Mapping[str, AttentionConfig]  # method -> config
    dense_layers: Tuple[int, ...] = ()
    num_layers: Optional[int] = None  # when set, the model must have exactly this many layers
    num_attention_heads: Optional[int] = None
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    measured: Mapping[str, Any] = field(default_factory=dict)  # method -> measured fidelity notes
    # method -> {layer: {config field: value}}: per-layer changes applied on top of the method's
    # config (the recipe's, or a user's override), e.g. a calibrated per-layer permute choice
    layer_overrides: Mapping[str, Mapping[int, Mapping[str, Any]]] = field(default_factory=dict)

    def __post_init__(self):
        if not self.name or not isinstance(self.name, str):
            raise RecipeError(f"recipe name must be a non-empty str, got {self.name!r}")
        if not self.model_types:
            raise RecipeError(f"recipe {self.name!r}: model_types must name at least one model family")
        if not self.configs:
            raise RecipeError(f"recipe {self.name!r}: configs must give at least one method")
        for method, cfg in self.configs.items():
            if method not in METHODS or method == "dense":
                raise RecipeError(f"recipe {self.name!r}: unknown method {method!r} (expected pbs, pisa or bsa)")
            if not isinstance(cfg, AttentionConfig) or cfg.method != method:
                raise RecipeError(f"recipe {self.name!r}: configs[{method!r}] must be a {METHODS[method].__name__}, got {cfg!r}")
        for i in self.dense_layers:
            if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                raise RecipeError(f"recipe {self.name!r}: dense_layers must hold non-negative ints, got {i!r}")
            if self.num_layers is not None and i >= self.num_layers:
                raise RecipeError(f"recipe {self.name!r}: dense layer {i} >= num_layers={self.num_layers}")
        if len(set(self.dense_layers)) != len(self.dense_layers):
            raise RecipeError(f"recipe {self.name!r}: dense_layers has duplicates: {list(self.dense_layers)}")
        for method, per_layer in self.layer_overrides.items():
            if method not in self.configs:
                raise RecipeError(f"recipe {self.name!r}: layer_overrides for {method!r}, which has no config")
            for i, changes in per_layer.items():
                if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                    raise RecipeError(f"recipe {self.name!r}: layer_overrides[{method!r}] keys must be non-negative ints, got {i!r}")
                if i in self.dense_layers:
                    raise RecipeError(f"recipe {self.name!r}: layer {i} is dense and has layer_overrides")
                try:
                    self.configs[method].replace(**dict(changes))
                except (TypeError, ValueError) as exc:
                    raise RecipeError(f"recipe {self.name!r}: layer_overrides[{method!r}][{i}]: {exc}") from exc

    def layer_configs_for(self, method: str, base: AttentionConfig, n_layers: Optional[int] = None) -> Dict[int, AttentionConfig]:
        """``{layer: config}``: this recipe's per-layer changes for ``method`` applied to ``base``
        (the recipe's config or a user's). Layers beyond ``n_layers`` are an error."""
        out = {}
        for i, changes in sorted(self.layer_overrides.get(method, {}).items()):
            if n_layers is not None and i >= n_layers:
                raise RecipeError(f"recipe {self.name!r}: layer_overrides name layer {i}, but the model has {n_layers} layers")
            try:
                out[i] = base.replace(**dict(changes))
            except (TypeError, ValueError) as exc:
                raise RecipeError(f"recipe {self.name!r}: layer_overrides[{method!r}][{i}] on {base.to_dict()}: {exc}") from exc
        return out

    @property
    def methods(self) -> List[str]:
        return sorted(self.configs)

    def config_for(self, method: str) -> AttentionConfig:
        if method not in self.configs:
            raise RecipeError(f"recipe {self.name!r} has no {method!r} settings; it covers {self.methods}")
        return self.configs[method]

    def check_model(self, model_config) -> None:
        """Raise :class:`RecipeError` when a transformers config is not of this recipe's family."""
        mt = getattr(model_config, "model_type", None)
        if mt not in self.model_types:
            raise RecipeError(f"recipe {self.name!r} is for model types {list(self.model_types)}, but the model is {mt!r}")
        n_layers = getattr(model_config, "num_hidden_layers", None)
        checks = (
            ("num_hidden_layers", self.num_layers, n_layers),
            ("num_attention_heads", self.num_attention_heads, getattr(model_config, "num_attention_heads", None)),
            ("num_key_value_heads", self.num_key_value_heads, getattr(model_config, "num_key_value_heads", None)),
            ("head_dim", self.head_dim, getattr(model_config, "head_dim", None)),
        )
        for name, want, got in checks:
            if want is not None and got is not None and want != got:
                raise RecipeError(f"recipe {self.name!r} expects {name}={want}, but the model has {got}")
        if n_layers is not None:
            bad = [i for i in self.dense_layers if i >= n_layers]
            if bad:
                raise RecipeError(f"recipe {self.name!r}: dense layers {bad} do not exist in a {n_layers}-layer model")

    def plan(self, method: str, model_config=None, *, backend: str = "auto", source: Optional[str] = None):
        """The per-layer :class:`sparseflow.hf.Plan` of ``method`` for a model (checked when
        ``model_config`` is given)."""
        from ..hf import Plan

        cfg = self.config_for(method)
        n_layers = None
        if model_config is not None:
            self.check_model(model_config)
            n_layers = getattr(model_config, "num_hidden_layers", None)
        return Plan(method=method, config=cfg, backend=backend, dense_layers=tuple(self.dense_layers),
                    layer_configs=self.layer_configs_for(method, cfg, n_layers),
                    recipe=self.name, num_layers=n_layers, source=source)

    def to_dict(self) -> Dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "model_types": list(self.model_types),
            "configs": {m: c.to_dict() for m, c in sorted(self.configs.items())},
            "dense_layers": list(self.dense_layers),
            "num_layers": self.num_layers,
            "layer_overrides": {m: {str(i): dict(c) for i, c in sorted(per.items())}
                                for m, per in sorted(self.layer_overrides.items())},
            "measured": dict(self.measured),
        }


def list_recipes() -> List[str]:
    """Names of the recipes shipped with sparseflow."""
    return sorted(RECIPE_MODULES)


def get_recipe(name: str) -> Recipe:
    """The recipe called ``name``; :class:`RecipeError` (a ValueError) names the known ones."""
    if not isinstance(name, str):
        raise TypeError(f"recipe name must be a str, got {type(name).__name__}")
    key = name.strip().lower()
    if key not in RECIPE_MODULES:
        raise RecipeError(f"unknown recipe {name!r}; available recipes: {list_recipes()}")
    module = importlib.import_module(RECIPE_MODULES[key])
    recipe = getattr(module, "RECIPE", None)
    if not isinstance(recipe, Recipe):
        raise RecipeError(f"recipe module {RECIPE_MODULES[key]} does not define RECIPE as a sparseflow Recipe")
    return recipe
