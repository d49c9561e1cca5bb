"""Context-parallel prefill on gloo (CPU), 2 and 3 processes: every rank's output rows (and
gradients) equal the single-process op's, and shardings it cannot do fail with a clear error.

One group of processes per world size runs every case (spawning costs seconds); each case's
outcome comes back through a file and is asserted by its own test.
"""

from __future__ import annotations

import json
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _spawn_ranks import spawn_ranks

import sparseflow
from sparseflow import context_parallel as cpm
from sparseflow import BSAConfig, ContextParallel, DenseConfig, PBSConfig, PISAConfig

_PBS = dict(block_size=16, segment_size=32, min_seq_len=0)
_TOKEN = dict(block_size=8, min_seq_len=0)

# name -> (config, sharding, sequence length, is_causal, check gradients)
CASES = {
    "pbs-sparse-zigzag": (PBSConfig(threshold=0.3, **_PBS), "zigzag", 168, True, True),
    "pbs-sparse-contiguous-odd": (PBSConfig(threshold=0.3, **_PBS), "contiguous", 169, True, False),
    "pbs-exact-zigzag": (PBSConfig(threshold=1.0, **_PBS), "zigzag", 168, True, False),
    "pbs-proxies-antidiagonal": (
        PBSConfig(threshold=0.3, proxy_blocks=3, scoring="antidiagonal", antidiagonal_stride=4, **_PBS),
        "zigzag",
        168,
        True,
        False,
    ),
    "pbs-kv-head-noncausal": (
        PBSConfig(threshold=0.3, gqa_permutation="kv_head", **_PBS),
        "contiguous",
        170,
        False,
        False,
    ),
    "pisa-sparse-zigzag": (PISAConfig(top_k=3, **_TOKEN), "zigzag", 108, True, True),
    "pisa-sparse-contiguous-odd": (PISAConfig(top_k=3, **_TOKEN), "contiguous", 101, True, False),
    "pisa-exact-zigzag": (PISAConfig(top_k=64, **_TOKEN), "zigzag", 108, True, False),
    "pisa-noncausal": (PISAConfig(top_k=3, **_TOKEN), "contiguous", 100, False, False),
    "bsa-sparse-zigzag": (BSAConfig(top_k=3, **_TOKEN), "zigzag", 108, True, True),
    "bsa-sparse-contiguous-odd": (BSAConfig(top_k=3, **_TOKEN), "contiguous", 101, True, False),
    "bsa-noncausal": (BSAConfig(top_k=3, **_TOKEN), "contiguous", 100, False, False),
    "dense-zigzag": (DenseConfig(), "zigzag", 108, True, True),
    "pbs-short-runs-dense": (PBSConfig(min_seq_len=4096), "zigzag", 108, True, False),
}

# name -> (what the call does wrong, the words its ValueError must contain)
ERRORS = {
    "zigzag-odd-length": ("odd", "divisible by 2 * world size"),
    "zigzag-noncausal": ("noncausal", "sharding='contiguous'"),
    "heads-disagree": ("heads", "disagree on query heads"),
    "attn-mask": ("mask", "attn_mask is not supported"),
}

HQ, HKV, D = 4, 2, 16


def _inputs(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, h, n, D, generator=g) for h in (HQ, HKV, HKV))
    w = torch.randn(2, HQ, n, D, generator=g)
    return q, k, v, w


def _grads(out, w, tensors):
    return torch.autograd.grad((out * w).sum(), tensors)


def _run_case(config, sharding, n, is_causal, check_grad, group) -> str:
    """'' when the rank's rows and gradients match the single-process op, else what differs."""
    cp = ContextParallel(group, sharding=sharding)
    q, k, v, w = _inputs(n)
    full = [t.clone().requires_grad_(check_grad) for t in (q, k, v)]
    want = sparseflow.attention(*full, config=config, is_causal=is_causal, backend="reference")
    local = [cpm.shard(t, cp).requires_grad_(check_grad) for t in (q, k, v)]
    got = sparseflow.attention(*local, config=config, is_causal=is_causal, backend="reference", context_parallel=cp)
    errors = []
    whole = cpm.unshard(got.detach(), cp)
    if whole.shape != want.shape or not torch.allclose(whole, want, atol=1e-5, rtol=1e-5):
        errors.append(f"output differs by {(whole - want).abs().max():.3g}")
    if check_grad:
        for name, g_full, g_local in zip("qkv", _grads(want, w, full), _grads(got, cpm.shard(w, cp), local)):
            if not torch.allclose(g_local, cpm.shard(g_full, cp), atol=1e-5, rtol=1e-5):
                errors.append(f"d{name} differs by {(g_local - cpm.shard(g_full, cp)).abs().max():.3g}")
    return "; ".join(errors)


