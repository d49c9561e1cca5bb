"""benchmarks/studies/kernel_resources.py: the programs an H200 SM holds, by registers, warps,
shared memory and the program cap, with the limit (or tied limits) named."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks", "studies"))

import kernel_resources as kr  # noqa: E402


@pytest.mark.parametrize(
    "registers, warps, shared, programs, limit",
    [
        (96, 8, 28672, 2, "registers"),  # 3072 registers a warp: 21 warps, two 8-warp programs
        (63, 1, 64, 32, "registers=blocks"),  # rounded to 64 a thread: 32 one-warp programs, the cap too
        (32, 4, 200 * 1024, 1, "shared"),
        (16, 32, 0, 2, "warps"),
        (168, 4, 24576, 3, "registers"),  # 168 x 32 = 5376 a warp: 12 warps
    ],
    ids=["node-scan", "walk-tie", "shared-bound", "warp-bound", "leaf-pairs"],
)
def test_programs_an_sm_holds_and_what_limits_them(registers, warps, shared, programs, limit):
    got = kr.programs_per_sm(registers, warps, shared)
    assert (got["programs"], got["limit"]) == (programs, limit)
    assert got["programs"] == min(got["by"].values())


def test_sass_instructions_counts_instruction_lines_only(tmp_path):
    """The static count reads nvdisasm's listing: instruction lines (their address comment, then
    an opcode, predicated or not) count; headers, labels and blank lines do not."""
    listing = "\n".join(
        [
            '\t.headerflags\t@"EF_CUDA_SM90"',
            "        .text._leaf_pairs_kernel:",
            "        /*0000*/                   LDC R1, c[0x0][0x28] ;",
            ".L_x_3:",
            "        /*0010*/                   S2R R0, SR_CTAID.X ;",
            "",
            "        /*0020*/               @P0 EXIT ;",
            "        /*0030*/                   BRA 0x30;",
        ]
    )
    fake = tmp_path / "nvdisasm"
    fake.write_text(f"#!/bin/sh\ncat <<'LISTING'\n{listing}\nLISTING\n")
    fake.chmod(0o755)
    assert kr.sass_instructions(b"\x7fELF", str(fake)) == 4


def test_sass_loops_count_each_loop_from_its_label_to_its_last_branch_back():
    listing = "\n".join(
        [
            "        /*0000*/                   LDC R1, c[0x0][0x28] ;",
            ".L_x_1:",
            "        /*0010*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR12], RZ ;",
            ".L_x_2:",
            "        /*0020*/                   MUFU.EX2 R26, R26 ;",
            "        /*0030*/               @P1 BRA `(.L_x_2) ;",
            "        /*0040*/               @P2 BRA `(.L_x_1) ;",
            "        /*0050*/               @P3 BRA `(.L_x_3) ;",
            "        /*0060*/                   FADD R1, R1, R2 ;",
            ".L_x_3:",
            "        /*0070*/                   EXIT ;",
        ]
    )
    # the outer loop holds the inner one; a forward branch (to .L_x_3) is no loop
    assert kr.sass_loops(listing) == [4, 2]


def test_scan_launch_settings_are_parsed_and_checked_by_name():
    from common import parse_scan_launches  # benchmarks/common.py: kernel_resources and pisa_layer_kernels share it

    assert parse_scan_launches("pair_unit=siblings, pair_rows=64") == [{"pair_unit": "siblings", "pair_rows": 64}]
    assert parse_scan_launches("heads=loop;pair_unit=siblings") == [{"heads": "loop"}, {"pair_unit": "siblings"}]
    assert parse_scan_launches("") == []
    with pytest.raises(ValueError, match=r"unknown settings \['pair_size'\]"):
        parse_scan_launches("pair_size=2")


def test_one_scan_layout_applies_to_a_whole_run(monkeypatch):
    from common import use_scan_launch  # e2e_prefill's and auto_vs_dense's --scan-launch
    from sparseflow.methods.pisa import triton_select_scan as scan

    monkeypatch.setattr(scan, "LAUNCH", dict(scan.LAUNCH))  # the test's own copy of the process-wide dict
    before = dict(scan.LAUNCH)
    assert use_scan_launch("") == before
    applied = use_scan_launch("heads=loop,pair_unit=siblings")
    assert applied == dict(before, heads="loop", pair_unit="siblings") == scan.LAUNCH
    assert scan.dot_rows(3, scan.LAUNCH["rows"])[2] is True  # the kernels' launch helpers read it
    assert scan.pair_unit(2) == (2, 2)
    with pytest.raises(ValueError, match="one variant for a whole run, got 2"):
        use_scan_launch("heads=loop;pair_unit=siblings")
    with pytest.raises(ValueError, match=r"unknown settings \['pair_size'\]"):
        use_scan_launch("pair_size=2")
