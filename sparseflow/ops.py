"""The ``sparseflow::*_attention`` custom ops: schemas, fake implementations, autograd, dispatch.

Torch-only and registered at import; Triton and FlexAttention backends are imported lazily the
first time they are asked for. One op per method, whose schema is derived from the method's
config dataclass, so a config field and an op argument can never drift apart:

    sparseflow::<method>_attention(Tensor q, Tensor k, Tensor v, Tensor? attn_mask,
        bool is_causal, float? scale, <config fields...>, <tuning fields...>, str backend, str tag) -> Tensor

The tuning fields are the method's fields of :class:`sparseflow.Tuning` (launch options of the
Triton backends; none for dense and BSA), carried the same way so they are read per call.

``tag`` names the module the call came from (the rewrite pass fills it) so reports and logged
fallbacks say which layer they are about. The Python entry points ``pbs_attention`` etc. below
take a config object instead of loose arguments.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib.util
import inspect
import itertools
import math
from collections.abc import Mapping
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

from . import autobackend as _autobackend
from . import decode_state as _decode_state
from . import graph_replay as _graph_replay
from . import methods as _methods
from . import recording as _capture
from .config import BACKENDS, AttentionConfig, BSAConfig, DenseConfig, PBSConfig, PISAConfig, default_instance
from .kernels._triton_env import interpreting
from .masks import MaskAnalysis, analyse_mask, check_mask, window_mask, with_causality
from .tuning import DEFAULT_TUNING, Tuning, check_tuning
from .tuning import fields_of as _tuning_fields

__all__ = [
    "attention",
    "dense_attention",
    "pbs_attention",
    "pisa_attention",
    "bsa_attention",
    "op_for",
    "op_args",
    "IMPLEMENTATIONS",
]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # fp64: oracles, gradcheck
_SCHEMA_TYPES = {int: "int", float: "float", bool: "bool", str: "str"}


class _Implementations(Mapping):
    """``{(method, backend): "module:function"}`` read live from the method registry (read-only:
    a backend is added by registering a method's spec, see :mod:`sparseflow.methods`)."""

    def __getitem__(self, key: Tuple[str, str]) -> str:
        if not (isinstance(key, tuple) and len(key) == 2) or key[0] not in _methods.names():
            raise KeyError(key)
        backend = _methods.spec_for(key[0]).backends.get(key[1])
        if backend is None:
            raise KeyError(key)
        return backend.target

    def __iter__(self) -> Iterator[Tuple[str, str]]:
        return iter([(s.name, b) for s in _methods.specs() for b in s.backends])

    def __len__(self) -> int:
        return sum(len(s.backends) for s in _methods.specs())


IMPLEMENTATIONS: Mapping[Tuple[str, str], str] = _Implementations()


def _grad_backend(method: str, backend: str, device: torch.device) -> str:
    """The backend the backward recomputes through: the forward's when autograd can
    differentiate it on ``device``, else the reference (which selects the same blocks)."""
    impl = _methods.spec_for(method).backends.get(backend)
    return backend if impl is not None and impl.differentiable_on(device.type) else "reference"


def _config_fields(cls) -> List[dataclasses.Field]:
    return list(dataclasses.fields(cls))


def _schema(method: str) -> str:
    config = [
        f"{_SCHEMA_TYPES[_field_type(f)]} {f.name}" for f in _config_fields(_methods.spec_for(method).config_type)
    ]
    tuning = [f"{kind} {name}" for name, kind in _tuning_fields(method)]
    fields = "".join(f"{a}, " for a in config + tuning)
    return (
        "(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, bool is_causal, float? scale, "
        f"{fields}str backend, str tag) -> Tensor"
    )


def _field_type(f: dataclasses.Field) -> type:
    t = f.type if isinstance(f.type, type) else {"int": int, "float": float, "bool": bool, "str": str}[f.type]
    return t


def op_for(method: str):
    """The OpOverload of a method's op, e.g. ``torch.ops.sparseflow.pbs_attention.default``."""
    return getattr(torch.ops.sparseflow, f"{method}_attention").default


def op_args(config: AttentionConfig, tuning: Optional[Tuning] = None) -> List[Any]:
    """The config's values, then the tuning's fields of its method (default: ``Tuning()``), in
    schema order: the positional arguments between ``scale`` and ``backend``."""
    tuning = DEFAULT_TUNING if tuning is None else tuning
    values = [
        float(getattr(config, name)) if kind is float else getattr(config, name)
        for name, kind in _FIELDS[config.method]
    ]
    return values + [getattr(tuning, name) for name in _TUNING_NAMES[config.method]]


# --------------------------------------------------------------------------- validation


def validate_inputs(method: str, q, k, v, attn_mask, scale, backend: str, tag: str) -> None:
    """Checks every call makes, on real and on fake tensors (so errors surface at trace time)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, heads, seq, head_dim], got shape {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share a dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    qs, ks, vs = q.shape, k.shape, v.shape  # every call pays for these checks: read each shape once
    if not (qs[0] == ks[0] == vs[0]):
        raise ValueError(f"batch sizes of q, k, v must match, got {qs[0]}, {ks[0]}, {vs[0]}")
    if ks[:3] != vs[:3]:
        raise ValueError(f"k and v must agree in batch, heads and length, got k={tuple(ks)}, v={tuple(vs)}")
    if qs[-1] != ks[-1]:
        raise ValueError(f"q and k head dims must match, got q={qs[-1]}, k={ks[-1]}")
    if qs[1] == 0 or ks[1] == 0:
        # (SDPA returns an empty tensor here; a headless attention layer is a bug upstream)
        raise ValueError(f"q and k/v need at least one head, got q={tuple(qs)}, k={tuple(ks)}")
    if qs[1] % ks[1]:
        raise ValueError(f"query heads ({qs[1]}) must be a multiple of key/value heads ({ks[1]})")
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
        if attn_mask.device != q.device:
            raise ValueError(f"attn_mask must be on {q.device}, got {attn_mask.device}")
        check_mask(attn_mask, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), q.dtype)
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite float or None, got {scale!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")


# --------------------------------------------------------------------------- dispatch


def _sdpa(q, k, v, attn_mask, is_causal, scale):
    group = q.shape[1] // k.shape[1]
    if attn_mask is not None and is_causal:
        # the op's mask with is_causal is their intersection; SDPA's math and CUDA kernels refuse the pair
        attn_mask, is_causal = with_causality(attn_mask, q.shape[2], k.shape[2]), False
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=group > 1
    )


def _dense_reason(method: str, cfg: AttentionConfig, n_q: int, n_k: int, is_causal: bool) -> str:
    """Why this call cannot run the sparse method ("" when it can): the reasons every method
    shares, then the method's own rule."""
    if is_causal and n_q != n_k:
        # SDPA aligns is_causal to the top-left corner when Nq != Nk; keep its exact semantics.
        return f"is_causal with Nq={n_q} != Nk={n_k}"
    min_len = getattr(cfg, "min_seq_len", 0)  # the dense method's windowed calls have none
    if n_k < min_len:
        return f"sequence length {n_k} < min_seq_len={min_len}"
    return _methods.spec_for(method).dense_rule(cfg, n_q, n_k)


def _triton_usable(device: torch.device) -> bool:
    if device.type != "cuda" and not interpreting():
        return False
    return _triton_installed()


@functools.lru_cache(maxsize=None)
def _triton_installed() -> bool:
    # an installation does not change within a process; find_spec costs microseconds per call
    return importlib.util.find_spec("triton") is not None


def _resolve_backend(method: str, backend: str, device: torch.device, dtype: Optional[torch.dtype] = None) -> str:
    """The concrete backend for a call; ``auto`` here is the static part of the choice (reference
    off CUDA, else ``"measure"``: _run times the fast backends on the call, see autobackend)."""
    if backend == "auto":
        if device.type == "cuda" and _fast_backends(method, device, dtype):
            return "measure"
        return "reference"
    _methods.spec_for(method).backend(backend)  # ValueError naming the available ones
    if backend == "triton" and not _triton_usable(device):
        raise ValueError(
            f"backend='triton' needs CUDA tensors (got {device}) and an installed triton; "
            "on the CPU use backend='reference' or 'flex' (or TRITON_INTERPRET=1 for kernel tests)"
        )
    return backend


# The Triton kernels compute in fp32 from 16/32-bit inputs; fp64 (oracles, gradcheck) runs on the reference.
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_backend_dtype(method: str, backend: str, dtype: torch.dtype) -> None:
    """TypeError when an explicitly chosen backend cannot take ``dtype`` (before any kernel compiles)."""
    if backend == "triton" and _methods.spec_for(method).sparse and dtype not in TRITON_DTYPES:
        raise TypeError(
            f"backend='triton' ({method}) takes float16, bfloat16 or float32 q/k/v, got {dtype}; "
            "use backend='reference' (or 'auto') for float64"
        )


_FAST_BACKENDS = ("triton", "flex")  # the candidates backend='auto' measures, in this order


def _fast_backends(method: str, device: torch.device, dtype: Optional[torch.dtype] = None) -> List[str]:
    fast = [b for b in _FAST_BACKENDS if b in _methods.spec_for(method).backends]
    return [b for b in fast if b != "triton" or (_triton_usable(device) and dtype in (None,) + TRITON_DTYPES)]


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)


