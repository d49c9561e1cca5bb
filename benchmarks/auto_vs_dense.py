"""backend="auto" against dense SDPA end to end on the real checkpoint, variants interleaved.

    python benchmarks/auto_vs_dense.py --ns 4096,8192,16384 --json benchmarks/results/e2e_auto_interleaved_h200.json

SmolLM2-135M-Instruct (real weights, ``pydoc_topics`` text, YaRN beyond the trained 8K), the
converted-checkpoint path with every method at its defaults and ``backend="auto"``, PBS, the
``smollm2`` PBS recipe and BSA with ``backend="triton"`` (replayed from CUDA graphs; PBS also
replayed from graphs on static inputs only, and with every kernel launched, the
``Tuning.cuda_graphs=False`` path), beside transformers' own SDPA. At these lengths the eager
forward is host-bound and drifts from run to run, so the variants take turns: each round times
``--calls`` forwards of every variant in a row, starting each round one variant further along
(so no variant always follows the slow one), and the table gives each variant's median over
``--rounds`` rounds, the ratio of the medians to dense's, and the median of the per-round ratios
(each round's dense time over the variant's: drift between rounds cancels) with its quartiles.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import NamedTuple, Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import sparseflow  # noqa: E402
import sparseflow.hf  # noqa: E402
from common import mean_s_back_to_back, use_scan_launch  # noqa: E402
from e2e_prefill import TRAINED_POSITIONS, _ints, converted_plan, env_info, repeated_tokens, set_rope  # noqa: E402
from sparseflow.checkpoints import load_smollm2  # noqa: E402
from sparseflow.graph_replay import default_replays  # noqa: E402


class Variant(NamedTuple):
    setting: str  # an e2e_prefill setting: a method at its defaults, or recipe:method
    backend: str
    cuda_graphs: bool = True  # Tuning.cuda_graphs
    in_place: bool = True  # replays may use graphs that read recurring input addresses in place
    pisa_walk: str = "auto"  # Tuning.pisa_walk
    pdl: bool = False  # Tuning.pdl


VARIANTS = {  # name -> None (transformers' SDPA) or a Variant
    "dense": None,
    "pbs auto": Variant("pbs", "auto"),
    "pisa auto": Variant("pisa", "auto"),
    "bsa auto": Variant("bsa", "auto"),
    "pbs triton": Variant("pbs", "triton"),
    "recipe triton": Variant("smollm2:pbs", "triton"),
    "bsa triton": Variant("bsa", "triton"),
    "pisa triton": Variant("pisa", "triton"),
    "pisa per-token": Variant("pisa", "triton", pisa_walk="per_token"),
    "pisa pdl": Variant("pisa", "triton", pdl=True),
    "bsa pdl": Variant("bsa", "triton", pdl=True),
    "pbs copying": Variant("pbs", "triton", in_place=False),
    "pbs launched": Variant("pbs", "triton", cuda_graphs=False),
}


def use(model, variant: Optional[Variant]) -> None:
    if variant is None:
        model.set_attn_implementation("sdpa")
        return
    default_replays.in_place = variant.in_place
    n_layers = model.config.num_hidden_layers
    plan = converted_plan(
        variant.setting, variant.backend, n_layers, variant.cuda_graphs, variant.pisa_walk, variant.pdl
    )
    sparseflow.hf.apply_plan(model, plan)


def round_order(names, index: int):
    """The variants in the order round ``index`` times them: rotated by one each round."""
    names = list(names)
    shift = index % len(names)
    return names[shift:] + names[:shift]


def paired_ratios(times, base: str = "dense"):
    """name -> (median, lower quartile, upper quartile) of the per-round ratios base / name."""
    out = {}
    for name, ts in times.items():
        ratios = sorted(b / t for b, t in zip(times[base], ts))
        q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else [ratios[0]] * 3
        out[name] = (statistics.median(ratios), q[0], q[2])
    return out


def run_length(model, tok, n: int, args, variants):
    set_rope(model, "plain" if n <= TRAINED_POSITIONS else "yarn", n)
    ids = repeated_tokens(tok, args.text, n).to(args.device)
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)

    def forward():
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False, logits_to_keep=1)

    for variant in variants.values():  # auto's decisions, autotuning and captures happen before any timing
        use(model, variant)
        for _ in range(4):  # in-place graphs are recorded on an address's second visit, in call 3
            forward()
    times = {name: [] for name in variants}
    for r in range(args.rounds):
        for name in round_order(variants, r):
            use(model, variants[name])
            # two untimed forwards: a layer resolves its plan afresh after the switch, and its
            # repeat calls go straight to their graphs from its second call on
            times[name].append(mean_s_back_to_back(forward, args.calls, 2, sync) * 1e3)
    dense = statistics.median(times["dense"])
    paired = paired_ratios(times)
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        p_med, p_lo, p_hi = paired[name]
        rows.append(
            dict(
                n=n,
                variant=name,
                ms=med,
                ratio_vs_dense=dense / med,
                paired_ratio=p_med,
                paired_quartiles=[p_lo, p_hi],
                rounds=ts,
            )
        )
        print(
            f"N={n:6d} {name:12s} {med:8.2f} ms  {dense / med:5.3f}x dense  paired {p_med:5.3f}x "
            f"({p_lo:.3f}-{p_hi:.3f})  (min {min(ts):.2f} max {max(ts):.2f})",
            flush=True,
        )
    return rows


def auto_timings():
    """What ``backend="auto"`` measured so far: per decision, the method, query length bucket and
    each candidate's ms per call (op level, on the call that decided)."""
    timings = sparseflow.autobackend.default_chooser.timings
    return [{"method": key[0], "q_len_bucket": key[-3], "ms": dict(times)} for key, times in timings.items()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ns", type=_ints, default=[4096, 8192, 16384])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--calls", type=int, default=3, help="forwards per variant and round")
    ap.add_argument(
        "--variants",
        type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
        default=list(VARIANTS),
        help=f"comma list of {', '.join(VARIANTS)} (dense is always timed)",
    )
    ap.add_argument("--text", default="pydoc_topics")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--scan-launch",
        default="",
        help='PISA scan settings for the whole run (triton_select_scan.LAUNCH), e.g. "heads=loop,pair_unit=siblings"',
    )
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    for name in ("rounds", "calls"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; expected names from {list(VARIANTS)}")
    variants = {name: VARIANTS[name] for name in ["dense", *args.variants] if name in VARIANTS}
    try:
        scan_launch = use_scan_launch(args.scan_launch)
    except ValueError as err:
        ap.error(str(err))
    model, tok = load_smollm2(dtype=torch.bfloat16 if args.device != "cpu" else torch.float32)
    model.to(args.device)
    rows = []
    for n in args.ns:
        rows += run_length(model, tok, n, args, variants)
        if args.json:
            out = {
                "env": env_info(),
                "args": vars(args),
                "scan_launch": scan_launch,
                "rows": rows,
                "auto_timings": auto_timings(),
            }
            with open(args.json, "w") as fh:
                json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
