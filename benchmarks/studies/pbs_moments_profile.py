"""Where PBS's ``scoring="moments"`` selection stage spends its time on the GPU: the stage under
torch's profiler at one length, kernels by CUDA time, beside ``scoring="mean"``.

    python benchmarks/studies/pbs_moments_profile.py --n 32768 --heads 9,3,64 [--product tf32]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from common import kernel_rows  # noqa: E402

from sparseflow.methods.pbs import triton_gather as TG  # noqa: E402
from sparseflow.methods.pbs import triton_select as S  # noqa: E402
from sparseflow.methods.pbs.permutation import key_scores, segment_permutation  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--heads", default="9,3,64")
    ap.add_argument("--product", default="tf32")
    ap.add_argument("--json")
    a = ap.parse_args()
    hq, hkv, d = (int(x) for x in a.heads.split(","))
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, hq, a.n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, hkv, a.n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    sc = key_scores(q, k, block_size=128, segment_size=256, gqa_permutation="query_head")
    perm = segment_permutation(sc, segment_size=256)
    lay = TG.permuted_layout(k, None, perm, block_size=128)
    out = {}
    for scoring in ("mean", "moments"):

        def stage():
            S.select_block_lists(
                q,
                lay.k,
                perm,
                block_size=128,
                segment_size=256,
                threshold=0.9,
                layout=lay,
                return_block_mask=False,
                scoring=scoring,
                moments_product=a.product,
            )

        rows = kernel_rows(stage)
        print(f"== {scoring} n={a.n} heads={a.heads} product={a.product}: total {sum(r[1] for r in rows):.3f} ms")
        for name, ms, cnt in rows[:14]:
            print(f"  {ms:8.3f} ms  x{cnt:<4.0f} {name[:90]}")
        out[scoring] = rows
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(
                {
                    "n": a.n,
                    "heads": a.heads,
                    "product": a.product,
                    "gpu": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "kernels": out,
                },
                fh,
                indent=1,
            )


if __name__ == "__main__":
    main()
