"""``sparseflow eval MODEL --method ... --tokens N [--json F] [--plots DIR] [--sweep F=V1,V2] [--no-permute]``:
fidelity vs dense on real text (mean/p99 KL, top-1, perplexity delta, density per layer and head), parameter
sweeps as KL/top-1-vs-density curves, PNG plots. ``--task niah`` is :mod:`sparseflow.cli.niah`, ``--recall``
:mod:`sparseflow.cli.recall`; ``--rope-scaling`` extends the context after loading (see :mod:`sparseflow.rope`)."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
from typing import NamedTuple

from ..methods import names_with
from ..eval.sweep import has_permute
from ..methods import sparse_names
from ..gguf_once import gguf_parsed_once
from .common import (
    BACKENDS,
    DTYPES,
    RECIPE_HELP,
    TEXTS_CHOICES,
    UsageError,
    _check_in_dir,
    _check_out_dir,
    _check_out_file,
    _check_recipe_has_method,
    _count,
    _error,
    _index,
    _positive,
    _rope_label,
    _sparse_methods,
    _write_json_atomic,
    device_label,
    resolve_device,
)
from .niah import _check_task, _niah
from .recall import _recall

# --------------------------------------------------------------------------- arguments


def add_parser(sub) -> None:
    ev = sub.add_parser("eval", help="fidelity and density vs the dense model on real text")
    _add_plan_arguments(ev)
    _add_run_arguments(ev)
    _add_diagnostic_arguments(ev)
    ev.set_defaults(func=run)


def _add_plan_arguments(ev: argparse.ArgumentParser) -> None:
    ev.add_argument("model", help="converted folder, Hugging Face model folder or .gguf file")
    ev.add_argument(
        "--method",
        type=_sparse_methods,
        default=None,
        help=f"{', '.join(sparse_names())} or a comma list (default: the plan recorded by `sparseflow convert`)",
    )
    ev.add_argument("--recipe", help=RECIPE_HELP + " (for --method)")
    ev.add_argument(
        "--config",
        help="method config as JSON (single --method only); with --recipe, the fields it names change the recipe's",
    )
    ev.add_argument("--dense-layers", help="comma list of layer indices kept dense")


def _add_run_arguments(ev: argparse.ArgumentParser) -> None:
    ev.add_argument("--tokens", type=_positive, default=2048, help="prompt length in tokens (default 2048)")
    ev.add_argument(
        "--eval-positions", type=_positive, default=512, help="next-token predictions compared (default 512)"
    )
    ev.add_argument("--backend", default="auto", choices=BACKENDS)
    ev.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="weights dtype (auto: the checkpoint's; a GGUF's fp32 on the CPU, bfloat16 on CUDA)",
    )
    ev.add_argument(
        "--device", default="auto", help="where the model runs: auto (cuda when present, else cpu), cpu, cuda or cuda:N"
    )
    ev.add_argument("--tokenizer", help="tokenizer folder when MODEL has none")
    ev.add_argument("--json", help="write the results to this JSON file")
    ev.add_argument(
        "--plots",
        help="write PNG plots into this folder: density per layer x head, one head's "
        "selected-block map, and the sweep's KL/top-1 vs density curves (needs matplotlib)",
    )
    ev.add_argument(
        "--text",
        default="pydoc_topics",
        choices=sorted(TEXTS_CHOICES),
        help="real text to evaluate on (default pydoc_topics)",
    )
    ev.add_argument(
        "--sweep",
        help="one config field and its values, e.g. threshold=0.8,0.9,0.95 (PBS) or "
        "top_k=4,8,16 (PISA/BSA): one point per value",
    )
    ev.add_argument(
        "--no-permute",
        action="store_true",
        help="PBS: also run every point with permute=False (the no-permutation baseline)",
    )
    ev.add_argument("--cache", help="folder caching the dense logits per model/text/length (reused across runs)")
    ev.add_argument(
        "--map-layer", type=_index, default=None, help="layer of the selected-block map (default: the middle one)"
    )
    ev.add_argument("--map-head", type=_index, default=0, help="query head of the selected-block map (default 0)")


def _add_diagnostic_arguments(ev: argparse.ArgumentParser) -> None:
    ev.add_argument(
        "--recall",
        action="store_true",
        help="instead of fidelity: PISA Recall@K / retained-mass diagnostic on the model's Q/K (reference: "
        "top-K blocks by group-averaged attention mass, queries >= 512, C=64, g=2; PISA lse/mean/"
        "mean_var, BSA and a flat exact-LSE scan)",
    )
    ev.add_argument("--recall-k", type=int, default=8, help="K for --recall, 3 forced blocks included (default 8)")
    ev.add_argument(
        "--recall-selectors",
        help="comma list of --recall selectors (default pisa_lse,pisa_mean,pisa_mean_var,bsa,flat_lse); "
        "a PISA selector may name a beam, pisa_<score>_beam<B>, e.g. "
        "pisa_lse,pisa_lse_beam2,pisa_lse_beam4,flat_lse",
    )
    ev.add_argument(
        "--task",
        default="fidelity",
        help="fidelity (default: KL/top-1/perplexity vs dense) or niah (passkey retrieval accuracy, dense "
        "vs each method, per depth)",
    )
    ev.add_argument(
        "--depths", default=None, help="--task niah: comma list of relative needle depths (default 0.1,0.5,0.9)"
    )
    ev.add_argument("--samples", type=_count, default=None, help="--task niah: prompts per depth (default 4)")
    ev.add_argument(
        "--keys",
        type=int,
        default=1,
        help="--task niah: pass keys per prompt (1, or more named keys of which the question asks one; default 1)",
    )
    ev.add_argument("--max-new-tokens", type=_count, default=8, help="--task niah: greedy tokens generated (default 8)")
    ev.add_argument(
        "--prompt",
        default=None,
        help="--task niah: prompt format, auto (the chat template when the tokenizer has one; default), chat or "
        "plain (a bare completion prompt)",
    )
    ev.add_argument(
        "--rope-scaling",
        default=None,
        help="RoPE scaling applied after loading: yarn:F, yarn:auto:N (factor N / trained length), "
        "linear:F, dynamic:F or none",
    )


# --------------------------------------------------------------------------- the command


class _Checked(NamedTuple):
    """What the checks before any weights load found: the task, the model and the plans to run."""

    task: str
    rope_scaling: object
    source: object
    model_config: object
    plans: list
    field: object  # the swept config field, or None


@gguf_parsed_once()  # one header parse for the config check and the load
def run(args: argparse.Namespace) -> int:
    from ..checkpoints import real_tokens
    from ..eval.evaluate import model_device
    from ..convert import ConversionError
    from ..recipes import RecipeError
    from ..rope import set_rope_scaling

    try:
        c = _check(args)
        if args.recall:
            if args.device not in ("auto", "cpu"):
                raise UsageError(f"--device {args.device}: --recall runs on the CPU; leave --device out")
            return _recall(args, c.source, c.model_config)
        map_at = _map_at(args, c.model_config) if args.plots else None
        model, tok = _load(args, c.source, c.model_config)
        rope_info = None if c.rope_scaling is None else set_rope_scaling(model, args.rope_scaling)
        if c.task == "niah":
            return _niah(args, model, tok, c.plans, c.source, rope_info)
        ids = real_tokens(tok, args.tokens, text=args.text).to(model_device(model))
    except (ConversionError, RecipeError, FileNotFoundError, ValueError, ImportError) as exc:
        return _error("eval", exc)
    return _fidelity(args, model, ids, c, rope_info, map_at)


def _check(args: argparse.Namespace) -> _Checked:
    """Every argument checked, the model's config read and the plans built, before any weights load."""
    from ..convert import check_architecture, load_config, resolve_source
    from ..rope import parse_rope_scaling

    _check_paths(args)
    task = _check_task(args)
    try:
        rope_scaling = parse_rope_scaling(args.rope_scaling)
    except ValueError as exc:
        raise UsageError(f"--rope-scaling: {exc}") from None
    source = resolve_source(args.model)
    model_config = load_config(source)
    check_architecture(model_config)
    _check_recipe_has_method(args)
    plans = _plans(args, model_config, source)
    if args.recall and (args.sweep or args.no_permute):
        raise ValueError("--recall is a diagnostic of its own: it takes no --sweep/--no-permute")
    if args.recall_selectors and not args.recall:
        raise ValueError("--recall-selectors chooses the selectors of --recall: pass --recall too")
    field = None
    if args.sweep or args.no_permute:
        plans, field = _swept(args, plans)
    if args.no_permute and not any(has_permute(p.method) for p in plans):
        permuting = names_with("has_permute")
        raise ValueError(
            f"--no-permute compares {'/'.join(n.upper() for n in permuting)} with and without "
            f"permutation: include {' or '.join(permuting)} in --method"
        )
    if task == "niah" and (args.recall or field or args.plots or args.cache):
        raise ValueError("--task niah takes no --recall/--sweep/--no-permute/--plots/--cache")
    return _Checked(task, rope_scaling, source, model_config, plans, field)


