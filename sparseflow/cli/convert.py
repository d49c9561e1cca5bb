"""``sparseflow convert SRC --method pbs|pisa|bsa [--recipe NAME_OR_FILE] --out DIR``: HF folder or GGUF file ->
HF folder that reloads with the sparse attention (the logic is :func:`sparseflow.convert.convert`)."""

from __future__ import annotations

import argparse

from ..methods import sparse_names
from .common import BACKENDS, DTYPES, RECIPE_HELP, _error


def add_parser(sub) -> None:
    conv = sub.add_parser(
        "convert", help="convert a HF folder or GGUF file into a HF folder that runs sparse attention"
    )
    conv.add_argument("src", help="Hugging Face model folder (config.json + safetensors/bin) or a .gguf file")
    conv.add_argument("--method", required=True, choices=sparse_names())
    conv.add_argument("--out", required=True, help="output folder (written atomically)")
    conv.add_argument("--recipe", help=RECIPE_HELP)
    conv.add_argument(
        "--config", help="method config as JSON (or a JSON file); the fields it names change the recipe's config"
    )
    conv.add_argument("--dense-layers", help="comma list of layer indices kept dense (overrides the recipe's)")
    conv.add_argument("--backend", default="auto", choices=BACKENDS)
    conv.add_argument(
        "--dtype", default="auto", choices=DTYPES, help="weights dtype (auto: the checkpoint's; float32 for GGUF)"
    )
    conv.add_argument("--force", action="store_true", help="replace a non-empty output folder")
    conv.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..convert import ConversionError, convert, stderr_progress
    from ..recipes import RecipeError

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