def _run_triton_pbs(group) -> str:
    """'' when PBS's Triton selection and attention (interpreted), restricted to the rank's query
    blocks, give the single-process Triton op's rows, else what differs."""
    cp = ContextParallel(group, sharding="zigzag")
    q, k, v, _ = _inputs(168)
    config, tuning = PBSConfig(threshold=0.3, **_PBS), sparseflow.Tuning(pbs_select="triton")
    with torch.no_grad():
        want = sparseflow.attention(q, k, v, config=config, backend="triton", tuning=tuning)
        local = [cpm.shard(t, cp) for t in (q, k, v)]
        got = sparseflow.attention(*local, config=config, backend="triton", tuning=tuning, context_parallel=cp)
    whole = cpm.unshard(got, cp)
    if whole.shape != want.shape or not torch.allclose(whole, want, atol=1e-5, rtol=1e-5):
        return f"output differs by {(whole - want).abs().max():.3g}"
    return ""


def _run_error(kind, group) -> str:
    """The ValueError's message ('' when none was raised)."""
    rank = dist.get_rank()
    n = 97 if kind == "odd" else 96
    q, k, v, _ = _inputs(n)
    cp = ContextParallel(group, sharding="contiguous" if kind == "odd" else "zigzag")
    q, k, v = (cpm.shard(t, cp) for t in (q, k, v))
    if kind == "odd":
        cp = ContextParallel(group, sharding="zigzag")
    if kind == "heads" and rank == 1:
        q, k, v = q[:, :2], k[:, :1], v[:, :1]
    mask = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool) if kind == "mask" else None
    try:
        sparseflow.attention(
            q,
            k,
            v,
            config=PISAConfig(top_k=3, **_TOKEN),
            is_causal=kind != "noncausal",
            attn_mask=mask,
            backend="reference",
            context_parallel=cp,
        )
    except ValueError as e:
        return str(e)
    return ""


def _run_recorded(group) -> str:
    """What a capture records and the log says of a call that runs dense (min_seq_len above the
    global length 108, which no rank's shard shows)."""
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("sparseflow")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.DEBUG)
    cp = ContextParallel(group)
    try:
        q, k, v = (cpm.shard(t, cp) for t in _inputs(108)[:3])
        with sparseflow.capture() as cap:
            sparseflow.attention(q, k, v, config=PBSConfig(min_seq_len=4096), backend="reference", context_parallel=cp)
            sparseflow.attention(q, k, v, config=BSAConfig(top_k=3, **_TOKEN), backend="reference", context_parallel=cp)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    calls = [(c.method, c.backend, c.sparse, c.reason, list(c.q_shape)) for c in cap.calls]
    return json.dumps({"log": records, "calls": calls})


def _worker(rank: int, world: int, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = {}
    try:
        group = dist.group.WORLD
        for name, case in CASES.items():
            try:
                results[name] = _run_case(*case, group)
            except Exception:  # reported by the case's test, not lost in the child
                results[name] = traceback.format_exc()
        results["recorded"] = _run_recorded(group)
        if world == 2:  # the interpreter is slow: one world size checks the kernels' share of the ranks
            try:
                results["pbs-triton"] = _run_triton_pbs(group)
            except Exception:
                results["pbs-triton"] = traceback.format_exc()
        for name, (kind, _) in ERRORS.items():
            results["error:" + name] = _run_error(kind, group)
    finally:
        with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        # no rank tears its connections down while another still talks to it
        dist.barrier()
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda w: f"world{w}")
def outcomes(request, tmp_path_factory):
    world = request.param
    return spawn_ranks(_worker, world, lambda: str(tmp_path_factory.mktemp(f"cp{world}")))


def test_fallback_logged_and_calls_recorded(outcomes):
    for rank, res in enumerate(outcomes):
        got = json.loads(res["recorded"])
        reason = "sequence length 108 < min_seq_len=4096"
        assert any(reason in line for line in got["log"]), (rank, got["log"])
        assert got["calls"] == [
            ["pbs", "sdpa", False, reason, [2, HQ, 108, D]],
            ["bsa", "reference", True, "", [2, HQ, 108, D]],
        ], (rank, got["calls"])


def _needs_two_ranks(outcomes, name):
    if name == "heads-disagree" and len(outcomes) == 1:
        pytest.skip("one rank cannot disagree with another")


def test_pbs_triton_kernels_match_single_process(outcomes):
    # the fused Triton selection and attention with other ranks' query blocks emptied
    if len(outcomes) != 2:
        pytest.skip("checked with 2 ranks")
    for rank, res in enumerate(outcomes):
        assert res["pbs-triton"] == "", f"rank {rank}: {res['pbs-triton']}"


