"""PBS-Attn benchmark (issue 3): one run, ratios side by side, table + JSON.

    python benchmarks/pbs.py                 # everything below, default sizes
    python benchmarks/pbs.py --part check    # GPU correctness vs the reference (fp64) and SDPA's error
    python benchmarks/pbs.py --part kernel   # attention kernel at 100% density vs cuDNN / flash SDPA
    python benchmarks/pbs.py --part total    # whole op at the default threshold, per stage, vs dense
    python benchmarks/pbs.py --part variants # layouts / TMA / fixed tile configs side by side
    python benchmarks/pbs.py --part stages   # just the selection pipeline's kernels at 8K, 32K, 128K (short)

Shapes: B=1, Hq=32, Hkv=8, D=128, bf16, N in {8K..128K} (``--ns``). Dense baselines: SDPA with
the cuDNN backend and with the flash backend (causal, GQA), and FlexAttention (compiled) running
the same block mask as the Triton kernel (``--flex``). Equal-work throughput = causal FLOPs
(2·2·N²·D·Hq/2) over the time. Writes ``--json`` (default benchmarks/results/pbs_h200.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    bench,
    causal_flops,
    env_info,
    pbs_kernel_call,
    pbs_kernel_inputs,
    qkv,
    random_selection,
    sdpa_dense,
)
from sparseflow.methods.pbs.block_selection import candidate_blocks, forced_blocks, select_blocks, selection_density  # noqa: E402
from sparseflow.methods.pbs.estimate import block_probabilities  # noqa: E402
from sparseflow.methods.pbs.permutation import key_scores, segment_permutation  # noqa: E402
from sparseflow.methods.pbs.permuted_attention import permuted_block_attention  # noqa: E402

DEV = "cuda"


# --------------------------------------------------------------------------- helpers


def selection_diff(q, k, perm, bm, bs, seg, thr, tie_tol=1e-4):
    """Kernel block mask ``bm`` vs the reference's ``select_blocks`` on the same permutation:
    fraction of (batch, head, query block) rows that differ, and whether every differing block
    is a near-tie of the reference's threshold rule (the mass ranked before it within
    ``tie_tol`` of the threshold, or its probability within ``tie_tol`` (relative) of the
    probability of the last block the reference keeps)."""
    hq = q.shape[1]
    ref = select_blocks(q, k, perm, block_size=bs, segment_size=seg, threshold=thr)
    rows = (ref != bm).any(-1)  # [B, Hq, nB]
    out = dict(
        kern_same_selection=not bool(rows.any()),
        kern_sel_rows_differing=rows.float().mean().item(),
        kern_sel_blocks_differing=int((ref != bm).sum()),
    )
    if rows.any() and thr < 1.0:
        cand = candidate_blocks(perm, hq, block_size=bs, segment_size=seg)
        forced = forced_blocks(perm, hq, block_size=bs, segment_size=seg)
        probs = block_probabilities(q, k, perm, cand, block_size=bs)
        idx = rows.nonzero(as_tuple=True)
        pr, cd, dif = probs[idx], cand[idx], (ref != bm)[idx] & ~forced[idx]  # [R, nB]
        key = torch.where(cd, pr, torch.full_like(pr, -1.0))
        sp, order = torch.sort(key, dim=-1, descending=True, stable=True)
        mass = torch.where(sp >= 0, sp, torch.zeros_like(sp))
        before = torch.empty_like(mass).scatter_(-1, order, torch.cumsum(mass, -1) - mass)
        kept = cd & (before < thr)
        p_cut = torch.where(kept, pr, torch.full_like(pr, float("inf"))).amin(-1, keepdim=True)
        near = ((before - thr).abs() <= tie_tol) | ((pr - p_cut).abs() <= tie_tol * p_cut.clamp_min(1e-30))
        out["kern_sel_diff_all_near_ties"] = bool((near | ~dif).all())
        out["kern_sel_diff_max_threshold_gap"] = float(
            torch.where(dif, (before - thr).abs(), torch.zeros_like(before)).max()
        )
        del cand, forced, probs
    del ref
    return out


# --------------------------------------------------------------------------- parts


def part_check(args, results):
    """GPU correctness: Triton attention given the reference's selection vs the reference in fp64,
    and torch SDPA's own error on the same masked problem (the 2x rule)."""
    from sparseflow.methods.pbs import triton_impl as TI
    from sparseflow.methods.pbs import triton_gather as TG

    rows = []
    cases = [
        # n, hq, hkv, d, dtype, gqa, layout, pad, causal, bs, seg, thr
        (1000, 6, 2, 64, torch.bfloat16, "query_head", "permuted", False, True, 128, 256, 0.9),
        (2085, 32, 8, 128, torch.bfloat16, "query_head", "permuted", False, True, 128, 256, 0.9),
        (2085, 32, 8, 128, torch.bfloat16, "query_head", "gather", False, True, 128, 256, 0.9),
        (2085, 32, 8, 128, torch.float16, "kv_head", "permuted", True, True, 128, 256, 0.8),
        (1537, 6, 2, 80, torch.bfloat16, "kv_head", "gather", True, False, 64, 128, 0.8),
        (1300, 6, 2, 64, torch.float32, "query_head", "permuted", False, True, 128, 256, 0.9),
        (777, 4, 4, 32, torch.float16, "query_head", "permuted", False, True, 16, 32, 0.7),
        (4096, 32, 8, 128, torch.bfloat16, "query_head", "permuted", False, True, 128, 256, 1.0),
    ]
    for n, hq, hkv, d, dt, gqa, layout, pad, causal, bs, seg, thr in cases:
        b = 2 if pad else 1
        q, k, v = qkv(b, hq, hkv, n, d, dt, seed=n, structured=True)
        kpm = None
        if pad:
            kpm = torch.ones(b, n, dtype=torch.bool, device=DEV)
            kpm[0, n - n // 3 :] = False
            kpm[1, :7] = False
        sc = key_scores(q, k, key_padding_mask=kpm, block_size=bs, segment_size=seg, gqa_permutation=gqa)
        perm = segment_permutation(sc, segment_size=seg, key_padding_mask=kpm)
        bm = select_blocks(
            q, k, perm, key_padding_mask=kpm, is_causal=causal, block_size=bs, segment_size=seg, threshold=thr
        )
        ref = permuted_block_attention(
            q.double(), k.double(), v.double(), perm, bm, key_padding_mask=kpm, is_causal=causal, block_size=bs
        )
        outs = []
        for trial in range(2):
            out = TI.attention_from_selection(
                q,
                k,
                v,
                perm,
                bm,
                key_padding_mask=kpm,
                is_causal=causal,
                block_size=bs,
                segment_size=seg,
                layout=layout,
            )
            outs.append(out)
        torch.cuda.synchronize()
        err = ((outs[0].double() - ref).norm() / ref.norm()).item()
        deterministic = bool(torch.equal(outs[0], outs[1]))
        # torch SDPA on the same masked problem, in the same dtype
        from sparseflow.selection import Selection

        sel = Selection(
            method="pbs",
            density=torch.zeros(b, hq),
            block_size=bs,
            is_causal=causal,
            num_keys=n,
            block_mask=bm,
            permutation=perm,
            key_padding_mask=kpm,
        )
        km = sel.key_mask(hq)  # [B, Hq, N, N]
        kr, vr = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        sd = F.scaled_dot_product_attention(q, kr, vr, attn_mask=km).nan_to_num(0.0)
        sd = torch.where(km.any(-1, keepdim=True), sd, torch.zeros_like(sd))
        sd_err = ((sd.double() - ref).norm() / ref.norm()).item()
        ok = (err <= 2 * sd_err + 1e-6) and not bool(outs[0].isnan().any()) and deterministic
        row = dict(
            n=n,
            hq=hq,
            hkv=hkv,
            d=d,
            dtype=str(dt).split(".")[-1],
            gqa=gqa,
            layout=layout,
            pad=pad,
            causal=causal,
            block=bs,
            segment=seg,
            threshold=thr,
            err=err,
            sdpa_err=sd_err,
            deterministic=deterministic,
            ok=ok,
        )
        # stages 1-3 with the Triton kernels against the reference on the same inputs
        try:
            from sparseflow.methods.pbs import triton_select as S

            sc2 = S.key_scores(q, k, key_padding_mask=kpm, block_size=bs, segment_size=seg, gqa_permutation=gqa)
            perm2 = S.segment_permutation(sc2, segment_size=seg, key_padding_mask=kpm)
            _, _, _, bm2 = S.select_block_lists(
                q,
                TG.permute_kv(k, perm),
                perm,
                key_padding_mask=kpm,
                is_causal=causal,
                block_size=bs,
                segment_size=seg,
                threshold=thr,
            )
            lay = TG.permuted_layout(k, v, perm, key_padding_mask=kpm, block_size=bs)
            _, _, _, bm3 = S.select_block_lists(
                q,
                None,
                perm,
                key_padding_mask=kpm,
                is_causal=causal,
                block_size=bs,
                segment_size=seg,
                threshold=thr,
                layout=lay,
            )
            row.update(
                score_rel_err=((sc2 - sc).norm() / sc.norm().clamp_min(1e-30)).item(),
                same_permutation=bool(torch.equal(perm2, perm)),
                same_selection=bool(torch.equal(bm2, bm)),
                selection_diff_blocks=int((bm2 != bm).sum()),
                same_selection_layout_path=bool(torch.equal(bm3, bm)),
                layout_exact=bool(
                    torch.equal(lay.k, TG.permute_kv_torch(k, perm))
                    and torch.equal(lay.v, TG.permute_kv_torch(v, perm))
                ),
            )
        except Exception as e:  # noqa: BLE001
            row["select_kernels_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        print(
            f"check n={n:5d} h={hq}/{hkv} d={d:3d} {row['dtype']:8s} {gqa:10s} {layout:8s} pad={int(pad)} "
            f"causal={int(causal)} bs={bs:3d} err={err:.2e} sdpa_err={sd_err:.2e} det={int(deterministic)} "
            f"{'OK' if ok else 'FAIL'} | kernels: score_err={row.get('score_rel_err', float('nan')):.1e} "
            f"same_perm={row.get('same_permutation')} same_sel={row.get('same_selection')} "
            f"same_sel_layout={row.get('same_selection_layout_path')} layout_exact={row.get('layout_exact')} "
            f"{row.get('select_kernels_error', '')}",
            flush=True,
        )
        del q, k, v, ref, km, sd, kr, vr
        torch.cuda.empty_cache()
    results["check"] = rows


def part_variants(args, results):
    """Layouts x TMA x fixed tile configs at 100% density, side by side with cuDNN."""
    from sparseflow.methods.pbs import triton_attention as TA

    b, hq, hkv, d = 1, args.hq, args.hkv, args.d
    rows = []
    configs = (
        [dict(BLOCK_M=c[0], BLOCK_N=c[1], num_warps=c[2], num_stages=c[3]) for c in args.variant_configs]
        if args.variant_configs
        else [
            dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
            dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
            dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
            dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
            dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3),
            dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
        ]
    )
    for n in args.variant_ns:
        q, k, v = qkv(b, hq, hkv, n, d, torch.bfloat16, seed=n)
        cud, _ = sdpa_dense(q, k, v, "cudnn")
        t_cudnn = bench(cud)
        ref_out = cud()
        del q, k, v
        for gqa, layout, tma in args.variant_layouts:
            inp = pbs_kernel_inputs(b, hq, hkv, n, d, torch.bfloat16, gqa, layout)
            # exact mode with identity-free permutation: compare with dense attention over the same keys
            for cfg in configs + [None]:
                TA.set_fixed_config(cfg)
                try:
                    fn = pbs_kernel_call(inp, tma=tma == "1")  # Tuning.pbs_tma
                    out = fn()
                    torch.cuda.synchronize()
                    err = ((out.float() - ref_out.float()).norm() / ref_out.float().norm()).item()
                    t = bench(fn)
                except Exception as e:  # noqa: BLE001
                    print(f"variant failed {gqa} {layout} tma={tma} {cfg}: {type(e).__name__}: {str(e)[:200]}")
                    continue
                name = (
                    "autotune"
                    if cfg is None
                    else f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}w{cfg['num_warps']}s{cfg['num_stages']}"
                )
                row = dict(
                    n=n,
                    gqa=gqa,
                    layout=layout,
                    tma=tma == "1",
                    config=name,
                    ms=t,
                    cudnn_ms=t_cudnn,
                    ratio_vs_cudnn=t_cudnn / t,
                    err_vs_cudnn=err,
                )
                rows.append(row)
                print(
                    f"variant n={n:6d} {gqa:10s} {layout:8s} tma={tma} {name:16s} {t:8.3f} ms  cudnn {t_cudnn:8.3f} ms "
                    f" x{t_cudnn / t:5.3f}  err {err:.1e}",
                    flush=True,
                )
            TA.set_fixed_config(None)
            del inp
            torch.cuda.empty_cache()
    results["variants"] = rows