DENSE_CHOICE = "sdpa"  # what the auto chooser calls dense attention among its candidates


# --------------------------------------------------------------------------- per-call caches
# A decided call should cost what SDPA costs: everything that depends only on the call's
# arguments (the config object, its implementation kwargs, the auto choice and its reason) is
# built once per distinct argument tuple and looked up afterwards.


class _ConfigEntry(NamedTuple):
    cfg: AttentionConfig
    kwargs: Dict[str, Any]  # the implementation's keyword arguments (all fields but min_seq_len)
    serial: int  # never reused, so a key holding it can never mean another config
    tuning: Tuning
    values: Tuple  # the op's flattened config and tuning arguments it was built from


_CACHE_LIMIT = 512  # distinct configs per process; past it the caches start over (correct, slower)
_BY_VALUES: Dict[Tuple, _ConfigEntry] = {}
_BY_CONFIG: Dict[Tuple[AttentionConfig, Tuning], Tuple[Tuple, _ConfigEntry]] = {}
_SERIALS = itertools.count()


def _config_entry(method: str, values: Tuple) -> _ConfigEntry:
    """The config and tuning the op's flattened arguments (between ``scale`` and ``backend``)
    describe, validated and built once per tuple."""
    # the types are part of the key: True == 1 and 1 == 1.0, yet a config validates its types
    key = (method, values, tuple(map(type, values)))
    entry = _BY_VALUES.get(key)
    if entry is None:
        names = _NAMES[method]
        cfg = _methods.spec_for(method).config_type(**dict(zip(names, values)))
        tuning = Tuning(**dict(zip(_TUNING_NAMES[method], values[len(names) :])))
        entry = _ConfigEntry(cfg, _impl_kwargs(cfg), next(_SERIALS), tuning, values)
        if len(_BY_VALUES) >= _CACHE_LIMIT:
            _BY_VALUES.clear()
        _BY_VALUES[key] = entry
    return entry


def _config_call(config: AttentionConfig, tuning: Tuning = DEFAULT_TUNING) -> Tuple[Tuple, _ConfigEntry]:
    """(op arguments, entry) of a config and tuning, as the op would rebuild them from those arguments."""
    key = (config, tuning)
    try:
        hit = _BY_CONFIG.get(key)
    except TypeError:  # an unhashable (non-frozen) subclass: no caching
        hit = None
    if hit is None:
        values = tuple(op_args(config, tuning))
        hit = (values, _config_entry(config.method, values))
        try:
            if len(_BY_CONFIG) >= _CACHE_LIMIT:
                _BY_CONFIG.clear()
            _BY_CONFIG[key] = hit
        except TypeError:
            pass
    return hit


def _impl_kwargs(cfg: AttentionConfig) -> Dict[str, Any]:
    # min_seq_len is the dispatcher's (dense below it); implementations take the method's fields
    return {name: getattr(cfg, name) for name in _NAMES[cfg.method] if name != "min_seq_len"}


def _auto_key(entry: _ConfigEntry, q, k, mask) -> Tuple:
    # what an auto decision depends on; the chooser's own (coarser) key is built only on a miss
    return (
        entry.serial,
        q.device,
        q.dtype,
        q.shape[0],
        q.shape[1],
        k.shape[1],
        q.shape[3],
        _autobackend._bucket(q.shape[2]),
        _autobackend._bucket(k.shape[2]),
        mask.is_causal,
        mask.key_padding_mask is not None,
        mask.sliding_window,
        mask.chunk_size,
    )


