"""Find scaled-dot-product attention in an FX graph and rewrite it into a sparseflow op.

Works on the two graph flavours a user can reach:

* **Dynamo graphs** (what ``torch.compile`` hands a backend, before AOT autograd): SDPA appears as
  ``torch._C._nn.scaled_dot_product_attention`` (== ``F.scaled_dot_product_attention``) with
  ``example_value`` fake tensors on the nodes; ``nn.MultiheadAttention`` appears as one opaque
  ``F.multi_head_attention_forward`` node (Dynamo keeps it in the graph), whose inner SDPA call we
  route to the op (see ``mha_forward_routed``).
* **Export graphs** (``torch.export`` after ``run_decompositions({})``): ``aten.scaled_dot_product_attention``
  and, where a graph was captured below the SDPA dispatcher, the backend-specific variants
  (``_scaled_dot_product_flash_attention_for_cpu``, ``_efficient_attention``, ``_flash_attention``,
  ``_cudnn_attention``, ``_attention_math``), with ``val`` fake tensors.

Every call found becomes one :class:`RewriteEntry`: rewritten, or skipped with the reason. A
call is never rewritten unless the fake tensors prove the op can take it (4-D, fp16/bf16/fp32,
no dropout, head counts compatible); the op itself still falls back to dense at run time for
what only the values can tell (masks it cannot fold, decode steps, short sequences), and records
that under ``sparseflow.capture()``.
"""

from __future__ import annotations

import contextvars
import inspect as _inspect
import logging
import operator
import re
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..config import AttentionConfig, DenseConfig
from ..masks import describe_mask
from ..methods import windowed
from ..ops import op_for, op_args
from ..recording import log_fallback
from ..tuning import DEFAULT_TUNING, Tuning
from .gqa_fold import _same, erase_dead_chain, fake_of, fold_kv
from .mask_proof import MaskProof, prove_mask

__all__ = [
    "RewriteOptions",
    "RewriteEntry",
    "rewrite_graph",
    "module_tag",
    "layer_index",
    "normalize_module_path",
    "SDPA_TARGETS",
    "mha_forward_routed",
]

logger = logging.getLogger("sparseflow")
aten = torch.ops.aten

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class _Target:
    name: str  # readable name for reports
    schema: Any  # torch._C.FunctionSchema used to bind args/kwargs (with defaults)
    returns_tuple: bool  # backend variants return (output, logsumexp, ...)
    mask_arg: Optional[str]  # name of the mask/bias argument, if the variant has one


def _build_targets() -> Dict[Any, _Target]:
    base = aten.scaled_dot_product_attention.default._schema
    targets: Dict[Any, _Target] = {
        torch._C._nn.scaled_dot_product_attention: _Target("F.scaled_dot_product_attention", base, False, "attn_mask"),
        F.scaled_dot_product_attention: _Target("F.scaled_dot_product_attention", base, False, "attn_mask"),
        aten.scaled_dot_product_attention.default: _Target(
            "aten.scaled_dot_product_attention", base, False, "attn_mask"
        ),
    }
    variants = {
        "_scaled_dot_product_flash_attention_for_cpu": "attn_mask",
        "_scaled_dot_product_efficient_attention": "attn_bias",
        "_scaled_dot_product_flash_attention": None,
        "_scaled_dot_product_cudnn_attention": "attn_bias",
        "_scaled_dot_product_attention_math": "attn_mask",
    }
    for name, mask_arg in variants.items():
        packet = getattr(aten, name, None)
        if packet is None or not hasattr(packet, "default"):
            continue
        targets[packet.default] = _Target(f"aten.{name}", packet.default._schema, True, mask_arg)
    return targets


SDPA_TARGETS: Dict[Any, _Target] = _build_targets()

# Fused paths that hide SDPA inside one kernel: reported as skipped, never rewritten.
_FUSED_TARGETS: Dict[Any, str] = {}
for _obj, _name in (
    (getattr(torch, "_transformer_encoder_layer_fwd", None), "torch._transformer_encoder_layer_fwd"),
    (getattr(torch, "_native_multi_head_attention", None), "torch._native_multi_head_attention"),
    (
        getattr(getattr(aten, "_transformer_encoder_layer_fwd", None), "default", None),
        "aten._transformer_encoder_layer_fwd",
    ),
    (
        getattr(getattr(aten, "_native_multi_head_attention", None), "default", None),
        "aten._native_multi_head_attention",
    ),
):
    if _obj is not None:
        _FUSED_TARGETS[_obj] = _name