def _check_paths(args: argparse.Namespace) -> None:
    _check_out_file(args.json, "--json")
    _check_out_dir(args.plots, "--plots")
    _check_out_dir(args.cache, "--cache")
    _check_in_dir(args.tokenizer, "--tokenizer")
    if args.plots:
        from ..eval.plots import require_matplotlib

        require_matplotlib()  # fail now, not after a long run


def _plans(args: argparse.Namespace, model_config, source) -> list:
    """The plans of --method, else the one a converted folder recorded (none for --recall alone)."""
    from ..convert import ConversionError, build_plan
    from ..hf import PLAN_KEY, Plan

    recorded = getattr(model_config, PLAN_KEY, None)
    if args.method:
        config = args.config if len(args.method) == 1 else None
        return [
            build_plan(
                model_config,
                m,
                recipe=args.recipe,
                config=config,
                dense_layers=args.dense_layers,
                backend=args.backend,
                source=str(source),
            )
            for m in args.method
        ]
    if recorded is not None:
        plans = [Plan.from_dict(recorded)]
        if args.backend != "auto":
            import dataclasses

            plans = [dataclasses.replace(p, backend=args.backend) for p in plans]
        return plans
    if args.recall:
        return []
    raise ConversionError(
        f"{args.model} is not a converted model: pass --method ({', '.join(sparse_names())} or a comma list)"
    )


