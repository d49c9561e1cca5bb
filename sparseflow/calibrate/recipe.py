"""The recipe a calibration writes: the config most sparse layers run, the other layers' changes
from it, the dense layers, and every measurement behind them."""

from __future__ import annotations

from typing import Any, Dict, Sequence, Tuple

from ..config import AttentionConfig
from ..recipes import Recipe
from .choices import Choice
from .session import Session


def _changes_from_base(base: AttentionConfig, cfg: AttentionConfig) -> Dict[str, Any]:
    b, c = base.to_dict(), cfg.to_dict()
    return {k: v for k, v in c.items() if k not in ("method", "version") and b.get(k) != v}


def _common_config(s: Session, chosen: Sequence[Choice]) -> AttentionConfig:
    """The config most sparse layers run (the base when every layer is dense): the recipe's
    config for the method, so the per-layer overrides name only the layers that differ."""
    counts: Dict[str, Tuple[int, AttentionConfig]] = {}
    for c in chosen:
        if not c.dense:
            cfg = c.config(s.base)
            n, _ = counts.get(cfg.to_json(), (0, cfg))
            counts[cfg.to_json()] = (n + 1, cfg)
    if not counts:
        return s.base
    return max(counts.values(), key=lambda nc: nc[0])[1]


def build_recipe(s: Session, chosen: Sequence[Choice], *, name: str, measured: Dict[str, Any]) -> Recipe:
    """The recipe running ``chosen[i]`` at layer ``i``, described and carrying ``measured``."""
    mc = s.model.config
    common = _common_config(s, chosen)
    overrides = {i: _changes_from_base(common, c.config(s.base)) for i, c in enumerate(chosen) if not c.dense}
    overrides = {i: ch for i, ch in overrides.items() if ch}
    # a windowed layer runs its window whatever the recipe says: it is neither dense nor sparse here
    dense = tuple(i for i, c in enumerate(chosen) if c.dense and i not in s.windows)
    sparse_n = s.n_layers - len(dense) - len(s.windows)

    def opt_int(attr):
        v = getattr(mc, attr, None)
        return int(v) if isinstance(v, int) and not isinstance(v, bool) else None

    desc = (
        f"calibrated by `sparseflow calibrate` for {getattr(mc, 'model_type', '?')}: {s.method} in {sparse_n} of "
        f"{s.n_layers} layers{_windowed_note(s)} within mean KL {measured['budget']} (calibration target "
        f"{measured['calibration_target']:.4g}) on {measured['calibration']['tokens']} tokens "
        f"of {_texts_note(measured['text'])} (measured {measured['calibration']['mean_kl']:.5f}, density "
        f"{measured['calibration']['density']:.3f})"
    )
    return Recipe(
        name=name,
        description=desc,
        model_types=(str(mc.model_type),),
        configs={s.method: common},
        dense_layers=dense,
        num_layers=s.n_layers,
        num_attention_heads=opt_int("num_attention_heads"),
        num_key_value_heads=opt_int("num_key_value_heads"),
        head_dim=opt_int("head_dim"),
        layer_overrides={s.method: overrides} if overrides else {},
        measured=measured,
    )


def _windowed_note(s: Session) -> str:
    if not s.windows:
        return ""
    return f" ({len(s.windows)} windowed layers run inside their local window, not calibrated)"


def _texts_note(text: str) -> str:
    return f"each of {text.replace(',', ', ')} (the KL of the worst text)" if "," in text else text
