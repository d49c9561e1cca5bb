"""``sparseflow calibrate``: measure a per-layer plan for a checkpoint within a KL budget.

On real text, for each layer and each choice the method offers (PBS: threshold, permutation,
scoring; PISA/BSA: ``top_k``; and dense), the model runs with only that layer sparse and the mean
KL of its next-token distributions against the dense model is recorded, with the layer's measured
selection density. Single-layer runs are cheap: one dense pass stores the hidden state entering
every layer, and a run for layer ``L`` starts there (layers before ``L`` are skipped).

A greedy search then walks from the cheapest choice per layer towards dense, each step taking
the upgrade with the largest KL reduction per unit of predicted cost, until the sum of the
single-layer KLs fits the allowed sum; the whole-model KL of that plan is measured. The sum
predicts it only roughly, either way: layers interact, and in bf16 each sparse layer's KL
carries a rounding floor that does not add up across layers (a 32K plan on SmolLM2 predicted
0.0053 and measured 0.0022). So while the plan exceeds the calibration target the allowed sum
shrinks by the measured / predicted ratio, while it stays under :data:`GROW_BELOW` of the target
the sum grows by the headroom, and once plans on both sides are known it is bisected; the
cheapest measured plan within the target is kept (all layers dense at worst). The budget is
meant for the text the model will serve, not only the calibration text, so the target is
``margin`` x budget (default :data:`DEFAULT_MARGIN`) and the rest is headroom for text the plan
was not calibrated on; the first allowed sum is ``safety`` x that target. Every plan on the walk costs more than the one before and the walk does not depend
on the budget, so a larger allowed sum stops earlier on it; the correcting rounds make that
monotonicity in the budget a property of the measurements (tested), not a guarantee.

Not every (layer, choice) needs its KL for that walk. Every choice's cost is known before its KL
(its selection's density on the layer's q/k/v, without the attention or the rest of the model;
or its time), and a KL is never below 0, so a choice can only change the walk where it could be
a layer's cheapest option or where, even at KL 0, its KL reduction per added cost would match the
upgrade the walk takes. Only such choices are measured, the walk is rerun, until none is left
(:func:`unsettled`): the plan is the one the whole grid gives, and the skipped choices are listed
with their reason in the recipe's ``measured["single_layer"]`` (``prune=False`` /
``--measure-all`` measures the whole grid). A choice costing at least dense's 1 is always skipped:
dense is as cheap with KL 0.

Cost is in units of one dense attention call of the layer: on CPU (``cost="density"``) the
measured density plus a per-scoring estimate overhead (:data:`ESTIMATE_OVERHEAD`); with
``cost="time"`` (the default where CUDA is present) the op's measured time on the layer's own
q/k/v divided by dense SDPA's.

The result is a :class:`sparseflow.recipes.Recipe` (base config in ``configs``, per-layer
changes in ``layer_overrides``, ``dense_layers``) with both fidelities in ``measured``; every
``--recipe`` argument reads the file. Single-layer results are kept in a progress file, so a
rerun after an interruption measures only what is missing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from .config import AttentionConfig, default_config
from .hf import local_windows
from .methods import spec_for, sparse_names
from .methods.registry import or_list

__all__ = [
    "Choice",
    "Measurement",
    "CalibrationResult",
    "candidate_choices",
    "calibrate",
    "greedy_plan",
    "ESTIMATE_OVERHEAD",
    "DEFAULT_THRESHOLDS",
    "DEFAULT_TOP_KS",
    "DEFAULT_SCORINGS",
    "DEFAULT_MARGIN",
]

logger = logging.getLogger("sparseflow")

DEFAULT_THRESHOLDS = (0.9, 0.95, 0.98, 0.99)
DEFAULT_TOP_KS = (8, 16, 32)
DEFAULT_SCORINGS = ("sampled_rows", "mean")
# Share of the KL budget the plan may use on the calibration text. On SmolLM2 (2048 tokens,
# calibrated on prose, checked on code) the same plan's KL on the held-out text was 1.34-2.46x its
# calibration KL, the most at the smallest budgets (docs/results.md, "Calibrated plans"). The CLI
# repeats the value (it imports only the standard library at the top); a test keeps them equal.
DEFAULT_MARGIN = 0.7
PROGRESS_FORMAT = 1

# Rough cost of the block estimate in units of the layer's dense attention (QK^T and PV over
# the causal triangle): the strided scorings compute 1 / stride of the QK^T rows (or samples),
# i.e. about 1 / (2 * stride) of dense; block-mean scoring and PISA's pyramid walk touch
# O(N^2 / B^2) or O(N K log N) scores; the permutation adds one proxy pass and a sort.
ESTIMATE_OVERHEAD = {"mean": 0.01, "permute": 0.01, "pisa": 0.02, "bsa": 0.03}


@dataclass(frozen=True)
class Choice:
    """One thing a layer can run: ``changes`` applied to the base config, or dense (None)."""

    changes: Optional[Tuple[Tuple[str, Any], ...]]

    @property
    def dense(self) -> bool:
        return self.changes is None

    @property
    def key(self) -> str:
        if self.changes is None:
            return "dense"
        return ",".join(f"{k}={v}" for k, v in self.changes)

    def config(self, base: AttentionConfig) -> AttentionConfig:
        return base.replace(**dict(self.changes or ()))


DENSE = Choice(None)


@dataclass(frozen=True)
class Measurement:
    kl: float
    top1: float
    density: float
    cost: float

    def to_dict(self) -> Dict[str, float]:
        return dataclasses.asdict(self)


@dataclass
class CalibrationResult:
    recipe: Any  # sparseflow.recipes.Recipe
    choices: List[Choice]  # per layer
    calibration: Dict[str, Any]
    heldout: Optional[Dict[str, Any]]
    predicted_cost: float
    steps: List[Dict[str, Any]] = field(default_factory=list)


# --------------------------------------------------------------------------- choices


def _floats(values) -> Tuple[float, ...]:
    return tuple(float(v) for v in values)


def candidate_choices(
    method: str,
    base: AttentionConfig,
    *,
    thresholds: Optional[Sequence[float]] = None,
    top_ks: Optional[Sequence[int]] = None,
    scorings: Optional[Sequence[str]] = None,
    permutes: Sequence[bool] = (True, False),
) -> List[Choice]:
    """The sparse choices a layer is measured with (dense is always available besides), each a
    valid config of ``method`` on top of ``base``."""
    spec = _sparse_spec(method, "method")
    if spec.has_top_k:
        out = [Choice((("top_k", int(k)),)) for k in (top_ks or DEFAULT_TOP_KS)]
    elif spec.has_threshold:
        out = [
            Choice((("threshold", t), ("permute", bool(p)), ("scoring", s)))
            for s in (scorings or DEFAULT_SCORINGS)
            for p in permutes
            for t in _floats(thresholds or DEFAULT_THRESHOLDS)
        ]
    else:
        raise ValueError(f"method {method!r} has neither a top_k nor a threshold to calibrate")
    for c in out:
        try:
            c.config(base)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"choice {c.key} is not a valid {method} config on {base.to_dict()}: {exc}") from None
    return out


def _sparse_spec(method: str, arg: str):
    """The spec of a sparse method; ValueError naming them for anything else."""
    if method not in sparse_names():
        raise ValueError(f"{arg} must be {or_list(sparse_names())}, got {method!r}")
    return spec_for(method)


def estimate_overhead(cfg: AttentionConfig) -> float:
    """:data:`ESTIMATE_OVERHEAD` of one config (see there): a flat share per method where the
    table has one, else the scoring's share plus the permutation's."""
    if not spec_for(cfg).sparse:
        return 0.0
    if cfg.method in ESTIMATE_OVERHEAD:
        return ESTIMATE_OVERHEAD[cfg.method]
    strided = cfg.scoring in ("sampled_rows", "antidiagonal")
    scoring = 1.0 / (2 * cfg.antidiagonal_stride) if strided else ESTIMATE_OVERHEAD["mean"]
    return scoring + (ESTIMATE_OVERHEAD["permute"] if cfg.permute else 0.0)


# --------------------------------------------------------------------------- model surgery


def decoder_layers(model) -> torch.nn.ModuleList:
    """The model's list of decoder blocks (``model.layers``, ``transformer.h``, ...)."""
    n = int(getattr(model.config, "num_hidden_layers", 0) or 0)
    for _, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) == n and n > 0:
            return mod
    raise ValueError(
        f"cannot find the {n} decoder layers of {type(model).__name__}: calibrate needs a "
        "transformers causal LM with a ModuleList of num_hidden_layers blocks"
    )