def _auto_choice(
    method: str, entry: _ConfigEntry, q, k, v, attn_mask, is_causal, mask, scale
) -> Tuple[str, Optional[str]]:
    """``(backend, dense reason)`` for ``backend="auto"``: the reason is None when a sparse
    backend runs. Decided once per key of the default chooser (its ``clear()`` forgets them)."""
    chooser = _autobackend.default_chooser
    key = _auto_key(entry, q, k, mask)
    decision = chooser.decisions.get(key)
    if decision is None:
        decision = _decide(chooser, method, entry, q, k, v, attn_mask, is_causal, mask, scale)
        chooser.decisions[key] = decision
    return decision


def _decide(
    chooser, method: str, entry: _ConfigEntry, q, k, v, attn_mask, is_causal, mask, scale
) -> Tuple[str, Optional[str]]:
    """The static choice (reference off CUDA), else the fastest measured on this call, with the
    reason to log when that is dense SDPA: the op is never slower than dense at a length it has measured."""
    chosen = _resolve_backend(method, "auto", q.device, q.dtype)
    if chosen != "measure":
        return chosen, None
    kw = entry.kwargs
    window = (mask.sliding_window, mask.chunk_size)
    key = chooser.key(
        method,
        q,
        k,
        (tuple(sorted(kw.items())), mask.is_causal, mask.key_padding_mask is not None, window, entry.tuning),
    )

    def run(name: str):
        # each candidate as it would run this call: a Triton call it may replay is timed replayed
        if name == DENSE_CHOICE:
            if window != (0, 0):
                return _sdpa(q, k, v, _with_window_mask(attn_mask, q, k.shape[2], window), False, scale)
            return _sdpa(q, k, v, attn_mask, is_causal, scale)
        return _replayed_or_launched(method, name, entry, q, k, v, mask, scale)

    fast = _fast_backends(method, q.device, q.dtype)
    if window != (0, 0):
        fast = [b for b in fast if _methods.spec_for(method).backend(b).windows]
    candidates = fast + [DENSE_CHOICE]
    choice, forcing = chooser.decide(key, candidates, run, prefer=DENSE_CHOICE)
    if choice != DENSE_CHOICE:
        return choice, None
    times = None if forcing else chooser.timings.get(key)
    if not times:  # decided without measuring
        how = f"forced by {forcing[1]}" if forcing else f"no sparse backend can run {method} here"
        return choice, f"backend='auto' runs dense SDPA, {how} (on {_device_name(q.device)})"
    others = ", ".join(f"{b} {t:.3f} ms" for b, t in times.items() if b != DENSE_CHOICE)
    dense_ms = times.get(DENSE_CHOICE, float("nan"))
    if any(t < dense_ms for b, t in times.items() if b != DENSE_CHOICE):
        lead = f"{method} measured less than {chooser.margin:.2f}x faster than dense here (dense is exact)"
    else:
        lead = f"measured faster than {method} here"
    return choice, (
        f"{lead}: dense SDPA {dense_ms:.3f} ms"
        f" vs {others or 'the sparse backends'} (backend='auto' on {_device_name(q.device)})"
    )


def _load(method: str, backend: str) -> Callable:
    return _methods.spec_for(method).backend(backend).load()


@functools.lru_cache(maxsize=None)
def _takes_tuning(impl: Callable) -> bool:
    return "tuning" in inspect.signature(impl).parameters


def _call_impl(method: str, backend: str, entry: _ConfigEntry, q, k, v, mask, scale, return_selection: bool):
    """One implementation's call: the config object, the mask analysis's form of the mask, and
    the tuning for an implementation that takes one."""
    impl = _load(method, backend)
    extra = {"tuning": entry.tuning} if _takes_tuning(impl) else {}
    cfg = entry.cfg
    if (mask.sliding_window, mask.chunk_size) != (cfg.sliding_window, cfg.chunk_size):
        cfg = cfg.replace(sliding_window=mask.sliding_window, chunk_size=mask.chunk_size)  # a mask's window
    return impl(
        q,
        k,
        v,
        cfg,
        key_padding_mask=mask.key_padding_mask,
        is_causal=mask.is_causal,
        scale=scale,
        return_selection=return_selection,
        **extra,
    )


# --------------------------------------------------------------------------- the call's plan


class _Plan(NamedTuple):
    entry: _ConfigEntry
    mask: Any  # the MaskAnalysis (None for the dense method)
    reason: Optional[str]  # None: runs sparse on ``backend``; else runs dense SDPA, logged when non-empty
    backend: str


def _plan(method: str, args: Tuple, entry: Optional[_ConfigEntry] = None) -> _Plan:
    """What a (validated) call computes: dense with its reason, or which sparse backend.
    ``entry``: the config of ``args`` when the caller has it already."""
    q, k, v, attn_mask, is_causal, scale = args[:6]
    if entry is None:
        entry = _config_entry(method, args[6:-2])
    spec = _methods.spec_for(method)
    if not spec.sparse and not entry.cfg.has_window:
        return _Plan(entry, None, "", DENSE_CHOICE)
    mask = analyse_mask(attn_mask, is_causal, q.shape[0], q.shape[2], k.shape[2])
    if not mask.supported:
        return _Plan(entry, _with_config_window(mask, entry.cfg), mask.reason, DENSE_CHOICE)
    mask, conflict = _merged_window(mask, entry.cfg)
    if conflict:
        return _Plan(entry, mask, conflict, DENSE_CHOICE)
    if (mask.sliding_window or mask.chunk_size) and not mask.is_causal:
        raise ValueError(
            f"a local window (sliding_window={mask.sliding_window}, chunk_size={mask.chunk_size}) holds with "
            "causal attention only: pass is_causal=True or a causal mask"
        )
    if v.shape[-1] != q.shape[-1]:
        return _Plan(entry, mask, f"value head dim {v.shape[-1]} != query head dim {q.shape[-1]}", DENSE_CHOICE)
    reason = _dense_reason(method, entry.cfg, q.shape[2], k.shape[2], mask.is_causal)
    if reason:
        return _Plan(entry, mask, reason, DENSE_CHOICE)
    backend = args[-2]
    if backend == "auto":
        chosen, reason = _auto_choice(method, entry, q, k, v, attn_mask, is_causal, mask, scale)
    else:
        chosen, reason = _resolve_backend(method, backend, q.device, q.dtype), None
    if reason is None and (mask.sliding_window or mask.chunk_size) and not spec.backend(chosen).windows:
        reason = f"the {chosen} backend of {method} does not run a local window yet"
        chosen = DENSE_CHOICE
    return _Plan(entry, mask, reason, chosen)