def _flex_runner(inp, hq, hkv, bs=128):
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    kv_num, kv_full, kv_idx = inp["kv_num"], inp["kv_full"], inp["kv_idx"]
    n = inp["q"].shape[2]
    part_num = (kv_num - kv_full).contiguous()
    ar = torch.arange(kv_idx.shape[-1], device=DEV)
    part_idx = torch.gather(kv_idx, -1, (kv_full[..., None] + ar).clamp_max(kv_idx.shape[-1] - 1)).contiguous()
    kpos = inp["kpos"]
    hp = kpos.shape[1]
    pg = hq // hp

    def mask_mod(b, h, q_idx, kv_idx_):
        return kpos[b, h // pg, kv_idx_] <= q_idx

    bmask = BlockMask.from_kv_blocks(
        part_num, part_idx, kv_full, kv_idx, BLOCK_SIZE=bs, mask_mod=mask_mod, seq_lengths=(n, n)
    )
    kk, vv = (inp["kk"], inp["vv"]) if not inp["gather"] else (inp["k"], inp["v"])
    fa = torch.compile(flex_attention, dynamic=False)
    gqa = kk.shape[1] != hq
    return lambda: fa(inp["q"], kk, vv, block_mask=bmask, enable_gqa=gqa)


def part_kernel(args, results):
    """Attention kernel at 100% density (equal work) vs cuDNN/flash SDPA dense causal (+ flex)."""
    b, hq, hkv, d = 1, args.hq, args.hkv, args.d
    rows = []
    for n in args.ns:
        q, k, v = qkv(b, hq, hkv, n, d, args.dtype, seed=n)
        cud, cud_mode = sdpa_dense(q, k, v, "cudnn")
        fla, fla_mode = sdpa_dense(q, k, v, "flash")
        t_cudnn, t_flash = bench(cud), bench(fla)
        del q, k, v
        row = dict(
            n=n,
            cudnn_ms=t_cudnn,
            flash_ms=t_flash,
            cudnn_kv=cud_mode,
            flash_kv=fla_mode,
            cudnn_tflops=causal_flops(b, hq, n, d) / t_cudnn / 1e9,
            flash_tflops=causal_flops(b, hq, n, d) / t_flash / 1e9,
        )
        for gqa in args.gqa:
            inp = pbs_kernel_inputs(b, hq, hkv, n, d, args.dtype, gqa, args.layout, args.block, args.segment)
            fn = pbs_kernel_call(inp, args.block)
            t = bench(fn)
            row[f"triton_{gqa}_ms"] = t
            row[f"triton_{gqa}_tflops"] = causal_flops(b, hq, n, d) / t / 1e9
            row[f"triton_{gqa}_vs_cudnn"] = t_cudnn / t
            row[f"triton_{gqa}_vs_flash"] = t_flash / t
            row["density"] = inp["density"]
            if args.flex and n in args.flex_ns:
                try:
                    ff = _flex_runner(inp, hq, hkv, args.block)
                    fo, to = ff(), fn()
                    row[f"flex_{gqa}_err_vs_triton"] = ((fo.float() - to.float()).norm() / to.float().norm()).item()
                    tf = bench(ff)
                    row[f"flex_{gqa}_ms"] = tf
                    row[f"flex_{gqa}_vs_cudnn"] = t_cudnn / tf
                except Exception as e:  # noqa: BLE001
                    print(f"flex failed at n={n}: {type(e).__name__}: {str(e)[:300]}")
            del inp
            torch.cuda.empty_cache()
        rows.append(row)
        print(
            "kernel " + " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
            flush=True,
        )
    results["kernel_100pct"] = rows


def part_total(args, results):
    """The whole op (scoring + permutation + selection + attention) at the default threshold on the
    structured generator, per stage, vs cuDNN dense; plus time against density (random masks)."""
    from sparseflow.methods.pbs import triton_attention as TA
    from sparseflow.methods.pbs import triton_gather as TG

    b, hq, hkv, d = 1, args.hq, args.hkv, args.d
    bs, seg, thr = args.block, args.segment, args.threshold
    rows = []
    for n in args.ns:
        q, k, v = qkv(b, hq, hkv, n, d, args.dtype, seed=n, structured=True)
        cud, _ = sdpa_dense(q, k, v, "cudnn")
        t_cudnn = bench(cud)
        gqa = args.gqa[0]
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(6)]

        def stages():
            ev[0].record()
            sc = key_scores(q, k, block_size=bs, segment_size=seg, gqa_permutation=gqa)
            ev[1].record()
            perm = segment_permutation(sc, segment_size=seg)
            ev[2].record()
            bm = select_blocks(q, k, perm, block_size=bs, segment_size=seg, threshold=thr)
            ev[3].record()
            kpos = TA.key_positions(perm)
            kv_num, kv_full, kv_idx = TA.block_mask_to_indices(
                bm, num_keys=n, block_size=bs, segment_size=seg, is_causal=True
            )
            kk, vv = TG.permute_kv(k, perm), TG.permute_kv(v, perm)
            ev[4].record()
            out = TA.pbs_block_sparse_attention(q, kk, vv, kpos, kv_num, kv_full, kv_idx, block_size=bs)
            ev[5].record()
            return out, perm, bm

        stages()
        times = []
        for _ in range(3):
            out, perm, bm = stages()
            torch.cuda.synchronize()
            times.append([ev[i].elapsed_time(ev[i + 1]) for i in range(5)])
        t = [sorted(x)[1] for x in zip(*times)]
        dens = selection_density(bm, perm, block_size=bs).mean().item()
        # attention alone, properly timed
        kpos = TA.key_positions(perm)
        kv_num, kv_full, kv_idx = TA.block_mask_to_indices(
            bm, num_keys=n, block_size=bs, segment_size=seg, is_causal=True
        )
        kk, vv = TG.permute_kv(k, perm), TG.permute_kv(v, perm)
        t_attn = bench(lambda: TA.pbs_block_sparse_attention(q, kk, vv, kpos, kv_num, kv_full, kv_idx, block_size=bs))
        t_prep = bench(
            lambda: (
                TA.key_positions(perm),
                TA.block_mask_to_indices(bm, num_keys=n, block_size=bs, segment_size=seg, is_causal=True),
                TG.permute_kv(k, perm),
                TG.permute_kv(v, perm),
            )
        )
        sel_ms = t[0] + t[1] + t[2]
        total = sel_ms + t_prep + t_attn
        row = dict(
            n=n,
            threshold=thr,
            density=dens,
            cudnn_ms=t_cudnn,
            score_ms=t[0],
            permute_ms=t[1],
            select_ms=t[2],
            layout_ms=t_prep,
            attention_ms=t_attn,
            total_ms=total,
            select_frac_of_cudnn=(sel_ms + t_prep) / t_cudnn,
            total_speedup_vs_cudnn=t_cudnn / total,
            attention_speedup_vs_cudnn=t_cudnn / t_attn,
            selection_impl="torch reference (no kernel yet)",
        )
        # stages 1-3 + layout with the Triton kernels (triton_select, triton_gather.permuted_layout),
        # side by side; the selection is checked against the reference run on the kernels' own
        # permutation (perm2), which may differ from the reference's (perm) at score near-ties
        kern_stage_ms = None
        if args.select_kernels:
            try:
                from sparseflow.methods.pbs import triton_select as S

                sc2 = S.key_scores(q, k, block_size=bs, segment_size=seg, gqa_permutation=gqa)
                perm2 = S.segment_permutation(sc2, segment_size=seg)
                lay2 = TG.permuted_layout(k, v, perm2, block_size=bs)
                lists2 = S.select_block_lists(
                    q, None, perm2, block_size=bs, segment_size=seg, threshold=thr, layout=lay2
                )
                torch.cuda.synchronize()
                t_ks = bench(lambda: S.key_scores(q, k, block_size=bs, segment_size=seg, gqa_permutation=gqa))
                t_kp = bench(lambda: S.segment_permutation(sc2, segment_size=seg))
                t_kl = bench(lambda: TG.permuted_layout(k, v, perm2, block_size=bs))
                t_kb = bench(
                    lambda: S.select_block_lists(
                        q,
                        None,
                        perm2,
                        block_size=bs,
                        segment_size=seg,
                        threshold=thr,
                        return_block_mask=False,
                        layout=lay2,
                    )
                )
                kern_stage_ms = t_ks + t_kp + t_kl + t_kb
                ref_sc = key_scores(q, k, block_size=bs, segment_size=seg, gqa_permutation=gqa)
                diff = selection_diff(q, k, perm2, lists2[3], bs, seg, thr)
                row.update(
                    kern_score_ms=t_ks,
                    kern_permute_ms=t_kp,
                    kern_layout_ms=t_kl,
                    kern_select_ms=t_kb,
                    kern_stages_ms=kern_stage_ms,
                    kern_stages_frac_of_cudnn=kern_stage_ms / t_cudnn,
                    kern_total_ms=kern_stage_ms + t_attn,
                    kern_total_speedup_vs_cudnn=t_cudnn / (kern_stage_ms + t_attn),
                    kern_score_rel_err=((sc2 - ref_sc).norm() / ref_sc.norm()).item(),
                    kern_same_permutation=bool(torch.equal(perm2, perm)),
                    **diff,
                )
                del lay2, lists2, sc2, ref_sc
            except Exception as e:  # noqa: BLE001
                row["kern_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                print("select kernels failed:", row["kern_error"], flush=True)
        # time against density (random masks, forced blocks always in); the whole op at that
        # density = stages (+ layout) + attention
        sweep = {}
        for dd in (0.05, 0.1, 0.2, 0.5):
            bm2 = random_selection(perm, hq, n, bs, seg, dd)
            kv2 = TA.block_mask_to_indices(bm2, num_keys=n, block_size=bs, segment_size=seg, is_causal=True)
            d2 = selection_density(bm2, perm, block_size=bs).mean().item()
            t2 = bench(lambda: TA.pbs_block_sparse_attention(q, kk, vv, kpos, *kv2, block_size=bs))
            ent = dict(
                attention_ms=t2,
                speedup_vs_cudnn=t_cudnn / t2,
                total_ref_stages_speedup_vs_cudnn=t_cudnn / (sel_ms + t_prep + t2),
            )
            if kern_stage_ms is not None:
                ent["total_kernel_stages_speedup_vs_cudnn"] = t_cudnn / (kern_stage_ms + t2)
            sweep[f"{d2:.3f}"] = ent
        row["attention_vs_density"] = sweep
        rows.append(row)
        print(
            "total "
            + " ".join(
                f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                for k, v in row.items()
                if k != "attention_vs_density"
            ),
            flush=True,
        )
        print(
            "      density sweep: "
            + ", ".join(
                f"d={k}: attn {v['attention_ms']:.2f} ms x{v['speedup_vs_cudnn']:.2f}, total x"
                f"{v.get('total_kernel_stages_speedup_vs_cudnn', v['total_ref_stages_speedup_vs_cudnn']):.2f}"
                for k, v in sweep.items()
            ),
            flush=True,
        )
        del out
        q = k = v = kk = vv = bm = perm = None  # frees them; not del, closures above name them
        torch.cuda.empty_cache()
    results["total"] = rows


def part_stages(args, results):
    """Just the selection pipeline with the kernels (score, segment sort, layout, selection), per
    stage and back to back, at ``--stage-ns`` (default 8K, 32K, 128K) on the structured generator
    (query-head permutation), vs cuDNN dense; plus the old layout (two torch gathers + positions),
    the selection's parts (query pooling, logits GEMM, the row kernel with either cut), the whole
    op, and the selection checked against the reference on the same permutation."""
    from sparseflow.methods.pbs import triton_attention as TA
    from sparseflow.methods.pbs import triton_impl as TI
    from sparseflow.methods.pbs import triton_gather as TG
    from sparseflow.methods.pbs import triton_select as S

    b, hq, hkv, d = 1, args.hq, args.hkv, args.d
    bs, seg, thr = args.block, args.segment, args.threshold
    gqa = args.gqa[0]
    rows = []
    for n in args.stage_ns:
        q, k, v = qkv(b, hq, hkv, n, d, args.dtype, seed=n, structured=True)
        cud, _ = sdpa_dense(q, k, v, "cudnn")
        t_cudnn = bench(cud)
        sc = S.key_scores(q, k, block_size=bs, segment_size=seg, gqa_permutation=gqa)
        perm = S.segment_permutation(sc, segment_size=seg)
        lay = TG.permuted_layout(k, v, perm, block_size=bs)

        def select(cut="bisect"):
            return S.select_block_lists(
                q,
                None,
                perm,
                block_size=bs,
                segment_size=seg,
                threshold=thr,
                return_block_mask=False,
                layout=lay,
                cut=cut,
            )

        def pipeline():
            s_ = S.key_scores(q, k, block_size=bs, segment_size=seg, gqa_permutation=gqa)
            p_ = S.segment_permutation(s_, segment_size=seg)
            l_ = TG.permuted_layout(k, v, p_, block_size=bs)
            return S.select_block_lists(
                q, None, p_, block_size=bs, segment_size=seg, threshold=thr, return_block_mask=False, layout=l_
            )

        row = dict(n=n, cudnn_ms=t_cudnn)
        row["score_ms"] = bench(lambda: S.key_scores(q, k, block_size=bs, segment_size=seg, gqa_permutation=gqa))
        row["permute_ms"] = bench(lambda: S.segment_permutation(sc, segment_size=seg))
        row["layout_ms"] = bench(lambda: TG.permuted_layout(k, v, perm, block_size=bs))
        row["select_ms"] = bench(select)
        row["select_sort_ms"] = bench(lambda: select("sort"))
        row["qpool_ms"] = bench(lambda: TG.pool_query_blocks(q, None, bs))
        qbar = TG.pool_query_blocks(q, None, bs)
        row["logits_ms"] = bench(lambda: S.block_logits(qbar, lay.kbar))
        row["stages_sum_ms"] = row["score_ms"] + row["permute_ms"] + row["layout_ms"] + row["select_ms"]
        row["pipeline_ms"] = bench(pipeline)  # back to back, launch overheads included
        row["pipeline_frac_of_cudnn"] = row["pipeline_ms"] / t_cudnn
        # the same pipeline replayed from a CUDA graph: the GPU's own time, without the host's
        # per-launch cost (what a caller using graphs, e.g. torch.compile's reduce-overhead, pays)
        try:
            pipeline()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                pipeline()
            row["pipeline_graph_ms"] = bench(graph.replay)
            row["pipeline_graph_frac_of_cudnn"] = row["pipeline_graph_ms"] / t_cudnn
            del graph
        except Exception as e:  # noqa: BLE001 -- a host sync inside the pipeline cannot be captured
            row["pipeline_graph_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        row["old_layout_ms"] = bench(
            lambda: (TG.permute_kv_torch(k, perm), TG.permute_kv_torch(v, perm), TA.key_positions(perm))
        )
        row["op_ms"] = bench(
            lambda: TI.pbs_attention(q, k, v, block_size=bs, segment_size=seg, threshold=thr, gqa_permutation=gqa)
        )
        row["op_speedup_vs_cudnn"] = t_cudnn / row["op_ms"]
        exact_layout = bool(
            torch.equal(lay.k, TG.permute_kv_torch(k, perm))
            and torch.equal(lay.v, TG.permute_kv_torch(v, perm))
            and torch.equal(lay.kpos, TA.key_positions(perm))
        )
        row["layout_exact"] = exact_layout
        bm = S.select_block_lists(q, None, perm, block_size=bs, segment_size=seg, threshold=thr, layout=lay)[3]
        bm_sort = S.select_block_lists(
            q, None, perm, block_size=bs, segment_size=seg, threshold=thr, layout=lay, cut="sort"
        )[3]
        row["sort_vs_bisect_rows_differing"] = (bm != bm_sort).any(-1).float().mean().item()
        row["density"] = selection_density(bm, perm, block_size=bs).mean().item()
        if not args.no_stage_check:
            row.update(selection_diff(q, k, perm, bm, bs, seg, thr))
        # the whole op at lower densities: this pipeline, then the attention kernel over random
        # selections (forced blocks always in) of that density on the same layout
        sweep = {}
        for dd in (0.05, 0.1, 0.2):
            bm2 = random_selection(perm, hq, n, bs, seg, dd)
            kv2 = TA.block_mask_to_indices(bm2, num_keys=n, block_size=bs, segment_size=seg, is_causal=True)
            d2 = selection_density(bm2, perm, block_size=bs).mean().item()
            t2 = bench(lambda: TA.pbs_block_sparse_attention(q, lay.k, lay.v, lay.kpos, *kv2, block_size=bs))
            sweep[f"{d2:.3f}"] = dict(
                attention_ms=t2,
                total_ms=row["pipeline_ms"] + t2,
                total_speedup_vs_cudnn=t_cudnn / (row["pipeline_ms"] + t2),
            )
            bm2 = kv2 = None  # frees them; not del, closures above name them
        row["op_vs_density"] = sweep
        rows.append(row)
        print(
            "stages "
            + " ".join(
                f"{k_}={v_:.4f}" if isinstance(v_, float) else f"{k_}={v_}"
                for k_, v_ in row.items()
                if k_ != "op_vs_density"
            ),
            flush=True,
        )
        q = k = v = lay = bm = bm_sort = qbar = sc = perm = None  # frees them; not del, closures above name them
        torch.cuda.empty_cache()
    results["stages"] = rows


def print_table(results):
    if "kernel_100pct" in results:
        print("\n=== attention kernel at 100% density (equal work), B=1 Hq=32 Hkv=8 D=128 bf16 ===")
        rows = results["kernel_100pct"]
        keys = [k for k in rows[0] if k.endswith("_vs_cudnn") or k.endswith("tflops")]
        print(f"{'N':>7} {'cudnn ms':>9} {'flash ms':>9} " + " ".join(f"{k:>26}" for k in keys))
        for r in rows:
            print(
                f"{r['n']:>7} {r['cudnn_ms']:>9.3f} {r['flash_ms']:>9.3f} "
                + " ".join(f"{r.get(k, float('nan')):>26.3f}" for k in keys)
            )
    if "stages" in results:
        print("\n=== selection pipeline with the kernels (ms), B=1 Hq=32 Hkv=8 D=128 bf16, query-head permutation ===")
        cols = [
            "cudnn_ms",
            "score_ms",
            "permute_ms",
            "layout_ms",
            "select_ms",
            "select_sort_ms",
            "qpool_ms",
            "logits_ms",
            "stages_sum_ms",
            "pipeline_ms",
            "pipeline_frac_of_cudnn",
            "pipeline_graph_ms",
            "pipeline_graph_frac_of_cudnn",
            "old_layout_ms",
            "op_ms",
            "op_speedup_vs_cudnn",
            "density",
            "kern_sel_rows_differing",
        ]
        print(f"{'N':>7} " + " ".join(f"{c.replace('_ms', ''):>12}" for c in cols) + f" {'ties':>5} {'exact':>5}")
        for r in results["stages"]:
            print(
                f"{r['n']:>7} "
                + " ".join(f"{r.get(c, float('nan')):>12.4f}" for c in cols)
                + f" {str(r.get('kern_sel_diff_all_near_ties', '-')):>5} {str(r['layout_exact']):>5}"
            )
        print("whole op vs density (pipeline + attention over random selections of that density), speedup vs cuDNN:")
        for r in results["stages"]:
            print(
                f"{r['n']:>7} "
                + "  ".join(
                    f"d={k_}: {v_['total_ms']:.2f} ms x{v_['total_speedup_vs_cudnn']:.2f}"
                    for k_, v_ in r.get("op_vs_density", {}).items()
                )
            )
    if "total" in results:
        print("\n=== whole op at threshold, structured synthetic Q/K ===")
        print(
            "(ms; stages 1-3 with the torch reference, then with the Triton kernels [kern]; 'rows diff': fraction "
            "of (head, query block) rows whose kernel selection differs from the reference's on the kernels' "
            "permutation, 'ties': every differing block is a near-tie)"
        )
        print(
            f"{'N':>7} {'density':>8} {'cudnn':>8} {'score':>8} {'perm':>8} {'select':>8} {'layout':>8} "
            f"{'attn':>8} {'total':>8} {'sel/cudnn':>9} {'speedup':>8} | {'kscore':>7} {'kperm':>7} {'ksel':>7} "
            f"{'klayout':>7} {'ksel/cudnn':>10} {'kspeedup':>8} {'rows diff':>9} {'ties':>5}"
        )
        nan = float("nan")
        for r in results["total"]:
            print(
                f"{r['n']:>7} {r['density']:>8.3f} {r['cudnn_ms']:>8.2f} {r['score_ms']:>8.2f} {r['permute_ms']:>8.2f} "
                f"{r['select_ms']:>8.2f} {r['layout_ms']:>8.2f} {r['attention_ms']:>8.2f} {r['total_ms']:>8.2f} "
                f"{r['select_frac_of_cudnn']:>9.3f} {r['total_speedup_vs_cudnn']:>8.2f} | "
                f"{r.get('kern_score_ms', nan):>7.3f} {r.get('kern_permute_ms', nan):>7.3f} "
                f"{r.get('kern_select_ms', nan):>7.3f} {r.get('kern_layout_ms', nan):>7.3f} "
                f"{r.get('kern_stages_frac_of_cudnn', nan):>10.3f} {r.get('kern_total_speedup_vs_cudnn', nan):>8.2f} "
                f"{r.get('kern_sel_rows_differing', nan):>9.2e} {str(r.get('kern_sel_diff_all_near_ties', '-')):>5}"
            )
        print("whole op vs density (random selections, forced blocks in): speedup vs cuDNN, kernel stages")
        for r in results["total"]:
            print(
                f"{r['n']:>7} "
                + "  ".join(
                    f"d={k}: x{v.get('total_kernel_stages_speedup_vs_cudnn', v['total_ref_stages_speedup_vs_cudnn']):.2f}"
                    f" (attn x{v['speedup_vs_cudnn']:.2f})"
                    for k, v in r["attention_vs_density"].items()
                )
            )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", action="append", choices=["check", "kernel", "total", "variants", "stages"])
    ap.add_argument("--stage-ns", type=lambda s: [int(x) for x in s.split(",")], default=[8192, 32768, 131072])
    ap.add_argument(
        "--no-stage-check", action="store_true", help="--part stages: skip the comparison with the reference selection"
    )
    ap.add_argument("--ns", type=lambda s: [int(x) for x in s.split(",")], default=[8192, 16384, 32768, 65536, 131072])
    ap.add_argument("--variant-ns", type=lambda s: [int(x) for x in s.split(",")], default=[8192, 32768])
    ap.add_argument(
        "--variant-configs",
        type=lambda s: [tuple(int(x) for x in c.split("/")) for c in s.split(",")],
        default=None,
        help="BM/BN/warps/stages,...",
    )
    ap.add_argument(
        "--variant-layouts",
        type=lambda s: [tuple(c.split("/")) for c in s.split(",")],
        default=[
            ("query_head", "permuted", "1"),
            ("query_head", "permuted", "0"),
            ("query_head", "gather", "0"),
            ("kv_head", "permuted", "1"),
        ],
        help="gqa/layout/tma,...",
    )
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--segment", type=int, default=256)
    ap.add_argument("--dtype", type=lambda s: getattr(torch, s), default=torch.bfloat16)
    ap.add_argument("--gqa", type=lambda s: s.split(","), default=["query_head", "kv_head"])
    ap.add_argument("--layout", default="permuted", choices=["permuted", "gather"])
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--flex", action="store_true")
    ap.add_argument(
        "--no-select-kernels",
        dest="select_kernels",
        action="store_false",
        help="time only the reference (torch) stages 1-3",
    )
    ap.add_argument("--flex-ns", type=lambda s: [int(x) for x in s.split(",")], default=[8192, 32768])
    ap.add_argument(
        "--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "pbs_h200.json")
    )
    args = ap.parse_args(argv)
    parts = args.part or ["check", "kernel", "total"]
    if not torch.cuda.is_available():
        sys.exit("benchmarks/pbs.py needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False
    # bring the clocks up before the first timing (an idle H200 sits at ~400 MHz)
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    t_end = time.time() + 3.0
    while time.time() < t_end:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()
    del a
    results = {"env": env_info(), "args": {k: v for k, v in vars(args).items()}}
    print(json.dumps(results["env"]))
    t0 = time.time()
    for p in parts:
        {
            "check": part_check,
            "kernel": part_kernel,
            "total": part_total,
            "variants": part_variants,
            "stages": part_stages,
        }[p](args, results)
        print(f"[{p} done at {time.time() - t0:.0f}s]", flush=True)
        os.makedirs(os.path.dirname(args.json), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    print_table(results)


if __name__ == "__main__":
    main()
