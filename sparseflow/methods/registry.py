"""The method registry: everything the core needs to know about one attention method.

The core (ops, the rewrite pass, ONNX export, calibration, the CLI) never tests a method's
name; it looks the method's :class:`MethodSpec` up here and reads its attributes. Each method
package (``sparseflow/methods/<name>/``) registers its spec when :mod:`sparseflow.methods` is
imported, so adding a method is one new package whose ``__init__`` calls :func:`register`.

Implementations are named as ``"module:function"`` strings and imported on first use, so
importing sparseflow never imports Triton.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import types
from dataclasses import dataclass
from typing import Any, Callable, Dict, FrozenSet, List, Mapping, Optional, Tuple, Type, Union

from .._config_base import AttentionConfig

__all__ = [
    "Backend",
    "OnnxBody",
    "Decode",
    "BenchPart",
    "MethodSpec",
    "register",
    "unregister",
    "on_register",
    "spec_for",
    "specs",
    "names",
    "sparse_names",
    "names_with",
    "or_list",
    "windowed",
    "window_span_blocks",
    "DIFFERENTIABILITY",
    "TOKEN_CHUNKS",
]

# "always": autograd differentiates the backend's output on every device; "cuda": only on CUDA
# (compiled flex has no CPU backward); "never": the op's backward recomputes through the reference.
DIFFERENTIABILITY = ("always", "cuda", "never")

# How context-parallel ranks run a method whose selection of a query token reads only keys up to it
# (sparseflow.context_parallel): each rank's query chunks are bottom-right aligned calls of the
# implementation. A method that needs more (PBS: query rows of other ranks) names its own strategy.
TOKEN_CHUNKS = "token_chunks"


@functools.lru_cache(maxsize=None)
def load_target(target: str) -> Any:
    """The object named by ``"module:attribute"`` (imported once)."""
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def _check_target(owner: str, target: Any) -> None:
    if not isinstance(target, str) or target.count(":") != 1 or not all(target.split(":")):
        raise ValueError(f"{owner} must be a 'module:attribute' string, got {target!r}")


@dataclass(frozen=True)
class Backend:
    """One implementation of a method. ``target``: ``"module:function"``, a function taking
    ``(q, k, v, config=None, *, key_padding_mask, is_causal, scale, return_selection, **fields)``
    (the op passes the config object; ``fields`` are config fields by keyword, for direct calls)
    and, when ``tuned``, ``tuning`` (the call's :class:`sparseflow.Tuning`)."""

    target: str
    differentiable: str = "never"
    windows: bool = False  # runs a config's local window (else such calls run dense SDPA, logged)
    tuned: bool = False  # takes the call's sparseflow.Tuning as ``tuning=``
    # its autograd graph holds O(N) tensors (output, log-sum-exp, block lists): an eager training
    # call keeps it for the backward rather than recompute the forward (sparseflow.op_train)
    compact_graph: bool = False

    def __post_init__(self):
        _check_target("Backend.target", self.target)
        if self.differentiable not in DIFFERENTIABILITY:
            raise ValueError(
                f"Backend.differentiable must be one of {list(DIFFERENTIABILITY)}, got {self.differentiable!r}"
            )

    def load(self) -> Callable:
        return load_target(self.target)

    def differentiable_on(self, device_type: str) -> bool:
        return self.differentiable == "always" or (self.differentiable == "cuda" and device_type == "cuda")

    def keeps_graph_on(self, device_type: str) -> bool:
        """Whether an eager call under autograd keeps this backend's graph for the backward."""
        return self.compact_graph and self.differentiable_on(device_type)


_WINDOW_FIELDS = frozenset({"sliding_window", "chunk_size"})  # every config's: the shared prologue runs them


@dataclass(frozen=True)
class OnnxBody:
    """The method's ONNX node: its op type, the opset-23 text computing its attention mask
    (``mask``: ``"module:ATTRIBUTE"`` of a string, read on first use), the config fields that
    text implements, and ``refusal(cfg)``: why a config cannot be exported ("" when it can).
    ``windows``: the text chooses a sparse method's blocks inside each query's local window, as
    the reference does (a body that chose them over all keys and left the cut to the shared
    epilogue would compute another selection, so a window is refused without it). ``optional``:
    fields (of ``fields``) added after the node's first files were written: their attributes
    default to the config's default, so those files stay valid."""

    node_type: str
    mask: str
    fields: FrozenSet[str] = frozenset()
    refusal: Optional[Callable[[AttentionConfig], str]] = None
    windows: bool = False
    optional: FrozenSet[str] = frozenset()

    def __post_init__(self):
        _check_target("OnnxBody.mask", self.mask)
        object.__setattr__(self, "fields", frozenset(self.fields))
        object.__setattr__(self, "optional", frozenset(self.optional))
        if not self.optional <= self.fields:
            raise ValueError(
                f"OnnxBody.optional must name fields the body lists, got {sorted(self.optional - self.fields)}"
            )

    def mask_text(self) -> str:
        return load_target(self.mask)

    def refuse(self, cfg: AttentionConfig) -> str:
        """Why ``cfg`` has no faithful body ("" when it has): a setting the body does not
        reproduce, or a config field it does not know."""
        reason = self.refusal(cfg) if self.refusal is not None else ""
        if reason:
            return reason
        unknown = sorted({f.name for f in dataclasses.fields(cfg)} - self.fields - _WINDOW_FIELDS)
        if unknown:
            return (
                f"the ONNX body of {self.node_type} does not implement the config field(s) {unknown}; "
                "export with method='dense' until it does"
            )
        return ""


@dataclass(frozen=True)
class Decode:
    """Single-token decode on a cache the model keeps (``sparseflow.decode_state``), taken when
    the call runs on ``backend``. ``step``: ``"module:function"`` called as
    ``step(state, tag, cfg, tuning, q, k, v, scale, return_selection)`` -> ``(out, selection or None)``."""

    backend: str
    step: str

    def __post_init__(self):
        _check_target("Decode.step", self.step)

    def load(self) -> Callable:
        return load_target(self.step)


@dataclass(frozen=True)
class BenchPart:
    """The method's share of one CUDA part of ``sparseflow bench`` (:mod:`sparseflow.bench`). A
    part is named after the repository benchmark script it stands for (``script``); the methods
    naming the same script share its run. ``checks``: configs whose correctness properties run on
    the GPU backends; ``timings``: ``(config, (n, hq, hkv, d))`` whole-op timings against dense
    SDPA (methods timed at the same shape share its dense baseline)."""

    script: str
    checks: Tuple[AttentionConfig, ...] = ()
    timings: Tuple[Tuple[AttentionConfig, Tuple[int, int, int, int]], ...] = ()

    def __post_init__(self):
        if not isinstance(self.script, str) or not self.script.endswith(".py"):
            raise ValueError(f"BenchPart.script must name a benchmark script ('name.py'), got {self.script!r}")
        object.__setattr__(self, "checks", tuple(self.checks))
        object.__setattr__(self, "timings", tuple((cfg, tuple(shape)) for cfg, shape in self.timings))
        configs = list(self.checks) + [cfg for cfg, _ in self.timings]
        if not all(isinstance(c, AttentionConfig) for c in configs):
            raise TypeError("BenchPart.checks and the timings' configs must be AttentionConfig objects")
        if not all(len(shape) == 4 for _, shape in self.timings):
            raise ValueError("each BenchPart timing's shape must be (n, hq, hkv, d)")


def _always_sparse(cfg: AttentionConfig, n_q: int, n_k: int) -> str:
    return ""


@dataclass(frozen=True)
class MethodSpec:
    """What the core needs to know about one method.

    ``dense_rule(cfg, n_q, n_k)``: the method's own reason to run a call as dense SDPA ("" when it
    runs sparse); the reasons every method shares (masks, lengths, ``min_seq_len``) are applied
    by :mod:`sparseflow.ops`. ``sparse=False`` marks the dense pseudo-method: its op runs SDPA,
    and its backends (all ``windows=True``) run only a config's local window exactly. ``has_permute`` / ``has_top_k`` / ``has_threshold``: the config
    has that knob (sweeps, calibration choices and CLI flags that only make sense with it).
    ``exact(cfg, seq_len)``: the config that keeps every visible block at ``seq_len``.
    ``estimate_cost(cfg)``: what the method's selection costs in units of one dense attention call
    (calibration's density cost model adds it to the density; None: nothing to select).
    ``selection_densities``: ``"module:function"`` of ``fn(q, k, cfgs, scale) -> [density]``, the
    selections of several configs computed without their attention (sharing what they share) on
    the reference path, as the op reports them; None: calibration asks the op for each config.
    ``selection``: ``"module:function"`` of ``fn(q, k, cfg, *, key_padding_mask=None,
    is_causal=True, scale=None) -> Selection``, the reference's selection without its attention
    (what :mod:`sparseflow.eval`'s diagnostics measure); None: the method selects nothing.
    ``selection_check``: ``"module:function"`` of the method's selection contract for users' CI,
    for a method whose selection may be computed in a lower precision within a stated tolerance:
    ``fn(q, k, trace=None, config=None, **call) -> report``, raising AssertionError when the
    selection breaks it (:func:`sparseflow.testing.check_selection_tolerance`); None: the
    selection is exact (the op-level checks cover it).
    ``window_rule(cfg, sliding_window, chunk_size)``: why a layer whose model gives it that local
    window runs the dense method's exact window instead of ``cfg`` ("" when ``cfg``'s selection
    inside the window can skip blocks worth skipping; :func:`windowed`); None: always ``cfg``.
    ``tuning_type``: the method's launch options, a :class:`sparseflow.tuning.MethodTuning`
    subclass (its fields are ``Tuning`` keywords ``<method>_<field>`` and the op's arguments);
    None: the method has none.
    ``context_parallel``: how context-parallel ranks run the method (:mod:`sparseflow.context_parallel`):
    ``"token_chunks"`` (each rank's query chunks as bottom-right aligned calls of the implementation,
    right for a method whose selection of a token reads only keys up to it), or ``"module:function"``
    of the method's own strategy ``fn(method, q, k_all, v_all, layout, pg, cfg, kwargs, is_causal,
    scale, backend, tuning)`` -> the rank's output rows (``kwargs``: the config's op fields).
    ``bench``: the method's share of a CUDA part of ``sparseflow bench`` (:class:`BenchPart`);
    None: the method has no GPU part.
    """

    name: str
    config_type: Type[AttentionConfig]
    backends: Mapping[str, Backend]
    onnx: OnnxBody
    dense_rule: Callable[[AttentionConfig, int, int], str] = _always_sparse
    sparse: bool = True
    decode: Optional[Decode] = None
    has_permute: bool = False
    has_top_k: bool = False
    has_threshold: bool = False
    exact: Optional[Callable[[AttentionConfig, int], AttentionConfig]] = None
    context_parallel: str = "token_chunks"
    estimate_cost: Optional[Callable[[AttentionConfig], float]] = None
    selection_densities: Optional[str] = None
    selection: Optional[str] = None
    selection_check: Optional[str] = None
    window_rule: Optional[Callable[[AttentionConfig, int, int], str]] = None
    tuning_type: Optional[type] = None
    bench: Optional[BenchPart] = None

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"MethodSpec.name must be an identifier (it names the op), got {self.name!r}")
        if not (isinstance(self.config_type, type) and issubclass(self.config_type, AttentionConfig)):
            raise TypeError(f"MethodSpec.config_type must be an AttentionConfig subclass, got {self.config_type!r}")
        if self.config_type.method != self.name:
            raise ValueError(
                f"MethodSpec {self.name!r}: config_type {self.config_type.__name__}.method is "
                f"{self.config_type.method!r}; they must agree"
            )
        if not all(isinstance(b, Backend) for b in self.backends.values()):
            raise TypeError(f"MethodSpec {self.name!r}: backends must map backend names to Backend objects")
        if not self.sparse and not all(b.windows for b in self.backends.values()):
            raise ValueError(
                f"MethodSpec {self.name!r}: a dense (sparse=False) method runs SDPA; its backends (windows=True) run "
                "only windowed calls"
            )
        self._check_tuning_type()
        if self.bench is not None and not isinstance(self.bench, BenchPart):
            raise TypeError(f"MethodSpec {self.name!r}: bench must be a BenchPart or None, got {self.bench!r}")
        for name in ("selection_densities", "selection", "selection_check"):
            if getattr(self, name) is not None:
                _check_target(f"MethodSpec {self.name!r}: {name}", getattr(self, name))
        if self.context_parallel != TOKEN_CHUNKS:
            _check_target(f"MethodSpec {self.name!r}: context_parallel ({TOKEN_CHUNKS!r} or)", self.context_parallel)
        # read-only, so a frozen spec cannot be changed through its mapping either
        object.__setattr__(self, "backends", types.MappingProxyType(dict(self.backends)))

    def _check_tuning_type(self) -> None:
        from .._tuning_base import MethodTuning

        t = self.tuning_type
        if t is None:
            return
        if not (isinstance(t, type) and issubclass(t, MethodTuning)) or t.method != self.name:
            raise TypeError(
                f"MethodSpec {self.name!r}: tuning_type must be a sparseflow.tuning.MethodTuning subclass whose "
                f"method is {self.name!r}, got {t!r}"
            )

    @property
    def supports_decode(self) -> bool:
        return self.decode is not None

    def backend(self, name: str) -> Backend:
        """The ``name`` backend; ValueError naming the available ones."""
        try:
            return self.backends[name]
        except KeyError:
            raise ValueError(
                f"backend={name!r} is not available for method {self.name!r}; "
                f"available: {sorted(self.backends) + ['auto']}"
            ) from None

    def exact_config(self, cfg: AttentionConfig, seq_len: int) -> AttentionConfig:
        return cfg if self.exact is None else self.exact(cfg, seq_len)

    def select(self, q, k, cfg: AttentionConfig, **call):
        """The reference's :class:`sparseflow.selection.Selection` of ``cfg`` on ``q``, ``k``
        without its attention (``call``: ``key_padding_mask``, ``is_causal``, ``scale``)."""
        if self.selection is None:
            raise ValueError(f"method {self.name!r} selects no blocks; it has no selection to compute")
        return load_target(self.selection)(q, k, cfg, **call)

    def check_selection(self, q, k, trace=None, cfg: Optional[AttentionConfig] = None, **call):
        """The method's ``selection_check`` on ``trace`` (AssertionError when the selection breaks
        its contract, else the report)."""
        if self.selection_check is None:
            raise ValueError(
                f"method {self.name!r} states no selection tolerance (its selection is exact); "
                "check_matches_own_selection covers it"
            )
        return load_target(self.selection_check)(q, k, trace, cfg, **call)


