"""Fidelity and density of each method on a causal LM, against the same model run dense."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from ..config import AttentionConfig, default_config
from ..hf import local_windows
from ..methods import sparse_names
from .fidelity import Fidelity, compare_logits
from ..recording import capture

__all__ = [
    "MethodResult",
    "PlanResult",
    "evaluate_methods",
    "evaluate_plans",
    "dense_logits",
    "format_results",
    "last_logits",
    "layer_of_tag",
    "model_device",
    "weights_fingerprint",
]


@dataclass
class MethodResult:
    method: str
    config: Dict
    fidelity: Fidelity
    density: float  # mean over sparse calls of computed / causally visible blocks
    sparse_calls: int
    dense_calls: int
    fallback_reasons: List[str] = field(default_factory=list)
    rewritten: int = 0
    skipped: int = 0
    seconds: float = 0.0

    def to_dict(self) -> Dict:
        return {
            "method": self.method,
            "config": self.config,
            **self.fidelity.to_dict(),
            "density": self.density,
            "sparse_calls": self.sparse_calls,
            "dense_calls": self.dense_calls,
            "fallback_reasons": self.fallback_reasons,
            "rewritten": self.rewritten,
            "skipped": self.skipped,
            "seconds": self.seconds,
        }


def model_device(model: torch.nn.Module) -> torch.device:
    """The device ``model``'s weights are on (where its inputs must go)."""
    return next(model.parameters()).device


