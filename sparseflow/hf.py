"""Hugging Face transformers integration: a ``"sparseflow"`` attention implementation.

Nothing here runs at ``import sparseflow`` (which never imports transformers). Call
:func:`register` once, then load a folder written by ``sparseflow convert``::

    import sparseflow.hf
    sparseflow.hf.register()
    model = AutoModelForCausalLM.from_pretrained("converted/")   # attention runs sparseflow ops

or in one step ``model = sparseflow.hf.from_pretrained("converted/")``.

:func:`register` adds an attention function named ``"sparseflow"`` to transformers'
``AttentionInterface`` **and** a mask function under the same name to ``AttentionMaskInterface``
(without it, transformers hands a custom attention ``attention_mask=None`` and padding would be
lost). The mask function is transformers' SDPA mask: ``None`` for plain causal prefill (the op
gets ``is_causal=True``), a 4-D bool mask otherwise, which the op folds into causality + key
padding itself or runs dense with a logged reason.

Which layer computes what is the model config's ``sparseflow`` entry, a :class:`Plan` written
by ``sparseflow convert`` into ``config.json`` next to ``"attn_implementation": "sparseflow"``.
Layers a plan keeps dense call the ``sparseflow::dense_attention`` op (plain SDPA), so a
converted model holds no bare SDPA call: ``sparseflow.compile`` accepts it and finds nothing left
to rewrite (its report shows 0 rewrites) while the recorded per-layer plan stays in effect.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, NamedTuple, Optional, Tuple

import torch

from . import ops as _ops
from .config import BACKENDS, AttentionConfig, DenseConfig, config_from_dict
from .length_bands import band_for, check_bands
from .methods import spec_for, windowed
from .tuning import DEFAULT_TUNING, Tuning

__all__ = [
    "ATTN_IMPLEMENTATION",
    "PLAN_KEY",
    "PLAN_FORMAT",
    "Plan",
    "register",
    "is_registered",
    "plan_of",
    "apply_plan",
    "from_pretrained",
    "sparseflow_attention_forward",
    "local_windows",
    "attention_layer_index",
]

logger = logging.getLogger("sparseflow")

ATTN_IMPLEMENTATION = "sparseflow"
PLAN_KEY = "sparseflow"  # the key in config.json
PLAN_FORMAT = 1
PLAN_FORMAT_BANDS = 2  # a plan with bands for longer prompts (Plan.longer)

_LAYER_RE = re.compile(r"(\d+)")


@dataclass(frozen=True)
class Plan:
    """Per-layer sparse attention settings of a converted model (serialised into config.json).

    ``config`` applies to every layer except ``dense_layers`` (run dense) and ``layer_configs``
    (layer index -> its own config, any method). ``tuning``: the Triton backends' launch options
    (:class:`sparseflow.Tuning`) for every layer.
    """

    method: str
    config: AttentionConfig
    backend: str = "auto"
    dense_layers: Tuple[int, ...] = ()
    layer_configs: Mapping[int, AttentionConfig] = field(default_factory=dict)
    recipe: Optional[str] = None
    num_layers: Optional[int] = None
    source: Optional[str] = None
    tuning: Tuning = DEFAULT_TUNING
    # plans for longer prompts: ``((tokens, plan), ...)``, tokens increasing; a call with at least
    # ``tokens`` keys runs that plan (same method, backend and layer count)
    longer: Tuple[Tuple[int, "Plan"], ...] = ()

    def __post_init__(self):
        if not isinstance(self.tuning, Tuning):
            raise TypeError(f"Plan.tuning must be a sparseflow.Tuning, got {type(self.tuning).__name__}")
        if not isinstance(self.config, AttentionConfig):
            raise TypeError(f"Plan.config must be a sparseflow config, got {type(self.config).__name__}")
        if self.config.method != self.method:
            raise ValueError(f"Plan.method={self.method!r} but its config is for {self.config.method!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"Plan.backend must be one of {list(BACKENDS)}, got {self.backend!r}")
        for i in tuple(self.dense_layers) + tuple(self.layer_configs):
            if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                raise ValueError(f"layer indices must be non-negative ints, got {i!r}")
            if self.num_layers is not None and i >= self.num_layers:
                raise ValueError(f"layer index {i} out of range: the model has {self.num_layers} layers")
        both = sorted(set(self.dense_layers) & set(self.layer_configs))
        if both:
            raise ValueError(f"layers {both} are both dense and given a config")
        self._check_longer()

    def _check_longer(self) -> None:
        check_bands(self.longer, Plan, "Plan.longer")
        for tokens, plan in self.longer:
            same = (plan.method, plan.backend, plan.num_layers)
            if same != (self.method, self.backend, self.num_layers):
                raise ValueError(
                    f"Plan.longer[{tokens}] must share the plan's method, backend and layer count "
                    f"{(self.method, self.backend, self.num_layers)}; it has {same}"
                )

    def for_keys(self, n_keys) -> "Plan":
        """The plan a call with ``n_keys`` keys runs: the last band of :attr:`longer` it reaches."""
        return band_for(self.longer, n_keys, self)[1]

    def config_for(self, layer: Optional[int]) -> AttentionConfig:
        if layer is not None:
            if layer in self.dense_layers:
                return _DENSE
            if layer in self.layer_configs:
                return self.layer_configs[layer]
        return self.config

    def to_dict(self) -> Dict[str, Any]:
        out = self._band_dict()
        if self.longer:  # a reader of format 1 would run every length with the short-prompt plan
            out["format"] = PLAN_FORMAT_BANDS
            out["longer"] = [{"tokens": t, "plan": p._band_dict()} for t, p in self.longer]
        return out

    def _band_dict(self) -> Dict[str, Any]:
        from ._version import __version__

        return {
            "format": PLAN_FORMAT,
            "sparseflow_version": __version__,
            "method": self.method,
            "config": self.config.to_dict(),
            "backend": self.backend,
            "dense_layers": sorted(self.dense_layers),
            "layer_configs": {str(i): c.to_dict() for i, c in sorted(self.layer_configs.items())},
            "recipe": self.recipe,
            "num_layers": self.num_layers,
            "source": self.source,
            "tuning": self.tuning.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Plan":
        if not isinstance(data, Mapping):
            raise TypeError(f"a sparseflow plan must be a dict, got {type(data).__name__}")
        fmt = data.get("format", PLAN_FORMAT)
        if fmt not in (PLAN_FORMAT, PLAN_FORMAT_BANDS):
            raise ValueError(
                f"sparseflow plan format {fmt} is not readable by this sparseflow (expects {PLAN_FORMAT} "
                f"or {PLAN_FORMAT_BANDS})"
            )
        longer = data.get("longer") or []
        if not isinstance(longer, list) or not all(
            isinstance(b, Mapping) and set(b) == {"tokens", "plan"} for b in longer
        ):
            raise ValueError(
                f'a sparseflow plan\'s "longer" must be a list of {{"tokens": int, "plan": {{...}}}}, got {longer!r}'
            )
        cfg = config_from_dict(data["config"])
        return cls(
            method=data.get("method", cfg.method),
            config=cfg,
            backend=data.get("backend", "auto"),
            dense_layers=tuple(int(i) for i in data.get("dense_layers", ())),
            layer_configs={int(i): config_from_dict(c) for i, c in (data.get("layer_configs") or {}).items()},
            recipe=data.get("recipe"),
            num_layers=data.get("num_layers"),
            source=data.get("source"),
            tuning=_tuning_from(data.get("tuning")),
            longer=tuple((b["tokens"], cls.from_dict(b["plan"])) for b in longer),
        )


def _tuning_from(raw: Any) -> Tuning:
    # plans written before plans carried a tuning have none: the defaults
    return DEFAULT_TUNING if raw is None else Tuning.from_dict(raw, "a sparseflow plan's 'tuning'")


# --------------------------------------------------------------------------- runtime

_DENSE = DenseConfig()  # one object for every dense layer: the op's per-call memos key on it

_PLAN_CACHE: Dict[int, Tuple[Any, Plan]] = {}
_LOCK = threading.Lock()


def plan_of(config) -> Plan:
    """The :class:`Plan` recorded in a transformers config (``config.sparseflow``)."""
    raw = getattr(config, PLAN_KEY, None)
    if raw is None:
        raise ValueError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} needs the model config to carry a "
            f"'{PLAN_KEY}' entry (written by `sparseflow convert` or sparseflow.hf.apply_plan)"
        )
    if isinstance(raw, Plan):
        return raw
    key = id(config)
    with _LOCK:
        hit = _PLAN_CACHE.get(key)
        if hit is not None and hit[0] is raw:
            return hit[1]
        plan = Plan.from_dict(raw)
        _PLAN_CACHE[key] = (raw, plan)
        return plan


def attention_layer_index(module) -> Optional[int]:
    """The decoder layer an attention module belongs to (its ``layer_idx``), or None."""
    idx = getattr(module, "layer_idx", None)
    if isinstance(idx, int):
        return idx
    return None


def local_windows(config) -> Dict[int, Tuple[int, int]]:
    """Layer index -> ``(sliding_window, chunk_size)`` of the layers a transformers config limits
    to a local window, read as transformers' models read it: ``layer_types`` ("sliding_attention"
    with ``sliding_window``, "chunked_attention" with ``attention_chunk_size``) where the config has
    them, else every layer when it sets ``sliding_window`` (and ``use_sliding_window`` is not off)."""
    n_layers = int(getattr(config, "num_hidden_layers", 0) or 0)
    window = getattr(config, "sliding_window", None) or 0
    chunk = getattr(config, "attention_chunk_size", None) or 0
    types = getattr(config, "layer_types", None)
    if types is None:
        if window and getattr(config, "use_sliding_window", True) is not False:
            return {i: (int(window), 0) for i in range(n_layers)}
        return {}
    kinds = {"sliding_attention": (int(window), 0), "chunked_attention": (0, int(chunk))}
    return {i: kinds[t] for i, t in enumerate(types) if t in kinds and any(kinds[t])}


class _Layer(NamedTuple):
    """What a converted attention module runs, resolved once from its model config's plan."""

    config: Any  # the transformers config it was resolved from
    raw: Any  # that config's plan entry (a dict or a Plan): a new one means a new plan
    layer: Optional[int]
    cfg: AttentionConfig
    window: Tuple[int, int]  # the layer's (sliding_window, chunk_size) from its config, else (0, 0)
    windowed_cfg: AttentionConfig  # cfg with that window (registry.windowed): what a prefill runs
    backend: str  # the plan's backend for a sparse config; the dense op takes only 'auto'
    tag: str
    tuning: Tuning
    known: dict  # ops.attention_any_layout's notes of which call signatures run dense
    longer: Tuple[Tuple[int, "_Layer"], ...] = ()  # the plan's bands for longer prompts, resolved

    def for_keys(self, n_keys) -> "_Layer":
        """What a call with ``n_keys`` keys runs (:meth:`Plan.for_keys`)."""
        return band_for(self.longer, n_keys, self)[1]