class _Skip(torch.nn.Module):
    """Stands in for a skipped decoder layer: passes its hidden-state input through."""

    def __init__(self, original: torch.nn.Module):
        super().__init__()
        if hasattr(original, "attention_type"):
            self.attention_type = original.attention_type

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def _replace_hidden(hidden: torch.Tensor):
    def hook(module, args, kwargs):
        if args:
            return (hidden,) + tuple(args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    return hook


@contextlib.contextmanager
def start_at(model, layer: int, hidden: torch.Tensor) -> Iterator[None]:
    """Run the model from decoder layer ``layer`` on, with ``hidden`` as its input (the dense
    model's hidden state there): the earlier layers are skipped."""
    layers = decoder_layers(model)
    originals = [layers[i] for i in range(layer)]
    handle = layers[layer].register_forward_pre_hook(_replace_hidden(hidden), with_kwargs=True)
    try:
        for i in range(layer):
            layers[i] = _Skip(originals[i])
        yield
    finally:
        handle.remove()
        for i, mod in enumerate(originals):
            layers[i] = mod


def layer_inputs(model, input_ids: torch.Tensor) -> List[torch.Tensor]:
    """The hidden state entering every decoder layer in one dense forward pass."""
    layers = decoder_layers(model)
    seen: Dict[int, torch.Tensor] = {}

    def grab(i):
        def hook(module, args, kwargs):
            seen[i] = (args[0] if args else kwargs["hidden_states"]).detach().clone()

        return hook

    handles = [m.register_forward_pre_hook(grab(i), with_kwargs=True) for i, m in enumerate(layers)]
    try:
        with torch.no_grad():
            model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
    finally:
        for h in handles:
            h.remove()
    return [seen[i] for i in range(len(layers))]


def _layer_density(cap, layer: int) -> float:
    from .eval.evaluate import _layer_of

    vals = [c.density for c in cap.calls if _layer_of(c.tag) == layer and c.density is not None]
    return float(sum(vals) / len(vals)) if vals else 1.0


# --------------------------------------------------------------------------- measuring


@dataclass
class _Session:
    """What every measurement needs: the model, the tokens, the dense reference."""

    model: Any
    input_ids: torch.Tensor
    keep: int
    dense: torch.Tensor  # [keep, V]
    method: str
    base: AttentionConfig
    backend: str = "auto"
    cost: str = "density"
    hidden: List[torch.Tensor] = field(default_factory=list)
    timing: Optional[Tuple[int, Tuple[torch.Tensor, ...], float]] = None  # cost="time": (layer, q/k/v, dense s)
    reference: Optional["DenseReference"] = None  # the dense side of every KL, computed once
    qkv: Dict[int, Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[float]]] = field(default_factory=dict)
    fast_density: Optional[bool] = None  # the reference selection gives the op's density (checked once)
    # layer -> (sliding_window, chunk_size) of the layers the model limits to a local window: they
    # run that window exactly whatever the plan says (no method runs a window yet), so no choice
    windows: Dict[int, Tuple[int, int]] = field(default_factory=dict)

    @property
    def n_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    def layer_choices(self, layer: int, choices: Sequence["Choice"]) -> List["Choice"]:
        """The grid's choices a layer is calibrated over: none for a windowed layer."""
        return [] if layer in self.windows else list(choices)

    @property
    def targets(self) -> torch.Tensor:
        return self.input_ids[0, -self.keep :]


def _plan(s: _Session, configs: Mapping[int, AttentionConfig], dense_layers: Sequence[int]):
    from .hf import Plan

    return Plan(
        method=s.method,
        config=s.base,
        backend=s.backend,
        dense_layers=tuple(sorted(dense_layers)),
        layer_configs=dict(configs),
        num_layers=s.n_layers,
    )


def _single_layer_plan(s: _Session, layer: int, cfg: AttentionConfig):
    return _plan(s, {layer: cfg}, [i for i in range(s.n_layers) if i != layer])


def measure_layer(s: _Session, layer: int, choice: Choice, cost: Optional[float] = None) -> Measurement:
    """KL vs dense with only ``layer`` running ``choice``, its density and predicted cost
    (``cost``: the choice's cost when known already, from :func:`choice_cost`)."""
    from .eval.evaluate import _logits
    from .hf import apply_plan
    from .recording import capture

    cfg = choice.config(s.base)
    apply_plan(s.model, _single_layer_plan(s, layer, cfg))
    try:
        with start_at(s.model, layer, s.hidden[layer]), capture(keep_selections=False) as cap:
            logits = _logits(s.model, s.input_ids, s.keep)
    finally:
        s.model.set_attn_implementation("sdpa")
    kl, top1 = dense_reference(s).compare(logits)
    density = _layer_density(cap, layer)
    measured_cost = density + estimate_overhead(cfg) if s.cost == "density" else None
    if cost is None:
        cost = measured_cost if measured_cost is not None else layer_cost(s, layer, cfg, density)
    elif measured_cost is not None and abs(measured_cost - cost) > 1e-6:
        logger.warning(
            "sparseflow calibrate: layer %d %s: density %.6f measured in the model, %.6f from its "
            "selection alone; the model's is kept",
            layer,
            choice.key,
            density,
            cost - estimate_overhead(cfg),
        )
        cost = measured_cost
    return Measurement(kl=kl, top1=top1, density=density, cost=cost)


