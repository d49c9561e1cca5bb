"""ONNX export of rewritten models: one ``sparseflow``-domain node per attention call.

``export_onnx`` exports the model with ``torch.export`` (sequence length dynamic by default),
rewrites every SDPA call into the method's op (the same pass as :func:`sparseflow.export`), and
hands the program to ``torch.onnx.export(..., dynamo=True)`` with a translation table that turns
each ``sparseflow::<method>_attention`` call into ONE node of domain ``sparseflow``
(``DenseAttention``, ``BSAAttention``, ``PBSAttention``, ``PISAAttention``) whose attributes are
the op's configuration. The file carries, for each of those node types, a registered schema and a
model-local ONNX function whose body (standard opset-23 ops only) computes what the PyTorch
reference computes, so any ONNX runtime runs the file as it is, and a runtime with its own kernel
binds the node by (domain, op_type) and ignores the body. See ``docs/onnx.md``.

Node inputs (all methods): ``q [B, Hq, N, D]``, ``k, v [B, Hkv, N, D]`` (native GQA, never
repeated) and ``key_padding_mask [B, N]`` bool (True = valid key; all True when the model has no
padding). Causality is the ``is_causal`` attribute. A boolean SDPA mask of any form (``[Nq, Nk]``,
``[H, Nq, Nk]``, ``[B, H, Nq, Nk]`` with broadcast dims, e.g. the 4-D mask Hugging Face models build
under ``torch.export``) is folded at export time into ``(is_causal, key_padding_mask)``, after
checking on the example inputs that it is exactly ``causal & key_padding``, causal, or key padding
only; any other mask is refused.

What the function bodies compute (checked against the PyTorch reference by tests/test_onnx.py):

* ``DenseAttention``: masked softmax attention (SDPA semantics, GQA native).
* ``BSAAttention``: the full BSA selection -- block means over valid keys, group-summed scores,
  forced current / previous / sink blocks, ``TopK`` with ties to the lower block index (ONNX
  ``TopK`` breaks ties by the lower index, as the reference's stable sort does), then attention
  restricted to the selected blocks with the element-level causal mask. With a local window the
  candidates (forced ones too) are the visible blocks from the window's first block on. The selection is computed
  densely on the ``[N, N/C]`` block scores and the attention on the ``[N, N]`` scores: a portable
  O(N^2) fallback, not a fast kernel.
* ``PBSAttention`` (:mod:`sparseflow.methods.pbs.onnx`): proxy key scores from the last query block,
  per-segment key permutation (``TopK``, stable), block probabilities (``scoring`` "mean" or
  "antidiagonal"), cumulative-mass threshold, forced own-region and sink blocks, then attention
  in the original key order with the block mask gathered per key. With a local window the
  candidates and forced blocks are those holding a valid key at or after the window's bound of
  the query block's first query, and the threshold is a share of their mass.
* ``PISAAttention`` (:mod:`sparseflow.methods.pisa.onnx`): the pyramid walk per query token as an ONNX
  ``Loop`` over levels (their number depends on N, so the length stays dynamic), scores "lse",
  "mean" or "mean_var", forced current / previous / sink ancestors, ``top_k`` per level; with a
  local window the nodes wholly before the window's first block are no candidates.

Every option of every config has a body, so the export-time refusals are about the calls
themselves (masks other than causal / key padding, Nq != Nk, value head dim != query head dim) and
the local window of a sparse method whose body does not choose its blocks inside it
(``OnnxBody.windows``).
A node carrying a setting its body does not know (written by another tool) makes the body
output NaN, never a different attention.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn as nn

from .config import METHODS, AttentionConfig
from .methods import spec_for, specs
from .masks import analyse_mask

__all__ = ["export_onnx", "OnnxExportError", "DOMAIN", "NODE_TYPES", "function_protos", "register_schemas"]

DOMAIN = "sparseflow"
DOMAIN_VERSION = 1
OPSET = 23
NODE_TYPES = {s.name: s.onnx.node_type for s in specs()}  # method -> op type of its node


class OnnxExportError(ValueError):
    """The model (or one attention call in it) cannot be exported faithfully."""


# --------------------------------------------------------------------------- attributes


def _config_fields(method: str) -> List[Tuple[str, type]]:
    from .op_schema import FIELDS

    return list(FIELDS[method])


def _node_fields(method: str) -> List[Tuple[str, type]]:
    """The config fields a node carries as attributes (the local window's included)."""
    return _config_fields(method)


# node attributes with a default: a node without them has no local window (files written before
# windows were exported stay valid, and a runtime binding the node may leave them out)
_WINDOW_ATTRS = {"sliding_window": 0, "chunk_size": 0}


def _optional_attrs(method: str) -> Dict[str, Any]:
    """The node's attributes with a default: the local window's, and the fields its method's body
    added after its first files (``OnnxBody.optional``), at the config's default."""
    body, defaults = spec_for(method).onnx, METHODS[method]()
    added = sorted(body.optional) if body is not None else []
    return {**_WINDOW_ATTRS, **{n: getattr(defaults, n) for n in added}}


def _attr_names(method: str) -> List[str]:
    names = ["is_causal", "scale"] + [name for name, _ in _node_fields(method)]
    optional = _optional_attrs(method)
    return [
        f"{n}: {'float' if isinstance(optional[n], float) else 'int'} = {optional[n]!r}" if n in optional else n
        for n in names
    ]


# --------------------------------------------------------------------------- function bodies
#
# Written in the ONNX textual syntax; configuration values enter through attribute references
# (``@name``), so one function per node type serves every configuration.

_PROLOGUE = """
  qf = Cast <to = 1> (q)
  kf = Cast <to = 1> (k)
  vf = Cast <to = 1> (v)
  sc = Constant <value_float: float = @scale> ()
  causal_i = Constant <value_int: int = @is_causal> ()
  causal = Cast <to = 9> (causal_i)
  zero = Constant <value_int = 0> ()
  one = Constant <value_int = 1> ()
  i12 = Constant <value_ints = [1, 2]> ()
  i13 = Constant <value_ints = [1, 3]> ()
  i02 = Constant <value_ints = [0, 2]> ()
  i3 = Constant <value_ints = [3]> ()
  i0 = Constant <value_ints = [0]> ()
  i1 = Constant <value_ints = [1]> ()
  i2 = Constant <value_ints = [2]> ()
  im1 = Constant <value_ints = [-1]> ()
  ninf = Constant <value_float = -inf> ()
  pinf = Constant <value_float = inf> ()
  fzero = Constant <value_float = 0.0> ()
  fone = Constant <value_float = 1.0> ()
  B = Shape <start = 0, end = 1> (q)
  Hq = Shape <start = 1, end = 2> (q)
  Nq1 = Shape <start = 2, end = 3> (q)
  D = Shape <start = 3, end = 4> (q)
  Hkv = Shape <start = 1, end = 2> (k)
  Nk1 = Shape <start = 2, end = 3> (k)
  Dv = Shape <start = 3, end = 4> (v)
  G = Div (Hq, Hkv)
  Nq = Squeeze (Nq1, i0)
  Nk = Squeeze (Nk1, i0)
  g_shape = Concat <axis = 0> (B, Hkv, G, Nq1, D)
  qg = Reshape (qf, g_shape)
  iq = Range (zero, Nq, one)
  jk = Range (zero, Nk, one)
  iq_col = Unsqueeze (iq, i1)
  jk_row = Unsqueeze (jk, i0)
  kpm4 = Unsqueeze (kpm, i12)
  not_causal = Not (causal)
  sw = Constant <value_int: int = @sliding_window> ()
  cs = Constant <value_int: int = @chunk_size> ()
  p_off = Sub (Nk, Nq)
  pq = Add (iq, p_off)
  pq1 = Add (pq, one)
  sw_lo = Sub (pq1, sw)
  sw_lo0 = Max (sw_lo, zero)
  sw_on = Greater (sw, zero)
  lo_sw = Where (sw_on, sw_lo0, zero)
  cs_safe = Max (cs, one)
  cs_idx = Div (pq, cs_safe)
  cs_lo = Mul (cs_idx, cs_safe)
  cs_max = Max (lo_sw, cs_lo)
  cs_on = Greater (cs, zero)
  lo = Where (cs_on, cs_max, lo_sw)
  lo_col = Unsqueeze (lo, i1)
  in_window = GreaterOrEqual (jk_row, lo_col)
  i012 = Constant <value_ints = [0, 1, 2]> ()
  in_window5 = Unsqueeze (in_window, i012)
"""
# ``in_window5 [1, 1, 1, Nq, Nk]``: the local window (``sliding_window`` / ``chunk_size``, 0 = none)
# of each query at position ``i + Nk - Nq``, as ``masks.window_mask``: the epilogue intersects the
# method's selection with it

# ``allowed5 [B, 1 or Hkv, 1 or G, Nq, Nk]`` bool, ``cfg_ok`` bool -> ``out [B, Hq, Nq, Dv]`` in q's
# dtype. ``cfg_ok`` False (a node setting the body does not implement) makes the output NaN: a
# runtime running the body on such a node gets an unmistakable result, never another attention.
_EPILOGUE = """
  k5 = Unsqueeze (kf, i2)
  kt = Transpose <perm = [0, 1, 2, 4, 3]> (k5)
  qk = MatMul (qg, kt)
  logits = Mul (qk, sc)
  allowed_w = And (allowed5, in_window5)
  masked = Where (allowed_w, logits, ninf)
  mx = ReduceMax <keepdims = 1> (masked, im1)
  mx_inf = IsInf (mx)
  mx_safe = Where (mx_inf, fzero, mx)
  shifted = Sub (masked, mx_safe)
  p = Exp (shifted)
  den = ReduceSum <keepdims = 1> (p, im1)
  v5 = Unsqueeze (vf, i2)
  num = MatMul (p, v5)
  den_pos = Greater (den, fzero)
  den_safe = Where (den_pos, den, fone)
  o5 = Div (num, den_safe)
  o_shape = Concat <axis = 0> (B, Hq, Nq1, Dv)
  o4 = Reshape (o5, o_shape)
  fnan = Constant <value_float = nan> ()
  o4g = Where (cfg_ok, o4, fnan)
  out = CastLike (o4g, q)
"""


def _function_text(method: str, mask_body: str) -> str:
    attrs = ", ".join(_attr_names(method))
    return (
        f'<domain: "{DOMAIN}", opset_import: ["" : {OPSET}]>\n'
        f"{NODE_TYPES[method]} <{attrs}> (q, k, v, kpm) => (out) {{\n"
        f"{_PROLOGUE}{mask_body}{_EPILOGUE}}}\n"
    )


def function_protos() -> Dict[str, Any]:
    """``{method: onnx.FunctionProto}``: the portable body of every node type."""
    import onnx.parser

    return {s.name: onnx.parser.parse_function(_function_text(s.name, s.onnx.mask_text())) for s in specs()}


_SCHEMAS_REGISTERED = False


def _attr_type(kind: type):
    from onnx import defs

    AT = defs.OpSchema.AttrType
    return {int: AT.INT, bool: AT.INT, float: AT.FLOAT, str: AT.STRING}[kind]


def register_schemas() -> None:
    """Register the ``sparseflow`` node schemas with ``onnx.defs`` (idempotent), so the checker
    and shape inference know them. Runtimes that bind the nodes to their own kernels use the
    same names, inputs and attributes (docs/onnx.md)."""
    global _SCHEMAS_REGISTERED
    if _SCHEMAS_REGISTERED:
        return
    from onnx import defs

    for method, op_type in NODE_TYPES.items():
        if defs.has(op_type, DOMAIN):
            continue
        AT = defs.OpSchema.AttrType
        attrs = [
            defs.OpSchema.Attribute("is_causal", AT.INT, "1: causal (query i sees keys j <= i)."),
            defs.OpSchema.Attribute("scale", AT.FLOAT, "Softmax scale applied to q.k."),
        ] + [_schema_attribute(method, name, kind) for name, kind in _node_fields(method)]
        schema = defs.OpSchema(
            op_type,
            DOMAIN,
            DOMAIN_VERSION,
            doc=f"sparseflow {method} attention (see sparseflow.ops, docs/onnx.md).",
            inputs=[
                defs.OpSchema.FormalParameter("q", "T", "[B, Hq, N, D]"),
                defs.OpSchema.FormalParameter("k", "T", "[B, Hkv, N, D]"),
                defs.OpSchema.FormalParameter("v", "T", "[B, Hkv, N, Dv]"),
                defs.OpSchema.FormalParameter("key_padding_mask", "M", "[B, N] bool, True = valid"),
            ],
            outputs=[defs.OpSchema.FormalParameter("out", "T", "[B, Hq, N, Dv]")],
            type_constraints=[
                ("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "float types"),
                ("M", ["tensor(bool)"], "mask"),
            ],
            attributes=attrs,
        )
        defs.register_schema(schema)
    _SCHEMAS_REGISTERED = True


def _schema_attribute(method: str, name: str, kind: type):
    from onnx import defs, helper

    doc = f"{METHODS[method].__name__}.{name}"
    optional = _optional_attrs(method)
    if name in optional:
        default = helper.make_attribute(name, optional[name])
        note = " (0: no such window)" if name in _WINDOW_ATTRS else f" (default {optional[name]!r})"
        return defs.OpSchema.Attribute(name, default, doc + note)
    return defs.OpSchema.Attribute(name, _attr_type(kind), doc)


# --------------------------------------------------------------------------- export-time checks


@dataclass
class _CallPlan:
    tag: str
    method: str
    is_causal: bool
    mask_rank: int  # 0: no mask; else the rank of the SDPA mask the call gets (2 to 4)


def _static_int(x) -> Optional[int]:
    """``x`` as an int when it is a concrete size; None when symbolic (never specialises)."""
    if isinstance(x, int) and not isinstance(x, torch.SymInt):
        return x
    if isinstance(x, torch.SymInt):
        try:
            return int(x.node.maybe_as_int()) if x.node.maybe_as_int() is not None else None
        except Exception:
            return None
    return None


def _refusal(method: str, cfg: AttentionConfig, n_k, tag: str) -> str:
    """Why a call of ``method`` with ``cfg`` cannot get a faithful ONNX body ("" if it can).
    A config field the method's ONNX body does not list (``MethodSpec.onnx.fields``) is refused
    until the body implements it."""
    if method not in METHODS:
        return f"unknown method {method!r} at {tag or '<root>'}"
    spec = spec_for(method)
    if cfg.has_window and spec.sparse and not spec.onnx.windows:
        # a sparse method chooses its blocks inside the window; this body would choose them over
        # all keys and only then cut them to the window: another selection
        return (
            f"{method} at {tag or '<root>'}: the ONNX body of {spec.onnx.node_type} does not choose its blocks "
            f"inside a local window (sliding_window={cfg.sliding_window}, chunk_size={cfg.chunk_size}): it would "
            "choose them over all keys and only then cut them to the window, another selection than the op's "
            "(its OnnxBody is not marked windows=True); give the window to method='dense'"
        )
    reason = spec.onnx.refuse(cfg)
    return f"{method} at {tag or '<root>'}: {reason}" if reason else ""


def _sparseflow_nodes(gm) -> List[torch.fx.Node]:
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and isinstance(n.target, torch._ops.OpOverload)
        and n.target.namespace == "sparseflow"
    ]


def _method_of(target) -> str:
    name = target._schema.name.split("::")[1]
    return name[: -len("_attention")]


def _cfg_of(method: str, args: Sequence) -> AttentionConfig:
    fields = _config_fields(method)
    return METHODS[method](**{name: a for (name, _), a in zip(fields, args[6 : 6 + len(fields)])})


MaskAnalysisSummary = Tuple[bool, bool, str]


def _analyse_masks(ep, args, kwargs) -> Dict[str, MaskAnalysisSummary]:
    """Run the rewritten program once on the example inputs and analyse the mask every op call
    receives: ``{tag: (supported, is_causal, reason)}``. The op calls are intercepted (context
    local, see :func:`sparseflow.op_execute.intercepting`) and answered with dense attention: the masks
    never depend on attention outputs, so the model runs at SDPA speed."""
    from .op_execute import intercepting
    from .op_windows import sdpa

    found: Dict[str, MaskAnalysisSummary] = {}

    def analyse_call(method, a):
        q, k, v, mask, is_causal, scale = a[:6]
        res = analyse_mask(mask, bool(is_causal), q.shape[0], q.shape[2], k.shape[2])
        tag = a[-1]
        cur = (res.supported, res.is_causal, res.reason)
        if res.supported and (res.sliding_window or res.chunk_size):  # a node's mask input is key padding only
            window = f"sliding_window={res.sliding_window}, chunk_size={res.chunk_size}"
            cur = (False, False, f"attn_mask holding a local window ({window}) the graph did not prove")
        prev = found.get(tag)
        if prev is not None and prev != cur:
            cur = (False, False, f"calls tagged {tag!r} disagree about their mask")
        found[tag] = cur
        if not res.supported:  # SDPA may refuse such a mask; any output of the right shape will do
            return torch.zeros(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype, device=q.device)
        return sdpa(q, k, v, mask, is_causal, scale).contiguous()

    with torch.no_grad(), intercepting(analyse_call):
        ep.module()(*args, **(kwargs or {}))
    return found


# --------------------------------------------------------------------------- translation


def _make_translation(method: str, plans: Dict[str, _CallPlan], default_scales: Dict[str, float]):
    """The trace-only translation function of one op: emits one ``sparseflow`` node."""
    from onnxscript import opset23 as op
    from onnxscript.values import Opset

    sf = Opset(DOMAIN, DOMAIN_VERSION)
    fields = _config_fields(method)

    def translate(q, k, v, attn_mask, is_causal, scale, *rest):
        cfg_vals = rest[: len(fields)]
        tag = rest[-1] if len(rest) > len(fields) + 1 else ""  # rest: config, tuning, backend, tag
        plan = plans.get(tag)
        causal = bool(is_causal) if plan is None else plan.is_causal
        if attn_mask is None:
            # all keys valid: [B, Nk] of True, built from k's shape (dynamic N)
            shape_k = op.Shape(k)
            bn = op.Concat(op.Slice(shape_k, [0], [1]), op.Slice(shape_k, [2], [3]), axis=0)
            kpm = op.Expand(op.Constant(value=_bool_scalar(True)), bn)
        else:
            kpm = _key_padding_of(op, attn_mask, q, k, plan.mask_rank)
        sc = float(scale) if scale is not None else default_scales[tag]
        attrs: Dict[str, Any] = {"is_causal": int(causal), "scale": sc}
        attributes = dict(_node_fields(method))
        for (name, kind), val in zip(fields, cfg_vals):
            if name in attributes:
                attrs[name] = int(val) if kind is bool else (float(val) if kind is float else val)
        return getattr(sf, NODE_TYPES[method])(q, k, v, kpm, **attrs)

    return translate


def _key_padding_of(op, attn_mask, q, k, rank: int):
    """The ``[B, Nk]`` key padding of a mask checked (on the example inputs) to be key padding,
    causal, or causal & key padding: its last query row of head 0, broadcast with SDPA's rule
    (dims aligned from the right, sizes of 1 expanded), so no size is taken from the examples."""
    m = attn_mask
    if rank < 4:
        m = op.Unsqueeze(m, op.Constant(value_ints=list(range(4 - rank))))  # [B or 1, H or 1, Nq or 1, Nk or 1]
    row = op.Gather(m, op.Constant(value_int=0), axis=1)  # head 0: [B or 1, Nq or 1, Nk or 1]
    kpm = op.Gather(row, op.Constant(value_int=-1), axis=1)  # last query row: [B or 1, Nk or 1]
    shape_q, shape_k = op.Shape(q), op.Shape(k)
    bn = op.Concat(op.Slice(shape_q, [0], [1]), op.Slice(shape_k, [2], [3]), axis=0)
    return op.Expand(op.Cast(kpm, to=9), bn)


def _bool_scalar(value: bool):
    import onnx.numpy_helper
    import numpy as np

    return onnx.numpy_helper.from_array(np.array(value, dtype=np.bool_))


# --------------------------------------------------------------------------- the entry point


def _dynamic_shapes(model: nn.Module, args, kwargs, seq_dim: int = 1):
    """Mark dim ``seq_dim`` of every tensor input of rank >= 2 as one dynamic ``seq`` dimension
    (a dict keyed by ``forward``'s parameter names, as ``torch.export`` wants with kwargs)."""
    import inspect

    seq = torch.export.Dim("seq", min=2, max=1 << 17)

    def spec(x):
        if isinstance(x, torch.Tensor) and x.dim() > seq_dim:
            return {seq_dim: seq}
        return None

    bound = inspect.signature(model.forward).bind(*args, **(kwargs or {}))
    out = {}
    for name, val in bound.arguments.items():
        param = bound.signature.parameters[name]
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            out[name] = tuple(spec(a) for a in val)
        elif param.kind is inspect.Parameter.VAR_KEYWORD:
            out[name] = {k: spec(a) for k, a in val.items()}
        else:
            out[name] = spec(val)
    return out


def export_onnx(
    model: nn.Module,
    example_inputs: Tuple[Any, ...],
    path: Optional[str] = None,
    *,
    method: str,
    config: Optional[AttentionConfig] = None,
    example_kwargs: Optional[Dict[str, Any]] = None,
    dynamic_seq: bool = True,
    dynamic_shapes: Any = None,
    filter_fn: Optional[Callable[[str], bool]] = None,
    skip_layers: Iterable[int] = (),
    layer_configs: Optional[Mapping[int, Optional[AttentionConfig]]] = None,
    check: bool = True,
    optimize: bool = False,
    return_program: bool = False,
):
    """Export ``model`` rewritten with ``method``/``config`` to ONNX (``path``; returns the
    ``onnx.ModelProto``).

    Every sparseflow op becomes one ``sparseflow``-domain node (``DenseAttention``,
    ``BSAAttention``, ``PBSAttention``, ``PISAAttention``) carrying the configuration as
    attributes, with a model-local function as its portable body (see the module docstring for
    what is supported). ``dynamic_seq`` makes dim 1 of every tensor input of rank >= 2 one dynamic
    ``seq`` dimension (token ids and attention masks of a decoder LM); pass ``dynamic_shapes`` to
    say it yourself. Hugging Face models need ``example_kwargs={"use_cache": False}``.
    ``optimize`` runs the ONNX exporter's graph optimizer (off by default: on torch 2.13 its fused
    ``RotaryEmbedding`` breaks batch sizes > 1). With ``return_program`` returns
    ``(model_proto, program)``, ``program`` being the rewritten ``ExportedProgram`` (same dynamic
    shapes) that the file reproduces.
    Raises :class:`OnnxExportError` (a ``ValueError``) for anything the ONNX bodies cannot
    reproduce exactly, naming the layer and the setting, before any file is written.
    """
    from .option_checks import make_options

    model = _checked_export_arguments(model, example_inputs, example_kwargs, path)
    options = make_options(method, config, "auto", filter_fn, skip_layers, layer_configs)
    kwargs = dict(example_kwargs or {})
    if dynamic_shapes is None and dynamic_seq:
        dynamic_shapes = _dynamic_shapes(model, example_inputs, kwargs)

    t0 = time.perf_counter()
    ep, nodes = _rewritten_program(model, example_inputs, kwargs, dynamic_shapes, options)
    default_scales = {n.args[-1]: _checked_call_scale(n) for n in nodes}
    analysis = _analyse_masks(ep, example_inputs, kwargs)
    plans = {n.args[-1]: _call_plan(n, analysis) for n in nodes}
    methods_used = {_method_of(n.target) for n in nodes}
    proto = _onnx_model(ep, plans, default_scales, methods_used, optimize)
    _add_sparseflow_metadata(proto, options.config, time.perf_counter() - t0)
    if check:
        import onnx

        onnx.checker.check_model(proto)
    if path is not None:
        _save_atomically(proto, path)
    return (proto, ep) if return_program else proto


def _checked_export_arguments(model, example_inputs, example_kwargs, path) -> nn.Module:
    """Type checks of ``export_onnx``'s arguments; the model to export (a compiled model's original)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        model = model._orig_mod
    if not isinstance(example_inputs, tuple):
        raise TypeError(f"example_inputs must be a tuple of positional inputs, got {type(example_inputs).__name__}")
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise TypeError(f"example_kwargs must be a dict or None, got {type(example_kwargs).__name__}")
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str, a path or None, got {type(path).__name__}")
    return model


def _rewritten_program(model, example_inputs, kwargs, dynamic_shapes, options):
    """``torch.export`` the model and rewrite its SDPA calls: ``(program, sparseflow op nodes)``;
    refuses a model in which no call was rewritten, with the rewrite's reasons."""
    from .passes.sdpa_rewrite import rewrite_graph

    ep = torch.export.export(model, example_inputs, kwargs, dynamic_shapes=dynamic_shapes)
    # no run_decompositions({}) here: the rewrite works on the training IR and the ONNX exporter
    # decomposes the program itself (one decomposition instead of two: half the export time)
    entries = rewrite_graph(ep.graph_module, options, graph_kind="export")
    ep.graph_module.recompile()
    nodes = _sparseflow_nodes(ep.graph_module)
    if not nodes:
        raise OnnxExportError(
            "export_onnx: no attention call was rewritten"
            + ("" if not entries else ": " + "; ".join(f"{e.tag or '<root>'}: {e.reason}" for e in entries))
        )
    return ep, nodes


def _checked_call_scale(n: torch.fx.Node) -> float:
    """Refuse an op call whose shapes or config the ONNX bodies cannot reproduce; else the
    softmax scale SDPA would use for it (1/sqrt(head dim)), for calls that leave it unset."""
    m = _method_of(n.target)
    tag = n.args[-1]
    q_val, k_val, v_val = (a.meta["val"] for a in n.args[:3])
    n_q, n_k = q_val.shape[2], k_val.shape[2]
    if str(n_q) != str(n_k):
        raise OnnxExportError(
            f"export_onnx: attention at {tag or '<root>'} has Nq={n_q} != Nk={n_k}; the ONNX nodes "
            "cover prefill/self-attention (Nq == Nk) only"
        )
    reason = _refusal(m, _cfg_of(m, n.args), n_k, tag)
    if reason:
        raise OnnxExportError("export_onnx: " + reason)
    if spec_for(m).sparse and str(v_val.shape[-1]) != str(q_val.shape[-1]):
        # the op runs dense attention then (sparseflow.ops._run); the sparse body would not
        raise OnnxExportError(
            f"export_onnx: attention at {tag or '<root>'} has value head dim {v_val.shape[-1]} != query "
            f"head dim {q_val.shape[-1]}, where the {m} op runs dense; export it with method='dense'"
        )
    d = _static_int(q_val.shape[-1])
    if d is None:
        raise OnnxExportError(f"export_onnx: head dim of {tag or '<root>'} is not static")
    return 1.0 / math.sqrt(d)


def _call_plan(n: torch.fx.Node, analysis: Dict[str, MaskAnalysisSummary]) -> _CallPlan:
    """How the node of one op call is written: its causality and mask rank, refusing a mask
    that the example run did not show to be causal and/or key padding, or that is not boolean."""
    tag = n.args[-1]
    mask = n.args[3]
    m = _method_of(n.target)
    if mask is None:
        return _CallPlan(tag, m, bool(n.args[4]), 0)
    mval = mask.meta["val"]
    supported, is_causal, why = analysis.get(tag, (False, False, "not reached on the example inputs"))
    if not supported:
        raise OnnxExportError(
            f"export_onnx: attention at {tag or '<root>'} gets an attn_mask the sparseflow ONNX nodes "
            f"cannot take ({why}); only causal / key-padding masks are exported"
        )
    if mval.dtype != torch.bool:
        raise OnnxExportError(
            f"export_onnx: attention at {tag or '<root>'} gets a {mval.dtype} attn_mask; only boolean "
            "masks are exported"
        )
    # the analysis read the mask with SDPA's broadcasting and folded the call's is_causal in
    return _CallPlan(tag, m, is_causal, mval.dim())


def _onnx_model(ep, plans: Dict[str, _CallPlan], default_scales: Dict[str, float], methods_used, optimize: bool):
    """The ONNX model of the rewritten program: one ``sparseflow`` node per op call, the
    function bodies of the node types used, and both opsets declared."""
    import onnx

    from .ops import op_for

    register_schemas()
    table = {op_for(m): _make_translation(m, plans, default_scales) for m in methods_used}
    onnx_program = torch.onnx.export(
        ep,
        (),
        dynamo=True,
        custom_translation_table=table,
        opset_version=OPSET,
        optimize=optimize,
        verbose=False,
    )
    proto = onnx_program.model_proto
    fns = function_protos()
    present = {(f.domain, f.name) for f in proto.functions}
    for m in sorted(methods_used):
        f = fns[m]
        if (f.domain, f.name) not in present:
            proto.functions.append(f)
    if not any(o.domain == DOMAIN for o in proto.opset_import):
        proto.opset_import.append(onnx.helper.make_opsetid(DOMAIN, DOMAIN_VERSION))
    if not any(o.domain == "" for o in proto.opset_import):
        proto.opset_import.append(onnx.helper.make_opsetid("", OPSET))
    return proto


def _add_sparseflow_metadata(proto, config: AttentionConfig, seconds: float) -> None:
    proto.metadata_props.add(key="sparseflow_method", value=config.method)
    proto.metadata_props.add(key="sparseflow_config", value=config.to_json())
    proto.metadata_props.add(key="sparseflow_export_seconds", value=f"{seconds:.2f}")


def _save_atomically(proto, path) -> None:
    """Write next to the target and rename: an interrupted save never leaves a partial model."""
    import onnx

    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    try:
        onnx.save_model(proto, tmp)
        os.replace(tmp, os.fspath(path))
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
