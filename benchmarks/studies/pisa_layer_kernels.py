"""One PISA attention layer (selection + token-sparse attention, ``backend="triton"``) beside
SDPA at the same shape: the whole op's time from a CUDA graph (no host time, as in the
converted-checkpoint path), and every kernel it launches with its launches and GPU time per
call (profiler), so that the launch count and the small kernels show beside the big ones.

    python benchmarks/studies/pisa_layer_kernels.py --json benchmarks/results/pisa_layer_kernels_8k_h200.json
    python benchmarks/studies/pisa_layer_kernels.py --real 3,15,27 --attn-rows 32,64,128

SmolLM2's attention shape (B 1, Hq 9, Hkv 3, D 64), C 64, K 8, bf16, causal, PISA's defaults.
Inputs: structured random q/k/v, or with ``--real`` the q/k/v that SmolLM2-135M-Instruct's
listed layers see on real text (``pydoc_topics``; the selections, and so the attention's tile
unions, differ a lot from random ones). ``--attn-rows`` times the token-sparse attention with
other rows per program (``token_sparse_triton.FWD_ROWS``) on the same selection, ``--scan-launch``
the selection with other launch settings (``triton_select_scan.LAUNCH``). ``--old FOLDER``
also times an earlier commit's selection (``pisa_select_ab.OLD_MODULES``) and token-sparse
attention (``token_sparse_triton.py``) read from FOLDER, on the same inputs, and checks that they
select and output what the tree's do (see ``pisa_select_ab.py``):

    mkdir -p .ab && git show HEAD:sparseflow/kernels/token_sparse_triton.py > .ab/token_sparse_triton.py
    for f in triton_select_common triton_select_per_token triton_select triton_select_scan; do
        git show HEAD:sparseflow/methods/pisa/$f.py > .ab/$f.py 2>/dev/null || rm .ab/$f.py; done
    python benchmarks/studies/pisa_layer_kernels.py --real 3,15,27 --old .ab

``--pdl`` also times the op, the selection and the attention with their kernels chained by
programmatic dependent launch (``Tuning(pdl=True)``, ``sparseflow.kernels.pdl``), and checks that
they output what the plain launches do.
"""

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, ".."))

import sparseflow  # noqa: E402,F401
from sparseflow import Tuning  # noqa: E402
from common import (  # noqa: E402
    graph_us_per_call,
    kernel_launches_and_us,
    parse_scan_launches,
    qkv,
    sdpa_dense,
    write_result,
)
from e2e_prefill import env_info  # noqa: E402
from sparseflow.methods.pisa.triton_impl import pisa_attention  # noqa: E402
from sparseflow.methods.pisa import triton_select_scan as scan  # noqa: E402
from sparseflow.methods.pisa.triton_select import pisa_select  # noqa: E402
from sparseflow.kernels import token_sparse_triton as tst  # noqa: E402
from sparseflow.kernels.token_sparse_triton import token_sparse_attention  # noqa: E402


def load_old(folder: str):
    """(selection module, attention module or None) of an earlier commit, from ``folder``."""
    from pisa_select_ab import exec_renamed, load_old as load_old_selection

    path = os.path.join(os.path.abspath(folder), "token_sparse_triton.py")
    attention = exec_renamed(path, "sparseflow.kernels", "token_sparse_triton") if os.path.exists(path) else None
    return load_old_selection(folder), attention


def attention_launch(text: str):
    """``"rows[:warps[:stages]]"`` -> ``(rows, warps, stages)``, the attention's defaults filling in."""
    parts = [int(x) for x in text.split(":")]
    defaults = (tst.FWD_ROWS, tst._FWD_LAUNCH["num_warps"], tst._FWD_LAUNCH["num_stages"])
    return tuple(parts + list(defaults[len(parts) :]))


CHAINED = Tuning(pdl=True)


