"""Context-parallel sparse prefill: 2 GPUs against 1, and against dense SDPA under torch's
context parallelism (issue 18).

    torchrun --nproc-per-node 2 benchmarks/context_parallel.py \\
        --json benchmarks/results/context_parallel_h200x2.json

For every length (default 128K, 256K, 512K; B=1, Hq=32, Hkv=8, D=128, bf16, the structured inputs) and method (pbs, pisa, bsa) it times:

* ``1gpu``: ``sparseflow.attention`` on rank 0 alone (the other ranks wait);
* ``cp``: ``sparseflow.attention(..., context_parallel=ContextParallel(mesh, "zigzag"))`` on every
  rank, the slowest rank's time;
* ``comm``: the K/V all-gather alone (what ``cp`` spends communicating, plus PBS's small
  all-reduce of shared query rows, not timed separately);
* ``sdpa``: dense causal SDPA on one GPU and under ``torch.distributed.tensor.experimental.
  context_parallel`` (ring attention, head-tail load balance) on all ranks, K/V heads repeated.

``--check`` also compares the gathered context-parallel output with the 1-GPU output.
Smoke mode on the CPU (gloo, spawns its own processes): ``python benchmarks/context_parallel.py
--device cpu --tiny`` (``--nproc`` processes, default 2).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import sparseflow  # noqa: E402
from common import mean_s_back_to_back, structured_qkv  # noqa: E402
from sparseflow import context_parallel as cpm  # noqa: E402

K = 1024


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--ns",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[128 * K, 256 * K, 512 * K],
        help="sequence lengths, comma separated",
    )
    ap.add_argument(
        "--methods",
        type=lambda s: s.split(","),
        default=["pbs", "pisa", "bsa", "sdpa"],
        help="any of pbs, pisa, bsa, sdpa",
    )
    ap.add_argument("--sharding", choices=cpm.SHARDINGS, default="zigzag")
    ap.add_argument("--top-k", type=int, default=16, help="PISA / BSA top_k")
    ap.add_argument(
        "--backend",
        choices=["triton", "reference"],
        default=None,
        help="the sparse ops' backend, 1 GPU and CP alike (default: triton on CUDA, reference on CPU)",
    )
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="small shapes and configs (smoke test)")
    ap.add_argument("--nproc", type=int, default=2, help="processes to spawn when not run under torchrun")
    ap.add_argument("--check", action="store_true", help="compare the CP output with the 1-GPU output")
    ap.add_argument("--json", default=None, help="where to write the results (rank 0)")
    ap.add_argument(
        "--model",
        choices=["smollm2", "smollm2-random"],
        default=None,
        help="the whole SmolLM2-135M prefill through sparseflow.compile instead of the op "
        "(smollm2-random: its shape with random weights, no checkpoint needed)",
    )
    args = ap.parse_args(argv)
    unknown = set(args.methods) - {"pbs", "pisa", "bsa", "sdpa"}
    if unknown:
        ap.error(f"--methods: unknown {sorted(unknown)}; choose from pbs, pisa, bsa, sdpa")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda needs a GPU; use --device cpu --tiny for the smoke test")
    return args


def shapes(args):
    """(B, Hq, Hkv, D, dtype, lengths)."""
    if args.tiny:
        return 1, 4, 2, 16, torch.float32, [n for n in args.ns if n <= 4096] or [512]
    return 1, 32, 8, 128, torch.bfloat16, args.ns


def configs(args):
    if args.tiny:
        return {
            "pbs": sparseflow.PBSConfig(block_size=32, segment_size=64, threshold=0.5),
            "pisa": sparseflow.PISAConfig(block_size=16, top_k=4),
            "bsa": sparseflow.BSAConfig(block_size=16, top_k=4),
        }
    return {
        "pbs": sparseflow.PBSConfig(),
        "pisa": sparseflow.PISAConfig(top_k=args.top_k),
        "bsa": sparseflow.BSAConfig(top_k=args.top_k),
    }


def inputs(b, hq, hkv, n, d, dtype, device):
    """The structured inputs of benchmarks/common.py, the same on every rank (seeded by ``n``)."""
    g = torch.Generator(device=device).manual_seed(n)
    return structured_qkv(b, hq, hkv, n, d, dtype, g)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, args, device, group=None):
    """Mean seconds per call; with ``group`` every rank runs it and the slowest rank counts."""
    barrier = (lambda: dist.barrier(group)) if group is not None else None
    mean_s = mean_s_back_to_back(fn, args.iters, args.warmup, lambda: sync(device), before_start=barrier)
    elapsed = torch.tensor([mean_s], dtype=torch.float64, device=device)
    if group is not None:
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return float(elapsed)


def on_rank0(fn, device, group):
    """``fn()`` on rank 0 while the others wait; its value broadcast to all."""
    value = torch.zeros(1, dtype=torch.float64, device=device)
    if dist.get_rank(group) == 0:
        value += fn()
    dist.broadcast(value, 0, group=group)
    return float(value)


def dense_sdpa(q, k, v):
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), is_causal=True)


def torch_cp_sdpa(mesh, q, k, v, args, device):
    """Dense causal SDPA under torch's context parallelism (None where it does not run)."""
    from torch.distributed.tensor.experimental import context_parallel

    g = q.shape[1] // k.shape[1]
    qq, kk, vv = q.clone(), k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    try:
        with context_parallel(mesh, buffers=[qq, kk, vv], buffer_seq_dims=[2, 2, 2]):
            return timed(
                lambda: F.scaled_dot_product_attention(qq, kk, vv, is_causal=True), args, device, mesh.get_group()
            )
    except (RuntimeError, NotImplementedError) as e:  # e.g. no ring kernel for the CPU's SDPA
        if dist.get_rank() == 0:
            print(f"torch context_parallel SDPA did not run here: {type(e).__name__}: {str(e)[:120]}", flush=True)
        return None