_FASTPATH_REASON = (
    "{name}: the fused nn.TransformerEncoderLayer/nn.MultiheadAttention fast path (taken in eval mode "
    "without gradients) hides SDPA inside one kernel; disable it with "
    "torch.backends.mha.set_fastpath_enabled(False) or run with gradients enabled to rewrite this layer"
)


# --------------------------------------------------------------------------- options and entries


@dataclass(frozen=True)
class RewriteOptions:
    """What to rewrite into. ``layer_configs[i]`` overrides ``config`` for layer ``i`` (any method;
    ``None`` keeps that layer's SDPA untouched); ``skip_layers`` keeps those layers untouched;
    ``filter_fn(tag) -> bool`` keeps a call untouched when it returns False."""

    config: AttentionConfig
    backend: str = "auto"
    filter_fn: Optional[Callable[[str], bool]] = None
    skip_layers: frozenset = frozenset()
    layer_configs: Mapping[int, Optional[AttentionConfig]] = field(default_factory=dict)
    tuning: Tuning = DEFAULT_TUNING  # launch options of the Triton backends, carried by every op call
    # a sparseflow.ContextParallel: every call becomes context parallel, and a call the user keeps
    # as SDPA runs as the dense op instead (see passes/context_parallel_rewrite.py)
    context_parallel: Any = None

    def resolve(self, tag: str, layer: Optional[int]) -> Tuple[Optional[AttentionConfig], str]:
        cfg, why = self._resolve(tag, layer)
        if cfg is None and self.context_parallel is not None:
            return DenseConfig(), ""
        return cfg, why

    def _resolve(self, tag: str, layer: Optional[int]) -> Tuple[Optional[AttentionConfig], str]:
        if layer is not None and layer in self.skip_layers:
            return None, f"layer {layer} is in skip_layers"
        if layer is not None and layer in self.layer_configs and self.layer_configs[layer] is None:
            return None, f"layer_configs[{layer}] is None (SDPA kept)"
        if self.filter_fn is not None and not self.filter_fn(tag):
            return None, f"filter_fn({tag!r}) returned False"
        if layer is not None and layer in self.layer_configs:
            return self.layer_configs[layer], ""
        return self.config, ""


Shape = Tuple[Any, ...]


@dataclass
class RewriteEntry:
    """One attention call site found in a graph."""

    tag: str  # qualified module name, e.g. "model.layers.3.self_attn" ("" = the root module)
    layer: Optional[int]  # first integer path component of the tag
    rewritten: bool
    reason: str  # why it was skipped ("" when rewritten)
    method: Optional[str]  # the op it became (None when skipped)
    config: Optional[Dict[str, Any]]  # that op's config, as a dict
    target: str  # what the graph called ("F.scaled_dot_product_attention", "aten....", ...)
    graph: str  # "dynamo" or "export"
    site: int  # index of this call among the calls of the same tag in its graph
    q_shape: Optional[Shape] = None
    k_shape: Optional[Shape] = None  # as handed to the op (after the GQA fold)
    v_shape: Optional[Shape] = None
    gqa: str = ""  # "", "enable_gqa", "folded repeat xR", "broadcast", "K/V passed repeated"
    mask: str = "none"
    is_causal: Optional[bool] = None
    notes: List[str] = field(default_factory=list)
    graphs: int = 1  # how many compiled graphs held this call site with this decision
    # What the op did at run time, {dense reason: calls} with "" counting sparse calls (filled
    # while the model runs, shared by the entries of one tag and method: the op knows only those)
    runtime: Dict[str, int] = field(default_factory=dict)

    @property
    def dense_calls(self) -> Dict[str, int]:
        """{reason: calls} of the run-time calls that ran dense."""
        return {r: n for r, n in self.runtime.items() if r}

    @property
    def runs_dense(self) -> bool:
        """Rewritten, but every call seen at run time fell back to dense attention."""
        return self.rewritten and bool(self.runtime) and not self.runtime.get("", 0)

    @property
    def status(self) -> str:
        if not self.rewritten:
            return "skipped"
        dense = self.dense_calls
        if not dense:
            return "rewritten"
        n_dense, total = sum(dense.values()), sum(self.runtime.values())
        how = "runs dense at run time" if n_dense == total else f"ran dense in {n_dense} of {total} calls at run time"
        return f"rewritten ({how}: {_reasons(dense)})"

    def key(self) -> Tuple:
        """Deduplication key across recompiles: the same call site (tag + its index among that
        tag's calls in the graph) with the same decision is one entry."""
        return (self.graph, self.tag, self.site, self.target, self.rewritten, self.reason, self.method)


