"""Is the whole-model forward waiting on the GPU or on Python? One profiled forward per setting.

    python benchmarks/e2e_gpu_busy.py --n 8192 --settings pbs,smollm2:pbs,bsa \
        --json benchmarks/results/e2e_gpu_busy_8k_h200.json

SmolLM2-135M-Instruct (real weights, ``pydoc_topics`` text), transformers' SDPA and the
converted-checkpoint path with ``backend="triton"``. For each setting: the median wall time of 5
forwards, then one forward under the PyTorch profiler: the GPU's busy time (the union of its
kernels' intervals), and kernel time by kind. Wall well above busy means the forward waits on the
host; the profiler itself slows the host, so only its GPU columns are read.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Dict, List, Tuple

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import sparseflow.hf  # noqa: E402
from common import write_result  # noqa: E402
from e2e_prefill import converted_plan, env_info, repeated_tokens  # noqa: E402
from sparseflow.checkpoints import load_smollm2  # noqa: E402

# kernel-name fragment -> kind, first match wins
KINDS: Tuple[Tuple[str, str], ...] = (
    ("_pbs_fwd", "pbs attention"),
    ("_proxy", "pbs selection"),
    ("_gather_pool", "pbs selection"),
    ("_select_rows", "pbs selection"),
    ("_lse_combine", "pbs selection"),
    ("_segment_sort", "pbs selection"),
    ("_estimate", "pbs selection"),
    ("bsa", "bsa selection"),
    ("pisa", "pisa selection"),
    ("_node_scan", "pisa selection"),
    ("_leaf_pairs", "pisa selection"),
    ("_leaf_keep", "pisa selection"),
    ("_pair_order", "pisa selection"),
    ("_pair_index", "pisa selection"),
    ("_node_kernel", "pisa pyramid"),
    ("_level_tables", "pisa pyramid"),
    ("_leaf_kernel", "block summaries"),  # the leaf means BSA and PISA share
    ("_fwd_kernel", "token-sparse attention"),
    ("flash", "sdpa"),
    ("cudnn", "sdpa"),
    ("fmha", "sdpa"),
    ("Memcpy", "memcpy"),
    ("copy", "copy"),
    ("elementwise", "elementwise"),
    ("reduce", "reduce"),
)


TOP_KERNELS = 12  # kernels by name kept per setting (the profile's largest)


def kind_of(kernel: str) -> str:
    for fragment, kind in KINDS:
        if fragment in kernel:
            return kind
    return "other (GEMMs, norms, ...)"


def busy_us(intervals: List[Tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def profile_forward(forward) -> Dict[str, object]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        forward()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    intervals = [(e.time_range.start, e.time_range.end) for e in kernels]
    by_kind: Dict[str, float] = {}
    by_name: Dict[str, float] = {}
    for e in kernels:
        ms = (e.time_range.end - e.time_range.start) / 1e3
        by_kind[kind_of(e.name)] = by_kind.get(kind_of(e.name), 0.0) + ms
        by_name[e.name[:90]] = by_name.get(e.name[:90], 0.0) + ms
    return {
        "gpu_busy_ms": busy_us(intervals) / 1e3,
        "kernel_ms_by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "top_kernels_ms": dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]),
    }


def measure(model, ids, label: str) -> Dict[str, object]:
    def forward():
        with torch.inference_mode():
            model(input_ids=ids, use_cache=False, logits_to_keep=1)

    for _ in range(4):  # autotuning, graph captures (in-place ones on an address's second visit)
        forward()
    torch.cuda.synchronize()
    walls = []
    for _ in range(5):
        t0 = time.perf_counter()
        forward()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) * 1e3)
    row = {"setting": label, "wall_ms": statistics.median(walls), **profile_forward(forward)}
    kinds = ", ".join(f"{k} {v:.2f}" for k, v in row["kernel_ms_by_kind"].items())
    print(f"{label:14s} wall {row['wall_ms']:6.2f} ms  GPU busy {row['gpu_busy_ms']:6.2f} ms | {kinds}", flush=True)
    for name, ms in row["top_kernels_ms"].items():
        print(f"    {ms:7.3f} ms  {name}", flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--settings", default="pbs,smollm2:pbs,bsa", help="e2e_prefill settings, comma list")
    ap.add_argument("--text", default="pydoc_topics")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs CUDA (the profile reads GPU kernels)")
    model, tok = load_smollm2(dtype=torch.bfloat16)
    model.to("cuda")
    ids = repeated_tokens(tok, args.text, args.n).to("cuda")
    rows = []
    model.set_attn_implementation("sdpa")
    rows.append(measure(model, ids, "dense"))
    for name in [s.strip() for s in args.settings.split(",") if s.strip()]:
        sparseflow.hf.apply_plan(model, converted_plan(name, "triton", model.config.num_hidden_layers))
        rows.append(measure(model, ids, name))
        model.set_attn_implementation("sdpa")
    if args.json:
        write_result(args.json, env_info(), args, rows=rows)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
