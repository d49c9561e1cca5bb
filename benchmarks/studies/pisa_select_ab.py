"""PISA's selection at an earlier commit against the tree's, side by side in one process: time per
call (the pyramid build included; CUDA graphs, so no host time), the kernels by name (profiler) at
8K, and whether the two select the same blocks, for the scan and the per-token walk.

The earlier commit's selection modules (:data:`OLD_MODULES`; commits before the walks' shared
code left ``triton_select.py`` hold only it and ``triton_select_scan.py``) are read from a folder
(the device machine has no git history) and loaded beside the tree's under private module names,
their ops renamed into the ``sparseflow_ab`` namespace so that both sets of ops can be registered:

    mkdir -p .ab && for f in triton_select_common triton_select_per_token triton_select triton_select_scan; do
        git show d268b9f:sparseflow/methods/pisa/$f.py > .ab/$f.py 2>/dev/null || rm .ab/$f.py; done
    python benchmarks/studies/pisa_select_ab.py --old .ab --json benchmarks/results/pisa_select_session_h200.json

Shapes: SmolLM2's attention (B 1, Hq 9, Hkv 3) and the paper's (Hq 32, Hkv 2); D 64, C 64, K 8,
g 2, bf16, causal.
"""

import argparse
import importlib.util
import os
import sys
import types

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, ".."))

import sparseflow  # noqa: E402

PACKAGE = "sparseflow.methods.pisa"
# the modules an earlier commit may hold, in import order: the walks' shared code, the per-token
# walk, the selection (which imports the scan where it picks it) and the scan (which runs the
# per-token kernel; before the split it imported the walk from triton_select)
OLD_MODULES = ("triton_select_common", "triton_select_per_token", "triton_select", "triton_select_scan")


def renamed_source(src: str, siblings=()) -> str:
    """An earlier module's source with every op it registers and calls moved to
    ``sparseflow_ab::`` (a second registration under the package's names would replace the
    package's ops for the whole process) and its imports of ``siblings`` redirected to their
    ``_ab_`` copies."""
    src = src.replace('"sparseflow::', '"sparseflow_ab::').replace("torch.ops.sparseflow.", "torch.ops.sparseflow_ab.")
    for other in siblings:
        src = src.replace(f"from .{other} import", f"from ._ab_{other} import")
    return src


def exec_renamed(path: str, package: str, name: str, siblings=()) -> types.ModuleType:
    """``path`` (:func:`renamed_source`) imported as ``<package>._ab_<name>``, so that an earlier
    commit's module runs beside the tree's; its other relative imports resolve in ``package``."""
    with open(path) as fh:
        src = renamed_source(fh.read(), siblings)
    full = f"{package}._ab_{name}"
    spec = importlib.util.spec_from_loader(full, loader=None)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = package
    module.__file__ = path
    sys.modules[full] = module
    exec(compile(src, path, "exec"), module.__dict__)
    return module


def load_old(folder: str) -> types.ModuleType:
    """The earlier ``triton_select`` module from ``folder`` (with the other :data:`OLD_MODULES`
    there), each imported as ``sparseflow.methods.pisa._ab_<name>`` with its imports of the others
    redirected and its ops registered as ``sparseflow_ab::...``."""
    folder = os.path.abspath(folder)
    names = [m for m in OLD_MODULES if os.path.exists(os.path.join(folder, m + ".py"))]
    if "triton_select" not in names:
        raise FileNotFoundError(f"{folder} holds no triton_select.py")
    first = sys.modules.get(f"{PACKAGE}._ab_triton_select")
    if first is not None:  # its ops are registered for good: one earlier commit per process
        if os.path.dirname(first.__file__) != folder:
            raise ValueError(f"an earlier commit is already loaded from {os.path.dirname(first.__file__)}")
        return first
    loaded = {name: exec_renamed(os.path.join(folder, name + ".py"), PACKAGE, name, names) for name in names}
    return loaded["triton_select"]


SHAPES = {"smollm2": (9, 3), "paper": (32, 2)}


def main(argv=None) -> int:
    from common import graph_us_per_call, kernel_us_by_name, write_result
    from e2e_prefill import env_info
    from sparseflow.methods.pisa import triton_select as new

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="folder holding the earlier commit's selection modules (OLD_MODULES)")
    ap.add_argument("--cases", default="smollm2:4096,smollm2:8192,smollm2:32768,paper:8192", help="shape:N, comma list")
    ap.add_argument("--per-token-max", type=int, default=8192, help="time the per-token walk up to this length")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    old = load_old(args.old)
    rows = []
    for case in args.cases.split(","):
        shape, n = case.split(":")
        hq, hkv = SHAPES[shape]
        n = int(n)
        torch.manual_seed(0)
        q = torch.randn(1, hq, n, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, hkv, n, 64, device="cuda", dtype=torch.bfloat16)
        kw = dict(block_size=64, top_k=8, is_causal=True, index_dtype=torch.int32)
        for walk in ("scan", "per_token"):
            if walk == "per_token" and n > args.per_token_max:
                continue
            tuning = sparseflow.Tuning(pisa_walk=walk, cuda_graphs=False)
            row = dict(shape=shape, n=n, walk=walk)
            row["same"] = bool(
                torch.equal(old.pisa_select(q, k, tuning=tuning, **kw), new.pisa_select(q, k, tuning=tuning, **kw))
            )
            for name, mod in (("old", old), ("new", new)):
                row[f"{name}_us"] = graph_us_per_call(lambda: mod.pisa_select(q, k, tuning=tuning, **kw))
                if n == 8192 and walk == "scan":
                    per = kernel_us_by_name(lambda: mod.pisa_select(q, k, tuning=tuning, **kw), 5, 2)
                    row[f"{name}_kernels_us"] = {
                        kn[:40]: round(us, 1) for kn, us in sorted(per.items(), key=lambda x: -x[1])[:6]
                    }
            rows.append(row)
            print(
                f"{shape:8s} N={n:6d} {walk:9s} old {row['old_us']:8.1f} us  new {row['new_us']:8.1f} us  "
                f"({row['old_us'] / row['new_us']:.2f}x)  same selection: {row['same']}",
                flush=True,
            )
    if args.json:
        write_result(args.json, env_info(), args, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
