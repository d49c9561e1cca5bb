"""Named, validated sparse-attention configurations per model family.

A :class:`Recipe` says, for one model family, which config each method uses (block sizes,
thresholds, K), which layers stay dense, and what it was measured to reach. Recipes are looked up
by name (:func:`get_recipe`, :func:`list_recipes`), read from a JSON file (:func:`load_recipe`,
written by :meth:`Recipe.save`), or found for a model (:func:`resolve_recipe` with ``"auto"``),
and turned into a per-layer :class:`sparseflow.hf.Plan` for a concrete model with
:meth:`Recipe.plan`, which checks that the model belongs to the family.

Importing this package imports neither transformers nor any recipe's model.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

from ..config import METHODS, AttentionConfig, config_from_dict
from ..length_bands import band_for, check_bands
from ..methods import sparse_names
from ..methods.registry import or_list

__all__ = [
    "Recipe",
    "RecipeError",
    "get_recipe",
    "list_recipes",
    "load_recipe",
    "resolve_recipe",
    "auto_recipe",
    "RECIPE_MODULES",
    "RECIPE_FORMAT",
]

logger = logging.getLogger("sparseflow")

RECIPE_FORMAT = 1  # the "format" of a recipe file; a reader refuses any other

# name -> module defining ``RECIPE`` (imported on first use)
RECIPE_MODULES: Dict[str, str] = {
    "gemma3": "sparseflow.recipes.gemma3",
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
    # settings for longer prompts: ``((tokens, recipe), ...)``, tokens increasing; a call with at
    # least ``tokens`` keys runs that recipe (of the same family, covering the same methods)
    longer: Tuple[Tuple[int, "Recipe"], ...] = ()
    # the file it was read from (None for a shipped recipe); not part of the recipe's identity
    path: Optional[str] = field(default=None, compare=False)

    def __post_init__(self):
        if not self.name or not isinstance(self.name, str):
            raise RecipeError(f"recipe name must be a non-empty str, got {self.name!r}")
        if not self.model_types:
            raise RecipeError(f"recipe {self.name!r}: model_types must name at least one model family")
        self._check_configs()
        self._check_dense_layers()
        for method, per_layer in self.layer_overrides.items():
            self._check_overrides(method, per_layer)
        self._check_longer()

    def _check_configs(self) -> None:
        if not self.configs:
            raise RecipeError(f"recipe {self.name!r}: configs must give at least one method")
        for method, cfg in self.configs.items():
            if method not in sparse_names():
                raise RecipeError(
                    f"recipe {self.name!r}: unknown method {method!r} (expected {or_list(sparse_names())})"
                )
            if not isinstance(cfg, AttentionConfig) or cfg.method != method:
                raise RecipeError(
                    f"recipe {self.name!r}: configs[{method!r}] must be a {METHODS[method].__name__}, got {cfg!r}"
                )

    def _check_dense_layers(self) -> None:
        for i in self.dense_layers:
            if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                raise RecipeError(f"recipe {self.name!r}: dense_layers must hold non-negative ints, got {i!r}")
            if self.num_layers is not None and i >= self.num_layers:
                raise RecipeError(f"recipe {self.name!r}: dense layer {i} >= num_layers={self.num_layers}")
        if len(set(self.dense_layers)) != len(self.dense_layers):
            raise RecipeError(f"recipe {self.name!r}: dense_layers has duplicates: {list(self.dense_layers)}")

    def _check_overrides(self, method: str, per_layer: Mapping[int, Mapping[str, Any]]) -> None:
        if method not in self.configs:
            raise RecipeError(f"recipe {self.name!r}: layer_overrides for {method!r}, which has no config")
        for i, changes in per_layer.items():
            if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                raise RecipeError(
                    f"recipe {self.name!r}: layer_overrides[{method!r}] keys must be non-negative ints, got {i!r}"
                )
            if i in self.dense_layers:
                raise RecipeError(f"recipe {self.name!r}: layer {i} is dense and has layer_overrides")
            try:
                self.configs[method].replace(**dict(changes))
            except (TypeError, ValueError) as exc:
                raise RecipeError(f"recipe {self.name!r}: layer_overrides[{method!r}][{i}]: {exc}") from exc

    def _check_longer(self) -> None:
        check_bands(self.longer, Recipe, f"recipe {self.name!r}: longer", RecipeError)
        for tokens, rec in self.longer:
            if not set(rec.methods) <= set(self.methods) or not set(rec.model_types) <= set(self.model_types):
                raise RecipeError(
                    f"recipe {self.name!r}: longer[{tokens}] ({rec.name!r}) must cover some of the methods "
                    f"{self.methods} and model types {list(self.model_types)}; it has {rec.methods} and "
                    f"{list(rec.model_types)}"
                )

    def with_longer(self, tokens: int, recipe: "Recipe") -> "Recipe":
        """This recipe with ``recipe`` run from ``tokens`` keys on (after this one's other bands);
        e.g. two calibrations at 8K and 32K made one recipe."""
        return dataclasses.replace(
            self, longer=(*self.longer, (tokens, dataclasses.replace(recipe, path=None))), path=None
        )

    def bands_for(self, method: str) -> Tuple[Tuple[int, "Recipe"], ...]:
        """The bands of :attr:`longer` with settings for ``method``: a band without them leaves
        ``method`` on the settings of the band before it."""
        return tuple((tokens, rec) for tokens, rec in self.longer if method in rec.configs)

    def for_tokens(self, n_keys, method: str) -> "Recipe":
        """The recipe a ``method`` call with ``n_keys`` keys runs: the last band of
        :meth:`bands_for` it reaches, else this one."""
        return band_for(self.bands_for(method), n_keys, self)[1]

    def layer_configs_for(
        self, method: str, base: AttentionConfig, n_layers: Optional[int] = None
    ) -> Dict[int, AttentionConfig]:
        """``{layer: config}``: this recipe's per-layer changes for ``method`` applied to ``base``
        (the recipe's config or a user's). Layers beyond ``n_layers`` are an error."""
        out = {}
        for i, changes in sorted(self.layer_overrides.get(method, {}).items()):
            if n_layers is not None and i >= n_layers:
                raise RecipeError(
                    f"recipe {self.name!r}: layer_overrides name layer {i}, but the model has {n_layers} layers"
                )
            try:
                out[i] = base.replace(**dict(changes))
            except (TypeError, ValueError) as exc:
                raise RecipeError(
                    f"recipe {self.name!r}: layer_overrides[{method!r}][{i}] on {base.to_dict()}: {exc}"
                ) from exc
        return out

    @property
    def methods(self) -> List[str]:
        return sorted(self.configs)

    def config_for(self, method: str) -> AttentionConfig:
        if method not in self.configs:
            raise RecipeError(f"recipe {self.name!r} has no {method!r} settings; it covers {self.methods}")
        return self.configs[method]

    def check_model(self, model_config) -> None:
        """Raise :class:`RecipeError` when a transformers config is not of this recipe's family
        (its bands for longer prompts aside: :meth:`fitted` drops those made for another model)."""
        mt = getattr(model_config, "model_type", None)
        if mt not in self.model_types:
            raise RecipeError(
                f"recipe {self.name!r} is for model types {list(self.model_types)}, but the model is {mt!r}"
            )
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
            self.check_layers(n_layers)

    def fitted(self, model_config) -> "Recipe":
        """This recipe for ``model_config`` (:meth:`check_model` raises when it is not of the
        family), without the bands for longer prompts calibrated on another model of the family
        (a band's own check refuses the model): the band before such a band runs its lengths, logged."""
        self.check_model(model_config)
        return self._without_bands_refusing(lambda band: band.check_model(model_config))

    def fitted_to_layers(self, n_layers: int) -> "Recipe":
        """:meth:`fitted` for a model known only by its layer count (no transformers config)."""
        self.check_layers(n_layers)
        return self._without_bands_refusing(lambda band: band.check_layers(n_layers))

    def _without_bands_refusing(self, check: Callable[["Recipe"], None]) -> "Recipe":
        kept = []
        for tokens, rec in self.longer:
            try:
                check(rec)
            except RecipeError as exc:
                logger.warning(
                    "sparseflow: recipe %r: its settings from %d tokens (%r) do not fit this model (%s); "
                    "prompts of that length run the settings before them",
                    self.name,
                    tokens,
                    rec.name,
                    exc,
                )
                continue
            kept.append((tokens, rec))
        return self if len(kept) == len(self.longer) else dataclasses.replace(self, longer=tuple(kept))

    def check_layers(self, n_layers: int) -> None:
        """Raise :class:`RecipeError` when a dense layer or a per-layer override names a layer
        beyond ``n_layers``: the model is then not of the family the recipe was made for (its
        bands aside: :meth:`fitted_to_layers`)."""
        bad = [i for i in self.dense_layers if i >= n_layers]
        if bad:
            raise RecipeError(f"recipe {self.name!r}: dense layers {bad} do not exist in a {n_layers}-layer model")
        for method, per_layer in sorted(self.layer_overrides.items()):
            bad = sorted(i for i in per_layer if i >= n_layers)
            if bad:
                raise RecipeError(
                    f"recipe {self.name!r}: layer_overrides[{method!r}] name layers {bad}, "
                    f"which do not exist in a {n_layers}-layer model"
                )

    @property
    def label(self) -> str:
        """How reports name it: the file's path for a recipe read from a file, else its name."""
        return self.path or self.name

    def plan(self, method: str, model_config=None, *, backend: str = "auto", source: Optional[str] = None):
        """The per-layer :class:`sparseflow.hf.Plan` of ``method`` for a model (checked when
        ``model_config`` is given)."""
        from ..hf import Plan

        n_layers, rec = None, self
        if model_config is not None:
            rec = self.fitted(model_config)
            n_layers = getattr(model_config, "num_hidden_layers", None)

        def plan_of(rec: "Recipe", longer=()):
            cfg = rec.config_for(method)
            return Plan(
                method=method,
                config=cfg,
                backend=backend,
                dense_layers=tuple(rec.dense_layers),
                layer_configs=rec.layer_configs_for(method, cfg, n_layers),
                recipe=rec.name,
                num_layers=n_layers,
                source=source,
                longer=longer,
            )

        return plan_of(rec, tuple((tokens, plan_of(band)) for tokens, band in rec.bands_for(method)))

    def to_dict(self) -> Dict[str, Any]:
        """The recipe as JSON-able data: what a recipe file holds (:meth:`from_dict` reads it)."""
        return {
            "format": RECIPE_FORMAT,
            "name": self.name,
            "description": self.description,
            "model_types": list(self.model_types),
            "configs": {m: c.to_dict() for m, c in sorted(self.configs.items())},
            "dense_layers": list(self.dense_layers),
            "num_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "layer_overrides": {
                m: {str(i): dict(c) for i, c in sorted(per.items())} for m, per in sorted(self.layer_overrides.items())
            },
            "measured": dict(self.measured),
            **({"longer": [{"tokens": t, "recipe": r.to_dict()} for t, r in self.longer]} if self.longer else {}),
        }

    @classmethod
    def from_dict(cls, data: Any, *, where: str = "recipe") -> "Recipe":
        """The recipe a :meth:`to_dict` result describes, every field checked; a
        :class:`RecipeError` names ``where`` (e.g. the file) and the bad field."""
        return _recipe_from_dict(data, where)

    def save(self, path: Union[str, os.PathLike]) -> Path:
        """Write the recipe to the JSON file ``path`` atomically (a temporary file in the same
        folder, renamed into place), so a reader never sees half a file. Returns the path."""
        path = Path(path).expanduser()
        try:
            text = json.dumps(self.to_dict(), indent=2) + "\n"
        except (TypeError, ValueError) as exc:
            raise RecipeError(f"recipe {self.name!r} cannot be saved as JSON: {exc}") from exc
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=str(path.parent))
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(text)
            os.replace(tmp, path)
        finally:  # an error mid-write leaves no temporary file behind
            if os.path.exists(tmp):
                os.remove(tmp)
        return path


