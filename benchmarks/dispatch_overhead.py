"""What a sparseflow op call costs beyond its kernels: per-call time of plain SDPA, the dense op,
and ``backend="auto"`` once it has chosen dense, on SmolLM2's attention shape; then a profile of
the auto path's Python work.

    python benchmarks/dispatch_overhead.py --json benchmarks/results/dispatch_overhead_h200.json
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import platform
import pstats
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sparseflow  # noqa: E402
import sparseflow.graph_replay  # noqa: E402
import sparseflow.op_backends  # noqa: E402
from common import graph_us_per_call, mean_s_back_to_back  # noqa: E402


def per_call_us(fn, reps: int) -> float:
    """Wall microseconds per call, synchronising once at the end (what a model's layer loop
    sees when the GPU keeps up with the host)."""
    return mean_s_back_to_back(fn, reps, 10, torch.cuda.synchronize) * 1e6


def profile_calls(fn, calls: int = 100) -> str:
    """cProfile of ``calls`` back-to-back calls and one synchronisation: the top functions by
    own time and by cumulative time."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(45)
    return buf.getvalue()


def host_and_gpu_us(fn, calls: int = 20) -> dict:
    """Host microseconds per call to enqueue ``calls`` calls after a sync (few enough that the
    launch queue never fills), and device microseconds per call from one CUDA graph replay of
    ``calls`` calls (the error, as text, when the call cannot be captured)."""
    import time

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    try:
        gpu = graph_us_per_call(fn, calls=calls, replays=1, warmup=1)
    except Exception as exc:  # report, do not fail the run
        gpu = f"{type(exc).__name__}: {exc}"[:160]
    return {"host_us": host, "gpu_us": gpu}


def trace_calls(fn, path: str, calls: int = 5) -> None:
    """A Kineto trace (CPU ops, CUDA runtime and kernels, Python stacks) of ``calls`` calls."""
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)


def launch_baseline_us(reps: int) -> dict:
    """Per-call host cost of launching an empty Triton kernel: plain, and through a
    ``triton_op`` custom op (what every sparseflow kernel call pays at least)."""
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton

    @triton.jit
    def _empty(x_ptr, n, A: tl.constexpr):
        pid = tl.program_id(0)
        tl.store(x_ptr + pid, pid, mask=pid < n)

    @triton_op("sparseflow_bench::empty", mutates_args={"x"})
    def _empty_op(x: torch.Tensor) -> None:
        wrap_triton(_empty)[(1,)](x, x.numel(), A=1)

    x = torch.zeros(16, device="cuda", dtype=torch.int32)
    return {
        "triton launch": per_call_us(lambda: _empty[(1,)](x, 16, A=1), reps),
        "triton_op launch": per_call_us(lambda: _empty_op(x), reps),
        "torch.empty": per_call_us(lambda: torch.empty(1, 9, 64, 64, device="cuda"), reps),
    }


LAUNCHED = sparseflow.Tuning(cuda_graphs=False)


def copying(call):
    """``call()`` with the replay cache's in-place graphs switched off."""
    replays = sparseflow.graph_replay.default_replays
    replays.in_place = False
    try:
        return call()
    finally:
        replays.in_place = True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 4096, 8192])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--json")
    ap.add_argument(
        "--profile",
        default="pbs auto",
        help="comma list of variants profiled (cProfile, 100 calls) at the last --ns, e.g. 'pbs triton,bsa triton'",
    )
    ap.add_argument("--trace", help="folder for Kineto traces (CPU and CUDA, Python stacks) of the profiled variants")
    ap.add_argument("--launch-baseline", action="store_true", help="also time an empty Triton kernel's launch")
    args = ap.parse_args(argv)
    dev = "cuda"
    rows = []
    profiles = {}
    if args.launch_baseline:
        rows.append({"n": 0, **launch_baseline_us(args.reps)})
        print(rows[-1], flush=True)
    for n in args.ns:
        g = torch.Generator(device=dev).manual_seed(n)
        q = torch.randn(1, 9, n, 64, device=dev, dtype=torch.bfloat16, generator=g)
        k = torch.randn(1, 3, n, 64, device=dev, dtype=torch.bfloat16, generator=g)
        v = torch.randn_like(k)
        variants = {
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
            "op dense": lambda: sparseflow.dense_attention(q, k, v),
        }
        for method, cfg in (
            ("pbs", sparseflow.PBSConfig()),
            ("pisa", sparseflow.PISAConfig()),
            ("bsa", sparseflow.BSAConfig()),
        ):
            variants[f"{method} auto"] = lambda c=cfg: sparseflow.attention(q, k, v, config=c, backend="auto")
            variants[f"{method} triton"] = lambda c=cfg: sparseflow.attention(q, k, v, config=c, backend="triton")
            # every kernel launched each call (Tuning.cuda_graphs=False), the eager path before graph replay
            variants[f"{method} launched"] = lambda c=cfg: sparseflow.attention(
                q, k, v, config=c, backend="triton", tuning=LAUNCHED
            )
            if method == "pbs":  # replays from the graph on static inputs only: three input copies a call
                variants["pbs copying"] = lambda c=cfg: copying(
                    lambda: sparseflow.attention(q, k, v, config=c, backend="triton")
                )
            # the implementation alone, without the op's dispatch, validation and plan
            impl = sparseflow.op_backends.load(method, "triton")
            variants[f"{method} impl"] = lambda c=cfg, f=impl: f(q, k, v, c)
        row = {"n": n}
        for name, fn in variants.items():
            try:
                row[name] = per_call_us(fn, args.reps)
            except Exception as exc:
                row[name] = f"{type(exc).__name__}: {exc}"[:200]
        with sparseflow.capture() as cap:
            variants["pbs auto"]()
        row["pbs auto chose"] = cap.calls[-1].backend if cap.calls else None
        rows.append(row)
        print(" ".join(f"{k}={v:.1f}us" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        if n == args.ns[-1]:
            for name in [v.strip() for v in args.profile.split(",") if v.strip()]:
                profiles[name] = profile_calls(variants[name])
                profiles[name + " split"] = host_and_gpu_us(variants[name])
                print(f"{name}: {profiles[name + ' split']}", flush=True)
                if args.trace:
                    trace_calls(variants[name], os.path.join(args.trace, name.replace(" ", "_") + ".json"))
                print(f"--- profile {name} at n={n}\n{profiles[name][-7000:]}", flush=True)
    if args.json:
        import triton

        env = {
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        with open(args.json, "w") as fh:
            json.dump({"env": env, "rows": rows, "profiles": profiles}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