def _swept(args: argparse.Namespace, plans: list):
    """--sweep / --no-permute: one plan per point; returns the plans and the swept field."""
    from ..eval.sweep import parse_sweep, sweep_plans

    if args.sweep:
        field, values = parse_sweep(args.sweep)
    else:  # --no-permute alone: the plans as given, with and without permutation
        field, values = "threshold", None
    swept = []
    for p in plans:
        if values is None and not has_permute(p.method):
            swept.append(p)  # --no-permute alone only doubles the plans of permuting methods (PBS)
            continue
        vals = values if values is not None else [str(p.config.to_dict().get(field))]
        swept += sweep_plans(p, field, vals, no_permute=args.no_permute and has_permute(p.method))
    return swept, field


def _map_at(args: argparse.Namespace, model_config):
    """The (layer, head) of the selected-block map that --plots draws."""
    n_layers = int(model_config.num_hidden_layers)
    layer = n_layers // 2 if args.map_layer is None else args.map_layer
    if not (0 <= layer < n_layers):
        raise ValueError(f"--map-layer must be in [0, {n_layers - 1}], got {layer}")
    if not (0 <= args.map_head < int(model_config.num_attention_heads)):
        raise ValueError(f"--map-head must be in [0, {model_config.num_attention_heads - 1}], got {args.map_head}")
    return (layer, args.map_head)


def _load(args: argparse.Namespace, source, model_config=None):
    """The model and its tokenizer (--tokenizer's when given)."""
    from ..convert import ConversionError, load_source, stderr_progress

    device = resolve_device(args.device)
    stderr_progress(f"loading {source} ...")
    model, tok = load_source(source, dtype=args.dtype, device=device, config=model_config)
    model.to(device)
    args.device_label = device_label(model)
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    if tok is None:
        raise ConversionError(f"{args.model} has no tokenizer; pass --tokenizer PATH")
    return model, tok


# --------------------------------------------------------------------------- fidelity


