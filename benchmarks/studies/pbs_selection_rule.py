"""Which blocks to keep from an estimate: PBS's cumulative-mass threshold against a threshold
relative to each query block's largest block (FlashPrefill's rule: no sort), on SmolLM2's real
layers (issue 51).

For every layer of the ``smollm2`` recipe that runs PBS (its per-layer permutation choice
included), the study captures the layer's post-RoPE q / k on real text, computes the recipe's
block estimate (``--scoring``, default the recipe's ``sampled_rows``) and the exact block masses
(an oracle: the mean over each query block's rows of the true softmax mass per key block), and
applies both rules to both at a range of settings:

* ``mass@t``: keep the fewest blocks whose estimated mass reaches ``t`` (what PBS does);
* ``ratio@a``: keep every block whose estimated mass is at least ``a`` times the query block's
  largest.

``--strides 16,32`` adds the estimate at those sampled-row strides: its cost falls with the
stride (one exponential per sampled row and key; issue 51 asks for at most 5% of dense), and at
equal density the missed mass says what a cheaper estimate gives up. ``--moments`` adds the pooled
estimates, which take no per-key exponential: PBS's ``scoring="mean"`` (the blocks' mean logit)
and two that add each block pair's spread of logits from the blocks' second moments
(``mean_var``, :func:`moment_probabilities`, and ``moments``, ``scoring="moments"``: the mean
plus ``PBSConfig.moments_sd`` standard deviations, 0.5 by default). ``--bands
derot@0.5,var@1`` adds pooled estimates that score the rotary frequency bands apart
(:func:`band_probabilities`, ``HIGH@CUT``: the pairs turning by more than ``CUT`` pi over one block
are the high band, scored by ``HIGH``), beside ``mean``. The forced blocks (sink, the
query's own region) are kept by both rules. Each setting reports the
density of the whole selection (mean over the sparse layers) and the true attention mass it
misses on ``--queries`` query positions spread over the sequence (mean over layers and heads, and
the worst head of any layer). At equal density, the rule that misses less mass is the better
one; the model's KL follows the missed mass of its worst layers.

    python benchmarks/studies/pbs_selection_rule.py --n 4096 --texts pydoc_topics,copy_clauses \\
        --json benchmarks/results/pbs_selection_rule_4k_cpu.json
    python benchmarks/studies/pbs_selection_rule.py --n 4096 --texts pydoc_topics,copy_clauses \\
        --bands derot@0.5,energy@1,var@1,sd@1 --json benchmarks/results/pbs_selection_rule_bands_4k_cpu.json

CPU, fp32, the reference stages: about 10 minutes per text at 4K on 2 cores. Beyond SmolLM2's 8192
trained positions the model is YaRN-extended to N (as ``e2e_prefill``); ``--device cuda`` for 32K+.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Dict, List

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import e2e_prefill as e2e  # noqa: E402

MASSES = (0.8, 0.9, 0.95, 0.98, 0.99, 0.995)
RATIOS = (0.3, 0.1, 0.03, 0.01, 0.003, 0.001, 0.0003)


def ratio_blocks(probs: torch.Tensor, candidates: torch.Tensor, ratio: float) -> torch.Tensor:
    """Candidates whose mass is at least ``ratio`` times their query block's largest."""
    top = probs.masked_fill(~candidates, 0.0).amax(-1, keepdim=True)
    return candidates & (probs >= ratio * top) & (top > 0)