def bench_method(method, cfg, q, k, v, cp, layout, args, device):
    pg = cpm.process_group(cp.group)
    local = [cpm.shard(t, cp) for t in (q, k, v)]
    # one explicit backend for both sides: "auto" might time dense SDPA on one and not the other
    backend = args.backend or ("reference" if device.type == "cpu" else "triton")
    with torch.no_grad():
        one = on_rank0(
            lambda: timed(lambda: sparseflow.attention(q, k, v, config=cfg, backend=backend), args, device), device, pg
        )
        par = timed(
            lambda: sparseflow.attention(*local, config=cfg, backend=backend, context_parallel=cp), args, device, pg
        )
        comm = timed(
            lambda: (cpm.gather_sequence(local[1], layout, pg), cpm.gather_sequence(local[2], layout, pg)),
            args,
            device,
            pg,
        )
        row = dict(method=method, t_1gpu_s=one, t_cp_s=par, t_comm_s=comm)
        if args.check:
            got = cpm.unshard(sparseflow.attention(*local, config=cfg, backend=backend, context_parallel=cp), cp)
            want = sparseflow.attention(q, k, v, config=cfg, backend=backend)
            row["max_abs_diff_vs_1gpu"] = float((got.float() - want.float()).abs().max())
    return row


def bench_sdpa(q, k, v, mesh, layout, cp, args, device):
    pg = mesh.get_group()
    with torch.no_grad():
        one = on_rank0(lambda: timed(lambda: dense_sdpa(q, k, v), args, device), device, pg)
        par = torch_cp_sdpa(mesh, q, k, v, args, device)
    return dict(method="sdpa", t_1gpu_s=one, t_cp_s=par, t_comm_s=None)


def _smollm2(args, device):
    from e2e_prefill import random_smollm2, repeated_tokens  # (this folder is on sys.path, above)

    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    if args.model == "smollm2-random":
        model, tok = random_smollm2(dtype)
    else:
        from sparseflow.checkpoints import load_smollm2

        model, tok = load_smollm2(dtype=dtype)
    if args.tiny:
        model.model.layers = model.model.layers[:2]
        model.config.num_hidden_layers = 2
    return model.to(device).eval(), lambda n: repeated_tokens(tok, "pydoc_topics", n).to(device)


def _compiled(model, method, cfg, backend, cp=None):
    m = copy.deepcopy(model)
    if method == "sdpa":  # dense: plain SDPA on one GPU, the dense op under context parallelism
        method, cfg, backend = "dense", None, "auto"
    sparseflow.compile(
        m, method=method, config=cfg, backend=backend, recipe=None, inner_backend="eager", context_parallel=cp
    )
    return m


