"""The progress file: every single-layer measurement, choice cost and whole-plan measurement of a
run, kept as it is made, so a rerun after an interruption measures only what is missing."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Dict, Optional

import torch

from ..eval.evaluate import weights_fingerprint
from .session import Session

logger = logging.getLogger("sparseflow")

PROGRESS_FORMAT = 1


class Progress:
    """Single-layer measurements (and whole-plan ones) kept in a JSON file, rewritten
    atomically after each one; a file made for other inputs (``key``) is started afresh."""

    def __init__(self, path: Optional[Path], key: str):
        self.path, self.key = path, key
        self.layers: Dict[str, Dict[str, float]] = {}
        self.plans: Dict[str, Dict[str, float]] = {}
        self.costs: Dict[str, float] = {}  # "layer:choice" -> the choice's cost, known before its KL
        self.texts: Dict[str, Dict[str, dict]] = {}  # a mix's texts: each one's own "layers" and "costs"
        if path is not None and path.is_file():
            self._read()

    def _read(self) -> None:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError) as exc:
            logger.warning("sparseflow calibrate: ignoring unreadable progress file %s: %s", self.path, exc)
            return
        if data.get("format") != PROGRESS_FORMAT or data.get("key") != self.key:
            logger.warning("sparseflow calibrate: progress file %s is for other inputs; starting afresh", self.path)
            return
        self.layers = dict(data.get("layers", {}))
        self.plans = dict(data.get("plans", {}))
        self.costs = dict(data.get("costs", {}))
        self.texts = dict(data.get("texts", {}))

    def section(self, text: str) -> "Section":
        """The measurements of one text of a mix, kept in this file."""
        return Section(self, text)

    def save(self) -> None:
        if self.path is None:
            return
        write_json_atomic(
            self.path,
            {
                "format": PROGRESS_FORMAT,
                "key": self.key,
                "layers": self.layers,
                "plans": self.plans,
                "costs": self.costs,
                **({"texts": self.texts} if self.texts else {}),  # a one-text file keeps its old form
            },
        )


class Section:
    """One text's single-layer measurements and choice costs inside a mix's :class:`Progress`
    (its ``layers`` and ``costs``, as a one-text run keeps them at the top of the file)."""

    def __init__(self, parent: Progress, text: str):
        part = parent.texts.setdefault(text, {})
        self.layers: Dict[str, Dict[str, float]] = part.setdefault("layers", {})
        self.costs: Dict[str, float] = part.setdefault("costs", {})
        self.parent = parent

    def save(self) -> None:
        self.parent.save()


def write_json_atomic(path: Path, payload) -> None:
    """Write ``payload`` as JSON to ``path`` through a temporary file: a reader never sees half of it."""
    tmp = Path(f"{path}.tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(payload, indent=2) + "\n")
        os.replace(tmp, path)
    finally:  # an error mid-write leaves no partial file
        if tmp.exists():
            tmp.unlink()


def progress_key(s: Session) -> str:
    """What the measurements depend on: weights, tokens, base config, backend, cost model. The
    choice grid is not part of it, so a rerun with more or fewer choices reuses what it shares."""
    h = hashlib.sha256()
    h.update(weights_fingerprint(s.model).encode())
    h.update(s.input_ids.to(torch.int64).cpu().numpy().tobytes())
    rope = getattr(s.model.config, "rope_parameters", None)
    h.update(
        json.dumps(
            [s.keep, s.method, s.base.to_dict(), s.backend, s.cost, str(rope)], sort_keys=True, default=str
        ).encode()
    )
    return h.hexdigest()[:24]
