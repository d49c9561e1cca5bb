"""What each Triton kernel of one PISA, BSA or PBS call asks of an H200's multiprocessor, compiled
for sm_90 on a machine without a GPU (tests/sm90_compile.py's driver): registers a thread,
local memory (spills), shared memory, warps, and the programs an SM can hold with what limits
them. A kernel whose registers allow two programs an SM hides latency worse than one that
allows eight; this says which, before any device time is spent.

    python benchmarks/studies/kernel_resources.py --method pisa --n 8192 --json benchmarks/results/kernel_resources_pisa_8k_cpu.json

SmolLM2's attention shape (B 1, Hq 9, Hkv 3, D 64), bf16, causal, each method's defaults.
Nothing runs: the kernels' launch sizes are the ones the call picks for that shape, but a launch
whose size depends on what an earlier kernel wrote (the scan's leaf-pair chunks) sees zeros.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))

# an H200 multiprocessor (sm_90): what the programs resident on it share
SM_REGISTERS = 65536
REGISTER_UNIT = 256  # registers are given to a warp in multiples of this
SM_WARPS = 64
SM_BLOCKS = 32
SM_SHARED = 233472  # 228 KiB, of which each program's launch reserves 1 KiB
SHARED_RESERVED = 1024


def programs_per_sm(registers: int, warps: int, shared: int) -> Dict[str, int]:
    """Programs one SM can hold: ``"by"`` each limit (``registers`` a thread, ``warps`` a
    program, ``shared`` bytes a program), ``"programs"`` the smallest, ``"limit"`` its name."""
    per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT if registers else 0
    by = {
        "registers": (SM_REGISTERS // per_warp) // warps if per_warp else SM_BLOCKS,
        "warps": SM_WARPS // warps,
        "shared": SM_SHARED // (shared + SHARED_RESERVED),
        "blocks": SM_BLOCKS,
    }
    low = min(by.values())
    return {"by": by, "programs": low, "limit": "=".join(name for name, n in by.items() if n == low)}


def cubin_usage(cubin: bytes, cuobjdump: str) -> Dict[str, int]:
    """``REG`` and ``LOCAL`` (spill and stack bytes a thread) of a cubin, from ``cuobjdump -res-usage``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    usage = {key: int(val) for key, val in re.findall(r"(REG|LOCAL|STACK):(\d+)", text)}
    return {"registers": usage.get("REG", 0), "local": usage.get("LOCAL", 0) + usage.get("STACK", 0)}


_INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+\S")


def sass_listing(cubin: bytes, nvdisasm: str) -> str:
    """A cubin's SASS as ``nvdisasm -c`` lists it."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout


def sass_instructions(cubin: bytes, nvdisasm: str) -> int:
    """Static SASS instruction count of a cubin (``nvdisasm``): for kernels bound by what they
    issue, fewer instructions in the hot loop is the CPU's proxy for time."""
    return sum(1 for line in sass_listing(cubin, nvdisasm).splitlines() if _INSTRUCTION.match(line))


def sass_loops(listing: str) -> List[int]:
    """Instructions in each loop of a SASS listing, in listing order: from a label to the last
    branch back to it (an outer loop counts its inner ones). One trip through a kernel's main loop
    issues about that many instructions a thread."""
    lines = listing.splitlines()
    labels = {line.split(":")[0]: i for i, line in enumerate(lines) if re.match(r"\.L_x_\d+:", line)}
    ends: Dict[str, int] = {}
    for i, line in enumerate(lines):
        target = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", line)
        if target and labels.get(target.group(1), i) < i:
            ends[target.group(1)] = i
    spans = sorted((labels[name], end) for name, end in ends.items())
    return [sum(1 for line in lines[a : b + 1] if _INSTRUCTION.match(line)) for a, b in spans]