def _with_config_window(mask: MaskAnalysis, cfg: AttentionConfig) -> MaskAnalysis:
    return dataclasses.replace(mask, sliding_window=cfg.sliding_window, chunk_size=cfg.chunk_size)


def _merged_window(mask: MaskAnalysis, cfg: AttentionConfig) -> Tuple[MaskAnalysis, str]:
    """The call's window: the config's and the one the mask holds, intersected; a reason to run
    dense when they cannot be one window (two different chunk sizes, or a window and chunks)."""
    sliding = min((w for w in (mask.sliding_window, cfg.sliding_window) if w), default=0)
    chunks = {c for c in (mask.chunk_size, cfg.chunk_size) if c}
    if len(chunks) > 1 or (chunks and sliding):
        return _with_config_window(mask, cfg), (
            f"the attn_mask's window (sliding_window={mask.sliding_window}, chunk_size={mask.chunk_size}) and the "
            f"config's (sliding_window={cfg.sliding_window}, chunk_size={cfg.chunk_size}) are not one window"
        )
    return dataclasses.replace(mask, sliding_window=sliding, chunk_size=min(chunks, default=0)), ""


def _checked_plan(method: str, args: Tuple) -> _Plan:
    q, k, v, attn_mask, _, scale = args[:6]
    backend, tag = args[-2], args[-1]
    validate_inputs(method, q, k, v, attn_mask, scale, backend, tag)
    check_backend_dtype(method, backend, q.dtype)
    return _plan(method, args)


# attention() validates and plans a call before entering the op; the op's implementation takes
# that plan instead of redoing it when it receives exactly those arguments (the same tensor
# objects), and validates and plans itself otherwise (a direct torch.ops.sparseflow call).
_PREPARED: contextvars.ContextVar[Optional[Tuple[str, Tuple, _Plan]]] = contextvars.ContextVar(
    "sparseflow_prepared", default=None
)


def _prepared_plan(method: str, args: Tuple) -> Optional[_Plan]:
    got = _PREPARED.get()
    if got is None:
        return None
    m, ref, plan = got
    same = (
        m == method
        and len(args) == len(ref)
        and args[0] is ref[0]
        and args[1] is ref[1]
        and args[2] is ref[2]
        and args[3] is ref[3]
        and args[4:] == ref[4:]
    )
    return plan if same else None


def _dense_call(method: str, tag: str, reason: str, q, k, v, attn_mask, is_causal, scale, cap, window) -> torch.Tensor:
    """Dense SDPA for a call the plan sends there, contiguous like every op result (see _dense_sdpa)."""
    return _dense_sdpa(method, tag, reason, q, k, v, attn_mask, is_causal, scale, cap, window).contiguous()


def _dense_sdpa(
    method: str, tag: str, reason: str, q, k, v, attn_mask, is_causal, scale, cap, window: Tuple[int, int] = (0, 0)
) -> torch.Tensor:
    """Dense SDPA for a call the plan sends there: logged (and tallied) with its reason, recorded;
    the result as SDPA lays it out (a caller that re-lays it out saves a copy). ``window``: the
    call's (sliding_window, chunk_size), applied as a mask."""
    if reason:
        _capture.log_fallback(method, tag, reason)
    if window != (0, 0):
        attn_mask, is_causal = _with_window_mask(attn_mask, q, k.shape[2], window), False
    out = _sdpa(q, k, v, attn_mask, is_causal, scale)
    if cap is not None:
        cap.calls.append(_capture.CallRecord(tag, method, DENSE_CHOICE, False, reason, tuple(q.shape), tuple(k.shape)))
    return out


def _with_window_mask(attn_mask, q: torch.Tensor, n_k: int, window: Tuple[int, int]) -> torch.Tensor:
    """``attn_mask`` (None, bool or additive) intersected with causality and the local window, on q's device."""
    wm = window_mask(q.shape[2], n_k, window[0], window[1], q.device)
    if attn_mask is None:
        return wm
    if attn_mask.dtype == torch.bool:
        return attn_mask & wm
    return attn_mask.masked_fill(~wm, float("-inf"))


def _plan_window(plan: "_Plan") -> Tuple[int, int]:
    """The (sliding_window, chunk_size) a plan's call computes: its mask analysis's, else the config's."""
    src = plan.mask if plan.mask is not None else plan.entry.cfg
    return (src.sliding_window, src.chunk_size)


# An analysis that needs the arguments of every op call but not the sparse result (the ONNX
# export reads the mask each call receives) answers the calls itself inside ``intercepting``.
# A ContextVar, not a swapped module attribute: other threads and contexts keep running the ops.
OpInterceptor = Callable[[str, Tuple], torch.Tensor]

_INTERCEPTOR: contextvars.ContextVar[Optional[OpInterceptor]] = contextvars.ContextVar(
    "sparseflow_interceptor", default=None
)


@contextlib.contextmanager
def intercepting(fn: OpInterceptor) -> Iterator[None]:
    """Within the block, every sparseflow op call in this context returns ``fn(method, args)``
    (``args`` as the op received them, the tag last) instead of running its implementation."""
    token = _INTERCEPTOR.set(fn)
    try:
        yield
    finally:
        _INTERCEPTOR.reset(token)


def _run(method: str, args: Tuple, *, record: bool = True, for_grad: bool = False, twice: bool = False) -> torch.Tensor:
    """The real implementation behind every op: analyse, fall back or dispatch, record.
    ``for_grad``: the backward's recomputation (same choice as the forward, through a
    differentiable backend); ``twice``: through the reference, whose plain torch ops autograd
    differentiates twice (double backward; the kernels' backward passes are not differentiable)."""
    interceptor = _INTERCEPTOR.get()
    if interceptor is not None:
        return interceptor(method, args)
    plan = _prepared_plan(method, args) or _checked_plan(method, args)
    return _execute(method, plan, args, record=record, for_grad=for_grad, twice=twice)