def exact_block_masses(q, k, perm, candidates, block_size: int, chunk: int = 256) -> torch.Tensor:
    """``[1, Hq, nB, nB]``: per query block, the mean over its rows of the true causal softmax
    mass on each permuted key block (zero outside the candidates, renormalised over them)."""
    _, hq, n, d = q.shape
    g, hp = hq // k.shape[1], perm.shape[1]
    nb = -(-n // block_size)
    out = torch.zeros(1, hq, nb, nb)
    slot_of_key = torch.empty(hq, n, dtype=torch.long)
    for h in range(hq):
        slot_of_key[h, perm[0, h * hp // hq]] = torch.arange(n)
    block_of_key = slot_of_key // block_size  # [Hq, N]: the permuted block each key sits in
    for h in range(hq):
        for r0 in range(0, n, chunk):
            rows = torch.arange(r0, min(n, r0 + chunk))
            logits = (q[0, h, rows] @ k[0, h // g].t()) / d**0.5
            p = torch.softmax(logits.masked_fill(torch.arange(n)[None] > rows[:, None], float("-inf")), -1)
            per_block = torch.zeros(rows.numel(), nb).index_add_(1, block_of_key[h], p)
            out[0, h].index_add_(0, rows // block_size, per_block)
    counts = torch.bincount(torch.arange(n) // block_size, minlength=nb).float()
    out /= counts[None, None, :, None]
    out = out * candidates
    return out / out.sum(-1, keepdim=True).clamp_min(1e-30)


def _block_moments(x: torch.Tensor, valid: torch.Tensor, block_size: int):
    """``(mean [H, nB, D], second moment [H, nB, D*D])`` of ``x [H, total, D]`` over each block's
    ``valid [total]`` rows (uncentered: ``E[x x^T]``)."""
    h, total, d = x.shape
    nb = total // block_size
    w = valid.view(1, nb, block_size, 1).float()
    xb = x.view(h, nb, block_size, d) * w
    cnt = w.sum(2).clamp_min(1.0)  # [1, nB, 1]
    first = xb.sum(2) / cnt
    second = torch.einsum("hnbd,hnbe->hnde", xb, x.view(h, nb, block_size, d)) / cnt[..., None]
    return first, second.reshape(h, nb, d * d)


def moment_probabilities(q, k, perm, candidates, block_size: int) -> torch.Tensor:
    """``[1, Hq, nB, nB]``: softmax over the candidates of ``mu + var / 2`` (the log of the mean of
    ``exp`` for Gaussian logits), ``mu = s q̄·k̄`` (PBS's ``scoring="mean"``) and the variance of
    the pairs' logits ``var = s^2 <E[q q^T], E[k k^T]> - mu^2`` (``scoring="moments"`` takes
    ``mu + 2 sqrt(var)`` from the same moments)."""
    _, hq, n, d = q.shape
    hp = perm.shape[1]
    g = hq // k.shape[1]
    hq_per_hp = hq // hp
    nb = -(-n // block_size)
    total = nb * block_size
    sc = d**-0.5
    valid = torch.arange(total) < n
    qf = torch.nn.functional.pad(q[0].float(), (0, 0, 0, total - n))
    q1, q2 = _block_moments(qf, valid, block_size)
    out = torch.zeros(1, hq, nb, nb)
    for p in range(hp):
        kv_head = (p * hq_per_hp) // g
        slots = torch.nn.functional.pad(perm[0, p], (0, total - n), value=-1)
        kp = torch.where((slots >= 0)[:, None], k[0, kv_head].float()[slots.clamp_min(0)], 0.0)
        k1, k2 = _block_moments(kp[None], slots >= 0, block_size)
        heads = slice(p * hq_per_hp, (p + 1) * hq_per_hp)
        mu = torch.matmul(q1[heads], k1[0].t()) * sc
        var = (torch.matmul(q2[heads], k2[0].t()) * sc * sc - mu * mu).clamp_min(0.0)
        logit = (mu + var / 2).masked_fill(~candidates[0, heads], float("-inf"))
        out[0, heads] = torch.nan_to_num(torch.softmax(logit, -1), nan=0.0)
    return out


def _block_pool(x: torch.Tensor, valid: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[H, nB, ...]``: the mean of ``x [H, total, ...]`` over each block's ``valid [total]`` rows."""
    nb = valid.numel() // block_size
    w = valid.view(1, nb, block_size, *([1] * (x.dim() - 2))).to(x.real.dtype)
    xb = x.reshape(x.shape[0], nb, block_size, *x.shape[2:]) * w
    return xb.sum(2) / w.sum(2).clamp_min(1.0)


def band_probabilities(q, k, perm, candidates, block_size: int, inv_freq, cutoff: float, high: str) -> torch.Tensor:
    """``[1, Hq, nB, nB]``: softmax over the candidates of a pooled logit scored per rotary band.

    In rotary (``rotate_half``) coordinates dim ``f`` and ``f + D/2`` form the complex number
    ``z_f``, and the captured post-RoPE ``z_f`` at position ``p`` is the content ``c_f`` times
    ``exp(i p theta_f)``. A pair whose phase turns by more than ``cutoff`` radians over one block
    (``block_size * theta_f > cutoff``) is *high*: across a block pair the relative phase of its
    (query, key) pairs sweeps the circle, so the block means cancel and ``q̄·k̄`` keeps little of
    it; the other pairs are *low* and pool faithfully.

    * low band: ``s Re sum_f conj(q̄_f) k̄_f`` over the low pairs (``scoring="mean"`` restricted
      to them; ``s = D^-1/2``);
    * high band, ``high=``
      - ``"derot"``: each row is rotated back by its offset from its block's mean position
        (exact on post-RoPE vectors), then pooled: the logit of the blocks' mean content at the
        blocks' mean distance, ``s Re sum_f conj(Q_f) K_f exp(i (r_J - r_I) theta_f)``;
      - ``"bessel"``: the relative phase taken as uniform over the block pair, the log of the
        mean of ``exp`` of ``s |Q_f| |K_f| cos(phi)`` is ``log I0(s |Q_f| |K_f|)`` per pair
        (``Q``, ``K``: the de-rotated means, i.e. the blocks' coherent content);
      - ``"energy"``: the same phase average of the Gaussian log-mean-exp ``var / 2`` of the
        pairs' logits, ``var = s^2 / 2 sum_f E|q_f|^2 E|k_f|^2`` (per-pair energies: distinct
        frequencies' cross terms average out), which also keeps the content's spread in a block;
      - ``"var"`` / ``"sd"``: a band-specific spread added to the whole mean logit ``s q̄·k̄``: the
        low band's exact pair variance from its second moments ``E[x x^T]`` over its dims only
        (phases coherent: content spread, as ``mean_var``) plus the high band's phase-averaged
        ``"energy"`` variance (no ``D x D`` cross terms, the low-high ones dropped), then
        ``mu + var / 2`` (``"var"``) or ``mu + 2 sd`` (``"sd"``). With no high band, ``"var"``
        is ``mean_var`` exactly.
    The band logits add (the high band's ``mean`` term is ~0 for these pairs anyway).
    """
    _, hq, n, d = q.shape
    hp, g, f2 = perm.shape[1], hq // k.shape[1], d // 2
    hq_per_hp = hq // hp
    nb = -(-n // block_size)
    total = nb * block_size
    sc = d**-0.5
    theta = inv_freq.float().to(q.device)
    hi = block_size * theta > cutoff
    lo = ~hi
    lo_dims = torch.cat([torch.nonzero(lo)[:, 0], torch.nonzero(lo)[:, 0] + f2])
    pos = torch.arange(total, dtype=torch.float32)
    unrot = torch.polar(torch.ones(total, f2), -pos[:, None] * theta)  # [total, F]: exp(-i p theta)

    def pooled(x, slots):  # x [H, N, D] post-RoPE, slots [total] positions (-1: none)
        ok = slots >= 0
        z = torch.complex(x[..., :f2], x[..., f2:])[:, slots.clamp_min(0)] * ok[None, :, None]
        content = z * unrot[slots.clamp_min(0)]
        ref = _block_pool(slots.float()[None], ok, block_size)[0]  # [nB]: the block's mean position
        c_ref = _block_pool(content, ok, block_size) * torch.polar(torch.ones(nb, f2), ref[:, None] * theta)
        xl = x[:, slots.clamp_min(0)][..., lo_dims] * ok[None, :, None]  # the low band's real dims
        second = _block_pool(xl[..., :, None] * xl[..., None, :], ok, block_size).flatten(2)
        return _block_pool(z, ok, block_size), c_ref, _block_pool(z.abs() ** 2, ok, block_size), second

    qslots = torch.where(torch.arange(total) < n, torch.arange(total), -1)
    q_mean, q_ref, q_en, q_2 = pooled(q[0].float(), qslots)
    out = torch.zeros(1, hq, nb, nb)
    for p in range(hp):
        kv_head = (p * hq_per_hp) // g
        slots = torch.nn.functional.pad(perm[0, p], (0, total - n), value=-1)
        k_mean, k_ref, k_en, k_2 = pooled(k[0, kv_head : kv_head + 1].float(), slots)
        heads = slice(p * hq_per_hp, (p + 1) * hq_per_hp)
        logit = sc * (q_mean[heads][..., lo].conj() @ k_mean[0][:, lo].t()).real
        if high == "derot":
            logit = logit + sc * (q_ref[heads][..., hi].conj() @ k_ref[0][:, hi].t()).real
        elif high == "bessel":
            a = sc * q_ref[heads][..., hi].abs()[:, :, None, :] * k_ref[0][:, hi].abs()[None, None]
            logit = logit + (torch.log(torch.special.i0e(a)) + a).sum(-1)
        elif high == "energy":
            logit = logit + sc * sc / 4 * (q_en[heads][..., hi] @ k_en[0][:, hi].t())
        elif high in ("var", "sd"):
            mu_hi = sc * (q_mean[heads][..., hi].conj() @ k_mean[0][:, hi].t()).real
            var = (sc * sc * (q_2[heads] @ k_2[0].t()) - logit * logit).clamp_min(0.0)
            var = var + sc * sc / 2 * (q_en[heads][..., hi] @ k_en[0][:, hi].t())
            logit = logit + mu_hi + (var / 2 if high == "var" else 2 * var.sqrt())
        else:
            raise ValueError(f"high must be 'derot', 'bessel', 'energy', 'var' or 'sd', got {high!r}")
        logit = logit.masked_fill(~candidates[0, heads], float("-inf"))
        out[0, heads] = torch.nan_to_num(torch.softmax(logit, -1), nan=0.0)
    return out


def query_probabilities(q, k, positions) -> torch.Tensor:
    """``[Hq, m, N]``: the true causal softmax of the query ``positions`` (computed once a layer)."""
    hq, n, d = q.shape[1], q.shape[2], q.shape[3]
    g = hq // k.shape[1]
    future = torch.arange(n)[None, :] > positions[:, None]
    out = []
    for h in range(hq):
        logits = (q[0, h, positions] @ k[0, h // g].t()) / d**0.5
        out.append(torch.softmax(logits.masked_fill(future, float("-inf")), -1))
    return torch.stack(out)


def missed_mass(true_probs, perm, mask, positions, block_size: int) -> torch.Tensor:
    """``[Hq]``: the share of the queries' true attention mass on keys the selection leaves out."""
    hq, m, n = true_probs.shape
    hp = perm.shape[1]
    slot_block = torch.arange(n) // block_size
    missed = torch.empty(hq)
    for h in range(hq):
        per_slot = mask[0, h][positions // block_size][:, slot_block]  # [m, N] over permuted slots
        per_key = torch.zeros_like(per_slot).scatter_(1, perm[0, h * hp // hq][None, :].expand(m, n), per_slot)
        missed[h] = 1.0 - float((true_probs[h] * per_key).sum()) / m
    return missed.clamp_min(0.0)


def layer_rows(
    q, k, cfg, positions, scoring: str, strides=(), moments: bool = False, bands=(), inv_freq=None
) -> List[Dict[str, object]]:
    """Every (estimate, rule, setting) of one layer: its density and missed mass per head.
    ``bands``: ``(high, cutoff / pi)`` pairs of :func:`band_probabilities` (``inv_freq``: the
    model's rotary frequencies), each beside ``mean``."""
    from sparseflow.methods.pbs.block_selection import (
        candidate_blocks,
        forced_blocks,
        selection_density,
        threshold_blocks,
    )
    from sparseflow.methods.pbs.estimate import block_probabilities
    from sparseflow.methods.pbs.permutation import config_permutation

    hq = q.shape[1]
    bs = cfg.block_size
    perm = config_permutation(q, k, cfg, None, None)
    geo = dict(key_padding_mask=None, block_size=bs, segment_size=cfg.segment_size)
    cand = candidate_blocks(perm, hq, is_causal=True, **geo)
    forced = forced_blocks(perm, hq, force_sink=cfg.force_sink, **geo)
    # the estimate at the config's stride, then at each of ``strides`` (a strided estimate's cost
    # falls with its stride: one exp per sampled row and key)
    estimates = {
        scoring if s == cfg.antidiagonal_stride else f"{scoring}/{s}": block_probabilities(
            q, k, perm, cand, block_size=bs, scoring=scoring, antidiagonal_stride=s
        )
        for s in (cfg.antidiagonal_stride, *[s for s in strides if s != cfg.antidiagonal_stride])
    }
    if moments:  # the pooled estimates, no per-key exponential: PBS's mean and the second-moment ones
        estimates["mean"] = block_probabilities(q, k, perm, cand, block_size=bs, scoring="mean")
        estimates["mean_var"] = moment_probabilities(q, k, perm, cand, bs)
        # PBSConfig's scoring="moments": the mean plus moments_sd (0.5) standard deviations (files
        # written before that field called it "mean_2sd": 2 sd then)
        estimates["moments"] = block_probabilities(q, k, perm, cand, block_size=bs, scoring="moments")
    if bands:  # the band-pooled estimates, beside the mean scoring they refine
        estimates.setdefault("mean", block_probabilities(q, k, perm, cand, block_size=bs, scoring="mean"))
    for high, cut in bands:
        estimates[f"band_{high}@{cut:g}pi"] = band_probabilities(q, k, perm, cand, bs, inv_freq, cut * math.pi, high)
    estimates["exact"] = exact_block_masses(q, k, perm, cand, bs)
    true_probs = query_probabilities(q, k, positions)
    rows = []
    for name, probs in estimates.items():
        settings = [("mass", t, threshold_blocks(probs, cand, t)) for t in MASSES]
        settings += [("ratio", a, ratio_blocks(probs, cand, a)) for a in RATIOS]
        for rule, value, keep in settings:
            mask = keep | forced
            missed = missed_mass(true_probs, perm, mask, positions, bs)
            density = float(selection_density(mask, perm, is_causal=True, block_size=bs).mean())
            rows.append({"estimate": name, "rule": rule, "value": value, "density": density, "missed": missed.tolist()})
    return rows


def summarise(per_layer: Dict[int, List[Dict[str, object]]]) -> List[Dict[str, object]]:
    """Per (estimate, rule, setting): mean density and missed mass over layers, the worst head."""
    keys = [(r["estimate"], r["rule"], r["value"]) for r in next(iter(per_layer.values()))]
    out = []
    for est, rule, value in keys:
        rows = [
            r for rs in per_layer.values() for r in rs if (r["estimate"], r["rule"], r["value"]) == (est, rule, value)
        ]
        missed = [m for r in rows for m in r["missed"]]
        out.append(
            {
                "estimate": est,
                "rule": rule,
                "value": value,
                "density": sum(r["density"] for r in rows) / len(rows),
                "mean_missed": sum(missed) / len(missed),
                "worst_missed": max(missed),
                "mean_worst_head_missed": sum(max(r["missed"]) for r in rows) / len(rows),
            }
        )
    return out


def at_density(summary, estimate: str, rule: str, density: float, key: str):
    """``key`` of (estimate, rule) linearly interpolated at ``density`` (None outside its range)."""
    pts = sorted((r["density"], r[key]) for r in summary if (r["estimate"], r["rule"]) == (estimate, rule))
    for (d0, y0), (d1, y1) in zip(pts, pts[1:]):
        if d0 <= density <= d1:
            return y0 if d1 == d0 else y0 + (y1 - y0) * (density - d0) / (d1 - d0)
    return None


def table(summary) -> str:
    lines = [
        "| estimate | rule | setting | density | missed mass (mean) | worst head per layer (mean) | "
        "other rule at this density: mean / worst-head |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in summary:
        other = "ratio" if r["rule"] == "mass" else "mass"
        m = at_density(summary, r["estimate"], other, r["density"], "mean_missed")
        w = at_density(summary, r["estimate"], other, r["density"], "mean_worst_head_missed")
        cmp = "-" if m is None else f"{m:.4f} / {w:.4f}"
        lines.append(
            f"| {r['estimate']} | {r['rule']} | {r['value']:g} | {r['density']:.3f} | {r['mean_missed']:.4f} | "
            f"{r['mean_worst_head_missed']:.4f} | {cmp} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--texts", default="pydoc_topics,copy_clauses")
    ap.add_argument(
        "--queries", type=int, default=2048, help="query positions checked: runs of 64 spread over the sequence"
    )
    ap.add_argument("--scoring", default="sampled_rows")
    ap.add_argument(
        "--strides", default="", help="comma list of more sampled-row strides to estimate with (e.g. 16,32)"
    )
    ap.add_argument("--layers", default="", help="comma list of layers (default: every PBS layer of the recipe)")
    ap.add_argument(
        "--moments",
        action="store_true",
        help="also the pooled estimates: PBS's mean scoring and the second-moment ones (mean_var, moments)",
    )
    ap.add_argument(
        "--bands",
        default="",
        help="comma list of band-pooled estimates HIGH@CUT (HIGH: derot, bessel, energy, var or sd; CUT: the "
        "high band's rotation over one block, in units of pi), e.g. energy@1,bessel@0.5; adds mean",
    )
    ap.add_argument("--device", default="cpu", help="where the model and the study's tensors live (cuda at 32K+)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)

    from sparseflow.checkpoints import load_smollm2
    from sparseflow.eval.attention_mass import capture_qkv, spread_positions
    from sparseflow.recipes import get_recipe

    torch.set_grad_enabled(False)
    torch.set_default_device(args.device)  # every tensor the study makes, beside the captured q / k
    t0 = time.perf_counter()
    model, tok = load_smollm2(dtype=torch.float32)
    model.to(args.device).eval()
    rope = "yarn" if args.n > e2e.TRAINED_POSITIONS else "plain"  # the model extended to N, as e2e_prefill
    e2e.set_rope(model, rope, args.n)
    recipe = get_recipe("smollm2")
    base = recipe.config_for("pbs")
    n_layers = model.config.num_hidden_layers
    per_layer_cfg = {i: base for i in range(n_layers) if i not in recipe.dense_layers}
    per_layer_cfg.update(recipe.layer_configs_for("pbs", base, n_layers))
    if args.layers:
        wanted = {int(x) for x in args.layers.split(",")}
        per_layer_cfg = {i: c for i, c in per_layer_cfg.items() if i in wanted}
    positions = spread_positions(args.n, max(1, args.queries // 64), start=2 * base.block_size, width=64)
    strides = [int(x) for x in args.strides.split(",") if x.strip()]
    bands = [(b.split("@")[0].strip(), float(b.split("@")[1])) for b in args.bands.split(",") if b.strip()]
    inv_freq = model.model.rotary_emb.inv_freq.float()  # the rotary frequencies of the run's rope
    out = {"env": e2e.env_info(), "args": vars(args), "texts": {}}
    for text in [t.strip() for t in args.texts.split(",") if t.strip()]:
        ids = e2e.repeated_tokens(tok, text, args.n).to(args.device)
        layers = capture_qkv(model, ids)
        per_layer = {}
        for i, cfg in sorted(per_layer_cfg.items()):
            q, k, _ = layers[i]
            per_layer[i] = layer_rows(q, k, cfg, positions, args.scoring, strides, args.moments, bands, inv_freq)
        summary = summarise(per_layer)
        out["texts"][text] = {"summary": summary, "per_layer": per_layer}
        print(f"\n{text}, N={args.n}, {len(per_layer)} PBS layers ({time.perf_counter() - t0:.0f}s)")
        print(table(summary), flush=True)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