def _fidelity(args: argparse.Namespace, model, ids, c: _Checked, rope_info, map_at) -> int:
    """``eval`` (--task fidelity): KL / top-1 / density per plan, JSON rewritten after each plan."""
    from ..convert import stderr_progress
    from ..eval.evaluate import evaluate_plans, format_density, format_results
    from ..eval.sweep import curve_points

    keep = min(args.eval_positions, args.tokens - 1)
    plans, field = c.plans, c.field
    stderr_progress(
        f"{args.tokens} tokens of {args.text}; fidelity over the last {keep} next-token predictions; "
        f"{len(plans)} plan(s)"
    )
    payload = _payload(args, c.source, keep, rope_info)
    if rope_info is not None:
        stderr_progress(f"RoPE scaling {_rope_label(rope_info)}")
    if field:
        payload["sweep"] = {"field": field, "no_permute": bool(args.no_permute), "points": []}

    def write_json(result) -> None:
        payload["results"].append(result.to_dict())
        stderr_progress(
            f"  {result.method} {_point_label(result, field)}: density {result.density:.3f}, "
            f"mean KL {result.fidelity.mean_kl:.4f}, top-1 {result.fidelity.top1_agreement:.3f} "
            f"({result.seconds:.0f} s)"
        )
        if field:
            payload["sweep"]["points"] += curve_points([result], field)
        if args.json:
            _write_json_atomic(args.json, payload)

    results = evaluate_plans(
        model, ids, plans, eval_positions=keep, cache_dir=args.cache, map_at=map_at, on_result=write_json
    )
    print(format_results(results))
    if not field:
        for r in results:
            print(f"\n{r.method}: density per layer (rows) and query head (columns)")
            print(format_density(r))
    if args.json:
        print(f"wrote {args.json}")
    if args.plots:
        _plots(results, args.plots, field, args.text, args.tokens)
    return 0


def _payload(args: argparse.Namespace, source, keep: int, rope_info) -> dict:
    """The JSON's header: what ran, on what, when; results are appended as they come."""
    import torch

    from ..checkpoints import TEXTS

    return {
        "model": str(source),
        "tokens": args.tokens,
        "eval_positions": keep,
        "text": args.text,
        "text_description": TEXTS[args.text][1],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "rope_scaling": rope_info,
        "device": args.device_label,
        "results": [],
    }


def _point_label(result, field) -> str:
    cfg = result.config
    parts = [f"{field}={cfg.get(field)}"] if field else []
    if has_permute(result.method) and not cfg.get("permute", True) and field != "permute":
        parts.append("no-permute")
    return " ".join(parts)


def _plots(results, folder: str, field, text: str, tokens: int) -> None:
    from ..eval.plots import block_map_plot, curve_plot, density_heatmap
    from ..eval.sweep import curve_points

    os.makedirs(folder, exist_ok=True)
    seen = {}
    for r in results:
        label = r.method + ("_" + _point_label(r, field).replace(" ", "_").replace("=", "") if field else "")
        n = seen[label] = seen.get(label, 0) + 1
        if n > 1:
            label += f"_{n}"
        desc = f"{r.method} {_point_label(r, field)}".strip()
        print(
            "wrote",
            density_heatmap(
                r.density_per_layer_head,
                f"{desc}: density (mean {r.density:.3f})",
                os.path.join(folder, f"density_{label}.png"),
            ),
        )
        if r.block_map is not None:
            layer, head = r.map_at
            print(
                "wrote",
                block_map_plot(
                    r.block_map,
                    f"{desc}: layer {layer}, head {head}, {tokens} tokens",
                    os.path.join(folder, f"blockmap_{label}.png"),
                ),
            )
    if field:
        pts = curve_points(results, field)
        print(
            "wrote",
            curve_plot(
                pts,
                f"{text}, {tokens} tokens: KL vs density ({field})",
                os.path.join(folder, "sweep_kl_vs_density.png"),
            ),
        )
        print(
            "wrote",
            curve_plot(
                pts,
                f"{text}, {tokens} tokens: top-1 vs density ({field})",
                os.path.join(folder, "sweep_top1_vs_density.png"),
                y="top1",
                log_y=False,
            ),
        )