def _execute(
    method: str, plan: _Plan, args: Tuple, *, record: bool, for_grad: bool, twice: bool, contiguous: bool = True
) -> torch.Tensor:
    """Run ``args`` (validated) as ``plan`` says: dense SDPA with its reason, a decode step, or the
    sparse backend; record the call in the active capture. ``contiguous=False``: a sparse result
    may come in ``[B, N, H, D]`` memory order (a replay's copy lands there for free), for a
    caller that transposes it back to that order."""
    q, k, v, attn_mask, is_causal, scale = args[:6]
    tag = args[-1]
    cap = _capture.active_capture() if record else None
    if plan.reason is not None:
        return _dense_call(method, tag, plan.reason, q, k, v, attn_mask, is_causal, scale, cap, _plan_window(plan))
    mask, chosen = plan.mask, plan.backend
    if for_grad:
        chosen = "reference" if twice else _grad_backend(method, chosen, q.device)
    want_sel = cap is not None and cap.keep_selections
    decode = _decode_of(method, chosen, q, k, v, mask)
    if decode is not None:
        state, step = decode
        if record:
            _capture.note_call(method, tag, True)
        out, sel = step(state, tag, plan.entry.cfg, plan.entry.tuning, q, k, v, scale, cap is not None)
        _record_sparse(cap, tag, method, chosen, q, k, sel, want_sel)
        return out.contiguous()
    if cap is None and not for_grad:
        layout = None if contiguous else _TOKENS_MAJOR
        out, sel = _replayed_or_launched(method, chosen, plan.entry, q, k, v, mask, scale, layout), None
    else:
        result = _call_impl(method, chosen, plan.entry, q, k, v, mask, scale, cap is not None)
        out, sel = result if isinstance(result, tuple) else (result, None)
    _record_sparse(cap, tag, method, chosen, q, k, sel, want_sel)
    if record:
        _capture.note_call(method, tag, True)
    return out.contiguous() if contiguous else out


_TOKENS_MAJOR = (0, 2, 1, 3)  # [B, H, N, D] held in [B, N, H, D] memory: what a model transposes back to


def _replayed_or_launched(
    method: str, chosen: str, entry: _ConfigEntry, q, k, v, mask, scale, out_layout: Optional[Tuple[int, ...]] = None
) -> torch.Tensor:
    """The implementation's output without a selection: from the CUDA-graph cache when the call
    may replay (in ``out_layout``'s memory order, see ``GraphReplays.run``), else by launching its
    kernels."""
    if _replayable(chosen, entry, q, k, v, mask.key_padding_mask):
        return _replayed_impl(method, chosen, entry, q, k, v, mask, scale, out_layout)
    return _call_impl(method, chosen, entry, q, k, v, mask, scale, False)


def _replayable(chosen: str, entry: _ConfigEntry, q, k, v, kpm) -> bool:
    """Whether this sparse call may replay from a CUDA graph: a Triton call on CUDA that the
    tuning allows, without gradient or key padding, outside any other capture (which records it
    as it is). Padded calls launch their kernels: the pipelines read the mask on the host (is
    anything padded at all?), which a graph could not redo."""
    if chosen != "triton" or not entry.tuning.cuda_graphs or not q.is_cuda or kpm is not None:
        return False
    if _needs_autograd(q, k, v, None):
        return False
    if (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16:
        # the kernels specialise on 16-byte alignment, which a graph's static inputs always have
        return False
    return not torch.cuda.is_current_stream_capturing()


def _replayed_impl(method: str, chosen: str, entry: _ConfigEntry, q, k, v, mask, scale, out_layout) -> torch.Tensor:
    """``_call_impl`` through the CUDA-graph cache (a call without key padding), keyed on
    everything the pipeline's launches depend on besides the tensors' values."""
    key = (
        entry.serial,
        chosen,
        mask.is_causal,
        mask.sliding_window,
        mask.chunk_size,
        scale,
        torch._C._cuda_getCurrentRawStream(q.device.index),  # what current_stream().cuda_stream is, 5 us cheaper
        q.device,
        (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype),
    )
    view = _MaskView(None, mask.is_causal, mask.sliding_window, mask.chunk_size)

    def call(q_, k_, v_):
        return _call_impl(method, chosen, entry, q_, k_, v_, view, scale, False)

    out = _graph_replay.default_replays.run(key, call, (q, k, v), out_layout)
    note = _REPLAY_NOTE.get()
    # only the call that serves attention_any_layout asks for this layout (auto's timing runs do not)
    if note is not None and out_layout == _TOKENS_MAJOR:
        handle = _graph_replay.default_replays.in_place_handle(key, (q, k, v))
        if handle is not None:
            note.append(handle)
    return out


class _MaskView(NamedTuple):
    """The fields of a mask analysis that ``_call_impl`` reads."""

    key_padding_mask: Optional[torch.Tensor]
    is_causal: bool
    sliding_window: int = 0
    chunk_size: int = 0


def _decode_of(method: str, chosen: str, q, k, v, mask) -> Optional[Tuple[Any, Callable]]:
    """(the model's decode state, the method's decode step) when this call is one generate()
    step the method's cache serves: one query over cached keys, no padding, no gradient."""
    if q.shape[2] != 1 or k.shape[2] <= 1:  # a prefill: the common case, decided first
        return None
    decode = _methods.spec_for(method).decode
    if decode is None or chosen != decode.backend:
        return None
    if mask.key_padding_mask is not None:
        return None
    state = _decode_state.current()
    if state is None or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        return None
    return state, decode.load()


def _record_sparse(cap, tag: str, method: str, chosen: str, q, k, sel, want_sel: bool) -> None:
    if cap is not None:
        kept = sel if (sel is None or want_sel) else _strip(sel)
        cap.calls.append(_capture.CallRecord(tag, method, chosen, True, "", tuple(q.shape), tuple(k.shape), kept))


def _strip(sel):
    # keep the density, drop the (large) block tensors
    return dataclasses.replace(sel, block_mask=None, permutation=None, block_indices=None, key_padding_mask=None)


# --------------------------------------------------------------------------- registration


def _define(method: str) -> None:
    name = f"sparseflow::{method}_attention"
    bwd_name = f"sparseflow::{method}_attention_backward"
    torch.library.define(name, _schema(method))
    torch.library.define(
        bwd_name,
        _schema(method)
        .replace("(Tensor q", "(Tensor grad_out, Tensor q")
        .replace("-> Tensor", "-> (Tensor, Tensor, Tensor)"),
    )

    @torch.library.impl(name, "CompositeExplicitAutograd")
    def _impl(*args):
        return _run(method, args)

    @torch.library.register_fake(name)
    def _fake(*args):
        q, k, v, attn_mask, is_causal, scale = args[:6]
        validate_inputs(method, q, k, v, attn_mask, scale, args[-2], args[-1])
        check_backend_dtype(method, args[-2], q.dtype)
        return q.new_empty(q.shape[:-1] + (v.shape[-1],))

    @torch.library.impl(bwd_name, "CompositeExplicitAutograd")
    def _bwd_impl(grad_out, *args):
        # Recompute the forward with autograd on: the selection is made without gradient by the
        # implementation itself, so gradients flow through the attention over selected keys only.
        q, k, v = (t.detach().requires_grad_(True) for t in args[:3])
        # Recompute with the forward's choice (dense, or sparse through that backend when it is
        # differentiable, else through the reference, which selects exactly the same blocks).
        with torch.enable_grad(), _capture.suspended():
            out = _run(method, (q, k, v) + tuple(args[3:]), record=False, for_grad=True)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad_out, allow_unused=True)
        zeros = lambda t, g: torch.zeros_like(t) if g is None else g.contiguous()  # noqa: E731
        return zeros(q, dq), zeros(k, dk), zeros(v, dv)

    @torch.library.register_fake(bwd_name)
    def _bwd_fake(grad_out, *args):
        q, k, v = args[:3]
        # the real backward returns contiguous gradients; so must the fake (not empty_like's strides)
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    bwd_op = getattr(torch.ops.sparseflow, f"{method}_attention_backward").default

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:3], *([inputs[3]] if inputs[3] is not None else []))
        ctx.has_mask = inputs[3] is not None
        ctx.rest = inputs[4:]

    def backward(ctx, grad):
        saved = ctx.saved_tensors
        q, k, v = saved[:3]
        mask = saved[3] if ctx.has_mask else None
        if torch.is_grad_enabled():
            # create_graph=True: the gradient must itself be differentiable, which the backward
            # op (an opaque kernel) is not; recompute through a twice-differentiable path instead
            grads = _differentiable_grads(method, grad, (q, k, v, mask) + tuple(ctx.rest))
        else:
            grads = bwd_op(grad, q, k, v, mask, *ctx.rest)
        return tuple(grads) + (None,) * (3 + len(ctx.rest))

    torch.library.register_autograd(name, backward, setup_context=setup_context)


