"""CUDA self-check and timing of PBS's Triton strided block estimates
(``scoring="sampled_rows"|"antidiagonal"``, sparseflow/methods/pbs/triton_estimate.py).

1. Selections against the reference (``reference.select_blocks``) on the same bf16 inputs at
   N = 4K and 16K (B 1, Hq 32, Hkv 8, D 128, both GQA permutation modes): identical, or differing
   only at near-ties of the threshold rule (reported; a difference that is no near-tie fails).
2. The estimate + selection stage (``select_block_lists`` given the permuted layout the attention
   builds anyway) and the estimate alone, timed with ``triton.testing.do_bench`` (median) against
   cuDNN causal SDPA (K/V repeated to Hq outside the timing) at 8K / 32K / 128K, for each of
   ``--strides`` and ``--time-scorings`` (``mean``, ``moments``: the pooled blocks, no strided estimate) on
   ``--heads``. Targets: ``estimate <= dense / (2 * stride)`` (one pass of Q·K over the sampled
   rows), and issue 51's stage at most 5% of dense.

    python benchmarks/check_pbs_estimate_cuda.py --json benchmarks/results/pbs_estimate_h200.json

Exit status 1 when a selection check fails. Runs in a few minutes on an H200.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys

import torch

from sparseflow.methods.pbs.block_selection import candidate_blocks, select_blocks
from sparseflow.methods.pbs.estimate import block_probabilities

BS, SEG = 128, 256
SCORINGS = ("sampled_rows", "antidiagonal")
TILE_SWEEP = [(64, 128, 4), (128, 64, 8), (64, 64, 4)]  # (block_m, block_n, num_warps)


def _inputs(n, hq=32, hkv=8, d=128, dtype=torch.bfloat16, seed=0, device="cuda"):
    """Gaussian q, k, v plus a shared direction in q and, with a random weight per key block of
    128, in k: block masses differ (plain Gaussians give near-uniform block distributions that a
    0.9 threshold keeps almost whole, which would check little)."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(1, hq, n, d, generator=g, device=device)
    k = torch.randn(1, hkv, n, d, generator=g, device=device)
    v = torch.randn(1, hkv, n, d, generator=g, device=device)
    u = 2.0 * torch.randn(d, generator=g, device=device) / d**0.25  # block logit boost up to ~4
    w = 2.0 * torch.rand(-(-n // 128), generator=g, device=device) ** 3
    q += 0.5 * u
    k += w.repeat_interleave(128)[:n, None] * u
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _permutation(q, k, gqa):
    from sparseflow.methods.pbs import triton_select as S

    sc = S.key_scores(q, k, block_size=BS, segment_size=SEG, gqa_permutation=gqa)
    return S.segment_permutation(sc, segment_size=SEG)


def near_tie_mask(probs, cand, thr, tol_mass=1e-4, tol_prob=1e-5):
    """Blocks whose threshold decision is a near-tie: prefix mass within ``tol_mass`` of the
    threshold, or a probability within ``tol_prob`` of another candidate's in the same row."""
    key = torch.where(cand, probs, torch.full_like(probs, -1.0))
    sp, order = torch.sort(key, dim=-1, descending=True, stable=True)
    mass = torch.where(sp >= 0, sp, torch.zeros_like(sp))
    before = torch.zeros_like(probs).scatter_(-1, order, torch.cumsum(mass, -1) - mass)
    near_cut = (before - thr).abs() < tol_mass
    # neighbours in the sorted order are the only possible twins
    gap_next = torch.cat([(sp[..., :-1] - sp[..., 1:]).abs(), torch.full_like(sp[..., :1], 1.0)], -1)
    gap_prev = torch.cat([torch.full_like(sp[..., :1], 1.0), gap_next[..., :-1]], -1)
    twin_sorted = (torch.minimum(gap_next, gap_prev) < tol_prob) & (sp >= 0)
    near_twin = torch.zeros_like(cand).scatter_(-1, order, twin_sorted)
    return (near_cut | near_twin) & cand


def check_selection(n, scoring, stride, gqa, thr, device="cuda"):
    from sparseflow.methods.pbs import triton_gather as TG
    from sparseflow.methods.pbs import triton_select as S

    q, k, _ = _inputs(n, seed=n + stride, device=device)
    perm = _permutation(q, k, gqa)
    lay = TG.permuted_layout(k, None, perm, block_size=BS)
    _, _, _, bm = S.select_block_lists(
        q,
        lay.k,
        perm,
        block_size=BS,
        segment_size=SEG,
        threshold=thr,
        layout=lay,
        scoring=scoring,
        antidiagonal_stride=stride,
    )
    ref = select_blocks(
        q, k, perm, block_size=BS, segment_size=SEG, threshold=thr, scoring=scoring, antidiagonal_stride=stride
    )
    diff = bm != ref
    n_diff = int(diff.sum())
    cand = candidate_blocks(perm, q.shape[1], block_size=BS, segment_size=SEG)
    n_bad = 0
    if n_diff:
        probs = block_probabilities(q, k, perm, cand, block_size=BS, scoring=scoring, antidiagonal_stride=stride)
        n_bad = int((diff & ~near_tie_mask(probs, cand, thr)).sum())
    kept = float((ref & cand).sum()) / max(1.0, float(cand.sum()))  # of the candidates: not all, not none
    return {
        "n": n,
        "scoring": scoring,
        "stride": stride,
        "gqa": gqa,
        "threshold": thr,
        "blocks": bm.numel(),
        "candidates_kept": kept,
        "diff": n_diff,
        "diff_not_near_tie": n_bad,
        "ok": n_bad == 0,
    }


def _bench(fn):
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def time_stage(n, scoring, stride, gqa="kv_head", thr=0.9, device="cuda", heads=(32, 8, 128), product="tf32"):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from sparseflow.methods.pbs import triton_estimate as E
    from sparseflow.methods.pbs import triton_gather as TG
    from sparseflow.methods.pbs import triton_select as S

    q, k, v = _inputs(n, *heads, device=device)
    perm = _permutation(q, k, gqa)
    lay = TG.permuted_layout(k, None, perm, block_size=BS)
    hp = perm.shape[1]
    hq = q.shape[1]

    def stage():
        S.select_block_lists(
            q,
            lay.k,
            perm,
            block_size=BS,
            segment_size=SEG,
            threshold=thr,
            layout=lay,
            return_block_mask=False,
            scoring=scoring,
            antidiagonal_stride=stride,
            moments_product=product,
        )

    # the estimate alone, in the head chunks select_block_lists would use
    nb = -(-n // BS)
    nrows = nb * E.rows_per_block(scoring, BS, stride)
    hc = max(1, min(hq, (1 << 30) // (nrows * (nb + 1) * 4)))

    def estimate(**tiles):
        for h0 in range(0, hq, hc):
            E.strided_estimate(
                q,
                lay.k,
                None,
                None,
                None,
                scoring=scoring,
                stride=stride,
                hp=hp,
                h0=h0,
                hc=min(hc, hq - h0),
                block_size=BS,
                segment_size=SEG,
                **tiles,
            )

    g = hq // k.shape[1]
    kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)

    def dense():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q, kr, vr, is_causal=True)

    strided = scoring in SCORINGS  # "mean" / "moments" pool the blocks: no strided estimate to time alone
    t_stage, t_dense = _bench(stage), _bench(dense)
    t_est = _bench(estimate) if strided else float("nan")
    # other tiles for the estimate alone (the defaults are 128 x 128): what to tune next
    sweep = {}
    for bm, bn, warps in TILE_SWEEP if strided else ():
        try:
            sweep[f"m{bm}-n{bn}-w{warps}"] = _bench(lambda: estimate(block_m=bm, block_n=bn, num_warps=warps))
        except Exception as exc:  # e.g. out of shared memory: report, go on
            sweep[f"m{bm}-n{bn}-w{warps}"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return {
        "n": n,
        "heads": list(heads),
        "scoring": scoring,
        "moments_product": product if scoring == "moments" else None,
        "stride": stride,
        "gqa": gqa,
        "stage_ms": t_stage,
        "estimate_ms": t_est,
        "estimate_tile_sweep_ms": sweep,
        "cudnn_causal_ms": t_dense,
        "stage_over_dense": t_stage / t_dense,
        "target_over_dense": 1.0 / (2 * stride) if strided else None,
        "meets_target": t_stage <= t_dense / (2 * stride) if strided else None,
        "within_5_percent_of_dense": t_stage <= 0.05 * t_dense,
    }


def env_info():
    import triton

    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--check-n", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 16384])
    ap.add_argument("--time-n", type=lambda s: [int(x) for x in s.split(",")], default=[8192, 32768, 131072])
    ap.add_argument("--strides", type=lambda s: [int(x) for x in s.split(",")], default=[8])
    ap.add_argument(
        "--time-scorings",
        type=lambda s: [x for x in s.split(",") if x],
        default=list(SCORINGS),
        help="scorings timed (sampled_rows, antidiagonal; mean and moments: the pooled blocks, one row whatever the "
        "stride; moments:ieee its spread's products in IEEE fp32 instead of TF32)",
    )
    ap.add_argument(
        "--heads",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        default=(32, 8, 128),
        help="Hq,Hkv,D of the timed inputs (SmolLM2: 9,3,64)",
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    env = env_info()
    print(json.dumps(env))
    checks, timings = [], []
    for n in args.check_n:
        for scoring in SCORINGS:
            for gqa in ("kv_head", "query_head"):
                for stride in args.strides:
                    r = check_selection(n, scoring, stride, gqa, 0.9)
                    checks.append(r)
                    print(
                        f"check n={n:6d} {scoring:12s} s={stride} {gqa:10s} thr=0.9 "
                        f"(kept {r['candidates_kept']:.2f} of the candidates): "
                        f"{'identical' if r['diff'] == 0 else str(r['diff']) + ' blocks differ'}"
                        f"{'' if r['ok'] else ' (' + str(r['diff_not_near_tie']) + ' NOT near-ties: FAIL)'}"
                    )
    print(f"{'n':>7} {'scoring':12} {'s':>2} {'stage ms':>9} {'est ms':>8} {'cuDNN ms':>9} {'ratio':>6} {'target':>6}")
    for n in args.time_n:
        for name in args.time_scorings:
            scoring, _, product = name.partition(":")
            for stride in args.strides if scoring in SCORINGS else args.strides[:1]:
                r = time_stage(n, scoring, stride, heads=args.heads, product=product or "tf32")
                timings.append(r)
                target = "-" if r["target_over_dense"] is None else f"{r['target_over_dense']:6.3f}"
                print(
                    f"{n:7d} {name:12} {stride:2d} {r['stage_ms']:9.3f} {r['estimate_ms']:8.3f} "
                    f"{r['cudnn_causal_ms']:9.3f} {r['stage_over_dense']:6.3f} {target:>6}"
                    f"{'' if r['within_5_percent_of_dense'] else '  (above 5% of dense)'}"
                )
                print("        estimate, other tiles (ms):", r["estimate_tile_sweep_ms"])
                torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"env": env, "checks": checks, "timings": timings}, fh, indent=1)
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
