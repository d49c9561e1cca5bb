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
