"""benchmarks/e2e_gpu_busy.py's pure parts: the union of kernel intervals and the kernel kinds."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import e2e_gpu_busy  # noqa: E402


def test_busy_time_counts_overlapping_kernels_once_and_gaps_not_at_all():
    intervals = [(10, 20), (0, 5), (15, 30), (40, 41), (16, 18)]
    assert e2e_gpu_busy.busy_us(intervals) == 5 + 20 + 1
    assert e2e_gpu_busy.busy_us([]) == 0


def test_kernels_are_sorted_into_the_kinds_the_table_reads():
    assert e2e_gpu_busy.kind_of("_pbs_fwd_kernel") == "pbs attention"
    assert e2e_gpu_busy.kind_of("_select_rows_kernel") == "pbs selection"
    assert e2e_gpu_busy.kind_of("cudnn_generated_fort_native_sdpa_sm90") == "sdpa"
    assert e2e_gpu_busy.kind_of("nvjet_hsh_128x256") == "other (GEMMs, norms, ...)"


def test_pisa_scan_kernels_count_as_its_selection():
    """PISA's scan walk launches kernels named without "pisa": they still book as its selection,
    the pyramid build apart, and the leaf means BSA shares under neither method."""
    for name in ("_pisa_select_kernel", "_node_scan_kernel", "_leaf_pairs_kernel", "_leaf_keep_kernel"):
        assert e2e_gpu_busy.kind_of(name) == "pisa selection", name
    assert e2e_gpu_busy.kind_of("_pair_order_kernel") == "pisa selection"
    assert e2e_gpu_busy.kind_of("_pair_index_kernel") == "pisa selection"
    assert e2e_gpu_busy.kind_of("_node_kernel") == "pisa pyramid"
    assert e2e_gpu_busy.kind_of("_level_tables_kernel") == "pisa pyramid"
    assert e2e_gpu_busy.kind_of("_leaf_kernel") == "block summaries"
    assert e2e_gpu_busy.kind_of("_bsa_select_kernel") == "bsa selection"