@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_process(outcomes, name):
    for rank, res in enumerate(outcomes):
        assert res[name] == "", f"rank {rank}: {res[name]}"


@pytest.mark.parametrize("name", list(ERRORS))
def test_clear_error(outcomes, name):
    _needs_two_ranks(outcomes, name)
    words = ERRORS[name][1]
    for rank, res in enumerate(outcomes):
        assert words in res["error:" + name], f"rank {rank}: {res['error:' + name]!r}"


def test_context_parallel_argument_types():
    with pytest.raises(TypeError, match="context_parallel must be a DeviceMesh"):
        cpm.as_context_parallel(3)
    with pytest.raises(ValueError, match="sharding must be one of"):
        ContextParallel(None, sharding="ring")
    with pytest.raises(TypeError, match="group must be a 1-D DeviceMesh or a ProcessGroup"):
        ContextParallel("world")


def test_layout_zigzag_chunks():
    # rank r holds chunks r and 2W-1-r of 2W equal chunks (torch's head-tail load balancing)
    layout = cpm.Layout("zigzag", (4, 4, 4), rank=1)
    assert layout.chunks() == [(2, 4), (8, 10)]
    assert layout.positions().tolist() == [2, 3, 8, 9]
    assert cpm.split_lengths(7, 3, "contiguous") == (3, 2, 2)
    with pytest.raises(ValueError, match="divisible by 2 \\* world size = 6"):
        cpm.split_lengths(8, 3, "zigzag")


def test_benchmark_smoke_mode(tmp_path):
    # the 2-GPU benchmark's CPU smoke mode: argument parsing, gloo processes, its JSON and --check
    import subprocess
    import sys

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "context_parallel.py")
    out = tmp_path / "cp.json"
    subprocess.run(
        [
            sys.executable,
            path,
            "--device",
            "cpu",
            "--tiny",
            "--ns",
            "128",
            "--methods",
            "bsa,sdpa",
            "--iters",
            "1",
            "--warmup",
            "0",
            "--check",
            "--json",
            str(out),
        ],
        check=True,
        timeout=300,
    )
    got = json.loads(out.read_text())
    assert got["env"]["world_size"] == 2 and got["env"]["torch"] == torch.__version__
    bsa = next(r for r in got["rows"] if r["method"] == "bsa")
    assert bsa["max_abs_diff_vs_1gpu"] == 0.0 and bsa["t_cp_s"] > 0 and bsa["t_comm_s"] > 0


def test_benchmark_smoke_mode_whole_model(tmp_path):
    # the end-to-end mode: SmolLM2's shape (2 random-init layers) through sparseflow.compile with
    # context_parallel; the last rank's last logits must match the 1-process model's
    import subprocess
    import sys

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "context_parallel.py")
    out = tmp_path / "cpm.json"
    subprocess.run(
        [
            sys.executable,
            path,
            "--device",
            "cpu",
            "--tiny",
            "--model",
            "smollm2-random",
            "--ns",
            "160",
            "--methods",
            "bsa,sdpa",
            "--iters",
            "1",
            "--warmup",
            "0",
            "--check",
            "--json",
            str(out),
        ],
        check=True,
        timeout=300,
    )
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["model bsa", "model sdpa"]
    assert all(r["max_abs_diff_vs_1gpu"] < 1e-4 and r["t_cp_s"] > 0 for r in rows)


def _gpu_worker(rank: int, world: int, tmp: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    results = {}
    try:
        cp = ContextParallel(dist.group.WORLD, sharding="zigzag")
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(1, h, 4096, 64, device="cuda", dtype=torch.bfloat16, generator=g) for h in (8, 2, 2))
        for cfg in (PBSConfig(), PISAConfig(top_k=16), BSAConfig(top_k=16)):
            with torch.no_grad():
                want = sparseflow.attention(q, k, v, config=cfg, backend="triton")
                local = [cpm.shard(t, cp) for t in (q, k, v)]
                got = cpm.unshard(sparseflow.attention(*local, config=cfg, backend="triton", context_parallel=cp), cp)
            results[cfg.method] = float((got.float() - want.float()).abs().max())
    finally:
        with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        # no rank tears its connections down while another still talks to it
        dist.barrier()
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_kernels_on_gpus(tmp_path):
    # the Triton selection and attention under context parallelism (NCCL; 1 or 2 GPUs) equal the
    # single-device Triton op
    world = min(2, torch.cuda.device_count())
    mp.spawn(_gpu_worker, args=(world, str(tmp_path)), nprocs=world, join=True)
    for r in range(world):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert set(got) == {"pbs", "pisa", "bsa"}
        for method, diff in got.items():
            assert diff <= 1e-2, f"rank {r} {method}: max abs diff {diff}"