def _reasons(dense: Mapping[str, int], most: int = 2) -> str:
    ranked = sorted(dense, key=lambda r: -dense[r])
    text = "; ".join(ranked[:most])
    return text + (f"; and {len(ranked) - most} other reason(s)" if len(ranked) > most else "")


# --------------------------------------------------------------------------- tags


_ROOT_RE = re.compile(r"^(?:[LG]\[[^\]]*\](?:\[[^\]]*\])*|self)")


def normalize_module_path(path: str) -> str:
    """Dynamo writes module paths relative to frame locals (``L['self'].model.layers.0``,
    ``L['args'][0].h.1``, ``L['self']._modules['layers']._modules['0']``); export writes plain
    qualified names. Return the plain qualified name relative to the compiled module."""
    s = str(path)
    m = _ROOT_RE.match(s)
    if m:
        s = s[m.end() :]
    s = re.sub(r"\._modules\[['\"]([^'\"]+)['\"]\]", r".\1", s)
    s = re.sub(r"\[['\"]([^'\"]+)['\"]\]", r".\1", s)
    s = re.sub(r"\[(\d+)\]", r".\1", s)
    # getattr(L['self'].layers, '0') style
    while True:
        g = re.search(r"getattr\(([^,()]*), ['\"]([^'\"]+)['\"]\)", s)
        if not g:
            break
        inner = _ROOT_RE.sub("", g.group(1))
        s = s[: g.start()] + inner + "." + g.group(2) + s[g.end() :]
    return s.strip(".")


def module_tag(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1]
    path = path[0] if isinstance(path, (tuple, list)) else path
    return normalize_module_path(path)


_LAYER_RE = re.compile(r"(?:^|\.)(\d+)(?=\.|$)")


def layer_index(tag: str) -> Optional[int]:
    """The first integer component of a module path: ``model.layers.3.self_attn`` -> 3,
    ``transformer.h.0.attn`` -> 0, ``encoder.layer.11.attention.self`` -> 11."""
    m = _LAYER_RE.search(tag)
    return int(m.group(1)) if m else None


# --------------------------------------------------------------------------- helpers


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


def _shape(t: Optional[torch.Tensor]) -> Optional[Shape]:
    if t is None:
        return None
    return tuple(int(s) if isinstance(s, int) else str(s) for s in t.shape)


def _const_float(x) -> Optional[float]:
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
        if t.dtype not in _SUPPORTED_DTYPES:
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
        return f"k and v differ in heads or length (k={_shape(k)}, v={_shape(v)})"
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
        return describe_mask(_shape(mask_fake), mask_fake.dtype), ""
    return "", f"attn_mask of dtype {mask_fake.dtype}"


def _fake_output(op, args) -> Optional[torch.Tensor]:
    """The op's output as a fake tensor, for the new node's metadata."""
    fakes = [fake_of(a) if isinstance(a, fx.Node) else a for a in args]
    q = fakes[0]
    mode = getattr(q, "fake_mode", None)
    if mode is None:
        return None
    try:
        with mode:
            return op(*fakes)
    except Exception:  # metadata only: never fail the rewrite for it
        return None


# --------------------------------------------------------------------------- nn.MultiheadAttention


_MHA_SPEC: contextvars.ContextVar[Optional[Tuple]] = contextvars.ContextVar("sparseflow_mha_spec", default=None)
_real_sdpa = torch._C._nn.scaled_dot_product_attention


