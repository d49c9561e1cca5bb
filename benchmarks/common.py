"""Helpers the benchmark scripts share: the environment record, the synthetic inputs, dense SDPA
baselines, PBS kernel inputs, and the timing loops.

Scripts in this folder import it as ``common`` (their own folder is on ``sys.path`` when run as
``python benchmarks/<script>.py``); scripts under ``benchmarks/studies/`` put this folder on the
path first. Nothing here is part of the installed package.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

# the repository root, so ``import sparseflow`` finds the source checkout next to this folder
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# the synthetic long-context inputs live in the package: ``sparseflow bench`` uses them too
from sparseflow.bench import structured_qkv  # noqa: E402

__all__ = [
    "env_info",
    "write_result",
    "structured_qkv",
    "qkv",
    "sdpa_dense",
    "causal_flops",
    "exact_selection",
    "random_selection",
    "pbs_kernel_inputs",
    "pbs_kernel_call",
    "bench",
    "median_ms_per_call",
    "mean_s_back_to_back",
    "kernel_us_by_name",
    "kernel_launches_and_us",
    "graph_us_per_call",
    "mean_ms_cuda_events",
    "parse_scan_launches",
    "use_scan_launch",
]


# --------------------------------------------------------------------------- environment


def parse_scan_launches(text: str) -> List[Dict[str, object]]:
    """``"rows=64;pair_rows=64,pair_chunks=8"`` -> ``[{"rows": 64}, {"pair_rows": 64, "pair_chunks": 8}]``:
    variants (``;`` between them) of PISA's scan settings (``triton_select_scan.LAUNCH``), checked
    by name; digits become ints."""
    from sparseflow.methods.pisa import triton_select_scan as scan

    out = []
    for variant in (v for v in text.split(";") if v.strip()):
        pairs = (kv.split("=", 1) for kv in variant.split(",") if kv.strip())
        overrides = {key.strip(): int(val) if val.strip().isdigit() else val.strip() for key, val in pairs}
        unknown = sorted(set(overrides) - set(scan.LAUNCH))
        if unknown:
            raise ValueError(f"--scan-launch: unknown settings {unknown}; expected some of {sorted(scan.LAUNCH)}")
        out.append(overrides)
    return out


def use_scan_launch(text: str) -> Dict[str, object]:
    """Apply one variant of PISA's scan settings (:func:`parse_scan_launches`; ``""``: none) to
    ``triton_select_scan.LAUNCH`` for the rest of the process, and return the whole dict as it
    then stands, for the result's JSON. An end-to-end run that times a non-default layout takes
    it for every PISA call (a study setting, not a user option)."""
    from sparseflow.methods.pisa import triton_select_scan as scan

    variants = parse_scan_launches(text)
    if len(variants) > 1:
        raise ValueError(f"--scan-launch: one variant for a whole run, got {len(variants)} (';' separates variants)")
    for overrides in variants:
        scan.LAUNCH.update(overrides)
    return dict(scan.LAUNCH)


def env_info(device: str = "auto") -> Dict[str, object]:
    """The device, library versions and UTC date of a run (the ``env`` of every result JSON):
    the GPU with its CUDA and cuDNN versions, or the CPU with its thread count. ``device``: where
    the run measured ("auto": the GPU when there is one)."""
    import importlib.util

    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        where = {
            "gpu": torch.cuda.get_device_name(),
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
        }
    else:
        where = {"device": "cpu", "torch_threads": torch.get_num_threads()}
    triton = None
    if importlib.util.find_spec("triton") is not None:
        import triton as triton_module

        triton = triton_module.__version__
    return {
        **where,
        "torch": torch.__version__,
        "triton": triton,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_result(path: str, env: Dict[str, object], args=None, **measured) -> None:
    """A benchmark's JSON at ``path``: ``{"env": env, "args": vars(args), **measured}`` (``env``:
    the GPU, versions and date, from :func:`env_info` or ``e2e_prefill.env_info``; ``args``: the
    parsed command line, left out when None)."""
    out = {"env": env, **({} if args is None else {"args": vars(args)}), **measured}
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)


# --------------------------------------------------------------------------- inputs


def qkv(b, hq, hkv, n, d, dtype, seed=0, structured=False, device="cuda"):
    """Seeded Q/K/V: random normal, or :func:`structured_qkv`."""
    g = torch.Generator(device=device).manual_seed(seed)
    if not structured:
        q = torch.randn(b, hq, n, d, device=device, dtype=dtype, generator=g)
        k = torch.randn(b, hkv, n, d, device=device, dtype=dtype, generator=g)
        v = torch.randn(b, hkv, n, d, device=device, dtype=dtype, generator=g)
        return q, k, v
    return structured_qkv(b, hq, hkv, n, d, dtype, g)


# --------------------------------------------------------------------------- dense baselines


def sdpa_dense(q, k, v, backend):
    """Causal SDPA pinned to ``backend`` ("cudnn" or "flash"): (a runner, "gqa" or "repeated-kv")."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]
    g = q.shape[1] // k.shape[1]
    try:

        def run():
            with sdpa_kernel(be):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        run()
        return run, "gqa"
    except Exception:  # backend without native GQA: give it repeated K/V (costs it nothing at compute-bound)
        kr, vr = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)

        def run():
            with sdpa_kernel(be):
                return F.scaled_dot_product_attention(q, kr, vr, is_causal=True)

        run()
        return run, "repeated-kv"


