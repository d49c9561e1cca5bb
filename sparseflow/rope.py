"""Context extension of a loaded transformers (5.x) model through its RoPE scaling.

transformers 5.x reads ``config.rope_parameters`` only when the rotary embedding module is
constructed, so changing the config of a loaded model changes nothing: :func:`set_rope_scaling`
rewrites the config and rebuilds every rotary embedding module from it.

Specs: ``"yarn:F"`` (YaRN, factor F over the trained length), ``"yarn:auto:N"`` (YaRN with the
factor N / trained length; plain RoPE when N fits the trained length), ``"linear:F"``
(position interpolation), ``"dynamic:F"`` (dynamic NTK), ``"none"``/``None`` (the model's own RoPE).
The trained length is the config's ``max_position_embeddings`` before the first change (or the
``original_max_position_embeddings`` of a model that already ships scaled).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional

__all__ = ["RopeScaling", "parse_rope_scaling", "set_rope_scaling", "ROPE_SCALING_FORMS"]

ROPE_SCALING_FORMS = "'yarn:F', 'yarn:auto:N', 'linear:F', 'dynamic:F' (F a number >= 1, N a token count) or 'none'"
_TYPES = ("yarn", "linear", "dynamic")
_PLAIN_ATTR = "_sparseflow_plain_rope"


@dataclass(frozen=True)
class RopeScaling:
    """A parsed spec: ``rope_type`` one of yarn/linear/dynamic; ``factor`` or ``target`` (yarn:auto:N)."""

    rope_type: str
    factor: Optional[float] = None
    target: Optional[int] = None

    def factor_for(self, trained: int) -> Optional[float]:
        """The scaling factor over ``trained`` positions; None means plain RoPE (auto within the trained length)."""
        if self.target is not None:
            return self.target / trained if self.target > trained else None
        return self.factor


def _bad(spec) -> ValueError:
    return ValueError(f"rope_scaling must be {ROPE_SCALING_FORMS}, got {spec!r}")


def parse_rope_scaling(spec) -> Optional[RopeScaling]:
    """``spec`` -> :class:`RopeScaling`, or None for plain RoPE; a malformed spec raises ValueError."""
    if spec is None:
        return None
    if not isinstance(spec, str):
        raise _bad(spec)
    parts = spec.strip().lower().split(":")
    if parts == ["none"]:
        return None
    if parts[0] not in _TYPES:
        raise _bad(spec)
    if parts[0] == "yarn" and len(parts) == 3 and parts[1] == "auto":
        try:
            target = int(parts[2])
        except ValueError:
            raise _bad(spec) from None
        if target < 1:
            raise _bad(spec)
        return RopeScaling("yarn", target=target)
    if len(parts) != 2:
        raise _bad(spec)
    try:
        factor = float(parts[1])
    except ValueError:
        raise _bad(spec) from None
    if not math.isfinite(factor) or factor < 1:
        raise _bad(spec)
    return RopeScaling(parts[0], factor=factor)


def _plain(model):
    """(rope_parameters, max_position_embeddings, trained length) of the model as first seen."""
    base = getattr(model, _PLAIN_ATTR, None)
    if base is None:
        cfg = model.config
        params = getattr(cfg, "rope_parameters", None)
        if not isinstance(params, dict) or "rope_type" not in params:
            raise ValueError(
                "rope_scaling needs a transformers 5.x model whose config has rope_parameters "
                f"(got {type(model).__name__} with rope_parameters={params!r})"
            )
        max_pos = int(cfg.max_position_embeddings)
        trained = int(params.get("original_max_position_embeddings") or max_pos)
        base = (dict(params), max_pos, trained)
        object.__setattr__(model, _PLAIN_ATTR, base)  # a plain attribute, not a submodule or buffer
    return base


def _rebuild_rotary(model, params: dict, max_pos: int) -> list:
    """Write ``params`` into the config(s) the rotary modules read and rebuild each of them from
    it; returns the new modules."""
    found = [
        (name, mod)
        for name, mod in model.named_modules()
        if type(mod).__name__.endswith("RotaryEmbedding") and hasattr(mod, "inv_freq")
    ]
    if not found:
        raise ValueError(f"rope_scaling: {type(model).__name__} has no rotary embedding module to rebuild")
    for cfg in {id(c): c for c in [model.config] + [m.config for _, m in found]}.values():
        cfg.rope_parameters = dict(params)
        cfg.max_position_embeddings = max_pos
    new = []
    for name, mod in found:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        rebuilt = type(mod)(config=mod.config).to(mod.inv_freq.device)
        setattr(parent, attr, rebuilt)
        new.append(rebuilt)
    return new


def set_rope_scaling(model, spec) -> Dict[str, object]:
    """Apply the RoPE scaling ``spec`` to a loaded transformers model in place (see the module
    docstring for the forms). Returns what was applied: ``spec``, ``rope_type``, ``factor``,
    ``original_max_position_embeddings`` (the trained length), ``max_position_embeddings`` and
    the rotary module's ``attention_scaling``."""
    scaling = parse_rope_scaling(spec)
    params, max_pos, trained = _plain(model)
    params = dict(params)
    factor = scaling.factor_for(trained) if scaling is not None else None
    if factor is not None:
        params.update(rope_type=scaling.rope_type, factor=factor)
        if scaling.rope_type == "yarn":
            params["original_max_position_embeddings"] = trained
        if (
            scaling.rope_type != "dynamic"
        ):  # dynamic NTK scales beyond max_position_embeddings: it stays the trained length
            max_pos = max(max_pos, int(math.ceil(factor * trained)))
    rotary = _rebuild_rotary(model, params, max_pos)
    return {
        "spec": None if spec is None else str(spec),
        "rope_type": rotary[0].rope_type,
        "factor": factor,
        "original_max_position_embeddings": trained,
        "max_position_embeddings": max_pos,
        "attention_scaling": float(rotary[0].attention_scaling),
    }