def bench_model(method, cfg, model, ids, mesh, args, device):
    """The whole forward (``logits_to_keep=1``): 1 GPU with the full prompt against every rank
    with its contiguous shard (global position ids)."""
    pg = mesh.get_group()
    backend = args.backend or ("reference" if device.type == "cpu" else "triton")
    world, rank, n = dist.get_world_size(pg), dist.get_rank(pg), ids.shape[1]
    ((s, e),) = cpm.Layout("contiguous", cpm.split_lengths(n, world, "contiguous"), rank).chunks()
    cp = sparseflow.ContextParallel(mesh, sharding="contiguous")
    with torch.no_grad():
        if rank == 0:
            single = _compiled(model, method, cfg, backend) if method != "sdpa" else model
        one = on_rank0(lambda: timed(lambda: single(ids, logits_to_keep=1), args, device), device, pg)
        par_model = _compiled(model, method, cfg, backend, cp)
        pos = torch.arange(s, e, device=device)[None]
        par = timed(lambda: par_model(ids[:, s:e], position_ids=pos, logits_to_keep=1), args, device, pg)
        row = dict(method=f"model {method}", t_1gpu_s=one, t_cp_s=par, t_comm_s=None)
        if args.check:  # the last rank holds the prompt's last position
            got = par_model(ids[:, s:e], position_ids=pos, logits_to_keep=1).logits.float()
            want = single(ids, logits_to_keep=1).logits.float() if rank == 0 else torch.zeros_like(got)
            dist.broadcast(want, 0, group=pg)
            diff = torch.zeros(1, dtype=torch.float64, device=device)
            if rank == world - 1:
                diff += (got - want).abs().max().double()
            dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=pg)
            row["max_abs_diff_vs_1gpu"] = float(diff)
    return row


def run_model(args, mesh, device):
    model, ids_of = _smollm2(args, device)
    cfgs = configs(args)
    rows = []
    for n in shapes(args)[-1]:
        ids = ids_of(n)
        for method in args.methods:
            row = bench_model(method, cfgs.get(method), model, ids, mesh, args, device)
            row.update(n=n, world=dist.get_world_size())
            rows.append(row)
            if dist.get_rank() == 0:
                print(format_row(row), flush=True)
    return rows


def run(args):
    device = (
        torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0)))
        if args.device == "cuda"
        else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    world = dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("cp",))
    if args.model:
        return run_model(args, mesh, device)
    cp = sparseflow.ContextParallel(mesh, sharding=args.sharding)
    b, hq, hkv, d, dtype, ns = shapes(args)
    cfgs = configs(args)
    rows = []
    for n in ns:
        q, k, v = inputs(b, hq, hkv, n, d, dtype, device)
        layout = cpm.Layout(args.sharding, cpm.split_lengths(n, world, args.sharding), dist.get_rank())
        for method in args.methods:
            if method == "sdpa":
                row = bench_sdpa(q, k, v, mesh, layout, cp, args, device)
            else:
                row = bench_method(method, cfgs[method], q, k, v, cp, layout, args, device)
            row.update(n=n, world=world)
            rows.append(row)
            if dist.get_rank() == 0:
                print(format_row(row), flush=True)
        del q, k, v
    return rows


def format_row(r):
    def ms(t):
        return "      n/a" if t is None else f"{t * 1e3:9.2f}"

    speed = "  n/a" if r["t_cp_s"] is None else f"{r['t_1gpu_s'] / r['t_cp_s']:5.2f}"
    extra = f"  diff {r['max_abs_diff_vs_1gpu']:.2e}" if "max_abs_diff_vs_1gpu" in r else ""
    return (
        f"{r['method']:5s} n={r['n']:7d}  1 GPU {ms(r['t_1gpu_s'])} ms  {r['world']} GPUs {ms(r['t_cp_s'])} ms"
        f"  comm {ms(r['t_comm_s'])} ms  speedup {speed}x{extra}"
    )


def summary(rows):
    """Per length: each method's CP time against dense CP SDPA's."""
    lines = []
    for n in sorted({r["n"] for r in rows}):
        dense = next((r["t_cp_s"] for r in rows if r["n"] == n and r["method"] == "sdpa"), None)
        for r in rows:
            if r["n"] == n and r["method"] != "sdpa" and dense and r["t_cp_s"]:
                lines.append(f"n={n:7d} {r['method']:5s} CP vs dense CP SDPA: {dense / r['t_cp_s']:.2f}x faster")
    return lines


def env_info(device, world):
    info = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "world_size": world,
        "device": str(device.type),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device.type == "cuda":
        info.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    return info


def worker(rank, world, init, args):
    backend = "nccl" if args.device == "cuda" else "gloo"
    if init is None:
        dist.init_process_group(backend)
    else:
        os.environ["LOCAL_RANK"] = str(rank)  # the GPU of a spawned process
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    try:
        rows = run(args)
        if dist.get_rank() == 0:
            for line in summary(rows):
                print(line)
            if args.json:
                device = torch.device(args.device)
                with open(args.json, "w") as fh:
                    json.dump({"env": env_info(device, dist.get_world_size()), "rows": rows}, fh, indent=2)
                print(f"wrote {args.json}")
    finally:
        dist.destroy_process_group()


def main(argv=None):
    args = parse_args(argv)
    if "RANK" in os.environ:  # torchrun
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, args)
        return 0
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(args.nproc, f"file://{tmp}/store", args), nprocs=args.nproc, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