def causal_flops(b, hq, n, d):
    return 4.0 * b * hq * n * n * d / 2.0


# --------------------------------------------------------------------------- PBS selections and kernel inputs


def exact_selection(b, hq, hp, n, bs, seg, seed=0, device="cuda"):
    """Exact-mode (100% density) selection with a random in-segment permutation."""
    from sparseflow.methods.pbs.block_selection import block_regions
    from sparseflow.methods.pbs.permutation import segment_permutation

    g = torch.Generator(device=device).manual_seed(seed)
    scores = torch.rand(b, hp, n, device=device, generator=g)
    perm = segment_permutation(scores, segment_size=seg)
    nb = -(-n // bs)
    region = block_regions(None, b, n, block_size=bs, segment_size=seg, device=device)  # [B, nB]
    bm = (region[:, None, :] <= region[:, :, None])[:, None].expand(b, hq, nb, nb).contiguous()
    return perm, bm


def random_selection(perm, hq, n, bs, seg, density, seed=0):
    """Forced blocks (own region, sink) plus a random fraction of the candidates."""
    from sparseflow.methods.pbs.block_selection import candidate_blocks, forced_blocks

    cand = candidate_blocks(perm, hq, block_size=bs, segment_size=seg)
    forced = forced_blocks(perm, hq, block_size=bs, segment_size=seg)
    g = torch.Generator(device=perm.device).manual_seed(seed)
    keep = torch.rand(cand.shape, device=perm.device, generator=g) < density
    return (cand & keep) | forced


def pbs_kernel_inputs(b, hq, hkv, n, d, dtype, gqa, layout, bs=128, seg=256, density=1.0):
    """Everything the PBS attention kernel takes, for a random selection of ``density``."""
    from sparseflow.methods.pbs import triton_attention as TA
    from sparseflow.methods.pbs.block_selection import selection_density
    from sparseflow.methods.pbs import triton_gather as TG

    hp = hq if gqa == "query_head" else hkv
    q, k, v = qkv(b, hq, hkv, n, d, dtype, seed=n)
    perm, bm = exact_selection(b, hq, hp, n, bs, seg)
    if density < 1.0:
        bm = random_selection(perm, hq, n, bs, seg, density)
    kpos = TA.key_positions(perm)
    kv_num, kv_full, kv_idx = TA.block_mask_to_indices(bm, num_keys=n, block_size=bs, segment_size=seg, is_causal=True)
    if layout == "gather":
        kk, vv = k, v
    else:
        kk, vv = TG.permute_kv(k, perm), TG.permute_kv(v, perm)
    dens = selection_density(bm, perm, block_size=bs).mean().item()
    return dict(
        q=q,
        k=k,
        v=v,
        kk=kk,
        vv=vv,
        perm=perm,
        bm=bm,
        kpos=kpos,
        kv_num=kv_num,
        kv_full=kv_full,
        kv_idx=kv_idx,
        density=dens,
        gather=layout == "gather",
    )


def pbs_kernel_call(inp, bs=128, tma=True):
    """A no-argument call of the PBS attention kernel on :func:`pbs_kernel_inputs`' inputs."""
    from sparseflow.methods.pbs import triton_attention as TA

    return lambda: TA.pbs_block_sparse_attention(
        inp["q"],
        inp["kk"],
        inp["vv"],
        inp["kpos"],
        inp["kv_num"],
        inp["kv_full"],
        inp["kv_idx"],
        block_size=bs,
        is_causal=True,
        gather=inp["gather"],
        tma=tma,
    )


# --------------------------------------------------------------------------- timing


def bench(fn, rep_ms=200, warmup_ms=100) -> float:
    """Median ms of ``fn`` by ``triton.testing.do_bench`` (kernel-level timings)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def kernel_launches_and_us(fn: Callable[[], object], reps: int = 10, warmup: int = 3) -> Dict[str, Tuple[float, float]]:
    """Each CUDA kernel name ``fn`` launches -> (launches per call, mean GPU time per call in us),
    from the profiler: the host's launch cost is not in it, as under CUDA graphs."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    per_name: Dict[str, Tuple[float, float]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            count, us = per_name.get(e.name, (0.0, 0.0))
            per_name[e.name] = (count + 1 / reps, us + (e.time_range.end - e.time_range.start) / reps)
    return per_name


def kernel_rows(fn: Callable[[], object], reps: int = 5, warmup: int = 3) -> List[Tuple[str, float, float]]:
    """``(kernel name, ms per call, launches per call)`` of ``fn``'s CUDA kernels, the slowest first
    (:func:`kernel_launches_and_us`): a profile study's table."""
    rows = [(name, us / 1000.0, count) for name, (count, us) in kernel_launches_and_us(fn, reps, warmup).items()]
    return sorted(rows, key=lambda r: -r[1])


def kernel_us_by_name(fn: Callable[[], object], reps: int = 10, warmup: int = 3) -> Dict[str, float]:
    """Mean GPU time per call (us) of each CUDA kernel name ``fn`` launches
    (:func:`kernel_launches_and_us`)."""
    return {name: us for name, (_, us) in kernel_launches_and_us(fn, reps, warmup).items()}


def kernel_us_per_call(fn: Callable[[], object], reps: int = 10, warmup: int = 3, name: str = "") -> float:
    """Mean GPU time per call (us) of the CUDA kernels whose name contains ``name`` (all: "")."""
    return sum(us for kernel, us in kernel_us_by_name(fn, reps, warmup).items() if name in kernel)


def graph_us_per_call(fn: Callable[[], object], calls: int = 10, replays: int = 3, warmup: int = 3) -> float:
    """Mean time per call (us) of ``fn`` replayed from a CUDA graph of ``calls`` calls: GPU time
    with no host time in it (``fn`` must be capturable)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (replays * calls) * 1e3


def median_ms_per_call(call: Callable[[], object], reps: int, cuda: bool) -> Dict[str, float]:
    """Each of ``reps`` calls timed alone (CUDA events on ``cuda``, else wall clock): median and
    min ms. Warm-up is the caller's."""
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            call()
            times.append((time.perf_counter() - t) * 1e3)
    return {"ms": statistics.median(times), "ms_min": min(times)}


def mean_s_back_to_back(
    fn: Callable[[], object],
    reps: int,
    warmup: int,
    sync: Callable[[], object],
    before_start: Optional[Callable[[], object]] = None,
) -> float:
    """Mean wall seconds per call of ``reps`` calls back to back, synchronising once at the end
    (what a layer loop sees when the device keeps up with the host). ``before_start`` runs after
    the warm-up's sync, just before the clock starts (e.g. a barrier of all ranks)."""
    for _ in range(warmup):
        fn()
    sync()
    if before_start is not None:
        before_start()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t0) / reps


def mean_ms_cuda_events(fn: Callable[[], object], reps: int = 20, warmup: int = 3) -> float:
    """Mean GPU ms per call of ``reps`` calls back to back, between two CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps
