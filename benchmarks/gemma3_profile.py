"""Where a Gemma 3 forward spends its GPU time: one profiled forward per row, kernels by total time.

    python benchmarks/gemma3_profile.py --random --n 8192 --rows flex_compile,windows \
        --json benchmarks/results/gemma3_profile_8k_h100.json

The rows are ``gemma3_e2e``'s (the same models). Each row is warmed up, then one forward runs
under the PyTorch profiler; the table lists the row's GPU busy time and its ``--top`` kernels by
summed CUDA time, so two rows side by side show which kernels make the difference, then the host's
side: the events that wait for the GPU (a sync inside a forward keeps the host from running ahead)
and the ``--top`` host events by self time.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import write_result  # noqa: E402
from e2e_prefill import env_info  # noqa: E402
from gemma3_e2e import ROWS, load_gemma3, random_gemma3, variant  # noqa: E402


# host-side events that wait for the GPU: one inside a forward stops the host from running ahead
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "aten::_local_scalar_dense", "aten::item")


def profile_row(model, ids: torch.Tensor, warmup: int, top: int) -> Dict[str, object]:
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        for _ in range(warmup):
            model(ids, logits_to_keep=1)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            model(ids, logits_to_keep=1)
            torch.cuda.synchronize()
    host = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CPU]
    syncs: Dict[str, int] = {}
    for ev in host:
        if any(ev.name.startswith(s) for s in SYNCS):
            syncs[ev.name] = syncs.get(ev.name, 0) + 1
    self_host: Dict[str, List[float]] = {}
    for ev in host:
        entry = self_host.setdefault(ev.name, [0.0, 0])
        entry[0] += ev.self_cpu_time_total / 1e3
        entry[1] += 1
    host_top = sorted(self_host.items(), key=lambda kv: -kv[1][0])[:top]
    totals: Dict[str, List[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            entry = totals.setdefault(ev.name, [0.0, 0])
            entry[0] += ev.device_time / 1e3  # us -> ms
            entry[1] += 1
    kernels = sorted(totals.items(), key=lambda kv: -kv[1][0])
    return {
        "gpu_ms": sum(ms for ms, _ in totals.values()),
        "kernels": [{"name": name[:120], "ms": ms, "count": cnt} for name, (ms, cnt) in kernels[:top]],
        "syncs": syncs,
        "host_self": [{"name": name[:120], "ms": ms, "count": cnt} for name, (ms, cnt) in host_top],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a folder holding Gemma 3 270M (`sparseflow convert`'s output)")
    src.add_argument("--random", action="store_true", help="the architecture with random weights")
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--rows", default="flex_compile,windows", help=f"comma list of {','.join(ROWS)}")
    ap.add_argument("--recipe", help="a recipe file for the 'recipe' row")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        ap.error(f"--rows takes {','.join(ROWS)}; unknown: {unknown}")
    if not torch.cuda.is_available():
        ap.error("the profile reads CUDA kernel times: it needs a GPU")
    base, _ = random_gemma3(torch.bfloat16, "cuda") if args.random else load_gemma3(args.model, torch.bfloat16, "cuda")
    ids = torch.randint(0, base.config.vocab_size, (1, args.n), generator=torch.Generator().manual_seed(0)).cuda()
    out = []
    for row in rows:
        result = {"row": row, "n": args.n, **profile_row(variant(base, row, args.recipe), ids, args.warmup, args.top)}
        out.append(result)
        print(f"{row}: GPU busy {result['gpu_ms']:.2f} ms", flush=True)
        for k in result["kernels"]:
            print(f"  {k['ms']:8.3f} ms  x{k['count']:<4} {k['name']}", flush=True)
        print(f"  host events that wait for the GPU: {result['syncs'] or 'none'}; host self time:", flush=True)
        for k in result["host_self"]:
            print(f"  {k['ms']:8.3f} ms  x{k['count']:<4} {k['name']}", flush=True)
    if args.json:
        write_result(args.json, env_info("cuda"), args, rows=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