# --------------------------------------------------------------------------- recipe files

_OPTIONAL_INTS = ("num_layers", "num_attention_heads", "num_key_value_heads", "head_dim")
_FILE_KEYS = {"format"} | {f.name for f in fields(Recipe) if f.name != "path"}


def _fail(where: str, what: str) -> RecipeError:
    return RecipeError(f"{where}: {what}")


def _layer_key(where: str, arg: str, key: Any) -> int:
    # JSON object keys are strings; to_dict writes layer indices as "3"
    if isinstance(key, str) and key.isdigit():
        return int(key)
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return key
    raise _fail(where, f"{arg} keys must be non-negative layer indices, got {key!r}")


def _read_configs(where: str, raw: Any) -> Dict[str, AttentionConfig]:
    if not isinstance(raw, Mapping) or not raw:
        raise _fail(where, f"configs must be an object {{method: config}} naming at least one method, got {raw!r}")
    out = {}
    for method, cfg in raw.items():
        if not isinstance(cfg, Mapping):
            raise _fail(where, f"configs.{method} must be an object of config fields, got {cfg!r}")
        cfg = dict(cfg)
        if cfg.setdefault("method", method) != method:
            raise _fail(where, f"configs.{method} has method {cfg['method']!r}; a config's method must be its key")
        try:
            out[method] = config_from_dict(cfg)
        except (TypeError, ValueError) as exc:
            raise _fail(where, f"configs.{method}: {exc}") from None
    return out


