"""Read one SDPA node and decide whether the op can take it: its arguments bound to their
schema, the constant flags, the fake q/k/v and mask, and how its query heads map onto K/V heads
(native GQA, a folded ``repeat_kv``, MQA broadcast). Each check returns the reason it fails, for
the report; nothing here edits the graph."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from ..masks import describe_mask
from .gqa_fold import _same, fake_of, fold_kv
from .rewrite_entry import RewriteEntry, Shape
from .sdpa_targets import SdpaTarget

__all__ = [
    "SUPPORTED_DTYPES",
    "SdpaCall",
    "KVHeads",
    "shape_tuple",
    "const_float",
    "read_sdpa_call",
    "constant_args_reason",
    "tensor_args_reason",
    "kv_heads",
]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _bind(schema, args: Sequence, kwargs: Mapping) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    args = list(args)
    for i, a in enumerate(schema.arguments):
        if i < len(args):
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
        else:
            raise TypeError(f"missing argument {a.name!r}")
    return out


def shape_tuple(t: Optional[torch.Tensor]) -> Optional[Shape]:
    """A (fake) tensor's shape for the report: ints, and symbolic sizes by their names."""
    if t is None:
        return None
    return tuple(int(s) if isinstance(s, int) else str(s) for s in t.shape)


def const_float(x) -> Optional[float]:
    """``x`` as a float when the graph holds it as a constant number (a bool is not one), else None."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x)


def _check_qkv(q, k, v) -> str:
    """Reason the op cannot take these fake tensors ("" when it can)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t is None:
            return f"no shape metadata for {name}"
        if t.dim() != 4:
            return f"{name} is {t.dim()}-D (the ops take 4-D [batch, heads, seq, head_dim])"
        if t.dtype not in SUPPORTED_DTYPES:
            return f"unsupported dtype {t.dtype} (the ops take float16, bfloat16, float32)"
    if not (q.dtype == k.dtype == v.dtype):
        return f"mixed dtypes q={q.dtype}, k={k.dtype}, v={v.dtype}"
    # Under dynamic shapes equal sizes can carry different symbols (K and V lengths, say), so a
    # check fails only on sizes that are provably different; sizes SDPA itself requires equal
    # are then checked by the op at run time, where SDPA would have raised too.
    bq, bk, bv = q.shape[0], k.shape[0], v.shape[0]
    if (
        _differ(bq, bk)
        or _differ(bk, bv)
        or (not (_same(bq, bk) and _same(bk, bv)) and 1 in (_static(bq), _static(bk), _static(bv)))
    ):
        return f"batch sizes differ (q={bq}, k={bk}, v={bv}): broadcast batch"
    if _differ(k.shape[1], v.shape[1]) or _differ(k.shape[2], v.shape[2]):
        return f"k and v differ in heads or length (k={shape_tuple(k)}, v={shape_tuple(v)})"
    if _differ(q.shape[3], k.shape[3]):
        return f"q and k head dims differ ({q.shape[3]} vs {k.shape[3]})"
    return ""


def _static(x) -> Optional[int]:
    return x if isinstance(x, int) else None


def _differ(a, b) -> bool:
    """Provably different sizes (no guards added)."""
    try:
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return bool(statically_known_true(a != b))
    except Exception:  # pragma: no cover
        return isinstance(a, int) and isinstance(b, int) and a != b


def _describe_mask(mask_fake: Optional[torch.Tensor], present: bool) -> Tuple[str, str]:
    """(description, skip reason)."""
    if not present:
        return "none", ""
    if mask_fake is None:
        return "unknown", "attn_mask without shape metadata"
    if mask_fake.dtype == torch.bool or mask_fake.is_floating_point():
        # read from the shape alone, with SDPA's broadcasting: a size is 1 only where provably 1
        return describe_mask(shape_tuple(mask_fake), mask_fake.dtype), ""
    return "", f"attn_mask of dtype {mask_fake.dtype}"


@dataclass
class SdpaCall:
    """The arguments of one SDPA node, bound to its schema (``qf, kf, vf``: their fake tensors)."""

    bound: Dict[str, Any]
    q: Any
    k: Any
    v: Any
    qf: Any
    kf: Any
    vf: Any
    mask: Any
    is_causal: Any
    dropout: Optional[float]
    scale: Any
    enable_gqa: Any


@dataclass
class KVHeads:
    """The K/V the op receives: the node's, or the un-repeated bases of a folded ``repeat_kv``."""

    k: Any
    v: Any
    folded_k: Any = None  # the repeat chains found on K and V (erased once the op replaced the node)
    folded_v: Any = None


