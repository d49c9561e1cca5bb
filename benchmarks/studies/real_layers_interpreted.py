"""PISA's Triton kernels on SmolLM2's real layers, run by Triton's interpreter on the CPU: the
scan walk's selection against the reference's (scoring in fp32, and with ``--scores`` in bf16 /
tf32: the share of the reference's selected blocks kept and PISA's selection contract), and the
token-sparse forward against an fp64 attention over the same selection, beside the plain torch
implementation's error in the same dtype (the anchors' rule: a kernel may err about twice as much).

    python benchmarks/studies/real_layers_interpreted.py --n 2048 --layers 3,15,27 --scores bf16,tf32 \\
        --json benchmarks/results/real_layers_interpreted_2k_cpu.json

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
from sparseflow.testing import check_pisa_selection  # noqa: E402
from sparseflow.tuning import Tuning  # noqa: E402

BLOCK = 64


def max_error(out: torch.Tensor, exact: torch.Tensor) -> float:
    return (out.double() - exact).abs().max().item()


def check_layer(q, k, v, block_size: int = BLOCK, scores=()):
    """One layer's row of the table: selection equality (fp32 walk), each lower-precision walk's
    kept share of the reference's blocks and its contract, and each forward's error against fp64."""
    kw = {"block_size": block_size}
    sel = pisa_ref.pisa_select(q.float(), k.float(), **kw)
    scan = triton_select.pisa_select(q.float(), k.float(), tuning=Tuning(pisa_walk="scan"), index_dtype=sel.dtype, **kw)
    row = {"scan selection equal": bool(torch.equal(scan, sel)), "rows": int(sel.shape[1] * sel.shape[2])}
    for precision in scores:
        row.update(lower_precision_walk(q, k, sel, precision, block_size))
    exact = attend_selected_blocks(q.double(), k.double(), v.double(), sel, **kw)
    for dtype in (torch.bfloat16, torch.float32):
        qd, kd, vd = q.to(dtype), k.to(dtype), v.to(dtype)
        out = token_sparse_attention(qd, kd, vd, sel, **kw)
        name = str(dtype).replace("torch.", "")
        row[f"{name} kernel error"] = max_error(out, exact)
        row[f"{name} plain torch error"] = max_error(attend_selected_blocks(qd, kd, vd, sel, **kw), exact)
        row[f"{name} kernel NaN"] = bool(out.isnan().any())
    return row


def kept_share(sel: torch.Tensor, ref: torch.Tensor) -> float:
    """The share of ``ref``'s selected blocks (ids >= 0) that ``sel`` also selects, row by row."""
    hit = (sel.unsqueeze(-1) == ref.unsqueeze(-2)) & (ref >= 0).unsqueeze(-2)
    return int(hit.any(-2).sum()) / max(1, int((ref >= 0).sum()))


def lower_precision_walk(q, k, ref, precision: str, block_size: int, walk: str = "scan") -> dict:
    """The ``walk`` scoring in ``precision``: its kept share of the reference's blocks and whether
    PISA's selection contract holds (the fp32 reference's scores within the precision's
    tolerance)."""
    tuning = Tuning(pisa_walk=walk, pisa_scores=precision)
    sel = triton_select.pisa_select(q.float(), k.float(), tuning=tuning, index_dtype=ref.dtype, block_size=block_size)
    row = {f"{precision} kept share": kept_share(sel, ref)}
    try:
        check_pisa_selection(q.float(), k.float(), tuning=tuning, block_size=block_size)
        row[f"{precision} contract"] = "held"
    except AssertionError as exc:
        row[f"{precision} contract"] = str(exc)[:200]
    return row


def real_layer_qkv(n: int, layers, text: str = "pydoc_topics") -> dict:
    """{layer: (q, k, v)}: what SmolLM2-135M-Instruct's attention sees at those layers on ``n``
    tokens of real text (one dense bf16 forward on the CPU; the values are bf16's, held in fp32)."""
    from e2e_prefill import repeated_tokens
    from sparseflow.checkpoints import load_smollm2
    from sparseflow.eval.attention_mass import capture_qkv

    model, tok = load_smollm2(dtype=torch.bfloat16)
    every = capture_qkv(model, repeated_tokens(tok, text, n))
    return {layer: every[layer] for layer in layers}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--layers", default="3,15,27")
    ap.add_argument("--scores", default="", help="comma list of lower walk precisions to check (bf16, tf32)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    layers = [int(x) for x in args.layers.split(",")]
    scores = [x.strip() for x in args.scores.split(",") if x.strip()]
    got = real_layer_qkv(args.n, layers)
    rows = {}
    for layer in layers:
        t0 = time.time()
        rows[layer] = check_layer(*got[layer], scores=scores)
        shown = "  ".join(f"{k} {v:.3e}" if isinstance(v, float) else f"{k} {v}" for k, v in rows[layer].items())
        print(f"layer {layer} ({time.time() - t0:.0f} s): {shown}", flush=True)
    if args.json:
        write_result(args.json, env_info("cpu"), args, layers=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
