"""PISA's Triton kernels on SmolLM2's real layers, run by Triton's interpreter on the CPU: the
scan walk's selection against the reference's, and the token-sparse forward against an fp64
attention over the same selection, beside the plain torch implementation's error in the same
dtype (the anchors' rule: a kernel may err about twice as much). ``--old`` also runs an earlier
commit's ``token_sparse_triton.py`` on the same inputs and selections.

    python benchmarks/studies/real_layers_interpreted.py --n 2048 --layers 3,15,27 \\
        --old /tmp/old/token_sparse_triton.py --json benchmarks/results/real_layers_interpreted_2k_cpu.json

q/k/v: one dense bf16 forward of SmolLM2-135M-Instruct on real text (``pydoc_topics``), recorded
at the listed layers. PISA's defaults (C 64, K 8). Slow: the interpreter runs every program in
NumPy (about 10 minutes a layer at 2K on 2 cores).
"""

import argparse
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from common import env_info, write_result  # noqa: E402
from sparseflow.kernels.token_blocks import attend_selected_blocks  # noqa: E402
from sparseflow.kernels.token_sparse_triton import token_sparse_attention  # noqa: E402
from sparseflow.methods.pisa import reference as pisa_ref  # noqa: E402
from sparseflow.methods.pisa import triton_select  # noqa: E402
from sparseflow.tuning import Tuning  # noqa: E402

BLOCK = 64


def max_error(out: torch.Tensor, exact: torch.Tensor) -> float:
    return (out.double() - exact).abs().max().item()


def check_layer(q, k, v, old=None, block_size: int = BLOCK):
    """One layer's row of the table: selection equality and each forward's error against fp64."""
    kw = {"block_size": block_size}
    sel = pisa_ref.pisa_select(q.float(), k.float(), **kw)
    scan = triton_select.pisa_select(q.float(), k.float(), tuning=Tuning(pisa_walk="scan"), index_dtype=sel.dtype, **kw)
    row = {"scan selection equal": bool(torch.equal(scan, sel)), "rows": int(sel.shape[1] * sel.shape[2])}
    exact = attend_selected_blocks(q.double(), k.double(), v.double(), sel, **kw)
    for dtype in (torch.bfloat16, torch.float32):
        qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
        out = token_sparse_attention(qd, kd, vd, sel, **kw)
        name = str(dtype).replace("torch.", "")
        row[f"{name} kernel error"] = max_error(out, exact)
        row[f"{name} plain torch error"] = max_error(attend_selected_blocks(qd, kd, vd, sel, **kw), exact)
        row[f"{name} kernel NaN"] = bool(out.isnan().any())
        if old is not None and dtype == torch.bfloat16:
            earlier = old.token_sparse_attention(qd, kd, vd, sel, **kw)
            row[f"{name} old kernel error"] = max_error(earlier, exact)
            row[f"{name} outputs differing from the old kernel's"] = (earlier != out).float().mean().item()
    return row


def main(argv=None) -> int:
    from pisa_layer_kernels import real_layer_qkv
    from pisa_select_ab import exec_renamed

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--layers", default="3,15,27")
    ap.add_argument("--old", help="an earlier commit's token_sparse_triton.py, run beside the tree's")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    layers = [int(x) for x in args.layers.split(",")]
    old = exec_renamed(args.old, "sparseflow.kernels", "token_sparse_triton") if args.old else None
    got = real_layer_qkv(args.n, layers, device="cpu")
    rows = {}
    for layer in layers:
        t0 = time.time()
        rows[layer] = check_layer(*got[layer], old=old)
        shown = "  ".join(f"{k} {v:.3e}" if isinstance(v, float) else f"{k} {v}" for k, v in rows[layer].items())
        print(f"layer {layer} ({time.time() - t0:.0f} s): {shown}", flush=True)
    if args.json:
        write_result(args.json, env_info("cpu"), args, layers=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