_SPECS: Dict[str, MethodSpec] = {}
_BY_TYPE: Dict[type, MethodSpec] = {}


def register(spec: MethodSpec) -> MethodSpec:
    """Add ``spec`` to the registry (ValueError when its name is taken; a spec's name is its config
    type's ``method``, so a config type is never registered twice either)."""
    if not isinstance(spec, MethodSpec):
        raise TypeError(f"register takes a MethodSpec, got {type(spec).__name__}")
    if spec.name in _SPECS:
        raise ValueError(f"method {spec.name!r} is already registered; unregister it first")
    _SPECS[spec.name] = spec
    _BY_TYPE[spec.config_type] = spec
    try:
        for prepare in _ON_REGISTER:
            prepare(spec)
    except Exception:
        unregister(spec.name)
        raise
    return spec


# what a registration sets up beyond the registry itself (sparseflow.ops defines the method's op)
_ON_REGISTER: List[Callable[[MethodSpec], None]] = []


def on_register(prepare: Callable[[MethodSpec], None]) -> None:
    """Call ``prepare(spec)`` for every method registered now and later (``sparseflow.ops`` defines
    each method's torch op so); an exception it raises refuses that registration."""
    _ON_REGISTER.append(prepare)
    for spec in list(_SPECS.values()):
        prepare(spec)