def _routed_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    spec = _MHA_SPEC.get()
    ok = (
        spec is not None
        and float(dropout_p) == 0.0
        and query.dim() == 4
        and key.dim() == 4
        and query.dtype in _SUPPORTED_DTYPES
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
    if query.dtype not in _SUPPORTED_DTYPES or not (query.dtype == key.dtype == value.dtype):
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


# --------------------------------------------------------------------------- the pass


def _stride_order(t: torch.Tensor) -> Optional[List[int]]:
    """Dims from outermost to innermost in memory (None when it cannot be told)."""
    try:  # handles symbolic strides too
        from torch._prims_common import compute_elementwise_output_logical_to_physical_perm

        perm = compute_elementwise_output_logical_to_physical_perm(t)
        return list(perm[0] if isinstance(perm, tuple) and isinstance(perm[0], (list, tuple)) else perm)
    except Exception:
        pass
    try:
        strides = [int(s) for s in t.stride()]
        sizes = [int(s) for s in t.shape]
    except Exception:
        return None
    return sorted(range(t.dim()), key=lambda d: (-strides[d], -sizes[d], d))


def _restore_layout(graph: fx.Graph, new: fx.Node, old_out: torch.Tensor, val: torch.Tensor) -> fx.Node:
    """Give the op's (contiguous) output the memory layout SDPA's output had.

    Export graphs are functional: a ``.contiguous()`` that was a no-op on SDPA's output (on the
    CPU and CUDA, SDPA returns [B, N, H, D]-major memory) is gone from the graph, and a later
    ``view`` relies on that layout. Permute to the old memory order, copy, permute back."""
    order = _stride_order(old_out)
    if order is None or order == list(range(old_out.dim())):
        return new
    inverse = [order.index(d) for d in range(len(order))]
    with graph.inserting_after(new):
        p1 = graph.call_function(aten.permute.default, (new, order))
    with graph.inserting_after(p1):
        c = graph.call_function(aten.clone.default, (p1,), {"memory_format": torch.contiguous_format})
    with graph.inserting_after(c):
        p2 = graph.call_function(aten.permute.default, (c, inverse))
    for n_ in (p1, c, p2):
        n_.meta.update({k_: v_ for k_, v_ in new.meta.items() if k_ not in ("val", "example_value", "tensor_meta")})
    try:
        with val.fake_mode:
            v1 = val.permute(order)
            v2 = v1.clone(memory_format=torch.contiguous_format)
            p1.meta["val"], c.meta["val"], p2.meta["val"] = v1, v2, v2.permute(inverse)
    except Exception:  # metadata only
        pass
    return p2


def _proven_mask(mask: fx.Node, qf, kf, windows: bool = False) -> Optional[MaskProof]:
    """The mask's proof when it can replace the mask: its key padding is ``[B, Nk]`` of these
    q/k and a causal mask is square (the op's causal is top-left, like SDPA's). ``windows``: a
    causal local window may be part of it (the caller then puts it into the op's config)."""
    proof = prove_mask(mask, windows=windows)
    if proof is None or qf is None or kf is None:
        return None
    if proof.causal and not _same(qf.shape[2], kf.shape[2]):
        return None
    if proof.key_padding is not None:
        pf = fake_of(proof.key_padding)
        if pf is None or pf.dim() != 2 or not (_same(pf.shape[0], qf.shape[0]) and _same(pf.shape[1], kf.shape[2])):
            return None
    return proof


def _padding_mask_node(graph: fx.Graph, before: fx.Node, proof: MaskProof) -> Tuple[Optional[fx.Node], bool]:
    """(attn_mask, is_causal) for the op from a proof: the key padding as SDPA's ``[B, 1, 1, Nk]``
    bool form (the op intersects it with causality), built from the ``[B, Nk]`` graph tensor."""
    kp = proof.key_padding
    if kp is None:
        return None, proof.causal
    pf = fake_of(kp)
    with graph.inserting_before(before):
        x = kp if pf.dtype == torch.bool else graph.call_function(aten.ne.Scalar, (kp, 0))
        x = graph.call_function(aten.unsqueeze.default, (x, 1))
        x = graph.call_function(aten.unsqueeze.default, (x, 2))
    _set_fake(x, pf)
    return x, proof.causal


def _set_fake(node: fx.Node, padding_fake) -> None:
    # the [B, 1, 1, Nk] bool value, for passes that read node metadata (export's ``val``)
    try:
        with padding_fake.fake_mode:
            val = (padding_fake != 0)[:, None, None, :]
    except Exception:  # metadata only
        return
    node.meta["val"] = node.meta["example_value"] = val


def _describe_proof(proof: MaskProof) -> str:
    parts = (["causal"] if proof.causal else []) + (["key padding [B, Nk]"] if proof.key_padding is not None else [])
    if proof.sliding_window:
        parts.append(f"sliding window {proof.sliding_window}")
    if proof.chunk_size:
        parts.append(f"chunks of {proof.chunk_size}")
    return " + ".join(parts) + " (proven from the graph; the [Nq, Nk] mask is not built)"


def _windowed_config(cfg: AttentionConfig, proof: MaskProof, entry: RewriteEntry) -> AttentionConfig:
    """The layer's config with the window its mask was proven to hold (see ``registry.windowed``),
    said in the report."""
    cfg, note = windowed(cfg, proof.sliding_window, proof.chunk_size)
    entry.notes.append(f"windowed layer: sliding_window={cfg.sliding_window}, chunk_size={cfg.chunk_size}")
    if note:
        entry.notes.append(note)
    return cfg


_ASSERT_METADATA = getattr(getattr(aten, "_assert_tensor_metadata", None), "default", None)


def _erase_if_dead(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` and, recursively, the inputs only it used (the mask construction)."""
    pending = [node]
    while pending:
        n = pending.pop()
        if n.graph is not graph or n.op not in ("call_function", "call_method"):
            continue
        for u in list(n.users):  # export's dtype/device asserts on the erased values go with them
            if u.target is _ASSERT_METADATA and not u.users:
                graph.erase_node(u)
        if n.users:
            continue
        inputs = list(n.all_input_nodes)
        graph.erase_node(n)
        pending.extend(inputs)


def _rewrite_sdpa(
    graph: fx.Graph, node: fx.Node, spec: _Target, entry: RewriteEntry, options: RewriteOptions, graph_kind: str
) -> None:
    """Rewrite one SDPA node into the op of its layer's config, or leave it and say why in ``entry``."""
    call = _read_sdpa_call(node, spec, entry)
    if call is None:
        return
    cfg, why = options.resolve(entry.tag, entry.layer)
    if cfg is None:
        entry.reason = why
        _keep_sdpa_causal(graph, node, spec, call, entry)
        return
    entry.reason = _constant_args_reason(node, spec, call) or _tensor_args_reason(call, entry)
    if entry.reason:
        return
    proven = _proven_mask(call.mask, call.qf, call.kf, windows=True) if call.mask is not None else None
    heads = _kv_heads(call, entry)
    if heads is None:
        return
    if proven is not None and (proven.sliding_window or proven.chunk_size):
        cfg = _windowed_config(cfg, proven, entry)
    _replace_with_op(graph, node, spec, cfg, call, heads, proven, entry, options, graph_kind)
    entry.rewritten, entry.reason = True, ""
    entry.method, entry.config = cfg.method, cfg.to_dict()


def _keep_sdpa_causal(graph: fx.Graph, node: fx.Node, spec: _Target, call: _SdpaCall, entry: RewriteEntry) -> None:
    """A call kept as SDPA whose materialised mask is proven purely causal gets ``is_causal=True``
    in place of the mask (the same result): transformers hands a compiled model's every layer an
    ``[N, N]`` mask, which SDPA would build and then run a masked kernel over all ``N x N`` (4x
    the causal kernel's time at 128K on the H200). A mask with key padding is kept: SDPA cannot
    take it together with ``is_causal``."""
    if spec.returns_tuple or spec.mask_arg is None or call.mask is None or call.is_causal is not False:
        return
    proof = _proven_mask(call.mask, call.qf, call.kf)
    if proof is None or not proof.causal or proof.key_padding is not None:
        return
    old_mask = call.mask
    _set_node_arg(node, spec.schema, spec.mask_arg, None)
    _set_node_arg(node, spec.schema, "is_causal", True)
    entry.is_causal = True
    entry.mask = _describe_proof(proof)
    entry.notes.append("SDPA kept, with is_causal=True in place of its proven causal mask")
    _erase_if_dead(graph, old_mask)


def _set_node_arg(node: fx.Node, schema, name: str, value) -> None:
    """Set argument ``name`` of ``node`` where the node passes it (positionally or by keyword)."""
    index = [a.name for a in schema.arguments].index(name)
    if index < len(node.args):
        node.update_arg(index, value)
    else:
        node.update_kwarg(name, value)


@dataclass
class _SdpaCall:
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
class _KVHeads:
    """The K/V the op receives: the node's, or the un-repeated bases of a folded ``repeat_kv``."""

    k: Any
    v: Any
    folded_k: Any = None  # the repeat chains found on K and V (erased once the op replaced the node)
    folded_v: Any = None


def _read_sdpa_call(node: fx.Node, spec: _Target, entry: RewriteEntry) -> Optional[_SdpaCall]:
    """Bind the node's arguments and note its shapes and causality in ``entry`` (None: unreadable)."""
    try:
        b = _bind(spec.schema, node.args, node.kwargs)
    except TypeError as e:
        entry.reason = f"cannot read arguments: {e}"
        return None
    q, k, v = b.get("query"), b.get("key"), b.get("value")
    call = _SdpaCall(
        bound=b,
        q=q,
        k=k,
        v=v,
        qf=fake_of(q),
        kf=fake_of(k),
        vf=fake_of(v),
        mask=b.get(spec.mask_arg) if spec.mask_arg else None,
        is_causal=b.get("is_causal", False),
        dropout=_const_float(b.get("dropout_p", 0.0)),
        scale=b.get("scale"),
        enable_gqa=b.get("enable_gqa", False),
    )
    entry.q_shape, entry.k_shape, entry.v_shape = _shape(call.qf), _shape(call.kf), _shape(call.vf)
    entry.is_causal = call.is_causal if isinstance(call.is_causal, bool) else None
    return call


def _constant_args_reason(node: fx.Node, spec: _Target, call: _SdpaCall) -> str:
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
    if call.scale is not None and _const_float(call.scale) is None:
        return f"scale is not a constant ({call.scale!r})"
    if not isinstance(call.enable_gqa, bool):
        return f"enable_gqa is not a constant bool ({call.enable_gqa!r})"
    return ""


def _tensor_args_reason(call: _SdpaCall, entry: RewriteEntry) -> str:
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


def _kv_heads(call: _SdpaCall, entry: RewriteEntry) -> Optional[_KVHeads]:
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
    heads = _KVHeads(mk.base, mv.base, mk, mv) if mk is not None else _KVHeads(call.k, call.v)
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
        entry.k_shape, entry.v_shape = _shape(kf2), _shape(fake_of(heads.v))
    return heads


def _replace_with_op(
    graph: fx.Graph,
    node: fx.Node,
    spec: _Target,
    cfg: AttentionConfig,
    call: _SdpaCall,
    heads: _KVHeads,
    proven,
    entry: RewriteEntry,
    options: RewriteOptions,
    graph_kind: str,
) -> None:
    """Insert the op call in place of the SDPA node (a proven mask replaced by its key padding),
    give it the node's meta and fake output, and erase what the node alone used."""
    op = op_for(cfg.method)
    mask, is_causal, scale = call.mask, call.is_causal, call.scale
    old_mask = None
    if proven is not None:
        old_mask, (mask, is_causal) = mask, _padding_mask_node(graph, node, proven)
        entry.mask = _describe_proof(proven)
    op_call_args = (
        call.q,
        heads.k,
        heads.v,
        mask,
        is_causal,
        None if scale is None else float(scale),
        *op_args(cfg, options.tuning if graph_kind == "export" else options.tuning.traced()),
        options.backend,
        entry.tag,
    )
    with graph.inserting_before(node):
        new = graph.call_function(op, args=op_call_args)
    new.meta.update({k_: v_ for k_, v_ in node.meta.items() if k_ not in ("val", "example_value", "tensor_meta")})
    val = _fake_output(op, op_call_args)
    old_out = fake_of(next(iter(node.users))) if spec.returns_tuple else fake_of(node)
    if val is not None:
        keys = [k_ for k_ in ("val", "example_value") if k_ in node.meta] or ["val"]
        for k_ in keys:
            new.meta[k_] = val
    result = new
    if graph_kind == "export" and old_out is not None and val is not None:
        result = _restore_layout(graph, new, old_out, val)
    if spec.returns_tuple:
        for u in list(node.users):
            u.replace_all_uses_with(result)
            graph.erase_node(u)
    else:
        node.replace_all_uses_with(result)
    graph.erase_node(node)
    for m in (heads.folded_k, heads.folded_v):
        if m is not None:
            erase_dead_chain(graph, m)
    if old_mask is not None:
        _erase_if_dead(graph, old_mask)


def _rewrite_mha(node: fx.Node, entry: RewriteEntry, options: RewriteOptions) -> None:
    try:
        b = _MHA_SIGNATURE.bind(*node.args, **node.kwargs)
        b.apply_defaults()
    except TypeError as e:
        entry.reason = f"cannot read arguments: {e}"
        return
    a = b.arguments
    qf, kf, vf = fake_of(a["query"]), fake_of(a["key"]), fake_of(a["value"])
    entry.q_shape, entry.k_shape, entry.v_shape = _shape(qf), _shape(kf), _shape(vf)
    entry.is_causal = a["is_causal"] if isinstance(a["is_causal"], bool) else None
    entry.notes.append("nn.MultiheadAttention: shapes are the module's [L, B, E] inputs")
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
    training, dropout = a["training"], _const_float(a["dropout_p"])
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
        if t.dtype not in _SUPPORTED_DTYPES:
            entry.reason = f"unsupported dtype {t.dtype} (the ops take float16, bfloat16, float32)"
            return
    mask_present = a["attn_mask"] is not None or a["key_padding_mask"] is not None
    if mask_present:
        entry.mask = (
            "merged nn.MultiheadAttention mask (4-D, SDPA form): runtime-recognised by value "
            "(causal / key padding / both run sparse, anything else dense, logged)"
        )
    spec = (cfg.method, tuple(op_args(cfg, options.tuning.traced())), options.backend, entry.tag)
    node.target = mha_forward_routed
    node.args = (spec,) + tuple(node.args)
    entry.rewritten, entry.reason = True, ""
    entry.method, entry.config = cfg.method, cfg.to_dict()


def rewrite_graph(gm: fx.GraphModule, options: RewriteOptions, *, graph_kind: str = "dynamo") -> List[RewriteEntry]:
    """Rewrite every attention call in ``gm.graph`` in place (then recompile ``gm``); return one
    entry per call found. Never raises for a call it cannot take: that call is kept as is and
    its entry says why (also logged at INFO on the "sparseflow" logger)."""
    graph = gm.graph
    entries: List[RewriteEntry] = []
    seen_per_tag: Dict[str, int] = {}
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        target = node.target
        try:
            spec = SDPA_TARGETS.get(target)
        except TypeError:  # unhashable target
            continue
        is_mha = target is F.multi_head_attention_forward
        fused = _FUSED_TARGETS.get(target) if spec is None and not is_mha else None
        if spec is None and not is_mha and fused is None:
            continue
        tag = module_tag(node)
        site = seen_per_tag.get(tag, 0)
        seen_per_tag[tag] = site + 1
        entry = RewriteEntry(
            tag=tag,
            layer=layer_index(tag),
            rewritten=False,
            reason="",
            method=None,
            config=None,
            target=spec.name if spec is not None else ("F.multi_head_attention_forward" if is_mha else fused),
            graph=graph_kind,
            site=site,
        )
        if spec is not None:
            _rewrite_sdpa(graph, node, spec, entry, options, graph_kind)
        elif is_mha:
            _rewrite_mha(node, entry, options)
        else:
            entry.reason = _FASTPATH_REASON.format(name=fused)
        if not entry.rewritten and not entry.reason:  # pragma: no cover - defensive
            entry.reason = "not rewritten"
        entries.append(entry)
    if options.context_parallel is not None:
        from .context_parallel_rewrite import to_context_parallel

        to_context_parallel(graph, entries, options)
    graph.lint()
    gm.recompile()
    return entries