def _differentiable_grads(method: str, grad: torch.Tensor, args: Tuple) -> Tuple[Optional[torch.Tensor], ...]:
    """(dq, dk, dv) as differentiable functions of the inputs and of ``grad`` (double backward):
    the forward is recomputed with the same choice through plain torch ops (the reference or
    SDPA; the selection carries no gradient), then differentiated with ``create_graph``."""
    q, k, v = args[:3]
    with _capture.suspended():
        out = _run(method, args, record=False, for_grad=True, twice=True)
    wanted = [i for i, t in enumerate((q, k, v)) if t.requires_grad]
    grads: List[Optional[torch.Tensor]] = [None, None, None]
    if out.requires_grad and wanted:
        got = torch.autograd.grad(out, [args[i] for i in wanted], grad, create_graph=True, allow_unused=True)
        for i, g in zip(wanted, got):
            grads[i] = g
    return tuple(grads)


# Precomputed so op_args stays traceable by Dynamo (it cannot introspect dataclass fields).
_FIELDS: Dict[str, Tuple[Tuple[str, type], ...]] = {
    s.name: tuple((f.name, _field_type(f)) for f in _config_fields(s.config_type)) for s in _methods.specs()
}

_NAMES: Dict[str, Tuple[str, ...]] = {m: tuple(name for name, _ in fields) for m, fields in _FIELDS.items()}

_TUNING_NAMES: Dict[str, Tuple[str, ...]] = {m: tuple(name for name, _ in _tuning_fields(m)) for m in _methods.names()}

for _method in _methods.names():
    _define(_method)


# --------------------------------------------------------------------------- public functions


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    config: AttentionConfig,
    attn_mask: Optional[torch.Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    backend: str = "auto",
    tag: str = "",
    context_parallel: Any = None,
    tuning: Optional[Tuning] = None,
) -> torch.Tensor:
    """Sparse attention with the method of ``config`` (PBSConfig, PISAConfig, BSAConfig or
    DenseConfig). ``q: [B, Hq, Nq, D]``, ``k, v: [B, Hkv, Nk, D]`` with Hq a multiple of Hkv.
    ``attn_mask``: None or any SDPA mask, with SDPA's meaning (a 2-D mask is ``[Nq, Nk]``); key
    padding is ``kpm[:, None, None, :]`` (``[B, 1, 1, Nk]`` bool, True = valid), and with
    ``is_causal=True`` a mask is intersected with causality. Causal / key-padding masks run
    sparse; others run dense, logged (see :mod:`sparseflow.masks`).
    ``context_parallel``: a 1-D DeviceMesh, a ProcessGroup or a :class:`sparseflow.ContextParallel`
    (its ``sharding``): q, k, v are then this rank's sequence shards and the result is the output
    of this rank's queries (see :mod:`sparseflow.context_parallel`).
    ``tuning``: launch options of the Triton backends (:class:`sparseflow.Tuning`; None: the
    defaults)."""
    tuning = check_tuning(tuning)
    _check_call_types(config, is_causal)
    return _attention(q, k, v, config, attn_mask, is_causal, scale, backend, tag, context_parallel, tuning, True)


def attention_any_layout(
    q,
    k,
    v,
    *,
    config,
    is_causal: bool,
    scale,
    backend: str,
    tag: str,
    tuning: Tuning = DEFAULT_TUNING,
    known: Optional[Dict[Tuple, Tuple[int, Optional[str]]]] = None,
) -> torch.Tensor:
    """:func:`attention` without a mask or context parallelism, for a caller that lays the
    result out itself (``sparseflow.hf``): a dense call returns SDPA's own layout, which for q/k/v
    viewed from ``[B, N, H, D]`` memory is that memory, and a replayed sparse call returns
    ``[B, N, H, D]`` memory, so transposing back to it copies nothing.

    ``known``: a dict the caller keeps for one (config, tuning, backend, tag) -- the same four on
    every call that passes it -- where plain eager calls note whether their signature runs dense
    SDPA, so a repeat of a dense call goes to SDPA from its signature alone (a converted layer
    that ``auto`` keeps dense then costs about what transformers' own SDPA function does)."""
    sig = None
    sparse_known = False
    plain_args = type(is_causal) is bool and (scale is None or type(scale) in (int, float))
    if known is not None and plain_args and _plain_eager(q, k, v, None):
        last = known.get(_LAST_REPLAY)
        if last is not None:
            out = _replay_again(last, q, k, v, is_causal, scale, backend)
            if out is not None:
                _capture.note_call(config.method, tag, True)
                return out
        sig = _call_signature(q, k, v, is_causal, scale, backend)
        hit = known.get(sig)
        if hit is not None and hit[0] == _autobackend.default_chooser.generation:
            if hit[1] is not None:
                scale = None if scale is None else float(scale)
                return _dense_sdpa(
                    config.method,
                    tag,
                    hit[1],
                    q,
                    k,
                    v,
                    None,
                    is_causal,
                    scale,
                    _capture.active_capture(),
                    (config.sliding_window, config.chunk_size),
                )
            sig, sparse_known = None, True  # known to run sparse: nothing to learn
    _check_call_types(config, is_causal)
    if sparse_known:
        return _attention_noting_replay(known, q, k, v, config, is_causal, scale, backend, tag, tuning)
    out = _attention(q, k, v, config, None, is_causal, scale, backend, tag, None, tuning, False)
    if sig is not None:
        _note_known(known, sig, config, tuning, backend, tag)
    return out