def read_sdpa_call(node: fx.Node, spec: SdpaTarget, entry: RewriteEntry) -> Optional[SdpaCall]:
    """Bind the node's arguments and note its shapes and causality in ``entry`` (None: unreadable)."""
    try:
        b = _bind(spec.schema, node.args, node.kwargs)
    except TypeError as e:
        entry.reason = f"cannot read arguments: {e}"
        return None
    q, k, v = b.get("query"), b.get("key"), b.get("value")
    call = SdpaCall(
        bound=b,
        q=q,
        k=k,
        v=v,
        qf=fake_of(q),
        kf=fake_of(k),
        vf=fake_of(v),
        mask=b.get(spec.mask_arg) if spec.mask_arg else None,
        is_causal=b.get("is_causal", False),
        dropout=const_float(b.get("dropout_p", 0.0)),
        scale=b.get("scale"),
        enable_gqa=b.get("enable_gqa", False),
    )
    entry.q_shape, entry.k_shape, entry.v_shape = shape_tuple(call.qf), shape_tuple(call.kf), shape_tuple(call.vf)
    entry.is_causal = call.is_causal if isinstance(call.is_causal, bool) else None
    return call


def constant_args_reason(node: fx.Node, spec: SdpaTarget, call: SdpaCall) -> str:
    """Why the non-tensor arguments (and the used outputs) rule the op out ("" if they do not):
    the op has no dropout, no logsumexp output, and needs constant flags and scale."""
    if spec.returns_tuple:
        users = list(node.users)
        if not users:
            return "output unused"
        bad = [u for u in users if not (u.op == "call_function" and u.target is operator.getitem and u.args[1] == 0)]
        if bad:
            return f"{spec.name} outputs other than output[0] are used (by {bad[0].name}: backward or logsumexp)"
    b = call.bound
    if b.get("dropout_mask") is not None:
        return "dropout_mask given"
    if call.dropout is None:
        return f"dropout_p is not a constant ({b.get('dropout_p')!r})"
    if call.dropout != 0.0:
        return f"dropout_p={call.dropout} (training-time attention dropout; the ops have none)"
    if not isinstance(call.is_causal, bool):
        return f"is_causal is not a constant bool ({call.is_causal!r})"
    if call.scale is not None and const_float(call.scale) is None:
        return f"scale is not a constant ({call.scale!r})"
    if not isinstance(call.enable_gqa, bool):
        return f"enable_gqa is not a constant bool ({call.enable_gqa!r})"
    return ""


def tensor_args_reason(call: SdpaCall, entry: RewriteEntry) -> str:
    """Why the q/k/v fakes or the mask rule the op out ("" if they do not); notes the mask in ``entry``."""
    reason = _check_qkv(call.qf, call.kf, call.vf)
    if reason:
        return reason
    mask_desc, reason = _describe_mask(fake_of(call.mask), call.mask is not None)
    entry.mask = mask_desc
    if reason:
        return reason
    if call.mask is not None and call.is_causal:
        return "attn_mask together with is_causal=True"
    return ""


def kv_heads(call: SdpaCall, entry: RewriteEntry) -> Optional[KVHeads]:
    """How the query heads map onto K/V heads -- native GQA, a folded repeat, or MQA broadcast --
    noted in ``entry``; None (with the reason) when the op cannot take the head counts."""
    hq, hkv = call.qf.shape[1], call.kf.shape[1]
    mk = mv = None
    if call.enable_gqa and not _same(hq, hkv):
        entry.gqa = "enable_gqa"
    elif _same(hq, hkv):
        mk, mv, why = fold_kv(call.k, call.v, hq)
        if mk is not None:
            entry.gqa = f"folded repeat x{mk.n_rep}"
        elif why:
            entry.gqa = "K/V passed repeated"
            entry.notes.append(why)
    elif _same(hkv, 1):
        entry.gqa = "broadcast"  # SDPA broadcasts a single K/V head: MQA
    else:
        entry.reason = f"query heads ({hq}) != key/value heads ({hkv}) without enable_gqa"
        return None
    heads = KVHeads(mk.base, mv.base, mk, mv) if mk is not None else KVHeads(call.k, call.v)
    kf2 = fake_of(heads.k)
    hkv2 = kf2.shape[1]
    try:
        divisible = _same(hq % hkv2, 0)
    except Exception:
        divisible = False
    if not divisible:
        entry.reason = f"query heads ({hq}) are not a multiple of key/value heads ({hkv2})"
        return None
    if mk is not None:
        entry.k_shape, entry.v_shape = shape_tuple(kf2), shape_tuple(fake_of(heads.v))
    return heads
