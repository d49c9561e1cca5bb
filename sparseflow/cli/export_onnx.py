"""``sparseflow export-onnx MODEL --method ... [--recipe NAME_OR_FILE] --out FILE``: ONNX file with one
``sparseflow``-domain node per attention layer (the logic is :mod:`sparseflow.onnx_export`)."""

from __future__ import annotations

import argparse

from ..methods import or_list
from ..methods import sparse_names
from ..gguf_once import gguf_parsed_once
from .common import DTYPES, RECIPE_HELP, _check_out_file, _check_recipe_has_method, _error, _positive


def add_parser(sub) -> None:
    onx = sub.add_parser(
        "export-onnx",
        help="export a HF folder, GGUF file or converted folder to ONNX with "
        "sparseflow-domain attention nodes (see docs/onnx.md)",
    )
    onx.add_argument("model", help="Hugging Face model folder, .gguf file or converted folder")
    onx.add_argument("--method", choices=sparse_names(), help="required unless MODEL is a converted folder")
    onx.add_argument("--recipe", help=RECIPE_HELP + " (for --method)")
    onx.add_argument(
        "--config", help="method config as JSON (or a JSON file); the fields it names change the recipe's config"
    )
    onx.add_argument("--dense-layers", help="comma list of layer indices kept dense")
    onx.add_argument(
        "--tokens",
        type=_positive,
        default=256,
        help="length of the example used for tracing (default 256; the file's length is dynamic)",
    )
    onx.add_argument("--dtype", default="auto", choices=DTYPES)
    onx.add_argument("--out", required=True, help="the .onnx file to write")
    onx.set_defaults(func=run)


def _require_onnx() -> None:
    # onnx_export imports onnx/onnxscript only inside export_onnx: check them before any work
    import importlib

    for name in ("onnx", "onnxscript"):
        importlib.import_module(name)


@gguf_parsed_once()  # one header parse for the config check and the load
def run(args: argparse.Namespace) -> int:
    """HF folder / GGUF / converted folder -> ONNX file with one ``sparseflow`` node per layer."""
    import time

    import torch

    from ..convert import ConversionError, load_config, load_source, resolve_source, stderr_progress

    try:
        _require_onnx()
        from ..onnx_export import export_onnx
    except ImportError as exc:
        return _error(
            "export-onnx", f"ONNX export needs onnx, onnxscript and onnxruntime (pip install 'sparseflow[onnx]'): {exc}"
        )
    try:
        _check_out_file(args.out, "--out", example="model.onnx")
        source = resolve_source(args.model)
        model_config = load_config(source)
        plan = _plan(args, model_config, source)
        stderr_progress(f"loading {source} ...")
        model, _ = load_source(source, dtype=args.dtype, config=model_config)
        vocab = int(getattr(model.config, "vocab_size", 0) or 0)
        if vocab < 1:
            raise ConversionError(f"{args.model}: the model config has no vocab_size to draw example tokens from")
        # the example only fixes what tracing needs; the exported length is dynamic
        ids = torch.randint(0, vocab, (1, args.tokens), generator=torch.Generator().manual_seed(0))
        stderr_progress(f"exporting {plan.method} ({plan.config.to_json()}) with a {args.tokens}-token example ...")
        t0 = time.perf_counter()
        proto = export_onnx(
            model,
            (ids,),
            args.out,
            method=plan.method,
            config=plan.config,
            skip_layers=plan.dense_layers,
            layer_configs=dict(plan.layer_configs) or None,
            example_kwargs={"use_cache": False},
        )
    except (ConversionError, ValueError, TypeError, FileNotFoundError) as exc:
        return _error("export-onnx", exc)
    nodes = [n.op_type for n in proto.graph.node if n.domain == "sparseflow"]
    kinds = ", ".join(f"{nodes.count(t)} {t}" for t in sorted(set(nodes)))
    print(f"wrote {args.out}: {kinds} node(s), dynamic sequence length, {time.perf_counter() - t0:.1f} s")
    return 0


def _plan(args: argparse.Namespace, model_config, source):
    """The plan of --method, else the one a converted folder recorded (export what it runs)."""
    from ..convert import ConversionError, build_plan
    from ..hf import PLAN_KEY, Plan

    recorded = getattr(model_config, PLAN_KEY, None)
    _check_recipe_has_method(args)
    if args.method:
        return build_plan(
            model_config,
            args.method,
            recipe=args.recipe,
            config=args.config,
            dense_layers=args.dense_layers,
            source=str(source),
        )
    if recorded is not None:
        return Plan.from_dict(recorded)
    raise ConversionError(f"{args.model} is not a converted model: pass --method ({or_list(sparse_names())})")