_LAYER_ATTR = "_sparseflow_layer"  # where a module keeps its _Layer (in its __dict__, no nn.Module hooks)


def _layer_of(module) -> _Layer:
    """The module's :class:`_Layer`: kept on the module while its config, that config's plan entry
    (by identity) and its layer index are the ones it was resolved from, resolved afresh otherwise."""
    config = module.config
    # the config's own attribute dict first: transformers' config __getattribute__ is Python (over
    # 1 us) and this runs in every layer's every call
    compiling = torch.compiler.is_compiling()  # Dynamo cannot trace object.__getattribute__
    attrs = {} if compiling else object.__getattribute__(config, "__dict__")
    raw = attrs[PLAN_KEY] if PLAN_KEY in attrs else getattr(config, PLAN_KEY, None)
    layer = attention_layer_index(module)
    kept = module.__dict__.get(_LAYER_ATTR)
    if kept is not None and kept.config is config and kept.raw is raw and kept.layer == layer:
        return kept
    plan = plan_of(config)
    window = local_windows(config).get(layer, (0, 0)) if layer is not None else (0, 0)
    tag = f"model.layers.{layer}.self_attn" if layer is not None else type(module).__name__

    def resolved(band: Plan, longer=()) -> _Layer:
        cfg = band.config_for(layer)
        windowed_cfg = windowed(cfg, *window)[0] if any(window) else cfg
        backend = band.backend if spec_for(cfg).sparse else "auto"
        return _Layer(config, raw, layer, cfg, window, windowed_cfg, backend, tag, plan.tuning, {}, longer)

    entry = resolved(plan, tuple((tokens, resolved(band)) for tokens, band in plan.longer))
    if not compiling:  # module state written in a trace is a side effect the compiler replays
        module.__dict__[_LAYER_ATTR] = entry
    return entry


