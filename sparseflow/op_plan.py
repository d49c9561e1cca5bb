"""What a validated attention call computes: dense SDPA with the reason it cannot run sparse, or
the sparse backend that runs it, with the call's mask analysis and window.

A plan is made once per call (``sparseflow.ops.attention`` remembers plans of repeated eager
calls); the op's implementation takes the plan its Python entry already made when it receives
exactly the arguments that plan was made for (:data:`PREPARED`).
"""

from __future__ import annotations

import contextvars
from typing import Any, NamedTuple, Optional, Tuple

from . import methods as _methods
from . import op_backends as _backends
from . import op_validation as _validation
from .autobackend import auto_choice
from .config import AttentionConfig
from .masks import analyse_mask
from .op_backends import DENSE_CHOICE
from .op_schema import ConfigEntry, config_entry
from .op_windows import merged_window, with_config_window

__all__ = ["Plan", "plan_call", "checked_plan", "PREPARED", "prepared_plan", "dense_reason"]


class Plan(NamedTuple):
    entry: ConfigEntry
    mask: Any  # the MaskAnalysis (None for the dense method)
    reason: Optional[str]  # None: runs sparse on ``backend``; else runs dense SDPA, logged when non-empty
    backend: str

    @property
    def window(self) -> Tuple[int, int]:
        """The (sliding_window, chunk_size) the call computes: its mask analysis's, else the config's."""
        src = self.mask if self.mask is not None else self.entry.cfg
        return (src.sliding_window, src.chunk_size)


def dense_reason(method: str, cfg: AttentionConfig, n_q: int, n_k: int, is_causal: bool) -> str:
    """Why this call cannot run the sparse method ("" when it can): the reasons every method
    shares, then the method's own rule."""
    if is_causal and n_q != n_k:
        # SDPA aligns is_causal to the top-left corner when Nq != Nk; keep its exact semantics.
        return f"is_causal with Nq={n_q} != Nk={n_k}"
    min_len = getattr(cfg, "min_seq_len", 0)  # the dense method's windowed calls have none
    if n_k < min_len:
        return f"sequence length {n_k} < min_seq_len={min_len}"
    return _methods.spec_for(method).dense_rule(cfg, n_q, n_k)


def plan_call(method: str, args: Tuple, entry: Optional[ConfigEntry] = None) -> Plan:
    """What a (validated) call computes: dense with its reason, or which sparse backend.
    ``entry``: the config of ``args`` when the caller has it already."""
    q, k, v, attn_mask, is_causal, scale = args[:6]
    if entry is None:
        entry = config_entry(method, args[6:-2])
    spec = _methods.spec_for(method)
    if not spec.sparse and not entry.cfg.has_window:
        return Plan(entry, None, "", DENSE_CHOICE)
    mask = analyse_mask(attn_mask, is_causal, q.shape[0], q.shape[2], k.shape[2])
    if not mask.supported:
        return Plan(entry, with_config_window(mask, entry.cfg), mask.reason, DENSE_CHOICE)
    mask, conflict = merged_window(mask, entry.cfg)
    if conflict:
        return Plan(entry, mask, conflict, DENSE_CHOICE)
    if (mask.sliding_window or mask.chunk_size) and not mask.is_causal:
        raise ValueError(
            f"a local window (sliding_window={mask.sliding_window}, chunk_size={mask.chunk_size}) holds with "
            "causal attention only: pass is_causal=True or a causal mask"
        )
    if v.shape[-1] != q.shape[-1]:
        return Plan(entry, mask, f"value head dim {v.shape[-1]} != query head dim {q.shape[-1]}", DENSE_CHOICE)
    reason = dense_reason(method, entry.cfg, q.shape[2], k.shape[2], mask.is_causal)
    if reason:
        return Plan(entry, mask, reason, DENSE_CHOICE)
    backend = args[-2]
    if backend == "auto":
        chosen, reason = auto_choice(method, entry, q, k, v, attn_mask, is_causal, mask, scale)
    else:
        chosen, reason = _backends.resolve_backend(method, backend, q.device, q.dtype), None
    if reason is None and (mask.sliding_window or mask.chunk_size) and not spec.backend(chosen).windows:
        reason = f"the {chosen} backend of {method} does not run a local window yet"
        chosen = DENSE_CHOICE
    return Plan(entry, mask, reason, chosen)


def checked_plan(method: str, args: Tuple) -> Plan:
    """The plan of an op call's arguments after validating them."""
    q, k, v, attn_mask, _, scale = args[:6]
    backend, tag = args[-2], args[-1]
    _validation.validate_inputs(method, q, k, v, attn_mask, scale, backend, tag)
    _validation.check_backend_dtype(method, backend, q.dtype)
    return plan_call(method, args)


# attention() validates and plans a call before entering the op; the op's implementation takes
# that plan instead of redoing it when it receives exactly those arguments (the same tensor
# objects), and validates and plans itself otherwise (a direct torch.ops.sparseflow call).
PREPARED: contextvars.ContextVar[Optional[Tuple[str, Tuple, Plan]]] = contextvars.ContextVar(
    "sparseflow_prepared", default=None
)


def prepared_plan(method: str, args: Tuple) -> Optional[Plan]:
    got = PREPARED.get()
    if got is None:
        return None
    m, ref, made = got
    same = (
        m == method
        and len(args) == len(ref)
        and args[0] is ref[0]
        and args[1] is ref[1]
        and args[2] is ref[2]
        and args[3] is ref[3]
        and args[4:] == ref[4:]
    )
    return made if same else None