class DenseReference:
    """The dense side of :func:`sparseflow.eval.fidelity.compare_logits` (fp64 log-probabilities,
    probabilities, argmax), computed once for all measurements: :meth:`compare` gives the same
    mean KL and top-1 agreement, row chunk by row chunk so the fp64 work stays in cache."""

    def __init__(self, dense: torch.Tensor, chunk: int = 32):
        self.log_probs = torch.log_softmax(dense.double(), dim=-1)
        self.probs = self.log_probs.exp()
        self.argmax = dense.argmax(-1)
        self.chunk = chunk

    def compare(self, sparse: torch.Tensor) -> Tuple[float, float]:
        """``(mean KL(dense || sparse), top-1 agreement)`` of ``sparse`` logits ``[T, V]``."""
        if sparse.shape != self.log_probs.shape:
            raise ValueError(f"sparse logits must be {tuple(self.log_probs.shape)}, got {tuple(sparse.shape)}")
        from .eval.fidelity import row_kl

        sparse = sparse.to(self.log_probs.device)
        kl = torch.empty(sparse.shape[0], dtype=torch.float64, device=sparse.device)
        for i in range(0, sparse.shape[0], self.chunk):
            rows = slice(i, i + self.chunk)
            lp_s = torch.log_softmax(sparse[rows].double(), dim=-1)
            kl[rows] = row_kl(self.log_probs[rows], lp_s, self.probs[rows])
        top1 = (self.argmax == sparse.argmax(-1)).double().mean()
        return float(kl.mean()), float(top1)


def dense_reference(s: _Session) -> DenseReference:
    if s.reference is None:
        s.reference = DenseReference(s.dense)
    return s.reference


def layer_cost(s: _Session, layer: int, cfg: AttentionConfig, density: float) -> float:
    if s.cost == "density":
        return density + estimate_overhead(cfg)
    return timed_cost(s, layer, cfg)


def timed_cost(s: _Session, layer: int, cfg: AttentionConfig, reps: int = 3) -> float:
    """The op's time on the layer's own q/k/v over dense SDPA's (``cost="time"``)."""
    from .config import DenseConfig
    from .ops import attention

    if s.timing is None or s.timing[0] != layer:  # the layer's q/k/v and dense time, once per layer
        q, k, v = layer_qkv(s, layer)
        dense = _median_time(lambda: attention(q, k, v, config=DenseConfig(), is_causal=True), reps)
        s.timing = (layer, (q, k, v), max(dense, 1e-9))
    _, (q, k, v), dense = s.timing
    return _median_time(lambda: attention(q, k, v, config=cfg, is_causal=True, backend=s.backend), reps) / dense


def _median_time(fn: Callable[[], Any], reps: int) -> float:
    cuda = torch.cuda.is_available()
    with torch.no_grad():
        fn()  # warm-up: compilation, autotuning, allocator
        times = []
        for _ in range(reps):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def layer_qkv(s: _Session, layer: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The q/k/v the layer's attention sees on the calibration text (one partial dense run)."""
    from transformers import AttentionInterface

    from . import hf

    got: Dict[str, torch.Tensor] = {}

    def record(module, query, key, value, *args, **kwargs):
        if hf._layer_index(module) == layer:
            got.update(q=query.detach(), k=key.detach(), v=value.detach())
        return hf.sparseflow_attention_forward(module, query, key, value, *args, **kwargs)

    apply_plan_dense = _plan(s, {}, range(s.n_layers))
    hf.apply_plan(s.model, apply_plan_dense)
    AttentionInterface.register(hf.ATTN_IMPLEMENTATION, record)
    try:
        with start_at(s.model, layer, s.hidden[layer]), torch.no_grad():
            s.model(input_ids=s.input_ids, use_cache=False, logits_to_keep=1)
    finally:
        AttentionInterface.register(hf.ATTN_IMPLEMENTATION, hf.sparseflow_attention_forward)
        s.model.set_attn_implementation("sdpa")
    return got["q"], got["k"], got["v"]


def all_layer_qkv(s: _Session) -> None:
    """Fill ``s.qkv`` with every layer's q/k/v (see :func:`each_layer_qkv`)."""
    each_layer_qkv(s, s.qkv.__setitem__)


def each_layer_qkv(s: _Session, visit: Callable[[int, Tuple], None]) -> None:
    """``visit(layer, (q, k, v, scale))`` with what every layer's attention sees on the calibration
    text, each layer fed the dense hidden state ``s.hidden[layer]`` (so its q/k/v are exactly those
    of a single-layer run there), in one dense pass, layer by layer."""
    from transformers import AttentionInterface

    from . import hf

    def record(module, query, key, value, *args, scaling=None, **kwargs):
        visit(
            hf._layer_index(module),
            (query.detach(), key.detach(), value.detach(), None if scaling is None else float(scaling)),
        )
        return hf.sparseflow_attention_forward(module, query, key, value, *args, scaling=scaling, **kwargs)

    layers = decoder_layers(s.model)
    handles = [
        m.register_forward_pre_hook(_replace_hidden(s.hidden[i]), with_kwargs=True) for i, m in enumerate(layers)
    ]
    hf.apply_plan(s.model, _plan(s, {}, range(s.n_layers)))
    AttentionInterface.register(hf.ATTN_IMPLEMENTATION, record)
    try:
        with torch.no_grad():
            s.model(input_ids=s.input_ids, use_cache=False, logits_to_keep=1)
    finally:
        AttentionInterface.register(hf.ATTN_IMPLEMENTATION, hf.sparseflow_attention_forward)
        s.model.set_attn_implementation("sdpa")
        for h in handles:
            h.remove()


def choice_cost(s: _Session, layer: int, choice: Choice) -> float:
    """The cost :func:`measure_layer` will give ``choice`` at ``layer``, known before the KL is:
    the op's time (``cost="time"``), or the density of its selection on the layer's q/k/v plus
    the estimate overhead."""
    return layer_costs(s, layer, [choice])[choice]


def layer_costs(s: _Session, layer: int, choices: Sequence[Choice]) -> Dict[Choice, float]:
    """:func:`choice_cost` of each of ``choices`` at ``layer``."""
    cfgs = {c: c.config(s.base) for c in choices}
    if s.cost == "time":
        return {c: timed_cost(s, layer, cfg) for c, cfg in cfgs.items()}
    densities = selection_densities(s, layer, list(cfgs.values()))
    return {c: d + estimate_overhead(cfg) for (c, cfg), d in zip(cfgs.items(), densities)}


def selection_densities(s: _Session, layer: int, cfgs: Sequence[AttentionConfig]) -> List[float]:
    """The op's measured density of each config on the layer's q/k/v. PBS on the reference path
    computes the selections only (no attention), one estimate for all thresholds of the same
    other fields; that shortcut is checked against the op once."""
    if layer not in s.qkv:
        all_layer_qkv(s)
    q = s.qkv[layer][0]
    reference_path = q.device.type == "cpu" and s.backend in ("auto", "reference")
    if s.fast_density is False or not reference_path or any(cfg.method != "pbs" for cfg in cfgs):
        return [_op_density(s, layer, cfg) for cfg in cfgs]
    fast = _reference_pbs_densities(s, layer, cfgs)
    if s.fast_density is None:
        s.fast_density = fast[0] == _op_density(s, layer, cfgs[0])
        if not s.fast_density:
            logger.info(
                "sparseflow calibrate: the PBS reference selection does not give the op's density here; "
                "every choice's density comes from the op"
            )
            return [_op_density(s, layer, cfg) for cfg in cfgs]
    return fast


def _op_density(s: _Session, layer: int, cfg: AttentionConfig) -> float:
    from .ops import attention
    from .recording import capture

    q, k, v, scale = s.qkv[layer]
    with capture(keep_selections=False) as cap, torch.no_grad():
        attention(
            q, k, v, config=cfg, is_causal=True, scale=scale, backend=s.backend, tag=f"model.layers.{layer}.self_attn"
        )
    return _layer_density(cap, layer)


def _reference_pbs_densities(s: _Session, layer: int, cfgs: Sequence[AttentionConfig]) -> List[float]:
    """Selection densities of PBS configs by the reference, configs differing only in threshold
    sharing one permutation and one block estimate."""
    from .methods.pbs import reference as ref
    from .methods.pbs.tail import mark_tail

    q, k, _, scale = s.qkv[layer]
    groups: Dict[str, List[int]] = {}
    for i, cfg in enumerate(cfgs):
        groups.setdefault(json.dumps({**cfg.to_dict(), "threshold": None}, sort_keys=True, default=str), []).append(i)
    out: List[float] = [0.0] * len(cfgs)
    for idx in groups.values():
        cfg = cfgs[idx[0]]
        perm, masks = ref.pbs_selections(q, k, cfg, [cfgs[i].threshold for i in idx], is_causal=True, scale=scale)
        for i, mask in zip(idx, masks):
            mask = mark_tail(mask, cfg.dense_tail_blocks)  # as the op reports its selection
            density = ref.selection_density(mask, perm, is_causal=True, block_size=cfg.block_size)
            out[i] = float(density.float().mean())  # as Selection.mean_density
    return out


# --------------------------------------------------------------------------- progress file


class Progress:
    """Single-layer measurements (and whole-plan ones) kept in a JSON file, rewritten
    atomically after each one; a file made for other inputs (``key``) is started afresh."""

    def __init__(self, path: Optional[Path], key: str):
        self.path, self.key = path, key
        self.layers: Dict[str, Dict[str, float]] = {}
        self.plans: Dict[str, Dict[str, float]] = {}
        self.costs: Dict[str, float] = {}  # "layer:choice" -> the choice's cost, known before its KL
        if path is not None and path.is_file():
            self._read()

    def _read(self) -> None:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError) as exc:
            logger.warning("sparseflow calibrate: ignoring unreadable progress file %s: %s", self.path, exc)
            return
        if data.get("format") != PROGRESS_FORMAT or data.get("key") != self.key:
            logger.warning("sparseflow calibrate: progress file %s is for other inputs; starting afresh", self.path)
            return
        self.layers = dict(data.get("layers", {}))
        self.plans = dict(data.get("plans", {}))
        self.costs = dict(data.get("costs", {}))

    def save(self) -> None:
        if self.path is None:
            return
        write_json_atomic(
            self.path,
            {
                "format": PROGRESS_FORMAT,
                "key": self.key,
                "layers": self.layers,
                "plans": self.plans,
                "costs": self.costs,
            },
        )


