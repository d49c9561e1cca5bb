"""``sparseflow eval --recall [--recall-k K] [--recall-selectors S1,S2]``: PISA Recall@K / retained-mass diagnostic
on the model's real Q/K (the logic is :func:`sparseflow.eval.attention_mass.recall_diagnostic`)."""

from __future__ import annotations

import argparse
import datetime
import os
import platform

from .common import _write_json_atomic

BLOCK_SIZE, BRANCHING = 64, 2  # the reference setting the diagnostic measures (C=64, g=2)


def _recall(args: argparse.Namespace, source, model_config) -> int:
    """``eval --recall``: PISA Recall@K / retained-mass diagnostic on the model's real Q/K."""
    import torch

    from ..eval.attention_mass import recall_diagnostic
    from ..checkpoints import TEXTS, real_tokens
    from ..convert import load_source, stderr_progress

    selectors = _selectors(args)
    stderr_progress(f"loading {source} ...")
    model, tok = load_source(source, dtype=args.dtype)
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    ids = real_tokens(tok, args.tokens, text=args.text)
    q_start = min(512, args.tokens - 1)
    stderr_progress(
        f"Recall@{args.recall_k} (C=64, g=2, 3 forced) over queries >= {q_start} of {args.tokens} tokens of {args.text}"
    )
    report = recall_diagnostic(
        model,
        ids,
        selectors=selectors,
        top_k=args.recall_k,
        block_size=BLOCK_SIZE,
        branching=BRANCHING,
        q_start=q_start,
        progress=stderr_progress,
    )
    report.update(
        model=str(source),
        text=args.text,
        text_description=TEXTS[args.text][1],
        torch=torch.__version__,
        python=platform.python_version(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
    _print_table(report, selectors)
    if args.json:
        _write_json_atomic(args.json, report)
        print(f"wrote {args.json}")
    if args.plots:
        _plots(report, selectors, args)
    return 0


def _selectors(args: argparse.Namespace) -> list:
    """--recall-k and --recall-selectors checked; the selectors to compare."""
    from ..eval.attention_mass import TOPK_SELECTORS, check_selectors

    if args.recall_k < 4:
        raise ValueError(f"--recall-k must be >= 4 (3 forced blocks + 1), got {args.recall_k}")
    selectors = list(TOPK_SELECTORS)
    if args.recall_selectors:
        selectors = [x.strip() for x in args.recall_selectors.split(",") if x.strip()]
        try:
            selectors = check_selectors(selectors)
        except ValueError as e:
            raise ValueError(f"--recall-selectors: {e}") from None
    return selectors


def _print_table(report: dict, selectors: list) -> None:
    w = max(14, *(len(s) for s in selectors))
    head = f"{'selector':<{w}} {'Recall@K':>9} {'free recall':>11} {'retained mass':>13}"
    print(head + "\n" + "-" * len(head))
    for s in selectors + ["oracle"]:
        m = report["mean"][s]
        print(
            f"{s:<{w}} {m.get('recall', float('nan')):>9.3f} {m.get('recall_free', float('nan')):>11.3f} "
            f"{m['retained_mass']:>13.3f}"
        )


def _plots(report: dict, selectors: list, args: argparse.Namespace) -> None:
    from ..eval.plots import bar_plot, curve_plot

    title = f"{args.text}, {args.tokens} tokens, K={args.recall_k}, C=64"
    print(
        "wrote",
        bar_plot(
            {s: report["mean"][s] for s in selectors},
            f"Recall@K / retained mass: {title}",
            os.path.join(args.plots, "recall_mean.png"),
        ),
    )
    pts = [
        {"series": s, "layer": r["layer"], "recall_free": r[s]["recall_free"], "value": ""}
        for r in report["layers"]
        for s in selectors
    ]
    print(
        "wrote",
        curve_plot(
            pts,
            f"free-block recall per layer: {title}",
            os.path.join(args.plots, "recall_per_layer.png"),
            x="layer",
            y="recall_free",
            log_y=False,
        ),
    )