def measure(n, label, q, k, v, attn_rows, old=None, scan_launches=(), pdl=False):
    sdpa, _ = sdpa_dense(q, k, v, "cudnn")
    idx = pisa_select(q, k, index_dtype=torch.int32)
    calls = {
        "sdpa (cudnn)": sdpa,
        "pisa op": lambda: pisa_attention(q, k, v),
        "pisa selection": lambda: pisa_select(q, k, index_dtype=torch.int32),
        "token-sparse attention": lambda: token_sparse_attention(q, k, v, idx, block_size=64),
    }
    attention_out = calls["token-sparse attention"]()
    checks = {}
    if pdl:
        op_out = calls["pisa op"]()
        calls["pisa op, pdl chain"] = lambda: pisa_attention(q, k, v, tuning=CHAINED)
        calls["pisa selection, pdl chain"] = lambda: pisa_select(q, k, index_dtype=torch.int32, tuning=CHAINED)
        calls["token-sparse attention, pdl chain"] = lambda: token_sparse_attention(
            q, k, v, idx, block_size=64, pdl=True
        )
        checks["pdl chain selection equal"] = bool(torch.equal(calls["pisa selection, pdl chain"](), idx))
        checks["pdl chain attention output equal"] = bool(
            torch.equal(calls["token-sparse attention, pdl chain"](), attention_out)
        )
        checks["pdl chain op output equal"] = bool(torch.equal(calls["pisa op, pdl chain"](), op_out))
    if old is not None:
        old_select, old_attention = old
        calls["old selection"] = lambda: old_select.pisa_select(q, k, index_dtype=torch.int32)
        checks["old selection equal"] = bool(torch.equal(calls["old selection"](), idx))
        if old_attention is not None:
            calls["old attention"] = lambda: old_attention.token_sparse_attention(q, k, v, idx, block_size=64)
            checks["old attention output equal"] = bool(torch.equal(calls["old attention"](), attention_out))
    graph = {name: graph_us_per_call(fn) for name, fn in calls.items()}
    default_rows, default_launch = tst.FWD_ROWS, tst._FWD_LAUNCH
    try:
        for rows, warps, stages in attn_rows:
            tst.FWD_ROWS = rows
            tst._FWD_LAUNCH = dict(num_warps=warps, num_stages=stages)
            same = torch.equal(calls["token-sparse attention"](), attention_out)
            graph[f"attention, {rows} rows, {warps} warps, {stages} stages{'' if same else ' (output differs)'}"] = (
                graph_us_per_call(calls["token-sparse attention"])
            )
    finally:
        tst.FWD_ROWS, tst._FWD_LAUNCH = default_rows, default_launch
    variant_kernels = {}
    for overrides in scan_launches:
        saved = dict(scan.LAUNCH)
        scan.LAUNCH.update(overrides)
        try:
            same = torch.equal(calls["pisa selection"](), idx)
            name = "selection, " + ",".join(f"{k_}={v_}" for k_, v_ in overrides.items())
            graph[name + ("" if same else " (selection differs)")] = graph_us_per_call(calls["pisa selection"])
            variant_kernels[name] = kernel_launches_and_us(calls["pisa selection"])
        finally:
            scan.LAUNCH.clear()
            scan.LAUNCH.update(saved)
    kernels = kernel_launches_and_us(calls["pisa op"])
    density = float((idx >= 0).sum()) * 64 / (q.shape[2] * (q.shape[2] + 1) / 2) / k.shape[1]
    print(
        f"N={n} {label}  Hq={q.shape[1]} Hkv={k.shape[1]}  kept keys / causal keys {density:.3f}; CUDA graph us per call:"
    )
    for name, us in graph.items():
        print(f"  {name:34s} {us:9.1f}  ({us / graph['sdpa (cudnn)']:.2f}x sdpa)")
    for name, ok in checks.items():
        print(f"  {name}: {ok}")
    print(
        f"  pisa op kernels ({sum(c for c, _ in kernels.values()):.0f} launches, "
        f"{sum(u for _, u in kernels.values()):.1f} us GPU):"
    )
    for name, (count, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1]):
        print(f"    {us:8.1f} us  x{count:4.1f}  {name[:90]}")
    for variant, launched in variant_kernels.items():
        print(f"  {variant} kernels:")
        for name, (count, us) in sorted(launched.items(), key=lambda kv: -kv[1][1])[:6]:
            print(f"    {us:8.1f} us  x{count:4.1f}  {name[:90]}")
    return {
        "n": n,
        "inputs": label,
        "graph_us": graph,
        "checks": checks,
        "kernels": {k_: list(v_) for k_, v_ in kernels.items()},
        "variant_kernels": {v: {k_: list(v_) for k_, v_ in ks.items()} for v, ks in variant_kernels.items()},
    }


def real_layer_qkv(n: int, layers, text: str = "pydoc_topics", device: str = "cuda"):
    """{layer: (q, k, v)}: what SmolLM2-135M-Instruct's attention sees at those layers on ``n``
    tokens of real text (bf16, CUDA; one dense forward through a recording attention function)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from e2e_prefill import repeated_tokens
    from sparseflow.checkpoints import load_smollm2

    model, tok = load_smollm2(dtype=torch.bfloat16)
    model.to(device)
    ids = repeated_tokens(tok, text, n).to(device)
    got = {}

    def record(module, query, key, value, *args, **kwargs):
        if module.layer_idx in layers:
            got[module.layer_idx] = (query.detach().clone(), key.detach().clone(), value.detach().clone())
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    AttentionInterface.register("sf_study_record", record)
    AttentionMaskInterface.register("sf_study_record", sdpa_mask)
    model.set_attn_implementation("sf_study_record")
    with torch.no_grad():
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
    del model
    return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ns", default="8192", help="sequence lengths, comma list")
    ap.add_argument("--heads", default="9:3", help="Hq:Hkv")
    ap.add_argument("--real", default="", help="SmolLM2 layers whose real q/k/v to use, comma list (default: random)")
    ap.add_argument(
        "--attn-rows", default="", help="token-sparse attention launches to compare: rows[:warps[:stages]], comma list"
    )
    ap.add_argument(
        "--scan-launch",
        default="",
        help='selection launch settings to compare, e.g. "rows=64;pair_rows=64,pair_chunks=8"',
    )
    ap.add_argument("--old", help="folder holding an earlier commit's selection and attention modules")
    ap.add_argument("--pdl", action="store_true", help="also time the op with its kernels chained by PDL")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    old = load_old(args.old) if args.old else None
    hq, hkv = (int(x) for x in args.heads.split(":"))
    env, cases = env_info(), []
    layers = [int(x) for x in args.real.split(",") if x]
    for n in (int(x) for x in args.ns.split(",")):
        if layers:
            inputs = {f"layer {i}": qkv_ for i, qkv_ in real_layer_qkv(n, layers).items()}
        else:
            inputs = {"structured": qkv(1, hq, hkv, n, 64, torch.bfloat16, structured=True)}
        for label, (q, k, v) in inputs.items():
            rows = [attention_launch(x) for x in args.attn_rows.split(",") if x]
            cases.append(measure(n, label, q, k, v, rows, old, parse_scan_launches(args.scan_launch), args.pdl))
    if args.json:
        write_result(args.json, env, args, cases=cases)
        print("wrote", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
