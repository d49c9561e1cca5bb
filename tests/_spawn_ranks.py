"""Run a gloo worker on ``world`` CPU processes and read back each rank's JSON results.

gloo can abort a process (``terminate called without an active exception``) on a loaded 2-core
machine, independent of the code under test. One such crash is retried once in a fresh folder:
a deterministic failure fails again and raises, so no failure is hidden."""

from __future__ import annotations

import json
import os
import warnings
from typing import Callable, List

import torch.multiprocessing as mp


def spawn_ranks(worker: Callable, world: int, make_dir: Callable[[], str], attempts: int = 2) -> List[dict]:
    """``worker(rank, world, folder)`` must write ``folder/rank{rank}.json``; returns them by rank."""
    for attempt in range(1, attempts + 1):
        folder = make_dir()
        try:
            mp.spawn(worker, args=(world, folder), nprocs=world, join=True)
        except mp.ProcessExitedException as exc:  # a signal, not a Python exception in a rank
            if attempt == attempts:
                raise
            warnings.warn(f"world {world}: {exc}; retrying once in a fresh folder")
            continue
        return [_read(folder, r) for r in range(world)]
    raise AssertionError("unreachable")


def _read(folder: str, rank: int) -> dict:
    with open(os.path.join(folder, f"rank{rank}.json")) as f:
        return json.load(f)