def _read_overrides(where: str, raw: Any) -> Dict[str, Dict[int, Dict[str, Any]]]:
    if not isinstance(raw, Mapping):
        raise _fail(where, f"layer_overrides must be an object {{method: {{layer: {{field: value}}}}}}, got {raw!r}")
    out: Dict[str, Dict[int, Dict[str, Any]]] = {}
    for method, per_layer in raw.items():
        if not isinstance(per_layer, Mapping):
            raise _fail(
                where, f"layer_overrides.{method} must be an object {{layer: {{field: value}}}}, got {per_layer!r}"
            )
        out[method] = {}
        for key, changes in per_layer.items():
            i = _layer_key(where, f"layer_overrides.{method}", key)
            if not isinstance(changes, Mapping):
                raise _fail(
                    where, f"layer_overrides.{method}.{key} must be an object {{field: value}}, got {changes!r}"
                )
            out[method][i] = dict(changes)
    return out


def _read_fields(where: str, data: Mapping[str, Any]) -> Dict[str, Any]:
    kw: Dict[str, Any] = {}
    name = data.get("name")
    if not isinstance(name, str) or not name.strip():
        raise _fail(where, f"name must be a non-empty string, got {name!r}")
    kw["name"] = name
    desc = data.get("description", "")
    if not isinstance(desc, str):
        raise _fail(where, f"description must be a string, got {desc!r}")
    kw["description"] = desc
    types = data.get("model_types")
    if not isinstance(types, list) or not types or not all(isinstance(t, str) and t for t in types):
        raise _fail(
            where, f'model_types must be a non-empty list of transformers model types (e.g. ["llama"]), got {types!r}'
        )
    kw["model_types"] = tuple(types)
    kw["configs"] = _read_configs(where, data.get("configs"))
    dense = data.get("dense_layers", [])
    if not isinstance(dense, list) or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in dense):
        raise _fail(where, f"dense_layers must be a list of non-negative layer indices, got {dense!r}")
    kw["dense_layers"] = tuple(dense)
    for key in _OPTIONAL_INTS:
        value = data.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise _fail(where, f"{key} must be a positive integer or null, got {value!r}")
        kw[key] = value
    measured = data.get("measured", {})
    if not isinstance(measured, Mapping):
        raise _fail(where, f"measured must be an object, got {measured!r}")
    kw["measured"] = dict(measured)
    kw["layer_overrides"] = _read_overrides(where, data.get("layer_overrides", {}))
    kw["longer"] = _read_longer(where, data.get("longer", []))
    return kw