# A caller's repeat of a sparse call that replayed an in-place CUDA graph (a model's layer,
# forward after forward) replays it again from what the call matches alone: the same tensors'
# addresses, layouts and flags, on the same stream, in the same mode. Everything the full path
# decides from is in that match or checked per call, so the result is the full path's; the
# full path's own checks cost a replayed call more host time than its kernels' launch.
_LAST_REPLAY = object()  # the key of a caller's _LastReplay in its ``known`` dict

# set while attention_any_layout runs a call the full way: _replayed_impl notes the in-place
# graph that served it
_REPLAY_NOTE: contextvars.ContextVar[Optional[List]] = contextvars.ContextVar("sparseflow_replay_note", default=None)


class _LastReplay(NamedTuple):
    site: Tuple  # _replay_site of the call
    handle: "_graph_replay.ReplayHandle"


def _replay_site(q, k, v, is_causal, scale, backend) -> Tuple:
    """Everything a plain eager sparse call's path to its graph depends on besides the caller's
    fixed config, tuning, backend and tag: the plan's signature (:func:`_call_signature`), the
    inputs' addresses and strides, the stream and the chooser's generation."""
    stream = torch._C._cuda_getCurrentRawStream(q.device.index) if q.is_cuda else None
    return _call_signature(q, k, v, is_causal, scale, backend) + (
        q.data_ptr(),
        k.data_ptr(),
        v.data_ptr(),
        q.stride(),
        k.stride(),
        v.stride(),
        stream,
        _autobackend.default_chooser.generation,
    )


def _replay_again(last: _LastReplay, q, k, v, is_causal, scale, backend) -> Optional[torch.Tensor]:
    """The output of ``last``'s graph when this call is its repeat and may replay (see
    _replayable; what the key of _replayed_impl holds is in the site), else None."""
    if _replay_site(q, k, v, is_causal, scale, backend) != last.site:
        return None
    if _needs_autograd(q, k, v, None) or _INTERCEPTOR.get() is not None or _capture.active_capture() is not None:
        return None
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    return _graph_replay.default_replays.replay_handle(last.handle, _TOKENS_MAJOR)


def _attention_noting_replay(known, q, k, v, config, is_causal, scale, backend, tag, tuning) -> torch.Tensor:
    """A call known to run sparse, the full way; the in-place graph that served it (if one did)
    becomes the caller's last replay."""
    note: List = []
    token = _REPLAY_NOTE.set(note)
    try:
        out = _attention(q, k, v, config, None, is_causal, scale, backend, tag, None, tuning, False)
    finally:
        _REPLAY_NOTE.reset(token)
    if len(note) == 1 and q.shape[2] > 1:  # a one-query call may be a decode step another time
        known[_LAST_REPLAY] = _LastReplay(_replay_site(q, k, v, is_causal, scale, backend), note[-1])
    else:
        known.pop(_LAST_REPLAY, None)
    return out


def _call_signature(q, k, v, is_causal, scale, backend) -> Tuple:
    """What a call's plan depends on besides the config, tuning, backend and tag (cf.
    :func:`_plan_memo_key`)."""
    return (
        is_causal,
        scale,
        q.shape,
        k.shape,
        v.shape,
        q.dtype,
        k.dtype,
        v.dtype,
        q.device,
        k.device,
        v.device,
    )


_KNOWN_LIMIT = 64  # signatures per caller (decode steps grow the key length: each is new)


def _note_known(known, sig, config, tuning, backend, tag) -> None:
    """Note in ``known`` the dense reason (None: sparse) of the plan the call just remembered
    (under :func:`_plan_memo_key`, which is ``sig`` behind the caller's fixed arguments)."""
    memo = None if type(tag) is not str else _memo_of(config, tuning, backend, tag, sig)
    plan = None if memo is None else _memoized_plan(memo, config, tuning)
    if plan is None:
        return
    if len(known) >= _KNOWN_LIMIT:
        known.clear()
    known[sig] = (_autobackend.default_chooser.generation, plan.reason)


def _attention(q, k, v, config, attn_mask, is_causal, scale, backend, tag, context_parallel, tuning, contiguous):
    """:func:`attention` after its type checks (``tuning`` a Tuning); ``contiguous``: make a dense
    result contiguous like the op's (else it keeps SDPA's layout)."""
    if q.is_meta:  # shape inference (a model built on the meta device): SDPA's meta output
        validate_inputs(config.method, q, k, v, attn_mask, scale, backend, tag)
        return _meta_output(q, v)
    eager = _plain_eager(q, k, v, attn_mask)
    memo = (
        _plan_memo_key(config, tuning, q, k, v, is_causal, scale, backend, tag)
        if eager and attn_mask is None and context_parallel is None
        else None
    )
    plan = None if memo is None else _memoized_plan(memo, config, tuning)
    if plan is not None and plan.reason is not None:
        # the same call signature was validated and planned to dense SDPA before
        out = _dense_sdpa(
            config.method,
            tag,
            plan.reason,
            q,
            k,
            v,
            None,
            is_causal,
            None if scale is None else float(scale),
            _capture.active_capture(),
            _plan_window(plan),
        )
        return out.contiguous() if contiguous else out
    method = config.method
    if plan is None:
        validate_inputs(method, q, k, v, attn_mask, scale, backend, tag)
        check_backend_dtype(method, backend, q.dtype)
    scale = None if scale is None else float(scale)
    if context_parallel is not None:
        from . import context_parallel as _cp

        return _cp.attention(
            q,
            k,
            v,
            config=config,
            context_parallel=context_parallel,
            attn_mask=attn_mask,
            is_causal=is_causal,
            scale=scale,
            backend=backend,
            tag=tag,
            tuning=tuning,
        )
    if not eager:
        # traced, transformed or intercepted calls see exactly the op (op_args stays traceable)
        if torch.compiler.is_compiling():
            tuning = tuning.traced()
        return op_for(method)(q, k, v, attn_mask, is_causal, scale, *op_args(config, tuning), backend, tag)
    # a remembered plan holds the entry _config_call would give (the memo checked config and tuning)
    values, entry = (plan.entry.values, plan.entry) if plan is not None else _config_call(config, tuning)
    args = (q, k, v, attn_mask, is_causal, scale) + values + (backend, tag)
    return _eager_call(config, tuning, memo, args, entry, contiguous, plan)