def last_logits(model, input_ids: torch.Tensor, keep: int) -> torch.Tensor:
    """``[keep, V]`` fp32 logits of ``model`` as it runs now for the last ``keep`` next-token
    predictions of ``input_ids`` (uncached; see :func:`dense_logits`)."""
    with torch.no_grad():
        out = model(input_ids=input_ids, use_cache=False, logits_to_keep=keep + 1)
    # [keep, V]: predictions for the last `keep` targets, on the CPU whatever the model's device,
    # like the cached dense logits they are compared with
    return out.logits[0, :-1].float().cpu()


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A short key of ``model``'s weights for caches of what they compute (dense logits,
    calibration progress)."""
    # Cheap identity of the weights: name, dtype, sizes and exact sums of a few tensors. A cache
    # hit on different weights would silently report a wrong KL, so sums of the first and last
    # tensors (embedding and final norm / head) are part of the key, not just the model's name.
    import hashlib

    params = list(model.state_dict().items())
    h = hashlib.sha256()
    h.update(str(getattr(model.config, "name_or_path", "")).encode())
    h.update(str(sum(p.numel() for _, p in params)).encode())
    for name, p in params[:2] + params[-2:]:
        h.update(f"{name}:{p.dtype}:{tuple(p.shape)}:{float(p.double().sum()):.10e}".encode())
    return h.hexdigest()[:16]


def dense_logits(model: torch.nn.Module, input_ids: torch.Tensor, keep: int, cache_dir=None) -> torch.Tensor:
    """``[keep, V]`` fp32 logits of ``model`` run dense (as loaded) for the last ``keep`` next-token
    predictions of ``input_ids``. With ``cache_dir`` they are stored there under a key of the
    weights and the tokens, so sweeps and repeated evals on the same text pay the dense pass once."""
    import hashlib
    import os

    if cache_dir is None:
        return last_logits(model, input_ids, keep)
    key = hashlib.sha256()
    key.update(weights_fingerprint(model).encode())
    key.update(input_ids.to(torch.int64).cpu().numpy().tobytes())
    key.update(f"keep={keep}:impl={getattr(model.config, '_attn_implementation', '')}".encode())
    rope = getattr(model.config, "rope_parameters", None)
    if isinstance(rope, dict) and rope.get("rope_type", "default") != "default":  # a scaled RoPE has other logits
        key.update(f":rope={sorted((k, str(v)) for k, v in rope.items())}".encode())
    path = os.path.join(os.fspath(cache_dir), f"dense_logits_{key.hexdigest()[:24]}.pt")
    if os.path.isfile(path):
        return torch.load(path, map_location="cpu", weights_only=True)
    logits = last_logits(model, input_ids, keep)
    os.makedirs(os.fspath(cache_dir), exist_ok=True)
    tmp = path + f".tmp{os.getpid()}"
    torch.save(logits, tmp)
    os.replace(tmp, path)  # atomic: a killed run never leaves a truncated cache entry
    return logits


def evaluate_methods(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    methods: Optional[Sequence[str]] = None,
    configs: Optional[Dict[str, AttentionConfig]] = None,
    *,
    eval_positions: int = 512,
    backend: str = "auto",
) -> List[MethodResult]:
    """Compare each method with the dense model on the last ``eval_positions`` next-token
    predictions of ``input_ids`` ([1, N]). The model is copied per method; it is not changed.
    ``methods``: default every sparse method of the registry (:func:`sparseflow.methods.sparse_names`)."""
    from ..api import compile as sf_compile, report as sf_report

    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, N], got {tuple(input_ids.shape)}")
    n = input_ids.shape[1]
    if not (1 <= eval_positions < n):
        raise ValueError(f"eval_positions must be in [1, {n - 1}], got {eval_positions}")
    methods = sparse_names() if methods is None else methods
    configs = dict(configs or {})
    targets = input_ids[0, n - eval_positions :].cpu()
    dense = last_logits(model, input_ids, eval_positions)
    results = []
    for method in methods:
        cfg = configs.get(method) or default_config(method)
        sparse_model = copy.deepcopy(model)
        sf_compile(
            sparse_model, method=method, config=cfg, backend=backend, inner_backend="eager", recipe=None
        )  # the config given, exactly: these rows are what it measures
        start = time.perf_counter()
        with capture(keep_selections=False) as cap:
            logits = last_logits(sparse_model, input_ids, eval_positions)
        seconds = time.perf_counter() - start
        rep = sf_report(sparse_model)
        sparse_calls = [c for c in cap.calls if c.sparse]
        results.append(
            MethodResult(
                method=method,
                config=cfg.to_dict(),
                fidelity=compare_logits(dense, logits, targets),
                density=cap.mean_density() if sparse_calls else 1.0,
                sparse_calls=len(sparse_calls),
                dense_calls=len(cap.calls) - len(sparse_calls),
                fallback_reasons=sorted({c.reason for c in cap.fallbacks() if c.reason}),
                rewritten=rep.num_rewritten,
                skipped=rep.num_skipped,
                seconds=seconds,
            )
        )
        del sparse_model
    return results


def format_results(results: Sequence[MethodResult]) -> str:
    head = f"{'method':<7} {'rewritten':>9} {'density':>8} {'mean KL':>9} {'p99 KL':>8} {'top-1':>7} {'ppl dense':>9} {'ppl sparse':>10} {'secs':>6}"
    lines = [head, "-" * len(head)]
    for r in results:
        f = r.fidelity
        lines.append(
            f"{r.method:<7} {r.rewritten:>9} {r.density:>8.3f} {f.mean_kl:>9.4f} {f.p99_kl:>8.3f} "
            f"{f.top1_agreement:>7.3f} {f.ppl_dense:>9.3f} {f.ppl_sparse:>10.3f} {r.seconds:>6.1f}"
        )
        for reason in r.fallback_reasons:
            lines.append(f"        dense fallback: {reason}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- converted / HF models


@dataclass
class PlanResult(MethodResult):
    """A :class:`MethodResult` of a transformers model run with the ``"sparseflow"`` attention
    and a per-layer plan, with the density per layer and head (``None`` rows: layer not seen)."""

    plan: Dict = field(default_factory=dict)
    density_per_layer: List[Optional[float]] = field(default_factory=list)
    density_per_layer_head: List[Optional[List[float]]] = field(default_factory=list)
    # what each layer ran: its method, "in window W" / "in chunk C" for a windowed layer (its density
    # is then the share of its window's blocks), "dense fallback" when a call ran dense ("" unseen)
    layer_kinds: List[str] = field(default_factory=list)
    tokens: int = 0
    # one head's selection as a [query block, original key block] map (plots only, not in JSON)
    block_map: Optional[torch.Tensor] = None
    map_at: Optional[tuple] = None  # (layer, head)

    def to_dict(self) -> Dict:
        return {
            **super().to_dict(),
            "plan": self.plan,
            "tokens": self.tokens,
            "density_per_layer": self.density_per_layer,
            "density_per_layer_head": self.density_per_layer_head,
            "layer_kinds": self.layer_kinds,
        }


def layer_of_tag(tag: str) -> Optional[int]:
    """The layer a recorded call's tag names: its first integer (``model.layers.3.self_attn`` -> 3)."""
    import re

    m = re.search(r"(\d+)", tag or "")
    return int(m.group(1)) if m else None


def evaluate_plans(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    plans,
    *,
    eval_positions: int = 512,
    dense: Optional[torch.Tensor] = None,
    cache_dir=None,
    map_at: Optional[tuple] = None,
    on_result=None,
) -> List[PlanResult]:
    """Compare a transformers causal LM run dense (SDPA) with the same weights run through the
    ``"sparseflow"`` attention under each :class:`sparseflow.hf.Plan` in ``plans``, on the last
    ``eval_positions`` next-token predictions of ``input_ids`` ([1, N]). The model is switched in
    place and left on SDPA.

    ``dense``: precomputed dense logits ([eval_positions, V]); otherwise computed (and cached in
    ``cache_dir`` when given, see :func:`dense_logits`). ``map_at=(layer, head)`` also records
    that head's selected-block map (:func:`sparseflow.eval.diagnostics.block_map`). ``on_result`` is
    called with each result as soon as it exists (long sweeps write their JSON as they go)."""
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, N], got {tuple(input_ids.shape)}")
    n = input_ids.shape[1]
    if not (1 <= eval_positions < n):
        raise ValueError(f"eval_positions must be in [1, {n - 1}], got {eval_positions}")
    n_layers = int(getattr(model.config, "num_hidden_layers", 0) or 0)
    n_heads = int(getattr(model.config, "num_attention_heads", 0) or 0)
    if map_at is not None:
        layer, head = map_at
        if not (0 <= int(layer) < n_layers) or not (0 <= int(head) < n_heads):
            raise ValueError(f"map_at must be (layer in [0, {n_layers - 1}], head in [0, {n_heads - 1}]), got {map_at}")
    model.set_attn_implementation("sdpa")
    if dense is None:
        dense = dense_logits(model, input_ids, eval_positions, cache_dir=cache_dir)
    elif tuple(dense.shape[:1]) != (eval_positions,):
        raise ValueError(f"dense must be [eval_positions={eval_positions}, V] logits, got {tuple(dense.shape)}")
    results: List[PlanResult] = []
    try:
        for plan in plans:
            results.append(_evaluate_plan(model, input_ids, plan, eval_positions, dense, map_at, n_layers, n_heads))
            if on_result is not None:
                on_result(results[-1])
    finally:
        model.set_attn_implementation("sdpa")
    return results


