"""PISA / BSA benchmark (issues 4 and 5): one run, ratios side by side, table + JSON.

    python benchmarks/pisa.py                  # every part, default sizes (CUDA)
    python benchmarks/pisa.py --part check     # GPU selections vs the reference, attention errors (2x rule)
    python benchmarks/pisa.py --part select    # selection only: PISA walk vs the fused BSA scan, 4K..256K
    python benchmarks/pisa.py --part select --beams 1,2,4 --select-ns 16384,65536,262144
                                               # ... with the walk's beam (PISAConfig.beam) side by side
    python benchmarks/pisa.py --part select --walk per_token,tiled --select-ns 16384,65536,262144 \
        --json benchmarks/results/pisa_h200_walks.json
                                               # ... the per-token and the tiled walk (Tuning.pisa_walk)
                                               # side by side, their selections compared
    python benchmarks/pisa.py --part select --walk per_token,leaf_pairs --select-scores bf16 \
        --select-ns 262144,1048576      # ... scoring the nodes in bf16 (Tuning.pisa_scores)
    python benchmarks/pisa.py --part select_tiled --variant-n 262144
                                               # the walk alone: per-token vs tiled over tile sizes / warps
    python benchmarks/pisa.py --part attn      # select + attention, forward and forward+backward, vs cuDNN
    python benchmarks/pisa.py --part flex      # triton vs flex backends on the same selection
    python benchmarks/pisa.py --part decode    # one decoding step at a long context vs dense SDPA decode

Selection shapes: B=1, Hq=32, Hkv=2, D=64, C=64, K=8, g=2, bf16. Attention: Hq=32, Hkv=8,
D=128, C=64, K=32. Dense baseline: SDPA's cuDNN backend (the fastest on the H200; flash beside it
in the attention part). Writes ``--json`` (default benchmarks/results/pisa_h200.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from common import bench, env_info, sdpa_dense, structured_qkv  # noqa: E402

DEV = "cuda"


def rand(*shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn(*shape, device=DEV, dtype=dtype, generator=g)


def pisa_inputs(n, hq, hkv, d, dtype=torch.bfloat16, seed=0, structured=False):
    """Random Q/K/V with a little structure: a shared direction per key block makes block means
    informative (pure noise would make every block score alike). ``structured``: the
    generator of benchmarks/common.py (sink, local band, topics in runs: neighbouring queries agree,
    as in real models, so a query tile's rows select overlapping blocks)."""
    if structured:
        g = torch.Generator(device=DEV).manual_seed(seed)
        return structured_qkv(1, hq, hkv, n, d, dtype, g)
    q = rand(1, hq, n, d, dtype=torch.float32, seed=seed)
    k = rand(1, hkv, n, d, dtype=torch.float32, seed=seed + 1)
    topic = rand(1, hkv, -(-n // 64), d, dtype=torch.float32, seed=seed + 2)
    k = k + 1.5 * topic.repeat_interleave(64, dim=2)[:, :, :n]
    v = rand(1, hkv, n, d, dtype=torch.float32, seed=seed + 3)
    return q.to(dtype), k.to(dtype), v.to(dtype)


# --------------------------------------------------------------------------- parts


def part_check(args, results):
    from sparseflow.kernels import token_blocks as tb
    from sparseflow.methods.bsa import reference as BR
    from sparseflow.methods.bsa import triton_select as BT
    from sparseflow.methods.pisa import reference as PR
    from sparseflow.methods.pisa import triton_select as PT
    from sparseflow.kernels.token_sparse_triton import token_sparse_attention

    rows = []
    for n, hq, hkv, d, dt, score in [
        (4096, 32, 2, 64, torch.bfloat16, "lse"),
        (3001, 12, 4, 128, torch.float16, "mean_var"),
        (2500, 8, 8, 64, torch.float32, "mean"),
    ]:
        q, k, v = pisa_inputs(n, hq, hkv, d, dt, seed=n)
        want = PR.pisa_select(q, k, block_size=64, top_k=8, score=score)
        got = PT.pisa_select(q, k, block_size=64, top_k=8, score=score)
        bw = BR.bsa_select(q, k, block_size=64, top_k=8)
        bg = BT.bsa_select(q, k, block_size=64, top_k=8)
        pisa_same = (got == want).all(-1).float().mean().item()
        beam_same = {}
        for beam in (b_ for b_ in args.beams if b_ > 1):  # the wider walks: the same check
            w_b = PR.pisa_select(q, k, block_size=64, top_k=8, score=score, beam=beam)
            g_b = PT.pisa_select(q, k, block_size=64, top_k=8, score=score, beam=beam)
            beam_same[beam] = (g_b == w_b).all(-1).float().mean().item()
        bsa_same = (bg == bw).all(-1).float().mean().item()
        # attention given the reference's selection: error vs fp64, and plain PyTorch's in dt
        q2, k2, v2 = (t.detach().requires_grad_(True) for t in (q, k, v))
        out = token_sparse_attention(q2, k2, v2, want, block_size=64)
        go = torch.randn_like(out)
        gq = torch.autograd.grad(out, (q2, k2, v2), go)
        o64 = [t.double().requires_grad_(True) for t in (q, k, v)]
        ref = tb.attend_selected_blocks(*o64, want, block_size=64)
        r64 = torch.autograd.grad(ref, o64, go.double())
        # plain PyTorch in the same dtype: SDPA on the same problem as a dense boolean mask
        km = tb.selection_for_indices(
            "pisa", want, q, k, key_padding_mask=None, is_causal=True, block_size=64
        ).key_mask(hq)
        plain_in = [t.detach().requires_grad_(True) for t in (q, k, v)]
        g_ = hq // hkv
        plain = F.scaled_dot_product_attention(
            plain_in[0], plain_in[1].repeat_interleave(g_, 1), plain_in[2].repeat_interleave(g_, 1), attn_mask=km
        )
        pg = torch.autograd.grad(plain, plain_in, go)
        rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
        errs = {
            nm: (rel(a, r), rel(p, r))
            for nm, a, p, r in zip(("out", "dq", "dk", "dv"), (out,) + gq, (plain,) + pg, (ref,) + r64)
        }
        ok = pisa_same == 1.0 and all(v_ == 1.0 for v_ in beam_same.values())
        ok = ok and all(e <= 2 * pe + 1e-6 for e, pe in errs.values())  # the 2x rule
        row = dict(
            n=n,
            hq=hq,
            hkv=hkv,
            d=d,
            dtype=str(dt).split(".")[-1],
            score=score,
            pisa_rows_identical=pisa_same,
            pisa_beam_rows_identical={str(b_): v_ for b_, v_ in beam_same.items()},
            bsa_rows_identical=bsa_same,
            errors={k_: dict(triton=e, torch_same_dtype=pe) for k_, (e, pe) in errs.items()},
            ok=ok,
        )
        rows.append(row)
        print(
            f"check n={n} {row['dtype']} {score}: pisa identical rows {pisa_same:.4f}, "
            + "".join(f"beam {b_} {v_:.4f}, " for b_, v_ in beam_same.items())
            + f"bsa {bsa_same:.4f}, "
            + ", ".join(f"{k_} {e:.1e} (torch {pe:.1e})" for k_, (e, pe) in errs.items())
            + f"  ok={ok}",
            flush=True,
        )
    results["check"] = rows


def part_select(args, results):
    from sparseflow.methods.bsa import triton_select as BT
    from sparseflow.methods.pisa import triton_select as PT

    from sparseflow import Tuning

    rows = []
    tunings = {w: Tuning(pisa_walk=w, pisa_scores=args.select_scores) for w in args.walks}
    for n in args.select_ns:
        q, k, _ = pisa_inputs(n, 32, 2, 64)
        kw = dict(block_size=64, top_k=8)
        # the walk per --walks entry and beam (pyramid build included); pisa_ms is the first walk's beam 1
        t_walk = {
            (w, b_): bench(lambda w=w, b_=b_: PT.pisa_select(q, k, branching=2, beam=b_, tuning=tunings[w], **kw))
            for w in args.walks
            for b_ in args.beams
        }
        t_beam = {b_: t_walk[(args.walks[0], b_)] for b_ in args.beams}
        t_pisa = t_beam[1] if 1 in t_beam else t_beam[args.beams[0]]
        t_pyr = bench(lambda: PT.build_pyramid(k, block_size=64, branching=2))
        t_bsa = bench(lambda: BT.bsa_select(q, k, **kw))
        t_bsa16 = bench(lambda: BT.bsa_select(q, k, precision="bf16", **kw))
        t_plain = bench(lambda: plain_torch_scan(q, k, **kw), rep_ms=50, warmup_ms=20)
        best_bsa = min(t_bsa, t_bsa16)
        row = dict(
            n=n,
            pisa_ms=t_pisa,
            pyramid_ms=t_pyr,
            bsa_ieee_ms=t_bsa,
            bsa_bf16_ms=t_bsa16,
            plain_torch_scan_ms=t_plain,
            speedup_vs_best_bsa=best_bsa / t_pisa,
            speedup_vs_bsa_ieee=t_bsa / t_pisa,
            speedup_vs_plain_torch_scan=t_plain / t_pisa,
        )
        row.update({f"pisa_beam{b_}_ms": t for b_, t in t_beam.items()})
        row.update({f"pisa_beam{b_}_speedup_vs_best_bsa": best_bsa / t for b_, t in t_beam.items()})
        if len(args.walks) > 1:
            row.update(_walk_rows(q, k, kw, PT, tunings, t_walk, args))
        rows.append(row)
        beams = (
            "".join(f"  beam {b_} {t:8.3f} (x{t / t_pisa:4.2f})" for b_, t in t_beam.items())
            if args.beams != [1]
            else ""
        )
        print(
            f"select n={n:7d}  pisa {t_pisa:8.3f} ms (pyramid {t_pyr:.3f})  bsa ieee {t_bsa:8.3f}  bsa bf16 {t_bsa16:8.3f}"
            f"  plain torch {t_plain:8.3f}  pisa speedup x{best_bsa / t_pisa:6.2f} (vs ieee x{t_bsa / t_pisa:6.2f},"
            f" vs plain torch x{t_plain / t_pisa:6.2f}){beams}",
            flush=True,
        )
        q = k = None  # frees them; not del, closures above name them
        torch.cuda.empty_cache()
    big = [r for r in rows if r["n"] >= 65536]
    if len(big) >= 2:
        xs = [math.log(r["n"]) for r in big]
        for key in ["pisa_ms", "bsa_ieee_ms", "bsa_bf16_ms", "plain_torch_scan_ms"] + [
            f"pisa_beam{b_}_ms" for b_ in args.beams if b_ != 1
        ]:
            ys = [math.log(r[key]) for r in big]
            mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
            slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
            results.setdefault("select_slopes_64k_up", {})[key] = slope
            print(f"log-log slope 64K..{big[-1]['n'] // 1024}K {key}: {slope:.3f}")
    results["select"] = rows


def plain_torch_scan(q, k, *, block_size, top_k, rows_per_chunk=8192):
    """What a user writes instead of a selection kernel: every query against every causal key
    block's mean key, scores summed over the query heads of each KV head (einsum + topk), in
    chunks of query rows so the ``[rows, blocks]`` scores fit in memory at 1M tokens."""
    b, hq, n, d = q.shape
    hkv = k.shape[1]
    nb = -(-n // block_size)
    kp = F.pad(k.float(), (0, 0, 0, nb * block_size - n))
    counts = torch.full((nb,), float(block_size), device=k.device)
    counts[-1] = n - (nb - 1) * block_size
    means = kp.view(b, hkv, nb, block_size, d).sum(3) / counts[:, None]
    q_group = q.float().view(b, hkv, hq // hkv, n, d).sum(2)
    width = min(top_k, nb)
    out = torch.empty(b, hkv, n, width, dtype=torch.int64, device=q.device)
    blocks = torch.arange(nb, device=q.device)
    for start in range(0, n, rows_per_chunk):
        rows = torch.arange(start, min(n, start + rows_per_chunk), device=q.device)
        scores = torch.einsum("bhnd,bhjd->bhnj", q_group[:, :, rows], means)
        scores.masked_fill_(blocks[None, :] > (rows // block_size)[:, None], float("-inf"))
        out[:, :, rows] = scores.topk(width, dim=-1).indices
    return out


def _walk_rows(q, k, kw, PT, tunings, t_walk, args):
    """Each walk's times (``pisa_<walk>_beam<b>_ms``) and whether its selection equals the first
    walk's (``walks_agree``: they must; a False is a bug to report, not a speed)."""
    row = {f"pisa_{w}_beam{b_}_ms": t for (w, b_), t in t_walk.items()}
    first = args.walks[0]
    agree = all(
        torch.equal(
            PT.pisa_select(q, k, branching=2, beam=b_, tuning=tunings[w], **kw),
            PT.pisa_select(q, k, branching=2, beam=b_, tuning=tunings[first], **kw),
        )
        for w in args.walks[1:]
        for b_ in args.beams
    )
    row["walks_agree"] = agree
    times = "  ".join(f"{w} beam {b_} {t:8.3f} ms" for (w, b_), t in t_walk.items())
    print(f"select n={q.shape[2]:7d}  walks: {times}  selections equal: {agree}", flush=True)
    return row


def part_select_variants(args, results):
    """Launch settings of the PISA walk side by side (``sparseflow.Tuning``'s ``pisa_warps`` and
    ``pisa_leaf_bytes``), plus the PISA-1 score (no raw keys at the leaves) for scale."""
    from sparseflow import Tuning
    from sparseflow.methods.pisa import triton_select as PT

    rows = []
    q, k, _ = pisa_inputs(args.variant_n, 32, 2, 64)
    for warps in (1, 2, 4, 8):
        for leaf_bytes in (16384, 65536):
            for score in ("lse", "mean"):
                if score == "mean" and leaf_bytes != 65536:
                    continue
                tuning = Tuning(pisa_warps=warps, pisa_leaf_bytes=leaf_bytes)
                try:
                    ms = bench(lambda: PT.pisa_select(q, k, block_size=64, top_k=8, score=score, tuning=tuning))
                except Exception as e:  # noqa: BLE001 -- a setting that cannot launch is a row, not the end of the sweep
                    ms = float("nan")
                    print(f"select variant warps={warps} leaf_bytes={leaf_bytes} failed: {type(e).__name__}: {e}")
                rows.append(dict(n=args.variant_n, warps=warps, leaf_bytes=leaf_bytes, score=score, ms=ms))
                print(
                    f"select variant n={args.variant_n} warps={warps} leaf_bytes={leaf_bytes} score={score}: {ms:.3f} ms",
                    flush=True,
                )
    results["select_variants"] = rows


def part_select_tiled(args, results):
    """The walk alone (pyramid built once, outside the timing) at ``--variant-n``: the per-token
    op beside the tiled one over tile sizes and warps; every tiled selection must equal the
    per-token one (``equal``)."""
    from sparseflow.methods.pisa import triton_select as PT
    from sparseflow.methods.pisa import triton_select_per_token as per_token
    from sparseflow.methods.pisa import triton_select_tiled as TT

    q, k, _ = pisa_inputs(args.variant_n, 32, 2, 64)
    summ, nfv, _, off, span = PT.build_pyramid(k, block_size=64, branching=2)
    # q, k, kpm, pyramid, scale, causal, score (lse), C, g, K, force sink / previous, beam
    walk = (q, k, None, summ, nfv, off, span, q.shape[-1] ** -0.5, True, 0, 64, 2, 8, True, True, 1)
    want = per_token._pisa_select_fwd(*walk)
    rows = [dict(n=args.variant_n, walk="per_token", ms=bench(lambda: per_token._pisa_select_fwd(*walk)))]
    print(f"walk only n={args.variant_n} per_token: {rows[0]['ms']:.3f} ms", flush=True)
    for block_q in (4, 8, 16):
        for warps in (4, 8):
            try:
                equal = bool(torch.equal(TT.pisa_select_tiled_fwd(*walk, warps, block_q), want))
                ms = bench(lambda: TT.pisa_select_tiled_fwd(*walk, warps, block_q))
            except Exception as e:  # noqa: BLE001 -- a setting that cannot launch is a row, not the end of the sweep
                ms, equal = float("nan"), False
                print(f"walk only tiled block_q={block_q} warps={warps} failed: {type(e).__name__}: {e}")
            rows.append(dict(n=args.variant_n, walk="tiled", block_q=block_q, warps=warps, ms=ms, equal=equal))
            print(
                f"walk only n={args.variant_n} tiled block_q={block_q} warps={warps}: {ms:.3f} ms "
                f"(x{rows[0]['ms'] / ms:.2f} vs per_token), selection equal: {equal}",
                flush=True,
            )
    results["select_tiled"] = rows


def _cudnn_fwd_bwd(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
        o.backward(torch.ones_like(o))

    try:
        run()
        return run, "gqa"
    except Exception:
        g = q.shape[1] // k.shape[1]
        kr, vr = (t.repeat_interleave(g, 1).detach().requires_grad_(True) for t in (k, v))

        def run2():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                o = F.scaled_dot_product_attention(qq, kr, vr, is_causal=True)
            o.backward(torch.ones_like(o))

        run2()
        return run2, "repeated-kv"


def _user_call_fwd_bwd(q, k, v, kw):
    """Forward + backward through the user's call (``sparseflow.attention``, Triton backend: the
    backward differentiates the forward's own graph) and through the op, whose backward
    recomputes the forward, selection included (what a compiled graph runs)."""
    import sparseflow
    from sparseflow.ops import op_args, op_for

    cfg = sparseflow.PISAConfig(min_seq_len=0, **kw)
    args = (q, k, v, None, True, None) + tuple(op_args(cfg, sparseflow.Tuning())) + ("triton", "")

    def api():
        o = sparseflow.attention(q, k, v, config=cfg, backend="triton")
        o.backward(torch.ones_like(o))

    def through_op():
        o = op_for("pisa")(*args)
        o.backward(torch.ones_like(o))

    return bench(api), bench(through_op)


def part_attn(args, results):
    from sparseflow.methods.pisa import triton_select as PT
    from sparseflow.kernels.token_sparse_triton import token_sparse_attention

    rows = []
    for n in args.attn_ns:
        q, k, v = pisa_inputs(n, 32, 8, 128, structured=True)
        kw = dict(block_size=64, top_k=args.attn_k)
        cud, mode = sdpa_dense(q, k, v, "cudnn")
        fla, _ = sdpa_dense(q, k, v, "flash")
        t_cud, t_fla = bench(cud), bench(fla)
        cud_fb, mode_fb = _cudnn_fwd_bwd(q, k, v)
        t_cud_fb = bench(cud_fb)
        idx = PT.pisa_select(q, k, **kw)
        from sparseflow.kernels.token_sparse_triton import BLOCK_M, tile_block_lists

        num, _ = tile_block_lists(idx.int(), BLOCK_M, -(-n // 64))
        union = num.float().mean().item() / args.attn_k  # blocks a tile loads / blocks a row uses
        t_sel = bench(lambda: PT.pisa_select(q, k, **kw))
        t_att = bench(lambda: token_sparse_attention(q, k, v, idx, block_size=64))
        qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))

        def fb():
            i = PT.pisa_select(qq, kk, **kw)
            o = token_sparse_attention(qq, kk, vv, i, block_size=64)
            o.backward(torch.ones_like(o))

        t_fb = bench(fb)
        t_api_fb, t_op_fb = _user_call_fwd_bwd(qq, kk, vv, kw)
        fwd = t_sel + t_att
        row = dict(
            n=n,
            top_k=args.attn_k,
            tile_union_over_k=union,
            cudnn_fwd_ms=t_cud,
            flash_fwd_ms=t_fla,
            cudnn_fwd_bwd_ms=t_cud_fb,
            cudnn_kv=mode,
            cudnn_fwd_bwd_kv=mode_fb,
            pisa_select_ms=t_sel,
            pisa_attention_fwd_ms=t_att,
            pisa_fwd_ms=fwd,
            pisa_fwd_bwd_ms=t_fb,
            fwd_speedup_vs_cudnn=t_cud / fwd,
            attention_only_fwd_speedup_vs_cudnn=t_cud / t_att,
            fwd_bwd_speedup_vs_cudnn=t_cud_fb / t_fb,
            api_fwd_bwd_ms=t_api_fb,
            op_recompute_fwd_bwd_ms=t_op_fb,
            api_fwd_bwd_speedup_vs_cudnn=t_cud_fb / t_api_fb,
        )
        rows.append(row)
        print(
            f"attn n={n:7d} K={args.attn_k}: cudnn fwd {t_cud:8.3f} (flash {t_fla:8.3f}) fwd+bwd {t_cud_fb:8.3f} | pisa select "
            f"{t_sel:7.3f} attn {t_att:7.3f} fwd {fwd:7.3f} fwd+bwd {t_fb:8.3f} | fwd x{t_cud / fwd:5.2f} "
            f"(attn only x{t_cud / t_att:5.2f}) fwd+bwd x{t_cud_fb / t_fb:5.2f} | tile union/K {union:.2f} | "
            f"sparseflow.attention fwd+bwd {t_api_fb:8.3f} (through the op, recomputing: {t_op_fb:8.3f}) "
            f"x{t_cud_fb / t_api_fb:5.2f}",
            flush=True,
        )
        q = k = v = qq = kk = vv = None  # frees them; not del, closures above name them
        torch.cuda.empty_cache()
    results["attn"] = rows


def part_flex(args, results):
    from sparseflow.kernels import flex_common as fc
    from sparseflow.methods.pisa import triton_select as PT
    from sparseflow.kernels.token_sparse_triton import token_sparse_attention

    rows = []
    for n in args.flex_ns:
        q, k, v = pisa_inputs(n, 32, 8, 128, structured=True)
        idx = PT.pisa_select(q, k, block_size=64, top_k=args.attn_k)
        tri = lambda: token_sparse_attention(q, k, v, idx, block_size=64)  # noqa: E731
        flx = lambda: fc.token_block_attention(  # noqa: E731
            q,
            k,
            v,
            idx,
            key_padding_mask=None,
            is_causal=True,
            scale=None,
            block_size=64,
        )
        ref = tri()
        err = ((flx().float() - ref.float()).norm() / ref.float().norm()).item()
        t_tri, t_flx = bench(tri), bench(flx)
        qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))

        def tri_fb():
            o = token_sparse_attention(qq, kk, vv, idx, block_size=64)
            o.backward(torch.ones_like(o))

        def flx_fb():
            o = fc.token_block_attention(
                qq, kk, vv, idx, key_padding_mask=None, is_causal=True, scale=None, block_size=64
            )
            o.backward(torch.ones_like(o))

        t_tri_fb = bench(tri_fb)
        try:
            t_flx_fb = bench(flx_fb)
        except Exception as exc:  # report, do not hide
            t_flx_fb = float("nan")
            print(f"flex backward failed at n={n}: {type(exc).__name__}: {exc}")
        row = dict(
            n=n,
            top_k=args.attn_k,
            triton_fwd_ms=t_tri,
            flex_fwd_ms=t_flx,
            triton_fwd_bwd_ms=t_tri_fb,
            flex_fwd_bwd_ms=t_flx_fb,
            flex_over_triton_fwd=t_flx / t_tri,
            flex_over_triton_fwd_bwd=t_flx_fb / t_tri_fb,
            flex_vs_triton_rel_err=err,
        )
        rows.append(row)
        print(
            f"flex n={n:7d}: fwd triton {t_tri:7.3f} flex {t_flx:7.3f} (x{t_flx / t_tri:4.2f}) | fwd+bwd triton {t_tri_fb:7.3f} "
            f"flex {t_flx_fb:7.3f} (x{t_flx_fb / t_tri_fb:4.2f}) | rel err {err:.1e}",
            flush=True,
        )
    results["flex"] = rows


def _capture(fn, warm=None):
    """``(graph, outputs)``: ``fn`` captured in a CUDA graph after two runs of ``warm`` (default
    ``fn``) on a side stream, which compile the kernels and settle the allocator."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            (warm or fn)()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def _error(exc):
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:240] if text else ''}"


def _graph_time(row, key, fn):
    """``row[key + "_ms"]``: ``fn`` (stateless) replayed from a CUDA graph; ``row[key + "_error"]``
    if it cannot be captured."""
    try:
        graph, _ = _capture(fn)
        row[f"{key}_ms"] = bench(graph.replay)
    except Exception as exc:
        row[f"{key}_error"] = _error(exc)
        torch.cuda.synchronize()


def _decode_eager(q1, k, v, top_k, tuning):
    """The eager step (PyramidCache.decode_step on the growing k/v): its times, its walk and its
    attention alone replayed from CUDA graphs (the GPU's share of a step: the tiled attention and
    the split-K one the step uses), and the output and selection of one real step for the
    captured path's check."""
    from sparseflow.kernels.token_sparse_decode_triton import token_sparse_decode
    from sparseflow.kernels.token_sparse_triton import token_sparse_attention
    from sparseflow.methods.pisa.pyramid_cache import PyramidCache

    n = k.shape[2]
    cache = PyramidCache(k[:, :, : n - 1], capacity=n + 1024, block_size=64, branching=2)
    base = cache.length
    out, idx = cache.decode_step(q1, k, v, top_k=top_k, tuning=tuning)

    def step():
        cache.length = base  # re-append the same token: the cost of one real step
        return cache.decode_step(q1, k, v, top_k=top_k, tuning=tuning)[0]

    def select():
        return cache.select(q1, k, top_k=top_k, tuning=tuning)

    row = dict(pisa_step_ms=bench(step), pisa_select_ms=bench(select))
    _graph_time(row, "pisa_select_graph", select)
    _graph_time(row, "pisa_attention_graph", lambda: token_sparse_attention(q1, k, v, idx, block_size=64))
    _graph_time(row, "pisa_split_attention_graph", lambda: token_sparse_decode(q1, k, v, idx, block_size=64))
    row.update(_split_vs_tiled(q1, k, v, idx))
    return row, out, idx


def _split_vs_tiled(q1, k, v, idx):
    """The split-K attention's largest difference from the tiled kernel on one step's selection
    (both steps use the split-K one: their comparison alone would not see its error)."""
    from sparseflow.kernels.token_sparse_decode_triton import token_sparse_decode
    from sparseflow.kernels.token_sparse_triton import token_sparse_attention

    try:
        split = token_sparse_decode(q1, k, v, idx, block_size=64).float()
        tiled = token_sparse_attention(q1, k, v, idx, block_size=64).float()
        return {"pisa_split_vs_tiled_max_abs_err": float((split - tiled).abs().max())}
    except Exception as exc:
        return {"pisa_split_vs_tiled_error": _error(exc)}


def _static_step(q1, k, v, top_k, tuning):
    """A fresh cache on preallocated buffers and its step ``length += 1; decode_step_static``
    (the new token's q / k / v in static input tensors), with its length tensor."""
    from sparseflow.methods.pisa.pyramid_cache import PyramidCache

    n = k.shape[2]
    cache = PyramidCache(k[:, :, : n - 1], capacity=n + 1024, block_size=64, branching=2)
    k_buf, v_buf, length = cache.static_buffers(k[:, :, : n - 1], v[:, :, : n - 1])
    ins = (q1.clone(), k[:, :, -1:].clone(), v[:, :, -1:].clone())

    def step():
        length.add_(1)
        return cache.decode_step_static(*ins, k_buf, v_buf, length, top_k=top_k, tuning=tuning)

    return step, length


def _host_syncs(fn):
    """Whether one call of ``fn`` synchronises with the host (torch's sync debug mode)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return False
    except RuntimeError as exc:
        return _error(exc)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _decode_captured(q1, k, v, top_k, eager_out, eager_idx, tuning):
    """The static step replayed from a CUDA graph: its first replay (the real step) compared with
    the eager step's, then timed (each timed replay resets the length first: one fill kernel)."""
    n = k.shape[2]
    warm, _ = _static_step(q1, k, v, top_k, tuning)  # its own cache: the captured one stays at the real step
    row = {}
    try:
        warm()  # compile first: the sync check is of a steady-state step
        row["pisa_static_host_sync"] = _host_syncs(warm)
        step, length = _static_step(q1, k, v, top_k, tuning)
        graph, (out, idx) = _capture(step, warm)
        graph.replay()
        w = eager_idx.shape[-1]
        row["pisa_graph_selection_equal"] = bool(torch.equal(idx[..., :w], eager_idx) and (idx[..., w:] == -1).all())
        row["pisa_graph_vs_eager_max_abs_err"] = float((out.float() - eager_out.float()).abs().max())

        def replay():
            length.fill_(n - 1)
            graph.replay()

        row["pisa_graph_step_ms"] = bench(replay)
        row["pisa_static_eager_step_ms"] = bench(lambda: (length.fill_(n - 1), step()))
    except Exception as exc:  # a failed capture is a result too: keep the other rows' numbers
        import traceback

        traceback.print_exc()
        row["pisa_graph_error"] = _error(exc)
        torch.cuda.synchronize()
    return row


def _decode_dense(q1, k, v):
    """Dense SDPA decode, eager and replayed from a CUDA graph."""

    def dense():
        return F.scaled_dot_product_attention(q1, k, v, enable_gqa=True)

    row = dict(dense_sdpa_decode_ms=bench(dense))
    _graph_time(row, "dense_sdpa_graph", dense)
    return row


def part_decode(args, results):
    """One decoding step at a long context: the eager PISA step, the static step replayed from a
    CUDA graph, dense SDPA decode eager and graph-replayed (Hq 32, Hkv 8, D 128, C 64, bf16), for
    each walk score precision of ``--decode-scores`` (``Tuning.pisa_scores``), walk width of
    ``--decode-warps`` (``Tuning.pisa_warps``: None picks by the candidate width) and walk of
    ``--decode-walks`` (``leaf_pairs``: the leaf level split off the walk)."""
    from sparseflow import Tuning

    rows = []
    runs = [
        (n, s, w, walk)
        for n in args.decode_ns
        for s in args.decode_scores
        for w in args.decode_warps
        for walk in args.decode_walks
    ]
    for n, scores, warps, walk in runs:
        tuning = Tuning(pisa_scores=scores, pisa_warps=warps, pisa_walk=walk)
        q, k, v = pisa_inputs(n, 32, 8, 128, structured=True)
        q1 = q[:, :, -1:].contiguous()
        row, eager_out, eager_idx = _decode_eager(q1, k, v, args.attn_k, tuning)
        row = dict(n=n, top_k=args.attn_k, scores=scores, warps=warps, walk=walk, **row, **_decode_dense(q1, k, v))
        row.update(_decode_captured(q1, k, v, args.attn_k, eager_out, eager_idx, tuning))
        row["speedup_vs_dense"] = row["dense_sdpa_decode_ms"] / row["pisa_step_ms"]
        if "pisa_graph_step_ms" in row and "dense_sdpa_graph_ms" in row:
            row["graph_speedup_vs_dense_graph"] = row["dense_sdpa_graph_ms"] / row["pisa_graph_step_ms"]
        rows.append(row)
        us = {
            key: f"{row[key] * 1e3:8.1f}" if key in row else "  failed"
            for key in (
                "pisa_step_ms",
                "pisa_select_ms",
                "dense_sdpa_decode_ms",
                "pisa_graph_step_ms",
                "dense_sdpa_graph_ms",
            )
        }
        print(
            f"decode n={n:7d} K={args.attn_k} {scores} warps {warps} walk {walk}: pisa step {us['pisa_step_ms']} us (select {us['pisa_select_ms']}) "
            f"dense {us['dense_sdpa_decode_ms']} us  x{row['speedup_vs_dense']:5.2f} | graphs: pisa "
            f"{us['pisa_graph_step_ms']} us dense {us['dense_sdpa_graph_ms']} us"
            f"  x{row.get('graph_speedup_vs_dense_graph', float('nan')):5.2f}"
            f"  selection equal: {row.get('pisa_graph_selection_equal')}",
            flush=True,
        )
        for key in (
            "pisa_graph_error",
            "dense_sdpa_graph_error",
            "pisa_split_attention_graph_error",
            "pisa_split_vs_tiled_error",
        ):
            if key in row:
                print(f"  {key}: {row[key]}", flush=True)
    results["decode"] = rows


def _beams(text):
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--beams must be a comma list of ints >= 1, got {text!r}") from None
    if not out or any(b_ < 1 for b_ in out) or len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"--beams must be a comma list of distinct ints >= 1, got {text!r}")
    return out


def _walks(text):
    from sparseflow.methods.pisa.tuning import WALKS as PISA_WALKS

    walks = text.split(",")
    if not walks or any(w not in PISA_WALKS for w in walks) or len(set(walks)) != len(walks):
        raise argparse.ArgumentTypeError(
            f"--walk must be a comma list of distinct walks from {list(PISA_WALKS)}, got {text!r}"
        )
    return walks


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--part",
        action="append",
        choices=["check", "select", "select_variants", "select_tiled", "attn", "flex", "decode"],
    )
    ap.add_argument("--variant-n", type=int, default=65536)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap.add_argument("--select-ns", type=ints, default=[4096, 8192, 16384, 32768, 65536, 131072, 262144])
    ap.add_argument("--attn-ns", type=ints, default=[16384, 32768, 131072])
    ap.add_argument("--flex-ns", type=ints, default=[16384, 32768])
    ap.add_argument("--decode-ns", type=ints, default=[32768, 131072])
    ap.add_argument("--attn-k", type=int, default=32)
    ap.add_argument(
        "--decode-scores",
        type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
        default=["fp32"],
        help="comma list of the decode walk's score precisions (Tuning.pisa_scores: fp32, bf16, tf32)",
    )
    ap.add_argument(
        "--decode-walks",
        type=_walks,
        default=["auto"],
        help="comma list of the decode walks (Tuning.pisa_walk: auto walks per token, leaf_pairs splits the leaves off)",
    )
    ap.add_argument(
        "--decode-warps",
        type=lambda s: [None if x.strip() == "auto" else int(x) for x in s.split(",") if x.strip()],
        default=[None],
        help="comma list of the decode walk's warps (Tuning.pisa_warps; auto: by the candidate width)",
    )
    ap.add_argument(
        "--beams",
        type=_beams,
        default=[1],
        help="comma list of PISA walk beams (PISAConfig.beam) timed side by side in --part select and "
        "checked against the reference in --part check, e.g. 1,2,4 (default 1)",
    )
    ap.add_argument(
        "--walk",
        dest="walks",
        type=_walks,
        default=["per_token"],
        help="comma list of PISA selection walks (Tuning.pisa_walk) timed side by side in --part select, "
        "their selections compared, e.g. per_token,tiled (default per_token)",
    )
    ap.add_argument(
        "--select-scores",
        choices=["fp32", "bf16", "tf32"],
        default="fp32",
        help="the walks' score precision in --part select (Tuning.pisa_scores; default fp32)",
    )
    ap.add_argument("--json", default=os.path.join(HERE, "results", "pisa_h200.json"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/pisa.py needs a CUDA device", file=sys.stderr)
        return 2
    parts = args.part or ["check", "select", "attn", "flex", "decode"]
    results = {"env": env_info(), "args": {k: v for k, v in vars(args).items() if k != "json"}}
    for p in parts:
        try:
            globals()[f"part_{p}"](args, results)
        except Exception as exc:  # keep the other parts' numbers; the failure is in the JSON too
            import traceback

            traceback.print_exc()
            results[f"{p}_error"] = f"{type(exc).__name__}: {exc}"
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