def sparseflow_attention_forward(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    **kwargs,
):
    """The attention function registered as ``"sparseflow"``: q ``[B, Hq, Nq, D]``, k/v
    ``[B, Hkv, Nk, D]`` (native GQA, no repeat) -> ``([B, Nq, Hq, D], None)``."""
    entry = _layer_of(module).for_keys(key.shape[-2])
    _check_expressible(entry, kwargs)
    if dropout and getattr(module, "training", False):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        logger.info("sparseflow: dropout=%s in training at layer %s runs transformers' SDPA", dropout, entry.layer)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    scale = None if scaling is None else float(scaling)
    cfg = _layer_config(entry, kwargs.get("sliding_window"), query.shape[2], attention_mask is not None)
    if attention_mask is None:
        causal = bool(query.shape[2] > 1 and causal)
        # a dense result keeps SDPA's [B, Nq, Hq, D] memory: the transpose below then copies nothing
        out = _ops.attention_any_layout(
            query,
            key,
            value,
            config=cfg,
            is_causal=causal,
            scale=scale,
            backend=entry.backend,
            tag=entry.tag,
            tuning=entry.tuning,
            known=entry.known,
        )
        return out.transpose(1, 2).contiguous(), None
    if attention_mask.dim() == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    out = _ops.attention(
        query,
        key,
        value,
        config=cfg,
        attn_mask=attention_mask,
        is_causal=False,
        scale=scale,
        backend=entry.backend,
        tag=entry.tag,
        tuning=entry.tuning,
    )
    return out.transpose(1, 2).contiguous(), None