def _read_longer(where: str, raw: Any) -> Tuple[Tuple[int, Recipe], ...]:
    if not isinstance(raw, list):
        raise _fail(where, f'longer must be a list of {{"tokens": int, "recipe": {{...}}}}, got {raw!r}')
    out = []
    for i, band in enumerate(raw):
        if not isinstance(band, Mapping) or set(band) != {"tokens", "recipe"}:
            raise _fail(where, f'longer[{i}] must be an object {{"tokens": int, "recipe": {{...}}}}, got {band!r}')
        tokens = band["tokens"]
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise _fail(where, f"longer[{i}].tokens must be a positive integer, got {tokens!r}")
        out.append((tokens, _recipe_from_dict(band["recipe"], f"{where}, longer[{i}]")))
    return tuple(out)


def _recipe_from_dict(data: Any, where: str, path: Optional[str] = None) -> Recipe:
    if not isinstance(data, Mapping):
        raise _fail(where, f"a recipe must be a JSON object, got {type(data).__name__}")
    fmt = data.get("format", RECIPE_FORMAT)
    if fmt != RECIPE_FORMAT:
        raise _fail(where, f"format must be {RECIPE_FORMAT} (the recipe format this sparseflow reads), got {fmt!r}")
    unknown = sorted(set(data) - _FILE_KEYS)
    if unknown:
        raise _fail(where, f"unknown fields {unknown}; a recipe has {sorted(_FILE_KEYS)}")
    kw = _read_fields(where, data)
    try:
        return Recipe(**kw, path=path)
    except RecipeError as exc:
        raise _fail(where, str(exc)) from None