def _evaluate_plan(
    model,
    input_ids: torch.Tensor,
    plan,
    eval_positions: int,
    dense: torch.Tensor,
    map_at: Optional[tuple],
    n_layers: int,
    n_heads: int,
) -> PlanResult:
    """Run ``model`` under one plan (leaving it on SDPA) and compare its logits with ``dense``."""
    from ..hf import apply_plan

    n = input_ids.shape[1]
    targets = input_ids[0, n - eval_positions :].cpu()
    apply_plan(model, plan)
    start = time.perf_counter()
    with capture(keep_selections=map_at is not None) as cap:
        logits = last_logits(model, input_ids, eval_positions)
    seconds = time.perf_counter() - start
    model.set_attn_implementation("sdpa")
    per_layer, head_map = _densities_per_layer(cap.calls, n_layers, n_heads, map_at)
    sparse = [c for c in cap.calls if c.sparse]
    return PlanResult(
        method=plan.method,
        config=plan.config.to_dict(),
        fidelity=compare_logits(dense, logits, targets),
        density=cap.mean_density() if cap.calls else 1.0,
        sparse_calls=len(sparse),
        dense_calls=len(cap.calls) - len(sparse),
        fallback_reasons=sorted({c.reason for c in cap.fallbacks() if c.reason}),
        rewritten=len(cap.calls),
        skipped=0,
        seconds=seconds,
        plan=plan.to_dict(),
        density_per_layer=[None if r is None else float(sum(r) / len(r)) for r in per_layer],
        density_per_layer_head=per_layer,
        layer_kinds=_layer_kinds(cap.calls, n_layers, local_windows(model.config)),
        tokens=n,
        block_map=head_map,
        map_at=None if map_at is None else (int(map_at[0]), int(map_at[1])),
    )


def _densities_per_layer(calls, n_layers: int, n_heads: int, map_at: Optional[tuple]):
    """``(per_layer, head_map)``: each layer's density per head (None for a layer with no call;
    1.0 per head for a dense call), and the selected-block map of ``map_at=(layer, head)``."""
    from .diagnostics import block_map

    per_layer: List[Optional[List[float]]] = [None] * n_layers
    head_map = None
    for c in calls:
        layer = layer_of_tag(c.tag)
        if layer is None or layer >= n_layers:
            continue
        if map_at is not None and layer == int(map_at[0]) and c.selection is not None:
            head_map = block_map(c.selection, int(map_at[1]))
        if c.selection is not None:
            row = c.selection.density.float().mean(0).tolist()
        else:  # dense call: every visible block
            row = [1.0] * (c.q_shape[1] if len(c.q_shape) > 1 else n_heads)
        per_layer[layer] = [float(x) for x in row]
    return per_layer, head_map


def _layer_kinds(calls, n_layers: int, windows) -> List[str]:
    """Per layer, what its calls ran (see ``PlanResult.layer_kinds``)."""
    kinds = [""] * n_layers
    for c in calls:
        i = layer_of_tag(c.tag)
        if i is None or not 0 <= i < n_layers:
            continue
        sliding, chunk = windows.get(i, (0, 0))
        where = f" in window {sliding}" if sliding else f" in chunk {chunk}" if chunk else ""
        kind = f"{c.method}{where}" if c.sparse else "dense fallback"
        kinds[i] = kinds[i] if kinds[i] == "dense fallback" else kind
    return kinds


def format_density(result: PlanResult) -> str:
    """Density per layer (rows) and head (columns) as a text table, with what each layer ran."""
    rows = result.density_per_layer_head
    kinds = result.layer_kinds or [""] * len(rows)
    width = max((len(r) for r in rows if r), default=0)
    head = "layer " + " ".join(f"{'h' + str(h):>5}" for h in range(width)) + "   mean  ran"
    lines = [head]
    for i, r in enumerate(rows):
        if r is None:
            lines.append(f"{i:>5}  (not called)")
            continue
        kind = kinds[i] if i < len(kinds) else ""
        lines.append(f"{i:>5} " + " ".join(f"{x:>5.2f}" for x in r) + f"  {sum(r) / len(r):>5.3f}  {kind}")
    return "\n".join(lines)
