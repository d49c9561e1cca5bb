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


def test_tile_unions_count_each_tiles_rows_times_its_distinct_blocks():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "studies"))
    import pisa_tile_unions

    # 3 rows keeping 2 blocks each (-1 unused). Tiles of 2 rows: {0, 1, 2} x 2 rows + {3} x 1 row
    sel = torch.tensor([[[[0, 1], [1, 2], [3, -1]]]], dtype=torch.int32)
    assert [pisa_tile_unions.union_rows_blocks(sel, t) for t in (1, 2, 3)] == [5, 7, 12]
    other_head = torch.tensor([[[[5, 6], [5, 6], [5, 6]]]], dtype=torch.int32)  # the same 2 blocks
    assert pisa_tile_unions.union_rows_blocks(torch.cat([sel, other_head], dim=1), 2) == 7 + 2 * 2 + 2 * 1


def test_whole_block_share_counts_listed_blocks_before_each_tiles_first_row():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "studies"))
    import pisa_tile_unions

    # blocks of 2 keys, tiles of 2 rows: tile 0 (rows 0-1) lists {0}, which holds row 0 itself;
    # tile 1 (rows 2-3) lists {0, 1}: block 0 (keys 0-1) lies wholly before row 2, block 1 does not;
    # tile 2 (row 4) lists {0, 2}: block 0 is whole, block 2 (keys 4-5) holds row 4
    sel = torch.tensor([[[[0, -1], [0, -1], [0, 1], [1, -1], [0, 2]]]], dtype=torch.int32)
    assert pisa_tile_unions.whole_block_share(sel, 2, 2) == 2 / 5
    # one row a tile: row 1 sees block 0 whole, rows 2 and 4 block 0, row 3 block 1; row 0 and the
    # blocks holding rows 2 and 4 do not
    assert pisa_tile_unions.whole_block_share(sel, 1, 2) == 4 / 7


def test_an_earlier_modules_source_renames_every_op_and_sibling_import():
    """An earlier commit's module (pisa_select_ab, token_sparse_schedule --baseline, --old) runs
    beside the package: none of its ops may keep the package's names (it would replace them for
    the process), and its imports of the other earlier modules go to their copies. Checked on the
    source text, so nothing is registered here."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "studies"))
    import pisa_select_ab

    import sparseflow.kernels.token_sparse_triton as current

    with open(current.__file__) as fh:
        src = fh.read()
    assert '"sparseflow::token_tile_lists"' in src and "from .pdl import" in src, "the check must cover both"
    out = pisa_select_ab.renamed_source(src, siblings=("pdl",))
    assert "sparseflow::" not in out.replace("sparseflow_ab::", "") and "torch.ops.sparseflow." not in out
    assert '"sparseflow_ab::token_tile_lists"' in out and "torch.ops.sparseflow_ab.token_tile_lists" in out
    assert "from ._ab_pdl import" in out and "from .pdl import" not in out
