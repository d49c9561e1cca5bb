"""PISA's selection against BSA's bf16 scan on a few shapes, one row each: the time of a walk with
its pyramid build, the scan's beside it, and a checksum of the selected blocks, so that two runs
of different code compare by their ratio to the scan and by their selections.

    python benchmarks/studies/pisa_select_rows.py --json pisa_select_rows.json

Rows: the paper's latency setting (Hq 32, Hkv 2, D 64, C 64, K 8) at 64K and 256K with the leaf
pairs in bf16; SmolLM2's heads (9, 3, 64) at 32K with the scan walk (fp32, the default there)
and at 128K with the leaf pairs in fp32 (the default there), bf16 and tf32.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Tuple

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

from common import bench, env_info, write_result  # noqa: E402
from pisa import pisa_inputs  # noqa: E402

ROWS = (
    (65536, (32, 2, 64), "leaf_pairs", "bf16"),
    (262144, (32, 2, 64), "leaf_pairs", "bf16"),
    (32768, (9, 3, 64), "scan", "fp32"),
    (131072, (9, 3, 64), "leaf_pairs", "fp32"),
    (131072, (9, 3, 64), "leaf_pairs", "bf16"),
    (131072, (9, 3, 64), "leaf_pairs", "tf32"),
)


def timed_selection(select) -> Tuple[int, float]:
    """``(checksum, ms)`` of a selection call: the sum of its selected block ids (two runs of
    different code compare by it), then its median time (:func:`common.bench`)."""
    checksum = int(select().long().sum().item())
    return checksum, bench(select)


def main() -> None:
    from sparseflow import Tuning
    from sparseflow.methods.bsa import triton_select as BT
    from sparseflow.methods.pisa import triton_select as PT

    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = []
    for n, (hq, hkv, d), walk, scores in ROWS:
        q, k, _ = pisa_inputs(n, hq, hkv, d)
        tuning = Tuning(pisa_walk=walk, pisa_scores=scores)

        def select():
            return PT.pisa_select(q, k, block_size=64, top_k=8, branching=2, tuning=tuning)

        checksum, ms = timed_selection(select)
        bsa = bench(lambda: BT.bsa_select(q, k, block_size=64, top_k=8, precision="bf16"))
        row = dict(n=n, heads=[hq, hkv, d], walk=walk, scores=scores, ms=ms, bsa_bf16_ms=bsa, checksum=checksum)
        rows.append(row)
        print(
            f"n={n:7d} heads={hq},{hkv},{d} {walk:10s} {scores}: {ms:8.3f} ms  BSA bf16 scan {bsa:8.3f} ms "
            f"({bsa / ms:5.2f}x)  checksum {checksum}",
            flush=True,
        )
        q = k = None
        torch.cuda.empty_cache()
    if a.json:
        write_result(a.json, env_info(), a, rows=rows)


if __name__ == "__main__":
    main()
