"""End-to-end prefill on the real checkpoint: SmolLM2-135M-Instruct, real text, the whole model.

    python benchmarks/e2e_prefill.py --ns 8192,32768 --json benchmarks/results/e2e_prefill_h200.json
    python benchmarks/e2e_prefill.py --plot benchmarks/results/e2e_prefill_h200.json   # PNG from a JSON

For each length N (the text's tokens repeated to N) and RoPE variant (``plain``, and ``yarn``: YaRN
with factor N/8192 over the model's 8192 trained positions, only where N > 8192), one row per path:

* ``dense``: eager dense SDPA (transformers ``attn_implementation="sdpa"``): the reference time
  and the reference logits;
* ``compile_dense``: ``torch.compile`` of the same dense model;
* ``converted``: a setting applied through transformers' ``AttentionInterface`` (what a folder
  written by ``sparseflow convert`` runs; eager);
* ``compile``: ``sparseflow.compile`` on the dense model with the same setting.

A setting is a method at its defaults (``pbs``), a shipped recipe's method (``smollm2:pbs``) or a
recipe file's (``plan.json:pbs``, e.g. from ``sparseflow calibrate``).
Each row: median forward time (``logits_to_keep=1``, no KV cache, CUDA events), speedup over eager
dense in the same run, first-call seconds, density (mean over layers, dense layers count 1) and
fidelity against dense on the same RoPE variant over the last ``--eval-positions`` positions
(mean KL, top-1, perplexity). JSON carries GPU, versions and date.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import time
from typing import Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sparseflow  # noqa: E402
from common import env_info as common_env_info  # noqa: E402
from common import median_ms_per_call, use_scan_launch  # noqa: E402
from sparseflow.checkpoints import load_smollm2, real_text  # noqa: E402
from sparseflow.eval.evaluate import last_logits  # noqa: E402
from sparseflow.eval.fidelity import compare_logits  # noqa: E402
from sparseflow.rope import set_rope_scaling  # noqa: E402

TRAINED_POSITIONS = 8192
DEFAULT_SETTINGS = "pbs,pisa,bsa,smollm2:pbs,smollm2:pisa,smollm2:bsa,smollm2-code:pbs"


def env_info(device: str = "auto") -> Dict[str, object]:
    """:func:`common.env_info` (device, torch / Triton / CUDA / cuDNN versions, date) with the
    transformers version the whole-model runs depend on."""
    import transformers

    return {**common_env_info(device), "transformers": transformers.__version__}


# --------------------------------------------------------------------------- inputs and model


def repeated_tokens(tokenizer, text: str, n: int) -> torch.Tensor:
    """``[1, n]``: the text's tokens, repeated end to end until there are ``n``."""
    ids = tokenizer(real_text(text), return_tensors="pt").input_ids[0]
    reps = -(-n // ids.numel())
    return ids.repeat(reps)[:n][None]


def yarn_factor(n: int) -> float:
    return max(1.0, n / TRAINED_POSITIONS)


def set_rope(model, rope: str, n: int) -> Optional[float]:
    """Rebuild the model's rotary embedding for ``rope`` ("plain" or "yarn" at the factor ``n``
    needs over the trained length); returns the YaRN factor (None for plain)."""
    if rope not in ("plain", "yarn"):
        raise ValueError(f"rope must be 'plain' or 'yarn', got {rope!r}")
    return set_rope_scaling(model, "none" if rope == "plain" else f"yarn:auto:{n}")["factor"]


class _ByteTokenizer:
    """Token ids = UTF-8 bytes: enough to feed a randomly initialised model real text."""

    def __call__(self, text, return_tensors=None):
        ids = torch.tensor([list(text.encode("utf-8"))], dtype=torch.long)
        return type("Encoding", (), {"input_ids": ids})()


def random_smollm2(dtype):
    """SmolLM2-135M's configuration (30 layers, 9 query / 3 KV heads of 64) with random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(dtype).eval(), _ByteTokenizer()


# --------------------------------------------------------------------------- settings


def parse_tuning(spec: str) -> Dict[str, object]:
    """``field=value,...`` as :class:`sparseflow.Tuning` keywords (ints and true/false read as
    such), checked by building the Tuning."""
    out: Dict[str, object] = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"--tuning: expected field=value, got {item!r}")
        low = value.lower()
        out[key] = True if low == "true" else False if low == "false" else int(value) if value.isdigit() else value
    try:
        sparseflow.Tuning(**out)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"--tuning: {exc}") from None
    return out


def parse_settings(spec: str) -> List[str]:
    names = [s.strip() for s in spec.split(",") if s.strip()]
    for name in names:
        plan_parts(name)  # validate early
    return names


def plan_parts(name: str, n_tokens: Optional[int] = None):
    """``(method, config, dense_layers, layer_configs, recipe)`` of a setting name: ``pbs``,
    ``smollm2:pbs`` or a recipe file's ``plan.json:pbs``, with optional field changes ``smollm2:pbs@threshold=0.97+scoring=mean`` (applied
    to the base config; a recipe's per-layer changes are applied on top). A recipe with bands for
    longer prompts gives the band that ``n_tokens`` reaches (what the user's call would run)."""
    from sparseflow.config import default_config
    from sparseflow.recipes import resolve_recipe

    base, _, changes = name.partition("@")
    fields = {}
    for item in filter(None, changes.split("+")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"setting {name!r}: expected field=value after '@', got {item!r}")
        fields[key] = value
    if ":" in base:
        recipe_name, method = base.rsplit(":", 1)
        if recipe_name.strip().lower() == "auto":
            raise ValueError(f"setting {name!r}: name the recipe (or its .json file); 'auto' depends on the model")
        recipe = resolve_recipe(recipe_name)
        if n_tokens is not None:
            recipe = recipe.for_tokens(n_tokens, method)
        cfg = _replaced(recipe.config_for(method), fields)
        return method, cfg, tuple(recipe.dense_layers), recipe.layer_configs_for(method, cfg), recipe.name
    if base not in ("pbs", "pisa", "bsa"):
        raise ValueError(f"setting must be a method (pbs, pisa, bsa) or recipe:method, got {name!r}")
    return base, _replaced(default_config(base), fields), (), {}, None


def _replaced(cfg, fields: Dict[str, str]):
    from sparseflow.eval.sweep import parse_config_field

    return cfg.replace(**{k: parse_config_field(cfg.method, k, v) for k, v in fields.items()}) if fields else cfg


def converted_plan(
    name: str,
    backend: str,
    n_layers: int,
    cuda_graphs: bool = True,
    pisa_walk: str = "auto",
    pdl: bool = False,
    n_tokens: Optional[int] = None,
    tuning: Optional[Dict[str, object]] = None,
):
    from sparseflow.hf import Plan

    method, cfg, dense, per_layer, recipe = plan_parts(name, n_tokens)
    return Plan(
        method=method,
        config=cfg,
        backend=backend,
        dense_layers=dense,
        layer_configs=per_layer,
        recipe=recipe,
        num_layers=n_layers,
        tuning=sparseflow.Tuning(**{"cuda_graphs": cuda_graphs, "pisa_walk": pisa_walk, "pdl": pdl, **(tuning or {})}),
    )


def compile_kwargs(
    name: str,
    backend: str,
    cuda_graphs: bool = True,
    n_tokens: Optional[int] = None,
    tuning: Optional[Dict[str, object]] = None,
) -> Dict[str, object]:
    method, cfg, dense, per_layer, _ = plan_parts(name, n_tokens)
    layer_configs = dict(per_layer)
    layer_configs.update({i: None for i in dense})
    return dict(
        method=method,
        config=cfg,
        backend=backend,
        layer_configs=layer_configs or None,
        recipe=None,  # the named setting only, not a shipped recipe on top
        tuning=sparseflow.Tuning(**{"cuda_graphs": cuda_graphs, **(tuning or {})}),
    )


# --------------------------------------------------------------------------- measuring


def time_forward(model, ids: torch.Tensor, reps: int, warmup: int) -> Dict[str, float]:
    """Median / min forward time in ms (CUDA events), and the first call's wall seconds."""

    def call():
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False, logits_to_keep=1)

    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    t0 = time.perf_counter()
    call()
    sync()
    first = time.perf_counter() - t0
    for _ in range(max(0, warmup - 1)):
        call()
    sync()
    return {**median_ms_per_call(call, reps, ids.is_cuda), "first_call_s": first}


def fidelity_row(model, ids, dense_logits, eval_positions: int, record: bool = True) -> Dict[str, object]:
    """Fidelity of one forward (logits of the last positions) and, with ``record``, the density
    of its calls under capture (a model replayed from CUDA graphs cannot record: fidelity only)."""
    targets = ids[0, ids.shape[1] - eval_positions :]
    with sparseflow.capture(keep_selections=False) if record else contextlib.nullcontext() as cap:
        logits = last_logits(model, ids, eval_positions)
    fid = compare_logits(dense_logits, logits, targets)
    row = {
        "mean_kl": fid.mean_kl,
        "p99_kl": fid.p99_kl,
        "top1": fid.top1_agreement,
        "ppl_dense": fid.ppl_dense,
        "ppl": fid.ppl_sparse,
        "layers": model.config.num_hidden_layers,
    }
    if cap is None:
        return row
    dens = [c.density if c.density is not None else 1.0 for c in cap.calls]
    # a layer the rewrite left dense (a recipe's dense layer under sparseflow.compile) records no
    # call: it counts 1, as it does on the converted path, where it records a dense call
    dens += [1.0] * max(0, row["layers"] - len(dens))
    return {
        **row,
        "density": float(sum(dens) / len(dens)),
        "op_calls": len(cap.calls),
        "sparse_calls": sum(c.sparse for c in cap.calls),
        "fallbacks": sorted({c.reason for c in cap.calls if not c.sparse and c.reason})[:4],
    }


def replays_cuda_graphs(mode: Optional[str]) -> bool:
    # what sparseflow.compile reads too: Inductor's settings for the mode
    from torch._inductor import list_mode_options

    return mode is not None and bool(list_mode_options(mode).get("triton.cudagraphs"))


def measure(
    model,
    ids,
    path: str,
    setting: Optional[str],
    dense_logits,
    args,
    backend: Optional[str] = None,
    cuda_graphs: Optional[bool] = None,
) -> Dict[str, object]:
    row = {"path": path, "setting": setting, "backend": backend}
    if cuda_graphs is not None:
        row["cuda_graphs"] = cuda_graphs
    try:
        row.update(time_forward(model, ids, args.reps, args.warmup))
        if dense_logits is not None:
            graphs = path == "compile" and replays_cuda_graphs(args.compile_mode)
            row.update(fidelity_row(model, ids, dense_logits, args.eval_positions, record=not graphs))
    except Exception as exc:  # a failing row is reported, the run goes on
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    return row


def run_length(model, tok, n: int, rope: str, args, on_row=lambda row: None) -> List[Dict[str, object]]:
    """Every row at one length; ``on_row`` sees each as it is measured (a long run that is cut
    short keeps what it measured)."""
    factor = set_rope(model, rope, args.yarn_length or n)
    ids = repeated_tokens(tok, args.text, n).to(args.device)
    model.set_attn_implementation("sdpa")
    dense = last_logits(model, ids, args.eval_positions)
    base = {"n": n, "rope": rope, "yarn_factor": factor, "text": args.text}
    rows = []

    def emit(row):
        row = {**base, **row}
        rows.append(row)
        print(format_row(row), flush=True)
        on_row(row)

    emit(measure(model, ids, "dense", None, dense, args))
    n_layers = model.config.num_hidden_layers
    if "converted" in args.paths:
        for name in args.settings:
            for backend in args.backend:
                for graphs in args.cuda_graphs:
                    sparseflow.hf.apply_plan(
                        model, converted_plan(name, backend, n_layers, graphs, n_tokens=n, tuning=args.tuning)
                    )
                    emit(measure(model, ids, "converted", name, dense, args, backend, graphs))
                    model.set_attn_implementation("sdpa")
    if n in args.compile_ns:
        if "compile_dense" in args.paths:
            m = copy.deepcopy(model)
            m.compile(mode=args.compile_mode)
            emit(measure(m, ids, "compile_dense", None, dense, args))
            del m
        if "compile" in args.paths:
            for name in args.compile_settings:
                for backend in args.backend:
                    for graphs in args.cuda_graphs:
                        m = copy.deepcopy(model)
                        sparseflow.compile(
                            m, **compile_kwargs(name, backend, graphs, n, args.tuning), mode=args.compile_mode
                        )
                        emit(measure(m, ids, "compile", name, dense, args, backend, graphs))
                        if args.show_report:
                            print(sparseflow.report(m), flush=True)
                        del m
    torch.cuda.empty_cache() if ids.is_cuda else None
    dense_ms = rows[0].get("ms")
    for r in rows:
        if dense_ms and r.get("ms"):
            r["speedup"] = dense_ms / r["ms"]
    return rows


def format_row(r: Dict[str, object]) -> str:
    if "error" in r and "ms" not in r:
        return f"N={r['n']:6d} {r['rope']:5s} {r['path']:13s} {str(r['setting']):16s} ERROR {r['error']}"
    kl = f"KL {r['mean_kl']:.4f} top1 {r['top1']:.3f}" if "mean_kl" in r else ""
    dens = f"dens {r['density']:.3f}" if "density" in r else ""
    launch = {True: "graphs", False: "launched"}.get(r.get("cuda_graphs"), "")
    ppl = f"ppl {r['ppl']:.2f}" if "ppl" in r else ""
    return (
        f"N={r['n']:6d} {r['rope']:5s} {r['path']:13s} {str(r['setting'] or '-'):16s} "
        f"{r.get('backend') or '-':7s} {launch:8s} {r['ms']:9.2f} ms  first {r['first_call_s']:6.1f}s  {dens}  {kl}  {ppl}"
        + (f"  ERROR {r['error']}" if "error" in r else "")
    )


def print_table(rows: List[Dict[str, object]]) -> None:
    print("\n| N | rope | path | setting | backend | ms | speedup | density | mean KL | top-1 | ppl |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "ms" not in r:
            print(
                f"| {r['n']} | {r['rope']} | {r['path']} | {r['setting'] or '-'} | {r.get('backend') or '-'} | "
                f"error: {r.get('error')} |||||"
            )
            continue
        print(
            f"| {r['n']} | {r['rope']}{'' if not r.get('yarn_factor') else ' x%g' % r['yarn_factor']} | "
            f"{r['path']} | {r['setting'] or '-'} | {r.get('backend') or '-'}"
            f"{' (launched)' if r.get('cuda_graphs') is False else ''} | {r['ms']:.1f} | {r.get('speedup', float('nan')):.2f}x | "
            f"{r.get('density', float('nan')):.3f} | {r.get('mean_kl', float('nan')):.4f} | "
            f"{r.get('top1', float('nan')):.3f} | {r.get('ppl', float('nan')):.2f} |"
        )


# --------------------------------------------------------------------------- plot


def _series(row: Dict[str, object]) -> tuple:
    return (row["path"], row["setting"] or "-", row.get("backend") or "-")


def plot(json_path: str, png_path: Optional[str] = None) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as fh:
        data = json.load(fh)
    rows = [r for r in data["rows"] if "ms" in r]
    png_path = png_path or os.path.splitext(json_path)[0] + ".png"
    ropes = sorted({r["rope"] for r in rows})
    fig, axes = plt.subplots(len(ropes), 2, figsize=(13, 4.8 * len(ropes)), squeeze=False)
    for i, rope in enumerate(ropes):
        sub = [r for r in rows if r["rope"] == rope]
        ax_t, ax_k = axes[i]
        for key in sorted({_series(r) for r in sub}):
            pts = sorted((r["n"], r["ms"]) for r in sub if _series(r) == key)
            ax_t.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker="o",
                label=" ".join(key),
                lw=2.5 if key[0] == "dense" else 1.2,
                ls="--" if key[0] == "compile" else "-",
                color="black" if key[0] == "dense" else None,
            )
        ax_t.set(
            xscale="log",
            yscale="log",
            xlabel="tokens N",
            ylabel="forward ms (median)",
            title=f"SmolLM2-135M whole prefill, {rope} RoPE",
        )
        ax_t.legend(fontsize=7)
        for n in sorted({r["n"] for r in sub}):
            pts = [r for r in sub if r["n"] == n and r["path"] != "dense" and "mean_kl" in r and "speedup" in r]
            ax_k.scatter([r["speedup"] for r in pts], [max(r["mean_kl"], 1e-5) for r in pts], label=f"N={n}")
        ax_k.axvline(1.0, color="gray", lw=0.8)
        ax_k.set(
            yscale="log",
            xlabel="end-to-end speedup over eager dense SDPA",
            ylabel="mean KL vs dense",
            title=f"fidelity vs speed per setting ({rope} RoPE)",
        )
        ax_k.legend(fontsize=7)
    env = data.get("env", {})
    fig.suptitle(
        f"{env.get('gpu', '?')}, torch {env.get('torch')}, triton {env.get('triton')}, {env.get('date', '')[:10]}"
    )
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    return png_path


# --------------------------------------------------------------------------- main


def _backends(s: str) -> List[str]:
    from sparseflow.config import BACKENDS

    names = [b.strip() for b in s.split(",") if b.strip()]
    bad = [b for b in names if b not in BACKENDS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"backends must be a comma list of {list(BACKENDS)}, got {s!r}")
    return names


def _on_off(s: str) -> List[bool]:
    values = {"on": True, "off": False}
    names = [x.strip() for x in s.split(",") if x.strip()]
    if not names or any(x not in values for x in names):
        raise argparse.ArgumentTypeError(f"--cuda-graphs must be a comma list of on, off; got {s!r}")
    return [values[x] for x in names]


def _ints(s: str) -> List[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's arguments. By default it measures the whole grid: every setting on both paths
    at every length (hours of device time); ``--ns``, ``--compile-ns`` and the settings narrow it."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ns", type=_ints, default=[8192, 16384, 32768, 65536, 131072])
    ap.add_argument("--ropes", default="plain,yarn", help="comma list of plain, yarn")
    ap.add_argument(
        "--yarn-length",
        type=int,
        default=None,
        help="the yarn rows' model is extended to this many tokens at every N (e.g. 32768: YaRN x4 at 8K "
        "too, so one model's KL is compared across lengths); default: each N's own",
    )
    ap.add_argument("--text", default="pydoc_topics")
    ap.add_argument("--settings", type=parse_settings, default=parse_settings(DEFAULT_SETTINGS))
    ap.add_argument("--paths", default="converted,compile,compile_dense")
    ap.add_argument(
        "--compile-ns", type=_ints, default=None, help="lengths that also run the compile paths (default: every --ns)"
    )
    ap.add_argument(
        "--compile-settings",
        type=parse_settings,
        default=None,
        help="settings of the sparseflow.compile rows (default: the --settings)",
    )
    ap.add_argument(
        "--backend",
        type=_backends,
        default=["triton"],
        help="comma list of backends; each sparse row runs once per backend (e.g. auto,triton)",
    )
    ap.add_argument(
        "--compile-mode",
        default=None,
        choices=["default", "reduce-overhead", "max-autotune"],
        help="torch.compile mode of both compile paths (reduce-overhead: CUDA graphs)",
    )
    ap.add_argument(
        "--cuda-graphs",
        type=_on_off,
        default=[True],
        help="Tuning.cuda_graphs of the sparse rows: on (the default), off, or on,off for both side by side",
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--eval-positions", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--random-init",
        action="store_true",
        help="SmolLM2-135M's architecture with random weights and a byte tokenizer (timing and "
        "graph checks without the checkpoint; densities and fidelity are not the model's)",
    )
    ap.add_argument(
        "--tuning",
        type=parse_tuning,
        default={},
        help='sparseflow.Tuning fields of every sparse row, e.g. "pisa_walk=leaf_pairs,pisa_scores=bf16"',
    )
    ap.add_argument("--show-report", action="store_true", help="print sparseflow.report after each compile row")
    ap.add_argument(
        "--scan-launch",
        default="",
        help='PISA scan settings for the whole run (triton_select_scan.LAUNCH), e.g. "heads=loop,pair_unit=siblings"',
    )
    ap.add_argument("--json")
    ap.add_argument("--plot", metavar="JSON", help="only draw the PNG of an existing JSON")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    """The arguments, checked, with the compile rows' defaults filled in and ``paths`` / ``ropes``
    as lists."""
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.compile_ns is None:
        args.compile_ns = list(args.ns)
    if args.compile_settings is None:
        args.compile_settings = list(args.settings)
    if args.yarn_length is not None and args.yarn_length <= TRAINED_POSITIONS:
        ap.error(f"--yarn-length must exceed the trained {TRAINED_POSITIONS} positions, got {args.yarn_length}")
    for name, val in (("--reps", args.reps), ("--warmup", args.warmup), ("--eval-positions", args.eval_positions)):
        if val < 1:
            ap.error(f"{name} must be >= 1, got {val}")
    args.paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    bad = set(args.paths) - {"converted", "compile", "compile_dense"}
    if bad:
        ap.error(f"--paths takes converted, compile, compile_dense; got {sorted(bad)}")
    args.ropes = [r.strip() for r in args.ropes.split(",") if r.strip()]
    if set(args.ropes) - {"plain", "yarn"}:
        ap.error(f"--ropes takes plain, yarn; got {args.ropes}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plot:
        print(plot(args.plot))
        return 0
    ropes = args.ropes
    scan_launch = use_scan_launch(args.scan_launch)
    import sparseflow.hf  # noqa: F401  (registers the attention function on first apply_plan)

    t0 = time.perf_counter()
    if args.random_init:
        model, tok = random_smollm2(getattr(torch, args.dtype))
    else:
        model, tok = load_smollm2(dtype=getattr(torch, args.dtype))
    model.to(args.device)
    print(f"loaded SmolLM2 in {time.perf_counter() - t0:.1f}s on {args.device}", flush=True)
    rows: List[Dict[str, object]] = []
    out = {
        "env": env_info(),
        "args": {k: v for k, v in vars(args).items() if k != "plot"},
        "scan_launch": scan_launch,
        "rows": rows,
    }

    def save():
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(out, fh, indent=1, default=str)

    def keep(row):
        rows.append(row)
        save()

    for n in args.ns:
        for rope in ropes:
            if rope == "yarn" and (args.yarn_length or n) <= TRAINED_POSITIONS:
                continue
            run_length(model, tok, n, rope, args, on_row=keep)
            save()
    print_table(rows)
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