def drive(method: str, n: int) -> None:
    import torch

    import sm90_compile as S

    q, k, v = S._qkv(1, 9, 3, n, 64, torch.bfloat16)
    if method == "pisa":
        from sparseflow import Tuning
        from sparseflow.methods.pisa import triton_impl

        triton_impl.pisa_attention(q, k, v, tuning=Tuning(pisa_walk="scan"))  # "auto" picks it on CUDA
        # on a GPU the selection launches these; CPU tensors take their torch forms
        torch.ops.sparseflow.token_tile_lists(torch.zeros(1, 3, n, 8, dtype=torch.int32), 21, -(-n // 64))
        S._pair_index(3 * -(-n // 64))
    elif method == "bsa":
        from sparseflow.methods.bsa import triton_impl

        triton_impl.bsa_attention(q, k, v)
        torch.ops.sparseflow.token_tile_lists(torch.zeros(1, 3, n, 8, dtype=torch.int32), 21, -(-n // 64))
    else:
        from sparseflow.methods.pbs import triton_gather, triton_impl

        triton_gather._use_kernels = lambda t: True
        triton_impl.pbs_attention(q, k, v)


def collect(method: str, n: int, scan_launch: Dict[str, object] = {}) -> List[Dict[str, object]]:
    import triton

    from sparseflow.methods.pisa import triton_select_scan as scan

    import sm90_compile as S

    seen: Dict[str, Dict[str, object]] = {}
    compile_only = S._orig_run

    def keep(self, *args, grid, warmup, **kwargs):
        kernel = compile_only(self, *args, grid=grid, warmup=True, **kwargs)
        seen.setdefault(f"{self.__name__} {kernel.hash[:8]}", {"name": self.__name__, "kernel": kernel})
        return kernel

    S._orig_run = keep
    S.install()
    saved = dict(scan.LAUNCH)
    scan.LAUNCH.update(scan_launch)
    try:
        drive(method, n)
    finally:
        scan.LAUNCH.update(saved)
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    cuobjdump, nvdisasm = os.path.join(tools, "cuobjdump"), os.path.join(tools, "nvdisasm")
    rows = []
    for entry in seen.values():
        kernel = entry["kernel"]
        md = kernel.metadata
        usage = cubin_usage(kernel.asm["cubin"], cuobjdump)
        fit = programs_per_sm(usage["registers"], md.num_warps, md.shared)
        rows.append(
            {
                "kernel": entry["name"],
                "warps": md.num_warps,
                "stages": md.num_stages,
                "shared": md.shared,
                "instructions": sass_instructions(kernel.asm["cubin"], nvdisasm),
                "loops": [n for n in sass_loops(sass_listing(kernel.asm["cubin"], nvdisasm)) if n > 1],
                **usage,
                **fit,
            }
        )
    return rows


def print_rows(title: str, rows: List[Dict[str, object]]) -> None:
    print(title)
    print(f"{'kernel':34s} warps stages  regs  local  shared  programs/SM (limit)  warps/SM  SASS  (loops)")
    for r in rows:
        loops = "/".join(str(n) for n in r["loops"])
        print(
            f"{r['kernel'][:34]:34s} {r['warps']:5d} {r['stages']:6d} {r['registers']:5d} {r['local']:6d} "
            f"{r['shared']:7d}  {r['programs']:3d} {'(' + r['limit'] + ')':17s} {r['programs'] * r['warps']:5d} "
            f"{r['instructions']:5d}  {loops}"
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", choices=("pisa", "bsa", "pbs"), default="pisa")
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument(
        "--scan-launch",
        default="",
        help='PISA scan settings to compile, ";" between variants, e.g. "pair_unit=siblings;heads=loop,pair_rows=64"',
    )
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from common import parse_scan_launches

    variants = []
    for launch in parse_scan_launches(args.scan_launch) or [{}]:
        rows = collect(args.method, args.n, launch)
        text = ",".join(f"{key}={val}" for key, val in launch.items())
        variants.append({"settings": text, "kernels": rows})
        settings = f" ({text})" if text else ""
        print_rows(
            f"{args.method} at N={args.n}{settings}, sm_90 (H200: 64K registers, 64 warps, 32 programs, "
            "228 KiB shared an SM)",
            rows,
        )
    if args.json:
        from common import env_info, write_result

        write_result(
            args.json,
            env_info("cpu"),
            args,
            target="sm_90 (compiled on the CPU)",
            kernels=variants[0]["kernels"],
            variants=variants,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