def load_recipe(path: Union[str, os.PathLike]) -> Recipe:
    """The recipe in the JSON file ``path`` (as :meth:`Recipe.save` writes it), fully checked;
    :class:`RecipeError` names the file and what is wrong."""
    p = Path(path).expanduser()
    where = f"recipe file {str(path)!r}"
    if not p.exists():
        raise RecipeError(
            f"{where} does not exist; pass the path of a recipe .json file or a shipped recipe name {list_recipes()}"
        )
    if p.is_dir():
        raise RecipeError(f"{where} is a folder; pass the path of a recipe .json file")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"{where} cannot be read: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RecipeError(f"{where} is not valid JSON: {exc}") from None
    return _recipe_from_dict(data, where, path=str(path))


def list_recipes() -> List[str]:
    """Names of the recipes shipped with sparseflow."""
    return sorted(RECIPE_MODULES)


def get_recipe(name: str) -> Recipe:
    """The recipe called ``name``; :class:`RecipeError` (a ValueError) names the known ones."""
    if not isinstance(name, str):
        raise TypeError(f"recipe name must be a str, got {type(name).__name__}")
    key = name.strip().lower()
    if key not in RECIPE_MODULES:
        raise RecipeError(
            f"unknown recipe {name!r}; available recipes: {list_recipes()} (or pass the path of a recipe .json file)"
        )
    module = importlib.import_module(RECIPE_MODULES[key])
    recipe = getattr(module, "RECIPE", None)
    if not isinstance(recipe, Recipe):
        raise RecipeError(f"recipe module {RECIPE_MODULES[key]} does not define RECIPE as a sparseflow Recipe")
    return recipe


# --------------------------------------------------------------------------- resolving


def _is_path(spec: str) -> bool:
    return spec.lower().endswith(".json") or os.sep in spec or "/" in spec or os.path.isfile(spec)


def auto_recipe(model_config) -> Optional[Recipe]:
    """The shipped recipe whose :meth:`Recipe.check_model` accepts ``model_config``; None when
    none does or no config is known. Several fitting: the first by name (logged)."""
    if model_config is None:
        return None
    fits = []
    for name in list_recipes():
        recipe = get_recipe(name)
        try:
            recipe.check_model(model_config)
        except RecipeError:
            continue
        fits.append(recipe)
    if len(fits) > 1:
        logger.info(
            "sparseflow: recipe='auto': recipes %s fit the model; using %r (the first by name)",
            [r.name for r in fits],
            fits[0].name,
        )
    return fits[0] if fits else None


def resolve_recipe(spec: Union[None, str, os.PathLike, Recipe], model_config=None) -> Optional[Recipe]:
    """The recipe ``spec`` means: a shipped name, a path to a ``.json`` recipe file, ``"auto"``
    (:func:`auto_recipe` for ``model_config``), a :class:`Recipe`, or None (no recipe).
    Explicit recipes are not checked against the model here (:meth:`Recipe.check_model` does)."""
    if spec is None or isinstance(spec, Recipe):
        return spec
    if isinstance(spec, os.PathLike):
        return load_recipe(spec)
    if not isinstance(spec, str):
        raise TypeError(
            f"recipe must be a recipe name, a path to a .json recipe file, 'auto' or None, got {type(spec).__name__}"
        )
    text = spec.strip()
    if text.lower() == "auto":
        return auto_recipe(model_config)
    if _is_path(text):
        return load_recipe(text)
    return get_recipe(text)
