"""``sparseflow calibrate MODEL --method ... --kl-budget B --out recipe.json``: a per-layer plan measured within a
KL budget, written as a recipe file (the logic is :func:`sparseflow.calibrate.calibrate_file`)."""

from __future__ import annotations

import argparse
import math

from ..methods import sparse_names
from .common import (
    BACKENDS,
    DTYPES,
    TEXTS_HELP,
    UsageError,
    _check_in_dir,
    _check_out_file,
    _error,
    _positive,
    resolve_device,
)


DEFAULT_MARGIN = 0.7  # sparseflow.calibrate.DEFAULT_MARGIN (tests/test_calibrate.py keeps them equal)
# sparseflow.calibrate.texts.DEFAULT_TEXT / DEFAULT_HELDOUT_TEXT (the same test keeps them equal)
DEFAULT_TEXT = "pydoc_topics,stdlib_source,copy_clauses"
DEFAULT_HELDOUT_TEXT = "stdlib_docs,more_stdlib_source,copy_log"


def add_parser(sub) -> None:
    cal = sub.add_parser(
        "calibrate", help="measure a per-layer plan within a KL budget on real text; write a recipe file"
    )
    cal.add_argument("model", help="Hugging Face model folder, .gguf file or converted folder (run dense)")
    cal.add_argument("--method", required=True, choices=sparse_names())
    cal.add_argument(
        "--kl-budget",
        type=float,
        required=True,
        help="whole-model mean KL vs dense allowed on the text the model serves (nats, e.g. 0.01); the plan "
        "aims at --margin of it on the calibration text",
    )
    cal.add_argument(
        "--out",
        required=True,
        help="the recipe .json file to write (atomically); progress is kept in "
        "OUT.progress.json, dense logits in OUT.cache/",
    )
    cal.add_argument("--tokens", type=_positive, default=2048, help="calibration length in tokens (default 2048)")
    cal.add_argument(
        "--eval-positions", type=_positive, default=512, help="next-token predictions compared (default 512)"
    )
    cal.add_argument(
        "--text",
        default=DEFAULT_TEXT,
        help="calibration text, or a comma list of texts measured together (a mix: the plan's KL must fit on "
        f"the worst of them); shipped texts: {TEXTS_HELP} (default {DEFAULT_TEXT}: one of each kind)",
    )
    cal.add_argument(
        "--heldout-text",
        default=DEFAULT_HELDOUT_TEXT,
        help="text(s) the plan is checked on afterwards, a comma list reported per text and kind, none of them a "
        f"--text (default {DEFAULT_HELDOUT_TEXT}: one of each kind, each over 128K SmolLM2 tokens; none to skip)",
    )
    cal.add_argument("--config", help="base method config as JSON (block sizes ...); the choices change its fields")
    cal.add_argument("--thresholds", help="PBS thresholds to try (default 0.9,0.95,0.98,0.99)")
    cal.add_argument(
        "--scorings", help="PBS scorings to try (default sampled_rows,mean; moments and antidiagonal are accepted too)"
    )
    cal.add_argument("--top-ks", help="PISA/BSA top_k values to try (default 8,16,32)")
    cal.add_argument(
        "--safety",
        type=float,
        default=0.8,
        help="share of the calibration target (--margin x --kl-budget) the single-layer KLs may sum to before "
        "the whole plan is measured (default 0.8)",
    )
    cal.add_argument(
        "--margin",
        type=float,
        default=DEFAULT_MARGIN,
        help="share of the budget the plan may use on the calibration text; the rest is headroom for "
        f"other text (default {DEFAULT_MARGIN:g})",
    )
    cal.add_argument(
        "--cost",
        default="auto",
        choices=["auto", "density", "time"],
        help="cost model: density (+ estimate overhead) or the op's measured time (auto: time on CUDA)",
    )
    cal.add_argument("--backend", default="auto", choices=BACKENDS)
    cal.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPES,
        help="weights dtype (auto: the checkpoint's; a GGUF's fp32 on the CPU, bfloat16 on CUDA)",
    )
    cal.add_argument(
        "--device", default="auto", help="where the model runs: auto (cuda when present, else cpu), cpu, cuda or cuda:N"
    )
    cal.add_argument("--tokenizer", help="tokenizer folder when MODEL has none")
    cal.add_argument("--cache", help="folder caching the dense logits (default OUT.cache)")
    cal.add_argument("--name", help="the recipe's name (default calibrated-<model type>-<method>)")
    cal.add_argument("--rope-scaling", default=None, help="RoPE scaling applied after loading (as for eval)")
    cal.add_argument(
        "--measure-all",
        action="store_true",
        help="measure every single-layer choice of the grid (default: only those that can change the "
        "plan, which gives the same plan; the skipped ones are listed in the recipe's measured)",
    )
    cal.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``sparseflow calibrate``: the logic is :func:`sparseflow.calibrate.calibrate_file`."""
    from ..calibrate import calibrate_file
    from ..convert import stderr_progress

    _check_args(args)
    values = _choices(args)
    try:
        device = resolve_device(args.device)
        calibrate_file(
            args.model,
            args.out,
            method=args.method,
            kl_budget=args.kl_budget,
            tokens=args.tokens,
            eval_positions=args.eval_positions,
            text=args.text,
            heldout_text=None if args.heldout_text == "none" else args.heldout_text,
            config=args.config,
            safety=args.safety,
            margin=args.margin,
            cost=args.cost,
            backend=args.backend,
            dtype=args.dtype,
            tokenizer=args.tokenizer,
            rope_scaling=args.rope_scaling,
            cache_dir=args.cache,
            name=args.name,
            say=stderr_progress,
            device=device,
            prune=not args.measure_all,
            **values,
        )
    except ValueError as exc:  # ConversionError and RecipeError are ValueErrors: all describe the input
        return _error("calibrate", exc)
    return 0


def _check_args(args: argparse.Namespace) -> None:
    if not (0.0 < args.kl_budget < math.inf):
        raise UsageError(f"--kl-budget must be a positive, finite mean KL in nats (e.g. 0.01), got {args.kl_budget:g}")
    if not (0.0 < args.safety <= 1.0):
        raise UsageError(
            f"--safety must be in (0, 1] (the share of the calibration target the single-layer KLs may sum to), "
            f"got {args.safety:g}"
        )
    if not (0.0 < args.margin <= 1.0):
        raise UsageError(
            f"--margin must be in (0, 1] (the share of the budget the plan may use on the calibration text), "
            f"got {args.margin:g}"
        )
    if args.eval_positions >= args.tokens:
        raise UsageError(f"--eval-positions must be < --tokens={args.tokens}, got {args.eval_positions}")
    _check_knob_flags(args)
    _check_out_file(args.out, "--out", "recipe.json")
    _check_in_dir(args.tokenizer, "--tokenizer")


def _check_knob_flags(args: argparse.Namespace) -> None:
    """--top-ks only for a method with top_k, --thresholds/--scorings only for one with a threshold."""
    from ..methods import names_with, spec_for

    spec = spec_for(args.method)
    top_k, threshold = ("/".join(n.upper() for n in names_with(c)) for c in ("has_top_k", "has_threshold"))
    if not spec.has_top_k and args.top_ks is not None:
        raise UsageError(f"--top-ks is a {top_k} choice; {args.method.upper()} takes --thresholds and --scorings")
    if not spec.has_threshold and (args.thresholds is not None or args.scorings is not None):
        raise UsageError(f"--thresholds/--scorings are {threshold} choices; {args.method} takes --top-ks")


def _choices(args: argparse.Namespace) -> dict:
    """The candidate values of --thresholds / --top-ks / --scorings (None: the defaults)."""
    from ..calibrate import parse_values

    try:
        return dict(
            thresholds=parse_values(args.thresholds, float, "--thresholds"),
            top_ks=parse_values(args.top_ks, int, "--top-ks"),
            scorings=parse_values(args.scorings, str, "--scorings"),
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