def write_json_atomic(path: Path, payload) -> None:
    tmp = Path(f"{path}.tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(payload, indent=2) + "\n")
        os.replace(tmp, path)
    finally:  # an error mid-write leaves no partial file
        if tmp.exists():
            tmp.unlink()


def progress_key(s: _Session) -> str:
    """What the measurements depend on: weights, tokens, base config, backend, cost model. The
    choice grid is not part of it, so a rerun with more or fewer choices reuses what it shares."""
    from .eval.evaluate import _weights_fingerprint

    h = hashlib.sha256()
    h.update(_weights_fingerprint(s.model).encode())
    h.update(s.input_ids.to(torch.int64).cpu().numpy().tobytes())
    rope = getattr(s.model.config, "rope_parameters", None)
    h.update(
        json.dumps(
            [s.keep, s.method, s.base.to_dict(), s.backend, s.cost, str(rope)], sort_keys=True, default=str
        ).encode()
    )
    return h.hexdigest()[:24]


DENSE_MEASUREMENT = Measurement(kl=0.0, top1=1.0, density=1.0, cost=1.0)
Table = Dict[int, Dict[Choice, Measurement]]


def measure_all(s: _Session, choices: Sequence[Choice], progress: Progress, say: Callable[[str], None]) -> Table:
    """Every (layer, choice) single-layer measurement, from the progress file where present."""
    table = stored_measurements(s, choices, progress)
    todo = [(layer, c) for layer in range(s.n_layers) for c in s.layer_choices(layer, choices)]
    for i, (layer, choice) in enumerate(todo):
        if choice not in table[layer]:
            table[layer][choice] = measure_entry(s, layer, choice, progress, say, f"[{i + 1}/{len(todo)}]")
    return table


def stored_measurements(s: _Session, choices: Sequence[Choice], progress: Progress) -> Table:
    """Dense, and the measurements of ``choices`` the progress file holds, per layer."""
    table: Table = {}
    for layer in range(s.n_layers):
        table[layer] = {DENSE: DENSE_MEASUREMENT}
        for choice in s.layer_choices(layer, choices):
            got = progress.layers.get(f"{layer}:{choice.key}")
            if got is not None:
                table[layer][choice] = Measurement(**got)
    return table


def measure_entry(
    s: _Session,
    layer: int,
    choice: Choice,
    progress: Progress,
    say: Callable[[str], None],
    label: str,
    cost: Optional[float] = None,
) -> Measurement:
    """One single-layer measurement, kept in the progress file at once."""
    t0 = time.perf_counter()
    m = measure_layer(s, layer, choice, cost=cost)
    progress.layers[f"{layer}:{choice.key}"] = m.to_dict()
    progress.save()
    say(
        f"{label} layer {layer} {choice.key}: KL {m.kl:.5f}, top-1 {m.top1:.3f}, "
        f"density {m.density:.3f}, cost {m.cost:.3f} ({time.perf_counter() - t0:.1f} s)"
    )
    return m


# --------------------------------------------------------------------------- measuring only what the search needs


@dataclass
class LazyGrid:
    """The choice grid measured on demand: every choice's cost is known first (its selection's
    density, or its time), and :meth:`settle` measures only the choices that could change the
    greedy walk at an allowed KL sum (see :func:`unsettled`), so the plan is the one the whole
    grid gives."""

    s: _Session
    choices: List[Choice]
    progress: Progress
    say: Callable[[str], None]
    table: Table = field(default_factory=dict)
    costs: Dict[int, Dict[Choice, float]] = field(default_factory=dict)
    measured: int = 0  # measurements made by this process

    def __post_init__(self):
        self.table = stored_measurements(self.s, self.choices, self.progress)
        self.costs = choice_costs(self.s, self.choices, self.progress, self.say)

    def settle(self, allowed: float) -> None:
        while True:
            todo = unsettled(self.table, self.costs, allowed)
            if not todo:
                return
            for layer, choice in todo:
                self.measured += 1
                self.table[layer][choice] = measure_entry(
                    self.s,
                    layer,
                    choice,
                    self.progress,
                    self.say,
                    f"[measured {self.measured}]",
                    self.costs[layer][choice],
                )

    def skipped(self) -> List[Dict[str, Any]]:
        """The choices never measured, each with its cost and why the plan cannot need it."""
        out = []
        for layer, costs in self.costs.items():
            for choice, cost in costs.items():
                if choice not in self.table[layer]:
                    out.append({"layer": layer, "choice": choice.key, "cost": cost, "reason": skip_reason(cost)})
        return out


def skip_reason(cost: float) -> str:
    if cost >= DENSE_MEASUREMENT.cost:
        return "dominated by dense: costs at least as much, and dense has KL 0"
    return (
        "cannot change the plan: even at KL 0 its KL reduction per added cost stays below the upgrade "
        "the greedy walk takes at every step"
    )


def choice_costs(
    s: _Session, choices: Sequence[Choice], progress: Progress, say: Callable[[str], None]
) -> Dict[int, Dict[Choice, float]]:
    """Every (layer, choice) cost (:func:`choice_cost`), from the progress file where present."""
    t0 = time.perf_counter()
    missing = {
        layer: [c for c in s.layer_choices(layer, choices) if f"{layer}:{c.key}" not in progress.costs]
        for layer in range(s.n_layers)
    }

    def fill(layer: int) -> None:
        if missing[layer]:
            t_layer = time.perf_counter()
            progress.costs.update({f"{layer}:{c.key}": v for c, v in layer_costs(s, layer, missing[layer]).items()})
            progress.save()
            say(
                f"costs: layer {layer + 1}/{s.n_layers}, {len(missing[layer])} choice(s)"
                f" ({time.perf_counter() - t_layer:.1f} s)"
            )

    if s.cost == "density" and any(missing.values()):
        each_layer_qkv(s, lambda layer, qkv: _with_qkv(s, layer, qkv, fill))  # one layer's q/k/v alive at a time
    else:
        for layer in range(s.n_layers):
            fill(layer)
    say(f"costs of {_grid_size(s, choices)} choice(s) ({time.perf_counter() - t0:.1f} s)")
    return {
        layer: {c: float(progress.costs[f"{layer}:{c.key}"]) for c in s.layer_choices(layer, choices)}
        for layer in range(s.n_layers)
    }


def _grid_size(s: _Session, choices: Sequence[Choice]) -> int:
    return sum(len(s.layer_choices(layer, choices)) for layer in range(s.n_layers))


def _with_qkv(s: _Session, layer: int, qkv: Tuple, fn: Callable[[int], None]) -> None:
    s.qkv[layer] = qkv
    try:
        fn(layer)
    finally:
        del s.qkv[layer]


def greedy_steps(table: Mapping[int, Mapping[Choice, Measurement]], allowed: float):
    """:func:`greedy_plan`'s walk: ``(picks, steps)``, a step being (every layer's current
    option before it, the KL reduction per added cost of the upgrade it takes)."""
    fronts = {layer: frontier(opts) for layer, opts in table.items()}
    pick = {layer: 0 for layer in fronts}
    total = sum(f[0][1].kl for f in fronts.values())
    steps: List[Tuple[Dict[int, Measurement], float]] = []
    while total > allowed:
        best = None
        for layer, f in sorted(fronts.items()):
            cur = f[pick[layer]][1]
            for j in range(pick[layer] + 1, len(f)):
                gain = cur.kl - f[j][1].kl
                ratio = gain / max(f[j][1].cost - cur.cost, 1e-12)
                if best is None or ratio > best[0]:
                    best = (ratio, layer, j, gain)
        if best is None:
            break
        ratio, layer, j, gain = best
        steps.append(({i: fronts[i][pick[i]][1] for i in fronts}, ratio))
        pick[layer] = j
        total -= gain
    return [pick[layer] for layer in sorted(fronts)], steps


def unsettled(
    table: Mapping[int, Mapping[Choice, Measurement]], costs: Mapping[int, Mapping[Choice, float]], allowed: float
) -> List[Tuple[int, Choice]]:
    """The unmeasured (layer, choice) pairs that could make ``greedy_plan(table, allowed)`` differ
    from the whole grid's; none: it is the whole grid's plan. A choice can matter only where it
    could be a layer's cheapest option (the walk's start: its cost is the layer's lowest), or where,
    at some step of the walk, its best possible upgrade (to KL 0 from the layer's current option,
    at its known cost) is at least as good per added cost as the upgrade taken there: otherwise
    every step takes the same upgrade with or without it. Choices costing at least dense's 1.0 never
    matter (dense is on the frontier with KL 0). Returns those of the earliest step that has any
    (the later steps may change once they are measured)."""
    open_ = {
        layer: [(c, cost) for c, cost in opts.items() if c not in table[layer] and cost < DENSE_MEASUREMENT.cost]
        for layer, opts in costs.items()
    }
    if not any(open_.values()):
        return []
    cheapest = {
        layer: min(min(m.cost for m in table[layer].values()), min((cost for _, cost in opts), default=1.0))
        for layer, opts in open_.items()
    }
    hits = [(layer, c) for layer, opts in open_.items() for c, cost in opts if cost <= cheapest[layer]]
    if hits:
        return hits
    for cur, ratio in greedy_steps(table, allowed)[1]:
        hits = [
            (layer, c)
            for layer, opts in open_.items()
            for c, cost in opts
            if cost > cur[layer].cost and cur[layer].kl / max(cost - cur[layer].cost, 1e-12) >= ratio
        ]
        if hits:
            return hits
    return []


# --------------------------------------------------------------------------- the search


def frontier(options: Mapping[Choice, Measurement]) -> List[Tuple[Choice, Measurement]]:
    """The layer's options no other beats in both cost and KL, cheapest first (dense last). Dense
    wins an exact tie, so a choice at dense's cost and KL never matters (see :func:`unsettled`)."""
    ordered = sorted(options.items(), key=lambda cm: (cm[1].cost, cm[1].kl, not cm[0].dense, cm[0].key))
    out: List[Tuple[Choice, Measurement]] = []
    for c, m in ordered:
        if not out or m.kl < out[-1][1].kl:
            out.append((c, m))
    return out


def greedy_plan(table: Mapping[int, Mapping[Choice, Measurement]], allowed: float) -> List[int]:
    """Per layer, the index into its :func:`frontier`: start from the cheapest option everywhere
    and take the upgrade with the best KL reduction per added cost until the single-layer KLs
    sum to at most ``allowed``. Deterministic, and the upgrade sequence does not depend on
    ``allowed``: a larger ``allowed`` stops earlier on the same walk."""
    return greedy_steps(table, allowed)[0]


def _chosen(table, picks) -> List[Tuple[Choice, Measurement]]:
    return [frontier(table[layer])[j] for layer, j in enumerate(picks)]


def plan_of_choices(s: _Session, chosen: Sequence[Choice]):
    configs = {i: c.config(s.base) for i, c in enumerate(chosen) if not c.dense}
    return _plan(s, configs, [i for i, c in enumerate(chosen) if c.dense])


def measure_plan(
    s: _Session, plan, input_ids: Optional[torch.Tensor] = None, dense: Optional[torch.Tensor] = None
) -> Dict[str, Any]:
    """Whole-model fidelity and density of ``plan`` (calibration text unless given)."""
    from .eval.evaluate import evaluate_plans

    ids = s.input_ids if input_ids is None else input_ids
    r = evaluate_plans(s.model, ids, [plan], eval_positions=s.keep, dense=s.dense if dense is None else dense)[0]
    return {
        "mean_kl": r.fidelity.mean_kl,
        "p99_kl": r.fidelity.p99_kl,
        "top1": r.fidelity.top1_agreement,
        "ppl_dense": r.fidelity.ppl_dense,
        "ppl_sparse": r.fidelity.ppl_sparse,
        "density": r.density,
        "density_per_layer": r.density_per_layer,
        "tokens": int(ids.shape[1]),
        "positions": s.keep,
    }


GROW_BELOW = 0.8  # a passing plan this far under the budget leaves room for a cheaper one


def search(
    s: _Session,
    table,
    budget: float,
    *,
    safety: float,
    progress: Progress,
    say: Callable[[str], None],
    max_rounds: int = 8,
    settle: Optional[Callable[[float], None]] = None,
) -> Tuple[List[Choice], Dict[str, Any], float, List[Dict[str, Any]]]:
    """The cheapest plan found on the greedy walk whose measured whole-model KL is within
    ``budget`` (all-dense at worst). Returns (choices per layer, its calibration fidelity,
    predicted cost, the steps taken). The walk is one family of plans, cheaper as the allowed
    single-layer KL sum grows; the sum predicts the measured KL only roughly (layers interact, and
    in bf16 every sparse layer adds a rounding floor), so each measurement corrects the allowed
    sum (:func:`_next_allowed`): shrunk while the plan is over budget, grown while it is under
    ``GROW_BELOW`` of it, bisected once a plan on each side is known. ``settle(allowed)``: fills
    ``table`` with what the walk at ``allowed`` needs (:meth:`LazyGrid.settle`) before each round."""
    allowed = budget * safety
    steps: List[Dict[str, Any]] = []
    best: Optional[Tuple[float, List[Choice], Dict[str, Any]]] = None  # (cost, choices, fidelity)
    bounds = _Bracket()
    seen: Dict[Tuple[str, ...], Tuple[float, float]] = {}  # plan -> (predicted, measured KL)
    for _ in range(max_rounds):
        if settle is not None:
            settle(allowed)
        picks = greedy_plan(table, allowed)
        chosen = _chosen(table, picks)
        choices = [c for c, _ in chosen]
        key = tuple(c.key for c in choices)
        if key not in seen:
            predicted = sum(m.kl for _, m in chosen)
            fid = _measured_plan(s, choices, progress)
            cost = sum(m.cost for _, m in chosen) / len(chosen)
            seen[key] = (predicted, fid["mean_kl"])
            steps.append({"allowed": allowed, "predicted_kl": predicted, "measured_kl": fid["mean_kl"], "cost": cost})
            say(
                f"plan at allowed KL sum {allowed:.5f}: predicted {predicted:.5f}, measured {fid['mean_kl']:.5f}, "
                f"cost {cost:.3f}, {sum(c.dense for i, c in enumerate(choices) if i not in s.windows)} dense layer(s)"
            )
            if fid["mean_kl"] <= budget and (best is None or cost < best[0]):
                best = (cost, choices, fid)
        predicted, measured = seen[key]
        bounds.add(allowed, measured <= budget)
        cheapest = all(j == 0 for j in picks)  # the walk's first plan: nothing cheaper to try
        allowed = _next_allowed(allowed, predicted, measured, budget, safety, bounds, cheapest)
        if allowed is None:
            break
    if best is not None:
        return best[1], best[2], best[0], steps
    chosen = [DENSE] * s.n_layers
    say(f"no plan on the walk met KL <= {budget} within {max_rounds} rounds: every layer dense")
    return chosen, _measured_plan(s, chosen, progress), 1.0, steps


@dataclass
class _Bracket:
    """The largest allowed sum whose plan fit the budget, and the smallest whose plan did not."""

    fits: Optional[float] = None
    over: Optional[float] = None

    def add(self, allowed: float, fits: bool) -> None:
        if fits:
            self.fits = allowed if self.fits is None else max(self.fits, allowed)
        else:
            self.over = allowed if self.over is None else min(self.over, allowed)


def _next_allowed(
    allowed: float,
    predicted: float,
    measured: float,
    budget: float,
    safety: float,
    bounds: _Bracket,
    cheapest: bool,
) -> Optional[float]:
    """The allowed single-layer KL sum of :func:`search`'s next round, after the plan at
    ``allowed`` predicted ``predicted`` and measured ``measured``; None: stop."""
    if measured <= budget and (measured >= GROW_BELOW * budget or cheapest):
        return None  # close enough to the budget, or the walk has no cheaper plan
    if bounds.fits is not None and bounds.over is not None:
        if bounds.over <= bounds.fits * 1.01:
            return None  # the bracket has closed
        return math.sqrt(bounds.fits * bounds.over)
    if measured <= budget:  # grow by the headroom the measurement shows, at most 4x a round
        return allowed * min(4.0, max(1.25, safety * budget / max(measured, 1e-12)))
    if predicted <= 0.0:
        return None
    # shrink by the measured/predicted ratio, and at least a little, so each round moves
    return min(allowed * 0.9, predicted * budget / measured * safety)


def _measured_plan(s: _Session, chosen: Sequence[Choice], progress: Progress) -> Dict[str, Any]:
    key = "|".join(c.key for c in chosen)
    if key not in progress.plans:
        progress.plans[key] = measure_plan(s, plan_of_choices(s, chosen))
        progress.save()
    return progress.plans[key]


# --------------------------------------------------------------------------- the recipe


def _changes_from_base(base: AttentionConfig, cfg: AttentionConfig) -> Dict[str, Any]:
    b, c = base.to_dict(), cfg.to_dict()
    return {k: v for k, v in c.items() if k not in ("method", "version") and b.get(k) != v}


def _common_config(s: _Session, chosen: Sequence[Choice]) -> AttentionConfig:
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


def build_recipe(s: _Session, chosen: Sequence[Choice], *, name: str, measured: Dict[str, Any]):
    from .recipes import Recipe

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
        f"of {measured['text']} (measured {measured['calibration']['mean_kl']:.5f}, density "
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


def _windowed_note(s: _Session) -> str:
    if not s.windows:
        return ""
    return f" ({len(s.windows)} windowed layers run their local window exactly)"


# --------------------------------------------------------------------------- entry point


def check_budget(budget) -> float:
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not (0.0 < float(budget) < math.inf):
        raise ValueError(f"kl_budget must be a positive, finite number of nats (e.g. 0.01), got {budget!r}")
    return float(budget)


def _default_cost(cost: str) -> str:
    if cost == "auto":
        return "time" if torch.cuda.is_available() else "density"
    if cost not in ("density", "time"):
        raise ValueError(f"cost must be auto, density or time, got {cost!r}")
    return cost


def calibrate(
    model,
    input_ids: torch.Tensor,
    method: str,
    kl_budget: float,
    *,
    base: Optional[AttentionConfig] = None,
    eval_positions: int = 512,
    heldout_ids: Optional[torch.Tensor] = None,
    choices: Optional[Sequence[Choice]] = None,
    safety: float = 0.8,
    margin: float = DEFAULT_MARGIN,
    cost: str = "auto",
    backend: str = "auto",
    progress_path=None,
    cache_dir=None,
    name: Optional[str] = None,
    text: str = "",
    heldout_text: str = "",
    say: Optional[Callable[[str], None]] = None,
    extra: Optional[Dict[str, Any]] = None,
    prune: bool = True,
) -> CalibrationResult:
    """Calibrate a per-layer plan of ``method`` for a transformers causal LM (see the module
    docstring). ``input_ids``: ``[1, N]`` calibration tokens, fidelity over the last
    ``eval_positions`` predictions; ``heldout_ids``: tokens the plan is checked on afterwards.
    ``progress_path``: the JSON file single-layer results are kept in (resume). ``prune``:
    measure only the choices the search can need (:class:`LazyGrid`; the same plan), else all.
    ``margin``: the share of ``kl_budget`` the plan may use on the calibration text."""
    from .eval.evaluate import dense_logits

    budget = check_budget(kl_budget)
    n = input_ids.shape[1]
    base = _checked_base(method, base, safety, eval_positions, n)
    _check_share(margin, "margin")
    say = say or (lambda msg: None)
    choices = list(choices) if choices is not None else candidate_choices(method, base)
    model.set_attn_implementation("sdpa")
    say(f"dense pass: logits of the last {eval_positions} positions and every layer's input ({n} tokens)")
    t_dense = time.perf_counter()
    s = _Session(
        model=model,
        input_ids=input_ids,
        keep=eval_positions,
        method=method,
        base=base,
        backend=backend,
        cost=_default_cost(cost),
        dense=dense_logits(model, input_ids, eval_positions, cache_dir=cache_dir),
        windows=local_windows(model.config),
    )
    if s.windows:
        say(f"{len(s.windows)} windowed layer(s) run their local window exactly, not calibrated: {sorted(s.windows)}")
    s.hidden = layer_inputs(model, input_ids)
    say(f"dense pass done ({time.perf_counter() - t_dense:.1f} s)")
    progress = Progress(None if progress_path is None else Path(progress_path), progress_key(s))
    grid = LazyGrid(s, choices, progress, say) if prune else None
    table = grid.table if grid is not None else measure_all(s, choices, progress, say)
    chosen, calib, pred_cost, steps = search(
        s,
        table,
        budget * margin,
        safety=safety,
        progress=progress,
        say=say,
        settle=None if grid is None else grid.settle,
    )
    single = single_layer_report(s, choices, table, grid)
    say(single["summary"])
    heldout = None
    if heldout_ids is not None:
        say(f"held-out check on {heldout_ids.shape[1]} tokens")
        ho_dense = dense_logits(model, heldout_ids, eval_positions, cache_dir=cache_dir)
        heldout = measure_plan(s, plan_of_choices(s, chosen), input_ids=heldout_ids, dense=ho_dense)
    measured = {
        "budget": budget,
        "method": method,
        "text": text,
        "heldout_text": heldout_text,
        "cost_model": s.cost,
        # the dtype every KL and time above was measured in (a plan's fidelity is that dtype's)
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "device": str(next(model.parameters()).device),
        "backend": backend,
        "safety": safety,
        "margin": margin,
        "calibration_target": budget * margin,
        "calibration": calib,
        "heldout": heldout,
        "predicted_cost": pred_cost,
        "search": steps,
        "per_layer": [{"layer": i, "choice": c.key, **table[i][c].to_dict()} for i, c in enumerate(chosen)],
        "single_layer": single,
        "windowed_layers": {str(i): {"sliding_window": w, "chunk_size": c} for i, (w, c) in sorted(s.windows.items())},
        **(extra or {}),
    }
    rname = name or f"calibrated-{model.config.model_type}-{method}"
    recipe = build_recipe(s, chosen, name=rname, measured=measured)
    return CalibrationResult(
        recipe=recipe, choices=chosen, calibration=calib, heldout=heldout, predicted_cost=pred_cost, steps=steps
    )


def _check_share(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0.0 < value <= 1.0):
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")


def _checked_base(
    method: str, base: Optional[AttentionConfig], safety: float, eval_positions: int, n: int
) -> AttentionConfig:
    """The base config of ``method`` (its default when None), after checking the arguments."""
    _sparse_spec(method, "method")
    _check_share(safety, "safety")
    if not (1 <= eval_positions < n):
        raise ValueError(f"eval_positions must be in [1, {n - 1}], got {eval_positions}")
    base = base or default_config(method)
    if base.method != method:
        raise ValueError(f"base config is for {base.method!r}, not {method!r}")
    return base


def single_layer_report(
    s: _Session, choices: Sequence[Choice], table: Table, grid: Optional[LazyGrid]
) -> Dict[str, Any]:
    """How many of the grid's single-layer choices were measured, and which were skipped and why."""
    total = _grid_size(s, choices)
    skipped = [] if grid is None else grid.skipped()
    reasons: Dict[str, int] = {}
    for row in skipped:
        reasons[row["reason"]] = reasons.get(row["reason"], 0) + 1
    summary = f"measured {total - len(skipped)} of {total} single-layer choice(s)"
    if skipped:
        summary += "; skipped " + "; ".join(f"{n} ({why})" for why, n in reasons.items())
    return {
        "grid": total,
        "measured": total - len(skipped),
        "pruned": grid is not None,
        "skipped_reasons": reasons,
        "skipped": skipped,
        "summary": summary,
    }


# --------------------------------------------------------------------------- files (the command)


def side_paths(out) -> Tuple[Path, Path]:
    """(progress file, dense-logits cache folder) kept next to the recipe file ``out``."""
    out = Path(out).expanduser()
    return out.with_name(out.name + ".progress.json"), out.with_name(out.name + ".cache")


def parse_values(text: Optional[str], kind, arg: str) -> Optional[Tuple]:
    """A comma list of ``kind`` values from the command line (None when not given)."""
    if text is None:
        return None
    try:
        out = tuple(kind(x.strip()) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{arg} must be a comma list of {kind.__name__} values, got {text!r}") from None
    if not out:
        raise ValueError(f"{arg} must name at least one value, got {text!r}")
    return out


def _tokens(tok, n: int, text: str, arg: str):
    from .checkpoints import real_tokens

    try:
        return real_tokens(tok, n, text=text)
    except ValueError as exc:
        longer = " (stdlib_source is the longest code text)" if text != "stdlib_source" else ""
        raise ValueError(f"{arg}: {exc}; pick a longer text{longer} or fewer --tokens") from None


def calibrate_file(
    model_path,
    out,
    *,
    method: str,
    kl_budget: float,
    tokens: int = 2048,
    eval_positions: int = 512,
    text: str = "pydoc_topics",
    heldout_text: Optional[str] = "argparse_source",
    config=None,
    thresholds=None,
    top_ks=None,
    scorings=None,
    safety: float = 0.8,
    margin: float = DEFAULT_MARGIN,
    cost: str = "auto",
    backend: str = "auto",
    dtype: str = "auto",
    tokenizer=None,
    rope_scaling=None,
    cache_dir=None,
    name: Optional[str] = None,
    say: Optional[Callable[[str], None]] = None,
    device=None,
    prune: bool = True,
) -> CalibrationResult:
    """``sparseflow calibrate``: load ``model_path`` (HF folder, GGUF file or converted folder, run
    dense), calibrate on ``tokens`` tokens of ``text``, check on ``heldout_text`` and write the
    recipe to ``out`` atomically. Everything checkable is checked before the weights load.
    ``device``: where the model runs (None: where it loads, the CPU). ``prune``: see :func:`calibrate`."""
    from .convert import _load_config, _parse_config, check_architecture, resolve_source

    budget = check_budget(kl_budget)
    _check_share(safety, "safety")
    _check_share(margin, "margin")
    _check_file_args(method, text, heldout_text, rope_scaling)
    source = resolve_source(model_path)
    model_config = _load_config(source)
    check_architecture(model_config)  # calibrate runs the plans through the attention interface as well
    base = _parse_config(method, config) or default_config(method)
    choices = candidate_choices(method, base, thresholds=thresholds, top_ks=top_ks, scorings=scorings)
    progress_path, default_cache = side_paths(out)
    say = say or (lambda msg: None)
    model, tok, rope_info = _load_model(source, model_path, dtype, device, tokenizer, rope_scaling, say)
    ids, heldout = _calibration_tokens(model, tok, tokens, text, heldout_text)
    say(
        f"{len(choices)} choice(s) + dense for each of {model.config.num_hidden_layers} layers; "
        f"{tokens} tokens of {text}, KL over the last {eval_positions} positions; progress in {progress_path}"
    )
    t0 = time.perf_counter()
    result = calibrate(
        model,
        ids,
        method,
        budget,
        base=base,
        eval_positions=eval_positions,
        heldout_ids=heldout,
        choices=choices,
        safety=safety,
        margin=margin,
        cost=cost,
        backend=backend,
        progress_path=progress_path,
        cache_dir=cache_dir if cache_dir is not None else default_cache,
        name=name,
        text=text,
        heldout_text=heldout_text or "",
        say=say,
        prune=prune,
        extra={
            "model": str(source),
            "rope_scaling": rope_info,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
        },
    )
    seconds = time.perf_counter() - t0
    recipe = dataclasses.replace(result.recipe, measured={**result.recipe.measured, "seconds": seconds})
    recipe.save(out)
    result.recipe = recipe
    say(_summary(result, out, seconds))
    return result


def _check_file_args(method: str, text: str, heldout_text: Optional[str], rope_scaling) -> None:
    """The command's checks that need no file: method, texts, RoPE scaling."""
    from .checkpoints import TEXTS
    from .rope import parse_rope_scaling

    _sparse_spec(method, "--method")
    for arg, t in (("--text", text), ("--heldout-text", heldout_text)):
        if t is not None and t not in TEXTS:
            raise ValueError(f"{arg} must be one of {sorted(TEXTS)}, got {t!r}")
    if heldout_text is not None and heldout_text == text:
        raise ValueError(f"--heldout-text {heldout_text!r} is the calibration text: pick the other text, or none")
    try:
        parse_rope_scaling(rope_scaling)
    except ValueError as exc:
        raise ValueError(f"--rope-scaling: {exc}") from None


def _load_model(source, model_path, dtype: str, device, tokenizer, rope_scaling, say: Callable[[str], None]):
    """``(model, tokenizer, RoPE scaling applied)`` of a resolved source."""
    from .convert import load_source
    from .rope import set_rope_scaling

    say(f"loading {source} ...")
    model, tok = load_source(source, dtype=dtype, device=device)
    say(f"weights in {next(model.parameters()).dtype} on {device or 'cpu'}")
    if device is not None:
        model.to(device)
    if tokenizer is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(tokenizer))
    if tok is None:
        raise ValueError(f"{model_path} has no tokenizer; pass --tokenizer PATH")
    rope_info = None if rope_scaling is None else set_rope_scaling(model, rope_scaling)
    return model, tok, rope_info


def _calibration_tokens(model, tok, tokens: int, text: str, heldout_text: Optional[str]):
    """``(calibration ids, held-out ids or None)`` on the model's device."""
    from .eval.evaluate import model_device

    on = model_device(model)
    ids = _tokens(tok, tokens, text, "--tokens").to(on)
    heldout = None if heldout_text is None else _tokens(tok, tokens, heldout_text, "--tokens (held-out text)").to(on)
    return ids, heldout


def _summary(result: CalibrationResult, out, seconds: float) -> str:
    c, h = result.calibration, result.heldout
    line = (
        f"wrote {out} in {seconds:.0f} s: {len(result.recipe.dense_layers)} dense layer(s); calibration KL "
        f"{c['mean_kl']:.5f}, top-1 {c['top1']:.3f}, density {c['density']:.3f}"
    )
    if h is not None:
        line += f"; held-out KL {h['mean_kl']:.5f}, top-1 {h['top1']:.3f}, density {h['density']:.3f}"
    single = result.recipe.measured.get("single_layer")
    if single:
        line += f"; {single['summary']}"
    return line
