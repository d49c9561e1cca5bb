"""PISA's selection walks scoring in fp32, bf16 or tf32 (``Tuning.pisa_scores``, issue 49): time and
contract, side by side.

The paper's latency setting: B 1, Hq 32, Hkv 2, D 64, C 64, K 8, g 2, bf16, causal. For every
length, walk (``--walks``: per_token, tiled, scan, leaf_pairs) and ``pisa_scores`` (``--scores``) it times ``triton_select.pisa_select``
(the pyramid build included; CUDA events around each call, warmup then the median of ``--reps``)
and checks PISA's selection contract (``tolerance_check.selection_within_tolerance`` with the
precision's ``delta``) on ``--check-rows`` query rows: four groups of consecutive rows ending at
1/4, 1/2, 3/4 and all of the prompt, each walked by the same Triton walk on its causal prefix
(``triton_trace.walk_trace_triton``: the walk's kept nodes per level) and replayed by the fp32
reference walk on those rows only, in chunks of rows sized by ``--mem-gib``, so that the check's
memory stays bounded at any length. A walk that does not cover a call runs per token (as
``pisa_select`` does); the ``ran`` column says which walk did.

It prints a table (ms, speedup over the first walk and precision at the same length, the share of the
reference's leaf blocks kept on the checked rows, whether the contract held) and writes the rows
with the GPU, torch / triton versions and date to ``--json``.

    python benchmarks/studies/pisa_walk_precision.py --json benchmarks/results/pisa_walk_precision_h100.json
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from typing import Dict, List, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, ".."))

from common import env_info, write_result  # noqa: E402
from sparseflow.methods.pisa import tolerance_check as tc  # noqa: E402
from sparseflow.methods.pisa import triton_select as ts  # noqa: E402
from sparseflow.methods.pisa.config import PISAConfig  # noqa: E402
from sparseflow.methods.pisa.triton_trace import walk_that_runs, walk_trace_triton  # noqa: E402
from sparseflow.methods.pisa.tuning import SCORES as PISA_SCORES  # noqa: E402
from sparseflow.tuning import Tuning  # noqa: E402

WALKS = ("per_token", "tiled", "scan", "leaf_pairs")
SHAPE = dict(b=1, hq=32, hkv=2, d=64)
CONFIG = dict(block_size=64, top_k=8, branching=2, score="lse")
FRACTIONS = (0.25, 0.5, 0.75, 1.0)


def parse_ns(text: str) -> List[int]:
    ns = [int(x) for x in text.split(",") if x.strip()]
    if not ns or min(ns) < 1:
        raise ValueError(f"--ns must list positive lengths, got {text!r}")
    return ns


def check_rows_bytes(cfg: PISAConfig, group: int, d: int) -> int:
    """A generous estimate of the reference check's memory per query row: the leaf level scores
    ``cw`` candidate blocks of ``C`` keys for ``group`` heads (fp32, with temporaries)."""
    cw = max(16, cfg.beam * cfg.top_k * cfg.branching)
    return 8 * group * cw * cfg.block_size * d * 4


def row_groups(n: int, rows: int) -> List[tuple]:
    """``(prefix length, first row, last row + 1)`` of the checked rows: ``rows`` split over the
    prefixes ending at :data:`FRACTIONS` of ``n``, the last rows of each prefix (a row is a query
    position: row ``i`` sees keys ``0..i``)."""
    out = []
    per = max(1, rows // len(FRACTIONS))
    for frac in FRACTIONS:
        p = max(1, int(round(n * frac)))
        out.append((p, max(0, p - per), p))
    return out


def check_contract(q, k, cfg: PISAConfig, tuning: Tuning, rows: int, mem_gib: float) -> Dict[str, object]:
    """The contract on ``rows`` query rows of the call (:func:`row_groups`), each chunk of rows
    walked as the last rows of its causal prefix (a call of its own, the same walk and tuning):
    ``ok``, the leaf agreement with the reference over those rows, the tightest near-tie margin,
    the walks that ran and the first broken rule (None when none)."""
    group = q.shape[1] // k.shape[1]
    chunk = max(1, int(mem_gib * 2**30 // (check_rows_bytes(cfg, group, q.shape[-1]) * q.shape[0] * k.shape[1])))
    kept = total = 0.0
    ok, first, margin, ran = True, None, math.inf, set()
    for p, lo, hi in row_groups(q.shape[2], rows):
        for c0 in range(lo, hi, chunk):
            c1 = min(hi, c0 + chunk)
            # rows c0..c1-1 are the last rows of the causal prefix of c1 keys (bottom-right aligned)
            qr, kp_rows = q[:, :, c0:c1].contiguous(), k[:, :, :c1]
            ran.add(walk_that_runs(qr, kp_rows, cfg, tuning))
            trace = walk_trace_triton(qr, kp_rows, cfg, tuning=tuning, fallback=True)
            rep = tc.selection_within_tolerance(qr, kp_rows, trace, cfg, precision=tuning.pisa_scores)
            kept += rep.leaf_agreement * (c1 - c0)  # rows weigh alike (each keeps top_k blocks past the first ones)
            total += c1 - c0
            margin = min(margin, rep.min_margin)
            if not rep.ok and ok:
                where = f"level {rep.level}, query {c0 + rep.query} (margin {rep.margin:.3g})"
                ok, first = False, f"{rep.rule} at {where}"
    return dict(ok=ok, leaf_agreement=kept / total if total else 1.0, min_margin=margin, ran=sorted(ran), broken=first)


def time_ms(fn, reps: int, warmup: int) -> float:
    """Median GPU ms of one call: CUDA events around each of ``reps`` calls after ``warmup``."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def format_row(row: Dict[str, object]) -> str:
    speed = "-" if row.get("speedup_vs_first") is None else f"{row['speedup_vs_first']:6.2f}x"
    agree = "-" if row.get("leaf_agreement") is None else f"{100 * row['leaf_agreement']:7.3f}%"
    ok = "-" if row.get("contract_ok") is None else ("ok" if row["contract_ok"] else f"BROKEN: {row['broken']}")
    return (
        f"N={row['n']:7d} {row['walk']:9s} {row['scores']:4s} ran {row['ran']:9s} {row['ms']:9.3f} ms  "
        f"{speed:>8s}  leaves {agree:>9s}  contract {ok}"
    )


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ns", default="16384,32768,65536,131072,262144")
    ap.add_argument("--check-rows", type=int, default=256, help="query rows checked against the reference (0: none)")
    ap.add_argument("--mem-gib", type=float, default=16.0, help="memory budget of the reference check")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--walks", default=",".join(WALKS), help="comma list of Tuning.pisa_walk values")
    ap.add_argument("--scores", default=",".join(PISA_SCORES), help="comma list of Tuning.pisa_scores values")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("pisa_walk_precision: needs a CUDA GPU", file=sys.stderr)
        return 2
    cfg = PISAConfig(**CONFIG)
    rows = []
    for n in parse_ns(args.ns):
        torch.manual_seed(0)
        b, hq, hkv, d = SHAPE["b"], SHAPE["hq"], SHAPE["hkv"], SHAPE["d"]
        q = torch.randn(b, hq, n, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16)
        kw = dict(is_causal=True, **CONFIG)
        here = []
        for walk in args.walks.split(","):
            for scores in args.scores.split(","):
                tuning = Tuning(pisa_walk=walk, pisa_scores=scores, cuda_graphs=False)
                ms = time_ms(lambda: ts.pisa_select(q, k, tuning=tuning, **kw), args.reps, args.warmup)
                row = dict(n=n, walk=walk, scores=scores, ran=walk_that_runs(q, k, cfg, tuning), ms=ms)
                if args.check_rows:
                    found = check_contract(q, k, cfg, tuning, args.check_rows, args.mem_gib)
                    row.update(
                        contract_ok=found["ok"],
                        leaf_agreement=found["leaf_agreement"],
                        min_margin=found["min_margin"],
                        check_ran=found["ran"],
                        broken=found["broken"],
                    )
                here.append(row)
                torch.cuda.empty_cache()
        base = here[0]["ms"]  # the first walk at the first precision
        for row in here:
            row["speedup_vs_first"] = base / row["ms"]
            print(format_row(row), flush=True)
        rows.extend(here)
        if args.json:  # after each length: a run cut off by the call's limit keeps what it measured
            write_result(args.json, env_info("cuda"), args, shape=SHAPE, config=CONFIG, rows=rows)
    return 0 if all(r.get("contract_ok", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
