"""sparseflow.compile(model, context_parallel=...): each rank runs a tiny HF decoder on its
contiguous shard and its logits equal the single-process compiled model's rows (gloo, CPU)."""

import copy
import re
import json
import os
import traceback

import pytest
import torch
import torch.distributed as dist

import sparseflow
from sparseflow import context_parallel as cpm
from sparseflow.config import BSAConfig, DenseConfig, PBSConfig

from _spawn_ranks import spawn_ranks
from conftest import make_tiny

N = 90  # 2 ranks: 45 + 45; 3 ranks: 30 each (shards cross PBS blocks and segments)
CONFIGS = {
    "pbs": PBSConfig(block_size=16, segment_size=32, threshold=0.8),
    "bsa": BSAConfig(block_size=16, top_k=4),
    "dense": DenseConfig(),
}
INNER = {"pbs": "eager", "bsa": "aot_eager", "dense": "eager"}  # aot_eager: the op is opaque to AOT


def _ids():
    return torch.randint(0, 128, (1, N), generator=torch.Generator().manual_seed(3))


def _single(name):
    model = make_tiny("llama", layers=2).eval()
    sparseflow.compile(
        model,
        method=CONFIGS[name].method,
        config=CONFIGS[name],
        backend=_backend(name),
        inner_backend=INNER[name],
        skip_layers=(1,) if name == "pbs" else (),
    )
    with torch.no_grad():
        return model(_ids()).logits


def _sharded(name, cp):
    model = make_tiny("llama", layers=2).eval()
    sparseflow.compile(
        model,
        method=CONFIGS[name].method,
        config=CONFIGS[name],
        backend=_backend(name),
        inner_backend=INNER[name],
        skip_layers=(1,) if name == "pbs" else (),
        context_parallel=cp,
    )
    s, e = _rows(dist.get_rank(), cp_world(cp))
    with torch.no_grad():
        out = model(_ids()[:, s:e], position_ids=torch.arange(s, e)[None]).logits
    return out, sparseflow.report(model)


def _rows(rank, world):
    ((start, end),) = cpm.Layout("contiguous", cpm.split_lengths(N, world, "contiguous"), rank).chunks()
    return start, end


def _backend(name):
    return "auto" if name == "dense" else "reference"


def cp_world(cp):
    return dist.get_world_size(cpm.process_group(cp.group))


def _worker(rank, world, tmp):
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = {}
    try:
        cp = sparseflow.ContextParallel(dist.group.WORLD, sharding="contiguous")
        for name in CONFIGS:
            try:
                got, rep = _sharded(name, cp)
                s, e = _rows(rank, world)
                want = _single(name)[:, s:e]
                results[name] = {"err": float((got - want).abs().max()), "rewritten": rep.num_rewritten}
            except Exception:
                results[name] = {"error": traceback.format_exc()}
    finally:
        with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.barrier()
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def outcomes(request, tmp_path_factory):
    world = request.param
    return spawn_ranks(_worker, world, lambda: str(tmp_path_factory.mktemp(f"cpc{world}")))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_sharded_model_equals_single_process(outcomes, name):
    for rank, res in enumerate(outcomes):
        r = res[name]
        assert "error" not in r, r.get("error")
        assert r["err"] <= 1e-4, f"rank {rank}: max |diff| {r['err']}"
        assert r["rewritten"] == 2  # the kept layer runs as the dense op, context parallel too


def test_zigzag_refused_for_a_model():
    # (no process group needed: the sharding is refused before any group is read)
    model = make_tiny("llama", layers=1)
    cp = object.__new__(sparseflow.ContextParallel)
    object.__setattr__(cp, "group", None)
    object.__setattr__(cp, "sharding", "zigzag")
    with pytest.raises(ValueError, match="sharding='contiguous'"):
        sparseflow.compile(copy.deepcopy(model), method="pbs", context_parallel=cp)


@pytest.mark.parametrize(
    "kwargs, where",
    [
        (dict(config=sparseflow.PBSConfig(dense_tail_blocks=1)), "(config)"),
        (dict(layer_configs={0: sparseflow.PBSConfig(dense_tail_blocks=2)}), "(layer_configs[0])"),
    ],
    ids=["config", "layer-config"],
)
def test_dense_tail_refused_for_a_context_parallel_model(kwargs, where):
    # refused when compiled, before any group is read or any forward runs
    model = make_tiny("llama", layers=1)
    cp = object.__new__(sparseflow.ContextParallel)
    object.__setattr__(cp, "group", None)
    object.__setattr__(cp, "sharding", "contiguous")
    with pytest.raises(ValueError, match=r"context_parallel does not run dense_tail_blocks=\d " + re.escape(where)):
        sparseflow.compile(copy.deepcopy(model), method="pbs", recipe=None, context_parallel=cp, **kwargs)
