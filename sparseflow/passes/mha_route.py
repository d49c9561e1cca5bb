"""``nn.MultiheadAttention`` in Dynamo graphs: one opaque ``F.multi_head_attention_forward`` node,
whose inner SDPA call is routed to the sparseflow op. The pass points the node at
``mha_forward_routed``, a copy of torch's function whose SDPA global calls the op (falling back
to SDPA, logged, for what the op cannot take)."""

from __future__ import annotations

import contextvars
import inspect as _inspect
import types
from typing import Callable, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..ops import op_args, op_for
from ..recording import log_fallback
from .gqa_fold import fake_of
from .rewrite_entry import RewriteEntry
from .rewrite_options import RewriteOptions, options_for_call
from .sdpa_call import SUPPORTED_DTYPES, const_float, shape_tuple

__all__ = ["mha_forward_routed", "rewrite_mha"]


_MHA_SPEC: contextvars.ContextVar[Optional[Tuple]] = contextvars.ContextVar("sparseflow_mha_spec", default=None)
_real_sdpa = torch._C._nn.scaled_dot_product_attention


def _routed_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    spec = _MHA_SPEC.get()
    ok = (
        spec is not None
        and float(dropout_p) == 0.0
        and query.dim() == 4
        and key.dim() == 4
        and query.dtype in SUPPORTED_DTYPES
        and query.dtype == key.dtype == value.dtype
        and query.shape[1] % key.shape[1] == 0
    )
    if not ok:
        if spec is not None:
            log_fallback(spec[0], spec[3], _mha_dense_reason(query, key, value, dropout_p))
        return _real_sdpa(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=dropout_p,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
    method, cfg_values, backend, tag = spec
    return op_for(method)(
        query,
        key,
        value,
        attn_mask,
        bool(is_causal),
        None if scale is None else float(scale),
        *cfg_values,
        backend,
        tag,
    )


def _mha_dense_reason(query, key, value, dropout_p) -> str:
    if float(dropout_p) != 0.0:
        return f"dropout_p={float(dropout_p)} (the ops have no dropout)"
    if query.dim() != 4 or key.dim() != 4:
        return f"q/k of {query.dim()}-D/{key.dim()}-D (the ops take 4-D)"
    if query.dtype not in SUPPORTED_DTYPES or not (query.dtype == key.dtype == value.dtype):
        return f"dtypes q={query.dtype}, k={key.dtype}, v={value.dtype}"
    return f"query heads ({query.shape[1]}) not a multiple of key/value heads ({key.shape[1]})"


def _clone_mha_forward() -> Optional[Callable]:
    """A copy of ``F.multi_head_attention_forward`` whose global ``scaled_dot_product_attention``
    is ``_routed_sdpa`` (and whose ``__torch_function__`` dispatch is off, so the copy itself runs).
    None when this torch's implementation does not call SDPA by that global name."""
    fn = F.multi_head_attention_forward
    code = getattr(fn, "__code__", None)
    if code is None or "scaled_dot_product_attention" not in code.co_names:
        return None
    g = dict(fn.__globals__)
    g["scaled_dot_product_attention"] = _routed_sdpa
    g["has_torch_function"] = lambda *a, **k: False
    clone = types.FunctionType(code, g, fn.__name__, fn.__defaults__, fn.__closure__)
    clone.__kwdefaults__ = dict(fn.__kwdefaults__ or {})
    return clone


_MHA_CLONE = _clone_mha_forward()
_MHA_SIGNATURE = _inspect.signature(F.multi_head_attention_forward)


def mha_forward_routed(spec: Tuple, *args, **kwargs):
    """``F.multi_head_attention_forward`` with its SDPA call replaced by the sparseflow op named in
    ``spec = (method, config_values, backend, tag)``. The rewrite pass points MHA nodes here."""
    token = _MHA_SPEC.set(spec)
    try:
        return _MHA_CLONE(*args, **kwargs)
    finally:
        _MHA_SPEC.reset(token)


def rewrite_mha(node: fx.Node, entry: RewriteEntry, options: RewriteOptions) -> None:
    try:
        b = _MHA_SIGNATURE.bind(*node.args, **node.kwargs)
        b.apply_defaults()
    except TypeError as e:
        entry.reason = f"cannot read arguments: {e}"
        return
    a = b.arguments
    qf, kf, vf = fake_of(a["query"]), fake_of(a["key"]), fake_of(a["value"])
    entry.q_shape, entry.k_shape, entry.v_shape = shape_tuple(qf), shape_tuple(kf), shape_tuple(vf)
    entry.is_causal = a["is_causal"] if isinstance(a["is_causal"], bool) else None
    entry.notes.append("nn.MultiheadAttention: shapes are the module's [L, B, E] inputs")
    if kf is not None:
        options = options_for_call(options, kf.shape[0], entry.notes)
    cfg, why = options.resolve(entry.tag, entry.layer)
    if cfg is None:
        entry.reason = why
        return
    if _MHA_CLONE is None:
        entry.reason = "this torch's F.multi_head_attention_forward does not call SDPA by name"
        return
    if a["need_weights"] is not False:
        entry.reason = (
            "need_weights=True: nn.MultiheadAttention then computes explicit attention weights "
            "(no SDPA); call it with need_weights=False"
        )
        return
    training, dropout = a["training"], const_float(a["dropout_p"])
    if not isinstance(training, bool) or dropout is None:
        entry.reason = "training/dropout_p are not constants"
        return
    if training and dropout != 0.0:
        entry.reason = f"dropout_p={dropout} in training mode (the ops have no dropout)"
        return
    for name, t in (("query", qf), ("key", kf), ("value", vf)):
        if t is None:
            entry.reason = f"no shape metadata for {name}"
            return
        if t.dtype not in SUPPORTED_DTYPES:
            entry.reason = f"unsupported dtype {t.dtype} (the ops take float16, bfloat16, float32)"
            return
    mask_present = a["attn_mask"] is not None or a["key_padding_mask"] is not None
    if mask_present:
        entry.mask = (
            "merged nn.MultiheadAttention mask (4-D, SDPA form): runtime-recognised by value "
            "(causal / key padding / both run sparse, anything else dense, logged)"
        )
    spec = (cfg.method, tuple(op_args(cfg, options.call_tuning("dynamo"))), options.backend, entry.tag)
    node.target = mha_forward_routed
    node.args = (spec,) + tuple(node.args)
    entry.rewritten, entry.reason = True, ""
    entry.method, entry.config = cfg.method, cfg.to_dict()