def _layer_config(entry: _Layer, sliding_window, n_queries: int, masked: bool) -> AttentionConfig:
    """The config a call runs. A prefill of a windowed layer runs its window: the sliding window
    transformers passes, else, without a mask, the one the layer's config gives (the mask function
    leaves a window out of the mask only for a prefill from position 0; where transformers skips
    the mask because the keys fit in the window, the window changes nothing). A decode step's
    window is in its mask: its keys are a cache's."""
    if n_queries <= 1:
        return entry.cfg
    if isinstance(sliding_window, int) and sliding_window > 0:
        return entry.windowed_cfg if sliding_window == entry.window[0] else windowed(entry.cfg, sliding_window)[0]
    return entry.cfg if masked else entry.windowed_cfg


def sparseflow_mask(**kwargs):
    """transformers' SDPA mask, without a sliding or chunked window's ``[N, N]`` mask where
    :func:`sparseflow_attention_forward` runs that window itself: a prefill from position 0 of
    unpadded rows (then the mask is ``None``, as for plain causal). Anything else (padding, a
    cache, a window size the config does not give) keeps the full mask."""
    from transformers.masking_utils import sdpa_mask

    local = kwargs.get("local_size")
    if local and _prefill_from_start(kwargs) and local in _config_windows(kwargs.get("config")):
        kwargs["local_size"] = None
    return sdpa_mask(**kwargs)


def _config_windows(config) -> Tuple[int, ...]:
    return tuple({size for window in local_windows(config).values() for size in window if size})


def _prefill_from_start(kwargs) -> bool:
    q_length, kv_length = kwargs.get("q_length"), kwargs.get("kv_length")
    offsets = (kwargs.get("q_offset", 0), kwargs.get("kv_offset", 0))
    # tensors (other transformers versions pass cache_position) are not read: no host sync here
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (q_length, kv_length, *offsets)):
        return False
    return offsets == (0, 0) and q_length == kv_length


# what some models hand their attention function beyond SDPA's arguments, which sparseflow's ops
# do not compute: dropping it would give a silently different model (transformers' SDPA refuses softcap)
_BEYOND_SDPA = ("softcap", "sinks", "s_aux", "position_bias")


def _check_expressible(entry: _Layer, kwargs) -> None:
    extra = [name for name in _BEYOND_SDPA if kwargs.get(name) is not None]
    if extra:
        raise ValueError(
            f"sparseflow attention at layer {entry.layer}: the model passes {extra}, which sparseflow's "
            "ops do not compute (they compute what SDPA computes); run this model with its own attention"
        )


_REGISTERED = False


def register() -> None:
    """Register ``attn_implementation="sparseflow"`` (attention and mask functions) with
    transformers. Idempotent; imports transformers."""
    global _REGISTERED
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("sparseflow.hf needs transformers>=5 (pip install 'sparseflow[hf]'): " + str(exc)) from exc
    AttentionInterface.register(ATTN_IMPLEMENTATION, sparseflow_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sparseflow_mask)
    _REGISTERED = True


def is_registered() -> bool:
    return _REGISTERED


def apply_plan(model, plan: Plan):
    """Switch a loaded transformers model to the ``"sparseflow"`` attention with ``plan``
    (in place; returns the model). ``model.set_attn_implementation("sdpa")`` switches back."""
    register()
    n_layers = getattr(model.config, "num_hidden_layers", None)
    if plan.num_layers is not None and n_layers is not None and plan.num_layers != n_layers:
        raise ValueError(f"the plan is for {plan.num_layers} layers but the model has {n_layers}")
    setattr(model.config, PLAN_KEY, plan.to_dict())
    _set_attn(model, ATTN_IMPLEMENTATION)
    return model


def _set_attn(model, name: str) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        setter(name)
    else:  # pragma: no cover - older transformers
        model.config._attn_implementation = name


def from_pretrained(path, **kwargs):
    """``register()`` then ``AutoModelForCausalLM.from_pretrained(path, **kwargs)``, in eval mode."""
    register()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    return model.eval()