def unregister(name: str) -> MethodSpec:
    """Remove and return the spec of ``name`` (ValueError when it is not registered)."""
    spec = spec_for(name)
    del _SPECS[spec.name]
    del _BY_TYPE[spec.config_type]
    return spec


def spec_for(method_or_config: Union[str, AttentionConfig, Type[AttentionConfig]]) -> MethodSpec:
    """The spec of a method name, a config object or a config class."""
    key = method_or_config
    if isinstance(key, str):
        if key not in _SPECS:
            raise ValueError(f"unknown method {key!r}; known methods: {list(_SPECS)}")
        return _SPECS[key]
    cls = key if isinstance(key, type) else type(key)
    if cls in _BY_TYPE:
        return _BY_TYPE[cls]
    if issubclass(cls, AttentionConfig):
        raise ValueError(
            f"config type {cls.__name__} is not registered; registered: "
            f"{[s.config_type.__name__ for s in _SPECS.values()]}"
        )
    raise TypeError(f"spec_for takes a method name, a config or a config class, got {cls.__name__}")


def specs() -> Tuple[MethodSpec, ...]:
    """Every registered spec, in registration order."""
    return tuple(_SPECS.values())


def names() -> Tuple[str, ...]:
    return tuple(_SPECS)


def sparse_names() -> Tuple[str, ...]:
    """The methods that run a sparse kernel (every one but the dense pseudo-method)."""
    return tuple(name for name, spec in _SPECS.items() if spec.sparse)


