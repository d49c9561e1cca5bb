"""Command line (``sparseflow`` console script and ``python -m sparseflow``), one module per subcommand:

* ``sparseflow demo`` (:mod:`.demo`): rewrite SmolLM2-135M with each method, print rewrites and fidelity;
* ``sparseflow convert SRC --method pbs|pisa|bsa [--recipe NAME_OR_FILE] --out DIR`` (:mod:`.convert`): HF folder
  or GGUF file -> HF folder that reloads with the sparse attention (see :mod:`sparseflow.convert`);
* ``sparseflow eval MODEL --method ... --tokens N [--json F] [--plots DIR] [--sweep F=V1,V2]
  [--no-permute]`` (:mod:`.eval`): fidelity vs dense on real text (mean/p99 KL, top-1, perplexity delta, density
  per layer and head), parameter sweeps as KL/top-1-vs-density curves, PNG plots;
  ``--task niah [--depths D1,D2] [--samples S] [--keys K]`` (:mod:`.niah`): passkey retrieval accuracy dense vs
  each method per depth (see :mod:`sparseflow.eval.niah`); ``--recall`` (:mod:`.recall`): PISA Recall@K diagnostic;
  ``--rope-scaling yarn:F|yarn:auto:N|linear:F|dynamic:F`` extends the context after loading (see
  :mod:`sparseflow.rope`);
* ``sparseflow export-onnx MODEL --method ... [--recipe NAME_OR_FILE] --out FILE`` (:mod:`.export_onnx`): ONNX
  file with one ``sparseflow``-domain node per attention layer (see :mod:`sparseflow.onnx_export`);
* ``sparseflow bench`` (:mod:`.bench`): each method's op vs dense SDPA on this device at a small size, plus (on
  CUDA) the package's PBS and PISA checks and op timings (see :mod:`sparseflow.bench`);
* ``sparseflow calibrate MODEL --method ... --kl-budget B --out recipe.json`` (:mod:`.calibrate`): a per-layer
  plan measured within a KL budget, written as a recipe file (see :mod:`sparseflow.calibrate`);
* ``sparseflow recipes`` (:mod:`.recipes`): list the shipped recipes.

Each subcommand module has ``add_parser(sub)`` (its arguments) and ``run(args)``; shared checks and argument
types are in :mod:`.common`. Modules import only the standard library at the top, so ``--help`` and argument
errors stay fast.

``--recipe`` takes a shipped recipe name, the path of a recipe ``.json`` file (written by
:meth:`sparseflow.recipes.Recipe.save`) or ``auto`` (the shipped recipe that fits the model, if any).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import sys
import threading
from typing import Iterator, List, Optional

from . import bench, calibrate, convert, demo, eval, export_onnx, recipes
from .common import UsageError, _error, _write_json_atomic

__all__ = ["main", "build_parser", "UsageError", "_write_json_atomic"]

COMMANDS = (demo, convert, eval, export_onnx, bench, calibrate, recipes)  # in the order --help lists them


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparseflow", description="Sparse attention for any PyTorch model.")
    p.add_argument("-v", "--verbose", action="store_true", help="log every rewrite decision and dense fallback")
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
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
    from ..convert import ConversionError
    from ..recipes import RecipeError

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
