"""benchmarks/common.py: the timing loops the benchmark scripts share, and the inputs."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

import common  # noqa: E402


def test_back_to_back_mean_counts_calls_and_syncs_around_the_clock():
    events = []
    mean = common.mean_s_back_to_back(
        lambda: events.append("call"),
        reps=4,
        warmup=2,
        sync=lambda: events.append("sync"),
        before_start=lambda: events.append("start"),
    )
    assert events == ["call"] * 2 + ["sync", "start"] + ["call"] * 4 + ["sync"]
    assert mean >= 0.0


def test_median_per_call_on_the_cpu_clock():
    calls = []
    out = common.median_ms_per_call(lambda: calls.append(1), reps=3, cuda=False)
    assert len(calls) == 3 and set(out) == {"ms", "ms_min"} and 0.0 <= out["ms_min"] <= out["ms"]


def test_seeded_inputs_repeat_and_follow_the_generator_device():
    a = common.qkv(1, 4, 2, 96, 16, torch.float32, seed=1, structured=True, device="cpu")
    b = common.qkv(1, 4, 2, 96, 16, torch.float32, seed=1, structured=True, device="cpu")
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and a[1].shape == (1, 2, 96, 16)
    perm, bm = common.exact_selection(1, 4, 4, 96, 16, 32, device="cpu")
    sel = common.random_selection(perm, 4, 96, 16, 32, 0.0)
    assert bm.shape == sel.shape and not (sel & ~bm).any()  # forced blocks only, inside the causal mask


@pytest.mark.parametrize(
    "name",
    [
        "mean_ms_cuda_events",
        "bench",
        "env_info",
        "sdpa_dense",
        "pbs_kernel_inputs",
        "kernel_us_by_name",
        "kernel_launches_and_us",
        "graph_us_per_call",
    ],
)
def test_cuda_helpers_are_exported(name):
    assert callable(getattr(common, name)) and name in common.__all__


def test_env_info_names_the_device_it_ran_on(monkeypatch):
    import importlib.util

    env = common.env_info("cpu")
    assert env["device"] == "cpu" and env["torch_threads"] == torch.get_num_threads() and "gpu" not in env
    assert env["torch"] == torch.__version__ and env["date"].endswith("+00:00")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    real_find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real_find(name, *a))
    bare = common.env_info()
    assert bare["device"] == "cpu" and bare["triton"] is None
    with pytest.raises(ValueError, match="device must be auto, cpu or cuda"):
        common.env_info("tpu")


def test_write_result_keeps_env_args_and_what_was_measured(tmp_path):
    import argparse
    import json

    path = tmp_path / "r.json"
    args = argparse.Namespace(ns=[8192], json=str(path))
    common.write_result(str(path), {"gpu": "X", "date": "d"}, args, rows=[{"ms": 1.5}], launch={"rows": 64})
    assert json.loads(path.read_text()) == {
        "env": {"gpu": "X", "date": "d"},
        "args": {"ns": [8192], "json": str(path)},
        "rows": [{"ms": 1.5}],
        "launch": {"rows": 64},
    }
    common.write_result(str(path), {"gpu": "X"}, rows=[])
    assert json.loads(path.read_text()) == {"env": {"gpu": "X"}, "rows": []}