def _meta_output(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The op's output for meta inputs: ``[B, Hq, Nq, Dv]``, contiguous, in q's dtype (no values
    to select from, so no method or backend runs; what SDPA answers for meta inputs)."""
    return q.new_empty(q.shape[0], q.shape[1], q.shape[2], v.shape[-1])


def _check_call_types(config, is_causal) -> None:
    if not isinstance(config, _CONFIG_TYPES):
        raise TypeError(f"config must be one of {[c.__name__ for c in _CONFIG_TYPES]}, got {type(config).__name__}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")


def _memoized_plan(memo, config, tuning) -> Optional[_Plan]:
    """The plan remembered under ``memo`` for this very config and tuning, or None."""
    hit = _autobackend.default_chooser.planned_calls.get(memo)
    if hit is not None and hit[0] is config and hit[1] is tuning:
        return hit[2]
    return None


def _eager_call(config, tuning, memo, args, entry, contiguous: bool, plan: Optional[_Plan] = None) -> torch.Tensor:
    """A plain eager call with validated ``args`` (the op's arguments): planned here (unless
    ``plan`` was remembered under ``memo``; a new plan is remembered there), run dense directly
    when the plan says so (made contiguous when asked), run sparse directly when nothing needs
    the op's autograd, else through the op."""
    method = config.method
    q, k, v, attn_mask, is_causal, scale = args[:6]
    tag = args[-1]
    if plan is None:
        plan = _plan(method, args, entry)
        if memo is not None:
            _remember_plan(memo, config, tuning, plan)
    if plan.reason is not None and not _needs_op(q, k, v, attn_mask):
        # exactly what the op computes and records for this plan, without the dispatcher's cost
        cap = _capture.active_capture()
        out = _dense_sdpa(method, tag, plan.reason, q, k, v, attn_mask, is_causal, scale, cap, _plan_window(plan))
        return out.contiguous() if contiguous else out
    if plan.reason is None and not _needs_autograd(q, k, v, attn_mask) and _INTERCEPTOR.get() is None:
        # what the op's implementation runs for this plan, without the dispatcher's cost
        return _execute(method, plan, args, record=True, for_grad=False, twice=False, contiguous=contiguous)
    token = _PREPARED.set((method, args, plan))
    try:
        return op_for(method)(*args)
    finally:
        _PREPARED.reset(token)


def _needs_autograd(q, k, v, attn_mask) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, attn_mask))


def _remember_plan(memo, config, tuning, plan: _Plan) -> None:
    planned = _autobackend.default_chooser.planned_calls
    if len(planned) >= _CACHE_LIMIT:
        planned.clear()
    planned[memo] = (config, tuning, plan)


_CONFIG_TYPES = tuple(s.config_type for s in _methods.specs())  # the methods that have an op


def _plan_memo_key(config, tuning, q, k, v, is_causal, scale, backend, tag):
    """The key under which a plain eager call without a mask or context parallelism remembers
    its plan, or None when an argument cannot be part of a key (those calls plan afresh).
    Every input the validation and the plan read is in it; the config and tuning by identity
    (the memo keeps them alive and checks them on a hit)."""
    if type(tag) is not str or not (scale is None or type(scale) in (int, float)):
        return None
    return _memo_of(config, tuning, backend, tag, _call_signature(q, k, v, is_causal, scale, backend))


def _memo_of(config, tuning, backend, tag, sig: Tuple) -> Tuple:
    return (id(config), id(tuning), backend, tag) + sig


def _plain_eager(q, k, v, attn_mask) -> bool:
    """True for plain tensors run eagerly: no compiler, fake or proxy tensors, dispatch or
    function modes, functorch transforms or autocast, all of which must see the op itself."""
    tensor = torch.Tensor
    return (
        type(q) is tensor
        and type(k) is tensor
        and type(v) is tensor
        and (attn_mask is None or type(attn_mask) is tensor)
        and not torch.compiler.is_compiling()
        and not torch._C._len_torch_dispatch_stack()
        and not torch._C._is_torch_function_mode_enabled()
        and not torch._C._are_functorch_transforms_active()
        and not torch._C._is_any_autocast_enabled()
    )


def _needs_op(q, k, v, attn_mask) -> bool:
    # the op's autograd backward keeps a mask that requires grad out of the gradient; SDPA would not
    return attn_mask is not None and attn_mask.requires_grad


def dense_attention(q, k, v, *, attn_mask=None, is_causal=True, scale=None, tag: str = ""):
    return attention(q, k, v, config=DenseConfig(), attn_mask=attn_mask, is_causal=is_causal, scale=scale, tag=tag)


def _method_config(config, cls):
    """``config`` (default ``cls()``) after checking it is a ``cls``: a method's function never
    runs another method's config."""
    if config is None:
        return default_instance(cls)
    if not isinstance(config, cls):
        raise TypeError(
            f"config must be a {cls.__name__} (or None), got {type(config).__name__}; "
            "use sparseflow.ops.attention(config=...) to run any method"
        )
    return config


def pbs_attention(q, k, v, *, config: Optional[PBSConfig] = None, **kw):
    return attention(q, k, v, config=_method_config(config, PBSConfig), **kw)


def pisa_attention(q, k, v, *, config: Optional[PISAConfig] = None, **kw):
    return attention(q, k, v, config=_method_config(config, PISAConfig), **kw)


def bsa_attention(q, k, v, *, config: Optional[BSAConfig] = None, **kw):
    return attention(q, k, v, config=_method_config(config, BSAConfig), **kw)
