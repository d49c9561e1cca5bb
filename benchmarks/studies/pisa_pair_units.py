"""How much work PISA's scan spends per scored pair, by the unit a pair covers
(``triton_select_scan.LAUNCH["pair_unit"]``): one leaf, or a kept parent's children scored
together ("siblings"). Counted from the reference walk's last level on SmolLM2-135M-Instruct's
real layers (their q/k captured by one dense forward, on the CPU by default), PISA's defaults
(C 64, K 8, g 2):

    python benchmarks/studies/pisa_pair_units.py --n 8192 --layers 3,15,27 \\
        --json benchmarks/results/pisa_pair_units_8k_cpu.json

A pair costs the leaf-pair kernel one gather of the query's heads, one slot of the pair index and
one atomic in the walk; its leaves cost one exact LSE each. Siblings trade fewer pairs for the
LSEs of siblings that are not scored for the query (forced, dropped or absent), which the keep
never reads. These are counts, not times: the H200 decides (``pisa_layer_kernels.py
--scan-launch pair_unit=siblings``).
"""

import argparse
import os
import sys
from typing import Dict

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, ".."))

from common import env_info, write_result  # noqa: E402
from sparseflow.methods.pisa import reference as pisa_ref  # noqa: E402


def leaf_level_candidates(q: torch.Tensor, k: torch.Tensor, **kw):
    """``(cand, valid, forced, width)`` of the reference walk's leaf level (its last
    ``select_top_k`` call): the children of each query's kept parents, ``g`` consecutive slots
    a parent, ``[B, Hkv, Nq, parents * g]``."""
    seen = []
    real = pisa_ref.tb.select_top_k

    def record(cand, valid, forced, scores, width):
        seen.append((cand, valid, forced, width))
        return real(cand, valid, forced, scores, width)

    pisa_ref.tb.select_top_k = record
    try:
        pisa_ref.pisa_select(q, k, **kw)
    finally:
        pisa_ref.tb.select_top_k = real
    return seen[-1]


def pair_counts(cand, valid, forced, width: int, branching: int) -> Dict[str, int]:
    """Scored leaf pairs, scored sibling units and the leaf LSEs each unit computes, as the
    scan's kernels count them (a leaf is scored when valid, not forced, in a row with more
    valid leaves than ``width``; a unit when one of its children is)."""
    scored = valid & ~forced & (valid.sum(-1, keepdim=True) > width)
    units = scored.view(*scored.shape[:-1], -1, branching).any(-1)
    return {
        "rows": int(scored.shape[0] * scored.shape[1] * scored.shape[2]),
        "leaf_pairs": int(scored.sum()),
        "sibling_pairs": int(units.sum()),
        "sibling_leaf_lses": int(units.sum()) * branching,
    }


def main(argv=None) -> int:
    from pisa_layer_kernels import real_layer_qkv

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--layers", default="3,15,27")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    layers = [int(x) for x in args.layers.split(",")]
    kw = dict(block_size=64, top_k=8, branching=2)
    rows = []
    print(f"N={args.n}, C 64, K 8, g 2: per (query, KV head) row")
    print(f"{'layer':>5} {'leaf pairs':>10} {'sibling pairs':>13} {'pairs saved':>11} {'leaf LSEs, siblings':>20}")
    for layer, (q, k, _) in sorted(real_layer_qkv(args.n, layers, device=args.device).items()):
        cand, valid, forced, width = leaf_level_candidates(q.float(), k.float(), **kw)
        counts = pair_counts(cand, valid, forced, width, kw["branching"])
        per_row = {key: val / counts["rows"] for key, val in counts.items() if key != "rows"}
        rows.append({"layer": layer, **counts, "per_row": per_row})
        print(
            f"{layer:5d} {per_row['leaf_pairs']:10.2f} {per_row['sibling_pairs']:13.2f} "
            f"{1 - counts['sibling_pairs'] / counts['leaf_pairs']:10.1%} "
            f"{per_row['sibling_leaf_lses']:11.2f} ({counts['sibling_leaf_lses'] / counts['leaf_pairs'] - 1:+.1%})"
        )
    if args.json:
        write_result(args.json, env_info(args.device), args, config=kw, layers=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
