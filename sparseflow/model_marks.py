"""What sparseflow leaves on a model it compiled (or a program it exported): the attributes
holding its settings, report and decode state; whether a model still runs its compiled call; and
the guard that makes a copy of a compiled model, which has lost that call, say so."""

from __future__ import annotations

import functools
import warnings
from typing import Any, Dict

import torch.nn as nn

from .passes.rewrite_options import RewriteOptions
from .rewrite_report import LOST_MODEL

__all__ = [
    "CONFIG_ATTR",
    "REPORT_ATTR",
    "DECODE_STATE_ATTR",
    "settings_marker",
    "check_not_transformed",
    "guard_copies",
    "is_compiled",
]


CONFIG_ATTR = "_sparseflow_config"  # the settings, as a dict (settings_marker)
REPORT_ATTR = "_sparseflow_report"  # the live RewriteReport
DECODE_STATE_ATTR = "_sparseflow_decode_state"  # the model's DecodeState (PISA pyramids across steps)


def settings_marker(options: RewriteOptions, **extra) -> Dict[str, Any]:
    """The settings a model or program was transformed with, as the dict it is marked with."""
    from ._version import __version__

    return {
        "sparseflow_version": __version__,
        "method": options.config.method,
        "config": options.config.to_dict(),
        "backend": options.backend,
        "skip_layers": sorted(options.skip_layers),
        "layer_configs": {i: (None if c is None else c.to_dict()) for i, c in options.layer_configs.items()},
        "filter_fn": None
        if options.filter_fn is None
        else getattr(options.filter_fn, "__qualname__", repr(options.filter_fn)),
        "tuning": options.tuning.to_dict(),
        "context_parallel": None if options.context_parallel is None else options.context_parallel.sharding,
        "longer": {
            tokens: {
                "config": band.config.to_dict(),
                "skip_layers": sorted(band.skip_layers),
                "layer_configs": {i: (None if c is None else c.to_dict()) for i, c in band.layer_configs.items()},
            }
            for tokens, band in options.longer
        },
        **extra,
    }


def check_not_transformed(model: nn.Module) -> None:
    # A marked module whose compiled call is gone (a deepcopy or unpickled copy: Module drops
    # _compiled_call_impl when pickled) runs plain SDPA again and may be compiled afresh.
    for name, mod in model.named_modules():
        marker = mod.__dict__.get(CONFIG_ATTR)
        if marker is not None and is_compiled(mod):
            where = "this model" if not name else f"its submodule {name!r}"
            raise RuntimeError(
                f"sparseflow.compile: {where} was already transformed by sparseflow "
                f"(method={marker.get('method')!r}); refusing to transform it twice. Start from the original model."
            )


# A model copied with copy.deepcopy, pickle or torch.save/torch.load loses its compiled call
# (Module.__getstate__ drops it) and runs dense SDPA. The guard in its __dict__ is rebuilt with the
# copy, before the copy's state is set, and gives the copy a call of its own: the first call
# warns that the compilation was lost, then the copy runs as the plain module it now is. (A
# forward hook would do the same, but any hook turns off nn.TransformerEncoderLayer's fused path.)
_COPY_GUARD_ATTR = "_sparseflow_copy_guard"


class _CopyGuard:
    __slots__ = ("model",)

    def __init__(self, model: nn.Module):
        self.model = model

    def __reduce__(self):
        return (_guarded_copy, (self.model,))


def _guarded_copy(model: nn.Module) -> _CopyGuard:
    # Module.__setstate__ keeps a _compiled_call_impl already in the copy's __dict__
    model.__dict__["_compiled_call_impl"] = functools.partial(_lost_compilation_call, model)
    return _CopyGuard(model)


def _lost_compilation_call(model: nn.Module, *args, **kwargs):
    model._compiled_call_impl = None
    rep = getattr(model, REPORT_ATTR, None)
    if rep is not None:
        rep.lost = LOST_MODEL
    warnings.warn(f"sparseflow: {LOST_MODEL}", RuntimeWarning, stacklevel=3)
    return model._call_impl(*args, **kwargs)


def guard_copies(model: nn.Module) -> None:
    """Put the copy guard in a compiled model's ``__dict__`` (see _CopyGuard)."""
    model.__dict__[_COPY_GUARD_ATTR] = _CopyGuard(model)


def is_compiled(mod: nn.Module) -> bool:
    """Whether ``mod`` still holds a compiled call (a copy's first-call warning is not one)."""
    impl = mod._compiled_call_impl
    return impl is not None and not (isinstance(impl, functools.partial) and impl.func is _lost_compilation_call)
