"""Whether PISA's leaf pairs gain from taking an eighth of their exponentials on the FMA units: the
selection timed with the library's split (``fma_exps``) and without it, alternating in rounds on
one machine, each with a checksum of the selected blocks and the leaf-pairs kernel's own time.

    python benchmarks/studies/pisa_fma_exps.py --json pisa_fma_exps.json

Why: compiled for sm_90, the leaf pairs' loop issues 417 instructions a chunk, 64 of them
exponentials a thread, and Hopper's special function unit takes 8 cycles a warp for each: about
544 cycles of exponentials against 417 of issue. A polynomial ``2**x`` costs about 9 FMA-unit
instructions, so an eighth of the exponentials moved (the columns one register holds in the
tensor cores' layout) gives about 490 of each. Rows: the paper's latency setting (Hq 32, Hkv 2, D
64, C 64, K 8) at 64K and 256K, SmolLM2's heads (9, 3, 64) at 32K (the scan walk) and 128K, bf16
scores. "off" patches the launch's ``fma_exps`` to 0, without changing the library.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

from common import env_info, kernel_us_per_call, write_result  # noqa: E402
from pisa import pisa_inputs  # noqa: E402
from pisa_select_rows import timed_selection  # noqa: E402

SHAPES = (
    (65536, (32, 2, 64), "leaf_pairs"),
    (262144, (32, 2, 64), "leaf_pairs"),
    (32768, (9, 3, 64), "scan"),
    (131072, (9, 3, 64), "leaf_pairs"),
)


def main() -> None:
    from sparseflow import Tuning
    from sparseflow.methods.pisa import triton_select as PT
    from sparseflow.methods.pisa import triton_select_scan as scan

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    library = scan.fma_exps
    rows = []
    for n, (hq, hkv, d), walk in SHAPES:
        q, k, _ = pisa_inputs(n, hq, hkv, d)
        tuning = Tuning(pisa_walk=walk, pisa_scores="bf16")

        def select():
            return PT.pisa_select(q, k, block_size=64, top_k=8, branching=2, tuning=tuning)

        for r in range(a.rounds):
            for variant in ("on", "off"):
                scan.fma_exps = library if variant == "on" else (lambda *args: 0)
                try:
                    checksum, ms = timed_selection(select)
                    pairs_ms = kernel_us_per_call(select, name="_leaf_pairs_kernel") / 1000.0
                finally:
                    scan.fma_exps = library
                row = dict(n=n, heads=[hq, hkv, d], walk=walk, fma_exps=variant, round=r, ms=ms, leaf_pairs_ms=pairs_ms)
                rows.append(dict(row, checksum=checksum))
                print(
                    f"n={n:7d} heads={hq},{hkv},{d} {walk:10s} fma_exps {variant:3s} round {r}: {ms:8.3f} ms"
                    f"  leaf pairs {pairs_ms:7.3f} ms  checksum {checksum}"
                )
        q = k = None
        torch.cuda.empty_cache()
    if a.json:
        write_result(a.json, env_info(), a, rows=rows)


if __name__ == "__main__":
    main()
