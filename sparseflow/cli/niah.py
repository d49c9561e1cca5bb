"""``sparseflow eval --task niah [--depths D1,D2] [--samples S] [--keys K] [--prompt auto|chat|plain]``: passkey retrieval accuracy, dense vs
each method, per depth (the logic is :mod:`sparseflow.eval.niah`)."""

from __future__ import annotations

import argparse
import datetime
import platform

from .common import UsageError, _rope_label, _write_json_atomic

TASKS = ("fidelity", "niah")


def _check_task(args: argparse.Namespace) -> str:
    """The eval task, and its own arguments checked before any weights load."""
    from ..eval.niah import PROMPT_FORMATS, parse_depths

    if args.task not in TASKS:
        raise UsageError(f"--task must be one of {', '.join(TASKS)}, got {args.task!r}")
    if args.task == "niah":
        args.depths = parse_depths(args.depths if args.depths is not None else "0.1,0.5,0.9")
        if not (1 <= args.keys <= 10):
            raise UsageError(f"--keys must be in [1, 10] (1: one pass key, more: named keys), got {args.keys}")
        args.prompt = args.prompt if args.prompt is not None else "auto"
        if args.prompt not in PROMPT_FORMATS:
            raise UsageError(f"--prompt must be one of {', '.join(PROMPT_FORMATS)}, got {args.prompt!r}")
    elif args.depths is not None or args.samples is not None or args.keys != 1 or args.prompt is not None:
        raise UsageError("--depths/--samples/--keys/--prompt are for --task niah")
    return args.task


def _niah(args: argparse.Namespace, model, tok, plans, source, rope_info) -> int:
    """``eval --task niah``: passkey retrieval accuracy, dense vs each plan, per depth."""
    from ..convert import stderr_progress
    from ..eval.niah import format_niah, prompt_format, run_niah

    samples = args.samples if args.samples is not None else 4
    try:
        args.prompt = prompt_format(tok, args.prompt)
    except ValueError as e:
        raise UsageError(str(e)) from None
    payload = _payload(args, source, samples, rope_info)
    if rope_info is not None:
        stderr_progress(f"RoPE scaling {_rope_label(rope_info)}")
    stderr_progress(
        f"needle retrieval: {args.tokens} tokens of {args.text}, {args.keys} key(s), depths {args.depths}, "
        f"{samples} sample(s) per depth, {args.prompt} prompt; dense + {len(plans)} plan(s)"
    )

    def on_result(r) -> None:
        payload["results"].append(r)
        stderr_progress(f"  {r['name']}: accuracy {r['accuracy']:.2f}, prefill density {r['density']:.3f}")
        if args.json:
            _write_json_atomic(args.json, payload)

    results = run_niah(
        model,
        tok,
        plans,
        n_tokens=args.tokens,
        depths=args.depths,
        samples=samples,
        keys=args.keys,
        text=args.text,
        prompt=args.prompt,
        max_new_tokens=args.max_new_tokens,
        on_result=on_result,
        progress=stderr_progress,
    )
    print(format_niah(results, args.depths))
    if args.json:
        print(f"wrote {args.json}")
    return 0


def _payload(args: argparse.Namespace, source, samples: int, rope_info) -> dict:
    """The JSON's header: what ran, on what, when; results are appended as they come."""
    import torch

    from ..checkpoints import TEXTS

    return {
        "task": "niah",
        "model": str(source),
        "tokens": args.tokens,
        "depths": args.depths,
        "samples": samples,
        "keys": args.keys,
        "max_new_tokens": args.max_new_tokens,
        "prompt": args.prompt,
        "text": args.text,
        "text_description": TEXTS[args.text][1],
        "rope_scaling": rope_info,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
        "device": args.device_label,
        "results": [],
    }
