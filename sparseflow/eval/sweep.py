"""Parameter sweeps for ``sparseflow eval --sweep``: one plan per value of one config field.

``parse_sweep("threshold=0.8,0.9")`` -> ``("threshold", ["0.8", "0.9"])``; :func:`sweep_plans`
turns a base plan into one plan per value (typed and validated by the method's config), plus the
same points with ``permute=False`` for PBS when asked (the paper's no-permutation baseline).
:func:`curve_points` flattens results into the rows the JSON and the KL-vs-density plot use.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Sequence, Tuple

from ..config import METHODS
from ..methods import names_with, spec_for

__all__ = ["parse_sweep", "parse_config_field", "sweep_plans", "curve_points", "series_name", "has_permute"]


def has_permute(method: str) -> bool:
    """Whether ``method``'s config has a ``permute`` option (``--no-permute`` doubles its points)."""
    return spec_for(method).has_permute


def _permuting() -> str:
    return "/".join(n.upper() for n in names_with("has_permute"))


def parse_sweep(text: str) -> Tuple[str, List[str]]:
    """``"field=v1,v2,..."`` -> ``(field, [v1, v2, ...])`` (values still strings)."""
    if not isinstance(text, str) or "=" not in text:
        raise ValueError(f"sweep must look like 'field=v1,v2,...' (e.g. threshold=0.8,0.9), got {text!r}")
    name, _, values = text.partition("=")
    name = name.strip()
    items = [v.strip() for v in values.split(",") if v.strip()]
    if not name or not items:
        raise ValueError(f"sweep must name a field and at least one value, got {text!r}")
    return name, items


def parse_config_field(method: str, name: str, raw: str) -> Any:
    """``raw`` text as the value of ``method``'s config field ``name``, typed like its default."""
    cls = METHODS[method]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if name not in fields or name == "min_seq_len":
        known = sorted(f for f in fields if f != "min_seq_len")
        raise ValueError(f"sweep field {name!r} is not a {method} setting; expected one of {known}")
    default = fields[name].default
    try:
        if isinstance(default, bool):
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return raw.lower() in ("true", "1")
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
    except ValueError:
        raise ValueError(f"sweep value {raw!r} for {method}.{name} must be a {type(default).__name__}") from None
    return raw


_typed = parse_config_field  # the private name, for existing callers


def sweep_plans(base, field: str, values: Sequence[str], *, no_permute: bool = False) -> List:
    """One :class:`sparseflow.hf.Plan` per value of ``field`` (config of ``base`` otherwise
    unchanged; configs validate the values). ``no_permute`` (PBS only) appends the same points
    with ``permute=False``. Raises ValueError naming the field when it does not apply."""
    plans = []
    permutes = [True, False] if no_permute else [None]
    if no_permute and not has_permute(base.method):
        raise ValueError(
            f"--no-permute compares {_permuting()} with and without permutation; method is {base.method!r}"
        )
    for perm in permutes:
        for raw in values:
            changes = {field: _typed(base.method, field, raw)}
            if perm is not None:
                changes["permute"] = perm
            plans.append(dataclasses.replace(base, config=base.config.replace(**changes)))
    return plans


def series_name(method: str, config: Dict[str, Any], field: str) -> str:
    """The curve a sweep point belongs to: the method, plus ``no permute`` for a point of a
    permuting method (PBS) without permutation."""
    if has_permute(method) and not config.get("permute", True) and field != "permute":
        return f"{method} (no permute)"
    return method


def curve_points(results, field: str) -> List[Dict[str, Any]]:
    """Rows ``{series, method, field, value, permute, density, mean_kl, p99_kl, top1}``."""
    rows = []
    for r in results:
        cfg = r.config
        rows.append(
            {
                "series": series_name(r.method, cfg, field),
                "method": r.method,
                "field": field,
                "value": cfg.get(field),
                "permute": cfg.get("permute"),
                "density": r.density,
                "mean_kl": r.fidelity.mean_kl,
                "p99_kl": r.fidelity.p99_kl,
                "top1": r.fidelity.top1_agreement,
                "ppl_delta": r.fidelity.ppl_delta,
            }
        )
    return rows
