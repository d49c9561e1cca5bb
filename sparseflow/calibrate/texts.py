"""Which texts a calibration measures on and checks on: a comma list of shipped texts from the
command line (:func:`parse_texts`), their tokens (:func:`text_tokens`), and the checks at
:func:`sparseflow.calibrate.calibrate`'s boundary (named tokens, no text both calibrated and held
out)."""

from __future__ import annotations

from typing import Dict, Iterable, Mapping, Optional, Tuple, Union

import torch

from ..checkpoints import real_tokens
from ..texts import LONG_TEXTS, TEXTS

# one text's [1, N] tokens, or text name -> tokens (a mix)
Texts = Union[torch.Tensor, Mapping[str, torch.Tensor]]

# The default mix: one text of each kind, each over 128K SmolLM2 tokens. On SmolLM2 at 2048 tokens
# and budget 0.01 a plan calibrated on pydoc_topics alone reached 12.3x the budget on copy_clauses
# and 1.8-2.0x on stdlib_source and copy_log; calibrated on this mix, its held-out KL was within
# 1.06x on a text of each kind (docs/results.md, "Calibration across kinds of text"). The CLI
# repeats both values (it imports only the standard library at the top); a test keeps them equal.
DEFAULT_TEXT = "pydoc_topics,stdlib_source,copy_clauses"
# one held-out text of each kind, none calibrating, each over 128K SmolLM2 tokens
DEFAULT_HELDOUT_TEXT = "stdlib_docs,more_stdlib_source,copy_log"


def parse_texts(value: Optional[str], arg: str) -> Tuple[str, ...]:
    """The shipped texts a comma list names (``None``: none), each once."""
    if value is None:
        return ()
    if not isinstance(value, str):
        raise TypeError(f"{arg} must be a comma list of text names (a str), got {type(value).__name__}")
    names = tuple(x.strip() for x in value.split(","))
    if not any(names) or not all(names):
        raise ValueError(f"{arg} must be a comma list of text names from {sorted(TEXTS)}, got {value!r}")
    unknown = [n for n in names if n not in TEXTS]
    if unknown:
        raise ValueError(f"{arg}: unknown text(s) {unknown}; pick from {sorted(TEXTS)}")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{arg} names {twice} more than once; name each text once")
    return names


def check_disjoint(calibration: Iterable[str], heldout: Iterable[str], arg: str) -> None:
    """A held-out text must not be a calibration text: the check would not be held out."""
    both = sorted(set(calibration) & set(heldout))
    if both:
        raise ValueError(f"{arg} names {both}, which calibrate the plan too: hold out other texts, or none")


def named_texts(ids: Texts, name: str, arg: str) -> Dict[str, torch.Tensor]:
    """``ids`` as text name -> ``[1, N]`` tokens (one tensor is the text ``name``)."""
    out = {name: ids} if isinstance(ids, torch.Tensor) else dict(ids) if isinstance(ids, Mapping) else None
    if out is None:
        raise TypeError(f"{arg} must be a [1, N] tensor or a mapping of text name to one, got {type(ids).__name__}")
    if not out:
        raise ValueError(f"{arg} must hold at least one text")
    for text, t in out.items():
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] != 1:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{arg}[{text!r}] must be [1, N] token ids, got {shape}")
    return out


def text_kinds(names: Iterable[str]) -> Dict[str, str]:
    """Each text's kind (prose, code, copy); ``other`` for a name that is not a shipped text."""
    return {n: TEXTS[n].kind if n in TEXTS else "other" for n in names}


def text_tokens(tok, n: int, names: Iterable[str], arg: str, device=None) -> Dict[str, torch.Tensor]:
    """``n`` tokens of each shipped text, or an error naming the command's argument."""
    out = {}
    for text in names:
        try:
            out[text] = real_tokens(tok, n, text=text).to(device)
        except ValueError as exc:
            longer = [t for t in LONG_TEXTS if t != text]
            raise ValueError(
                f"{arg}: {exc}; pick a longer text ({', '.join(longer)} hold over 128K SmolLM2 tokens) or fewer --tokens"
            ) from None
    return out


def kind_summary(fid: Mapping) -> str:
    """A fidelity's numbers per text: ``name (kind) KL k, top-1 t, density d`` joined by ``;``."""
    return "; ".join(
        f"{t} ({r['kind']}) KL {r['mean_kl']:.5f}, top-1 {r['top1']:.3f}, density {r['density']:.3f}"
        for t, r in fid["texts"].items()
    )
