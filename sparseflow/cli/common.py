"""What the subcommands share: the usage error, checks of paths the command reads or writes, argument
types (comma lists, bounded integers), the one-line error print and the atomic JSON write.

Only the standard library and the method registry (no torch) are imported here, so building the
parser stays light."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import List, Optional

from ..methods import or_list, sparse_names

BACKENDS = ("auto", "reference", "triton", "flex")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# sparseflow.texts.TEXTS and their kinds, repeated to keep the parser import-light (a test keeps them equal)
TEXT_KINDS = {
    "pydoc_topics": "prose",
    "stdlib_docs": "prose",
    "argparse_source": "code",
    "stdlib_source": "code",
    "more_stdlib_source": "code",
    "copy_clauses": "copy",
    "copy_log": "copy",
}
TEXTS_CHOICES = tuple(TEXT_KINDS)
TEXTS_HELP = ", ".join(f"{name} ({kind})" for name, kind in TEXT_KINDS.items())
RECIPE_HELP = "shipped recipe name (see `sparseflow recipes`), a recipe .json file, or auto"


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
        raise UsageError(f"--recipe {args.recipe!r} applies to --method: pass --method too ({or_list(sparse_names())})")


def _error(command: str, exc: object) -> int:
    print(f"sparseflow {command}: error: {exc}", file=sys.stderr)
    return 2


def _write_json_atomic(path: str, payload) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w") as fh:
            json.dump(payload, fh, indent=2)
        os.replace(tmp, path)
    finally:  # an error or SIGTERM mid-write leaves no partial file behind
        if os.path.exists(tmp):
            os.remove(tmp)


def _rope_label(info) -> str:
    """One line describing the RoPE scaling that :func:`sparseflow.rope.set_rope_scaling` applied."""
    if info["factor"] is None:
        return f"{info['spec']}: plain (trained length {info['original_max_position_embeddings']})"
    return (
        f"{info['spec']}: {info['rope_type']} x{info['factor']:g} over {info['original_max_position_embeddings']} "
        f"trained positions (attention scaling {info['attention_scaling']:.4f})"
    )


# --------------------------------------------------------------------------- argument types


def _comma_choices(text: str, allowed, message: str) -> List[str]:
    """The items of a comma list, each one of ``allowed``; ``message`` (formatted with the text)
    when one is not or the list is empty."""
    out = [x.strip() for x in text.split(",") if x.strip()]
    if not out or any(x not in allowed for x in out):
        raise argparse.ArgumentTypeError(message.format(text=repr(text)))
    return out


def _methods(text: str) -> List[str]:
    from ..config import METHODS

    return _comma_choices(text, METHODS, f"--methods must be a comma list of {sorted(METHODS)}, got {{text}}")


def _sparse_methods(text: str) -> List[str]:
    return _comma_choices(
        text, sparse_names(), f"--method must be {', '.join(sparse_names())} or a comma list of them, got {{text}}"
    )


def _backends(text: str) -> List[str]:
    return _comma_choices(
        text, BACKENDS, "--backends must be a comma list of auto, reference, triton, flex, got {text}"
    )


def _ints(text: str) -> List[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a comma list of ints, got {text!r}") from None
    if not out or any(x < 1 for x in out):
        raise argparse.ArgumentTypeError(f"must be a comma list of positive ints, got {text!r}")
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


def resolve_device(text: str):
    """``--device``: "auto" (the first CUDA device when there is one, else the CPU), "cpu",
    "cuda" or "cuda:N"; a UsageError naming the option for anything else or an absent GPU."""
    import torch

    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except RuntimeError:
        raise UsageError(f"--device must be auto, cpu, cuda or cuda:N, got {text!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device must be auto, cpu, cuda or cuda:N, got {text!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {text}: no CUDA device is available here; use --device cpu (or auto)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UsageError(f"--device {text}: only {torch.cuda.device_count()} CUDA device(s) here")
    return device


def device_label(model) -> str:
    """Where ``model`` ran, for a results file: the GPU's name, or the CPU."""
    import torch

    from ..eval.evaluate import model_device

    device = model_device(model)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
