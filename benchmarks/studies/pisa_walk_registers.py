"""Whether PISA's per-token walk gains from more programs an SM: the leaf-pairs walk timed with its
walk kernel capped at fewer registers a thread (Triton's ``maxnreg``), the caps alternating in
rounds on one machine, each with a checksum of the selected blocks.

    python benchmarks/studies/pisa_walk_registers.py --caps 0,96,80 --json pisa_walk_registers.json

Why: compiled for sm_90, the walk (one warp a program in the paper's setting) takes 128 registers a
thread, so an SM holds 16 of its programs; capped at 96 it holds 21 and at 80, 25, with no spill
and 4-8% more instructions a level. The walk issues one dependent load after another down the
pyramid, so more programs an SM may hide more of their latency. Cap 0 is the kernel as compiled.
Rows: the paper's latency setting (Hq 32, Hkv 2, D 64, C 64, K 8) at 64K and 256K and SmolLM2's
heads (9, 3, 64) at 128K, leaf pairs in bf16. The cap is a launch option given to the walk kernel
only (its ``run``), so the study measures it without changing the library.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

from common import env_info, write_result  # noqa: E402
from pisa import pisa_inputs  # noqa: E402
from pisa_select_rows import timed_selection  # noqa: E402

SHAPES = ((65536, (32, 2, 64)), (262144, (32, 2, 64)), (131072, (9, 3, 64)))


def _capped(kernel, cap: int):
    """``kernel.run`` with ``maxnreg=cap`` added to each launch (0: as compiled)."""
    run = kernel.run
    if cap:
        kernel.run = functools.partial(run, maxnreg=cap)
    return run


def main() -> None:
    from sparseflow import Tuning
    from sparseflow.methods.pisa import triton_select as PT
    from sparseflow.methods.pisa.triton_select_per_token import _pisa_select_kernel

    ap = argparse.ArgumentParser()
    ap.add_argument("--caps", default="0,96,80", help="comma list of register caps (0: none)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    caps = [int(c) for c in a.caps.split(",")]
    tuning = Tuning(pisa_walk="leaf_pairs", pisa_scores="bf16")
    rows = []
    for n, (hq, hkv, d) in SHAPES:
        q, k, _ = pisa_inputs(n, hq, hkv, d)

        def select():
            return PT.pisa_select(q, k, block_size=64, top_k=8, branching=2, tuning=tuning)

        for r in range(a.rounds):
            for cap in caps:
                run = _capped(_pisa_select_kernel, cap)
                try:
                    checksum, ms = timed_selection(select)
                finally:
                    _pisa_select_kernel.run = run
                row = dict(n=n, heads=[hq, hkv, d], cap=cap, round=r, ms=ms, checksum=checksum)
                rows.append(row)
                print(f"n={n:7d} heads={hq},{hkv},{d} cap {cap:3d} round {r}: {ms:8.3f} ms  checksum {checksum}")
        q = k = None
        torch.cuda.empty_cache()
    if a.json:
        write_result(a.json, env_info(), a, rows=rows)


if __name__ == "__main__":
    main()
