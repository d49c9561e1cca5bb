"""sparseflow's PBS beside the public PBS-Attn code (issue 3), in one run, on the same inputs.

    python benchmarks/pbs_public.py --public-path /path/to/checkout --json results/pbs_public_h200.json

``--public-path`` is a directory holding the public ``pbs_attn`` package (github.com/xinghaow99/pbs-attn,
fetched into an ignored folder; it is never part of this repository). Shapes as the benchmarks': B=1, Hq=32,
Hkv=8, D=128, bf16, the structured synthetic Q/K of ``benchmarks/common.py``. Per length:

* cuDNN SDPA causal (native GQA) -- the baseline of every ratio;
* the public op at ``--threshold``: it needs Hq == Hkv, so K/V are repeated to 32 heads first (as
  its Hugging Face patch does; the repeat is timed apart and not charged to it). Its attention
  kernel's own time comes from the CUDA profiler (kernel ``_permuted_block_sparse_attn_fwd``); the
  rest of the op's wall time is its selection pipeline (scoring, permutation, pooling, selection,
  the V gather);
* the public op at threshold 1.0 (its selection then keeps only ~57-77% of the blocks, so its
  kernel's equal-work throughput is reported as cuDNN time x density / kernel time);
* our op (``backend="triton"`` kernels, query-head permutation) at the same threshold, our selection
  pipeline alone, and our attention kernel at 100% density;
* both selections' densities (selected / causally visible block pairs).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from common import bench, env_info, kernel_us_per_call, pbs_kernel_call, pbs_kernel_inputs, sdpa_dense, structured_qkv  # noqa: E402
from sparseflow.methods.pbs.block_selection import selection_density  # noqa: E402

KERNEL_NAME = "_permuted_block_sparse_attn_fwd"


def profiled_kernel_ms(fn, name: str, reps: int = 5) -> float:
    """Mean device time per call (ms) of the CUDA kernels whose name contains ``name``."""
    return kernel_us_per_call(fn, reps=reps, warmup=1, name=name) / 1e3


def public_density(pub, q, kr, bs, seg, thr) -> float:
    """Selected / causally visible block pairs of the public selection (its mask and the in-segment
    blocks it always attends)."""
    pk, pidx = pub.apply_permutation(query_states=q, key_states=kr, block_size=bs, segment_size=seg)
    n = q.shape[2]
    qidx = torch.arange(n, device=q.device)[None, None].expand(q.shape[0], q.shape[1], -1)
    _, bm, segm = pub.permuted_block_selection(q, pk, qidx, pidx, bs, seg, threshold=thr, causal=True)
    nb = bm.shape[-1]
    qb = torch.arange(nb, device=q.device)[:, None]
    kb = torch.arange(nb, device=q.device)[None, :]
    vis = (kb <= qb) | ((kb // (seg // bs)) == (qb // (seg // bs)))
    sel = (bm | segm[None, None]) & vis
    return (sel.sum() / (vis.sum() * bm.shape[0] * bm.shape[1])).item()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--public-path", required=True, help="directory holding the public pbs_attn package")
    ap.add_argument("--ns", type=lambda s: [int(x) for x in s.split(",")], default=[8192, 32768, 131072])
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--segment", type=int, default=256)
    ap.add_argument("--json", default=os.path.join(HERE, "results", "pbs_public_h200.json"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/pbs_public.py needs a CUDA device")
    if not os.path.isdir(os.path.join(args.public_path, "pbs_attn")):
        sys.exit(f"--public-path must hold the pbs_attn package, got {args.public_path!r}")
    sys.path.insert(0, args.public_path)
    from pbs_attn.src import pbs as pub  # the public code, run beside ours, never copied
    from sparseflow.methods.pbs import triton_impl as TI
    from sparseflow.methods.pbs import triton_gather as TG
    from sparseflow.methods.pbs import triton_select as S

    torch.backends.cuda.matmul.allow_tf32 = False
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t_end = time.time() + 3.0
    while time.time() < t_end:  # clocks up before the first timing
        a @ a
        torch.cuda.synchronize()
    del a
    b, hq, hkv, d, bs, seg, thr = 1, 32, 8, 128, args.block, args.segment, args.threshold
    results = {"env": env_info(), "args": vars(args), "rows": []}
    for n in args.ns:
        g = torch.Generator(device="cuda").manual_seed(n)
        q, k, v = structured_qkv(b, hq, hkv, n, d, torch.bfloat16, g)
        cud, _ = sdpa_dense(q, k, v, "cudnn")
        t_cudnn = bench(cud)
        ref_out = cud()
        row = dict(n=n, threshold=thr, cudnn_ms=t_cudnn)

        def repeat():
            return (k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1))

        row["public_repeat_kv_ms"] = bench(repeat)
        kr, vr = repeat()

        def public(t):
            return lambda: pub.permuted_block_sparse_attn_fwd(
                q, kr, vr, block_size=bs, segment_size=seg, threshold=t, causal=True
            )

        try:
            out_pub = public(thr)()
            row["public_err_vs_cudnn"] = ((out_pub.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
            del out_pub
            row["public_ms"] = bench(public(thr))
            row["public_attention_ms"] = profiled_kernel_ms(public(thr), KERNEL_NAME)
            row["public_stages_ms"] = row["public_ms"] - row["public_attention_ms"]
            row["public_stages_frac_of_cudnn"] = row["public_stages_ms"] / t_cudnn
            row["public_speedup_vs_cudnn"] = t_cudnn / row["public_ms"]
            row["public_density"] = public_density(pub, q, kr, bs, seg, thr)
            row["public_full_attention_ms"] = profiled_kernel_ms(public(1.0), KERNEL_NAME)
            row["public_full_attention_vs_cudnn"] = t_cudnn / row["public_full_attention_ms"]
            row["public_full_density"] = public_density(pub, q, kr, bs, seg, 1.0)
            # its threshold 1.0 does not keep every block (density ~0.57-0.77 measured), so its kernel's
            # equal-work throughput is cuDNN's time x density / kernel time
            row["public_attention_equal_work_vs_cudnn"] = t_cudnn * row["public_density"] / row["public_attention_ms"]
            row["public_full_equal_work_vs_cudnn"] = (
                t_cudnn * row["public_full_density"] / row["public_full_attention_ms"]
            )
        except Exception as e:  # noqa: BLE001
            row["public_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        kr = vr = None  # frees them; not del, closures above name them
        torch.cuda.empty_cache()

        def ours():
            return TI.pbs_attention(
                q, k, v, block_size=bs, segment_size=seg, threshold=thr, gqa_permutation="query_head"
            )

        out, sel = TI.pbs_attention(
            q, k, v, block_size=bs, segment_size=seg, threshold=thr, gqa_permutation="query_head", return_selection=True
        )
        row["ours_err_vs_cudnn"] = ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
        row["ours_density"] = selection_density(sel.block_mask, sel.permutation, block_size=bs).mean().item()
        del out, sel
        row["ours_ms"] = bench(ours)
        row["ours_speedup_vs_cudnn"] = t_cudnn / row["ours_ms"]

        def stages():
            sc = S.key_scores(q, k, block_size=bs, segment_size=seg, gqa_permutation="query_head")
            p = S.segment_permutation(sc, segment_size=seg)
            lay = TG.permuted_layout(k, v, p, block_size=bs)
            return S.select_block_lists(
                q, None, p, block_size=bs, segment_size=seg, threshold=thr, return_block_mask=False, layout=lay
            )

        row["ours_stages_ms"] = bench(stages)
        row["ours_stages_frac_of_cudnn"] = row["ours_stages_ms"] / t_cudnn
        inp = pbs_kernel_inputs(b, hq, hkv, n, d, torch.bfloat16, "query_head", "permuted", bs, seg)
        row["ours_full_attention_ms"] = bench(pbs_kernel_call(inp, bs))
        row["ours_full_attention_vs_cudnn"] = t_cudnn / row["ours_full_attention_ms"]
        del inp
        results["rows"].append(row)
        print(
            " ".join(f"{k_}={v_:.4f}" if isinstance(v_, float) else f"{k_}={v_}" for k_, v_ in row.items()), flush=True
        )
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1, default=str)
        q = k = v = ref_out = None  # frees them; not del, closures above name them
        torch.cuda.empty_cache()
    nan = float("nan")
    print(
        f"\n=== PBS: sparseflow vs public PBS-Attn, threshold {thr}, B=1 Hq=32 Hkv=8 D=128 bf16 (ms; x = vs cuDNN) ==="
    )
    print(
        f"{'N':>7} {'cudnn':>8} | {'pub op':>8} {'pub dens':>8} {'pub sel/cud':>11} {'pub x':>6} {'pub =work':>9} | "
        f"{'our op':>8} {'our dens':>8} {'our sel/cud':>11} {'our x':>6} {'our 100%':>8}"
    )
    for r in results["rows"]:
        print(
            f"{r['n']:>7} {r['cudnn_ms']:>8.2f} | {r.get('public_ms', nan):>8.2f} {r.get('public_density', nan):>8.3f} "
            f"{r.get('public_stages_frac_of_cudnn', nan):>11.3f} {r.get('public_speedup_vs_cudnn', nan):>6.2f} "
            f"{r.get('public_full_equal_work_vs_cudnn', nan):>9.3f} | {r['ours_ms']:>8.2f} {r['ours_density']:>8.3f} "
            f"{r['ours_stages_frac_of_cudnn']:>11.3f} {r['ours_speedup_vs_cudnn']:>6.2f} "
            f"{r['ours_full_attention_vs_cudnn']:>8.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