def or_list(items) -> str:
    """``"a, b or c"``: names for an error message."""
    items = list(items)
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def names_with(capability: str) -> Tuple[str, ...]:
    """The methods whose spec has ``capability`` (a boolean attribute such as ``"has_top_k"``)."""
    if capability not in _CAPABILITIES:
        raise ValueError(f"capability must be one of {list(_CAPABILITIES)}, got {capability!r}")
    return tuple(name for name, spec in _SPECS.items() if getattr(spec, capability))


_CAPABILITIES = ("sparse", "has_permute", "has_top_k", "has_threshold", "supports_decode")


def windowed(cfg: AttentionConfig, sliding_window: int = 0, chunk_size: int = 0) -> Tuple[AttentionConfig, str]:
    """``(config, note)`` of a layer whose model gives it a local window: ``cfg`` with the window
    when every backend of its method runs windows (its selection inside the window) and the
    method's ``window_rule`` finds something to skip there; else the dense method's exact window
    and a note that says why."""
    window = dict(sliding_window=sliding_window, chunk_size=chunk_size)
    spec = spec_for(cfg)
    dense = next(s for s in _SPECS.values() if not s.sparse)
    if not all(b.windows for b in spec.backends.values()):
        return dense.config_type(
            **window
        ), f"{cfg.method} does not run a local window yet: the layer runs its window exactly"
    reason = spec.window_rule(cfg, sliding_window, chunk_size) if spec.window_rule is not None else ""
    if reason:
        return dense.config_type(**window), f"{reason}: the layer runs its window exactly"
    return cfg.replace(**window), ""


def window_span_blocks(block_size: int, sliding_window: int, chunk_size: int) -> int:
    """The most blocks of ``block_size`` keys one query's window can touch (0 without a window)."""
    widths = [w for w in (sliding_window, chunk_size) if w]
    width = min(widths) if widths else 0
    return -(-(width - 1) // block_size) + 1 if width else 0
