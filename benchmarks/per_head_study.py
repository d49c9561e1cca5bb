"""Does a per-head plan pay over a per-layer one? (issue 20: "per layer, per head where that pays")

``sparseflow calibrate`` picks one choice per layer. A per-head plan could give each query head its
own choice (a threshold, or dense). This study measures what that would buy, with the calibrator's
own machinery and cost model (density), on a real checkpoint:

1. for every layer L and PBS choice c: the whole model's KL vs dense with only layer L running c
   (all heads), and the selection's density per head;
2. for every head h of L: the KL with only head h of layer L running c (the other heads dense),
   by mixing the sparse and dense outputs of that layer per head;
3. the greedy walk of ``calibrate`` over layers (cost: the layer's mean density), and over
   (layer, head) units (cost: the head's density / heads), at the same allowed single-unit KL sum;
4. each plan measured whole (every layer mixed per head as planned): KL, top-1 and density.

Per head pays where, at a measured KL no higher, its plan's density is clearly lower. The mixing
is a study device (each sparse layer also runs dense SDPA); a per-head plan in the op would give
the heads their thresholds in one launch.

    python benchmarks/per_head_study.py MODEL.gguf --tokens 8192 --device cuda --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import env_info as common_env_info  # noqa: E402

from sparseflow import calibrate as cal  # noqa: E402
from sparseflow import recording  # noqa: E402
from sparseflow.ops import attention_any_layout  # noqa: E402

STUDY_IMPL = "sparseflow_per_head_study"


class HeadMix:
    """What each layer runs in the study: ``{layer: [(config, bool[Hq] heads), ...]}``; heads no
    entry names run dense. ``densities[layer]``: the per-head density of the last call."""

    def __init__(self, backend: str):
        self.backend = backend
        self.layers: Dict[int, List[Tuple[object, torch.Tensor]]] = {}
        self.densities: Dict[int, torch.Tensor] = {}
        self.cache: Dict[Tuple[int, str], Tuple[torch.Tensor, torch.Tensor]] = {}
        self.use_cache = False  # single-layer runs: layer L's input is the dense one every time

    def forward(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kw):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        layer = module.layer_idx
        dense, _ = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=0.0, scaling=scaling, is_causal=is_causal, **kw
        )
        parts = self.layers.get(layer)
        if not parts:
            return dense, None
        if attention_mask is not None:
            raise ValueError("the study runs unpadded prompts only (attention_mask must be None)")
        out = dense
        dens = torch.ones(query.shape[1])
        for cfg, heads in parts:
            sparse, d = self._sparse(layer, cfg, query, key, value, scaling)
            out = torch.where(heads.to(out.device).view(1, 1, -1, 1), sparse, out)
            dens = torch.where(heads.cpu(), d, dens)
        self.densities[layer] = dens
        return out, None

    def _sparse(self, layer, cfg, query, key, value, scaling):
        key_ = (layer, json.dumps(cfg.to_dict(), sort_keys=True))
        if self.use_cache and key_ in self.cache:
            return self.cache[key_]
        with recording.capture(keep_selections=True) as cap:
            out = attention_any_layout(
                query,
                key,
                value,
                config=cfg,
                is_causal=True,
                scale=scaling,
                backend=self.backend,
                tag=f"model.layers.{layer}.self_attn",
            )
        per_head = cap.density_per_head()
        d = per_head.mean(0) if per_head.numel() else torch.ones(query.shape[1])
        got = (out.transpose(1, 2).contiguous(), d.float().cpu())
        if self.use_cache:
            self.cache[key_] = got
        return got


def _run(s, mix: HeadMix, start: Optional[int], input_ids=None, dense_ref=None):
    from sparseflow.eval.evaluate import last_logits

    ids = s.input_ids if input_ids is None else input_ids
    ctx = cal.start_at(s.model, start, s.hidden[start]) if start is not None else contextlib.nullcontext()
    with ctx, torch.no_grad():
        logits = last_logits(s.model, ids, s.keep)
    ref = cal.dense_reference(s) if dense_ref is None else dense_ref
    return ref.compare(logits)


def measure_units(s, mix: HeadMix, choices: Sequence, heads: int, say) -> Tuple[dict, dict]:
    """``(layer_table, head_table)``: calibrate's Measurement per (layer, choice) and per
    ((layer, head), choice), costs in the density model (a head's cost is its share)."""
    layer_table: Dict[int, dict] = {}
    head_table: Dict[Tuple[int, int], dict] = {}
    mix.use_cache = True
    for layer in range(s.n_layers):
        t0 = time.perf_counter()
        layer_table[layer] = {cal.DENSE: cal.DENSE_MEASUREMENT}
        for h in range(heads):
            head_table[(layer, h)] = {cal.DENSE: cal.Measurement(kl=0.0, top1=1.0, density=1.0, cost=1.0 / heads)}
        for c in choices:
            cfg = c.config(s.base)
            mix.layers = {layer: [(cfg, torch.ones(heads, dtype=torch.bool))]}
            kl, top1 = _run(s, mix, layer)
            d = mix.densities[layer]
            layer_table[layer][c] = cal.Measurement(kl=kl, top1=top1, density=float(d.mean()), cost=float(d.mean()))
            for h in range(heads):
                one = torch.zeros(heads, dtype=torch.bool)
                one[h] = True
                mix.layers = {layer: [(cfg, one)]}
                kl_h, top1_h = _run(s, mix, layer)
                dh = float(d[h])
                head_table[(layer, h)][c] = cal.Measurement(kl=kl_h, top1=top1_h, density=dh, cost=dh / heads)
        mix.cache.clear()
        say(
            f"layer {layer + 1}/{s.n_layers}: {len(choices)} choice(s) x (all heads + {heads} single heads) "
            f"({time.perf_counter() - t0:.1f} s)"
        )
    mix.use_cache = False
    mix.layers = {}
    return layer_table, head_table


def layer_plan_mix(s, table, allowed: float, heads: int):
    picks = cal.greedy_plan(table, allowed)
    mix, pred = {}, 0.0
    for layer, j in zip(sorted(table), picks):
        c, m = cal.frontier(table[layer])[j]
        pred += m.kl
        if not c.dense:
            mix[layer] = [(c.config(s.base), torch.ones(heads, dtype=torch.bool))]
    return mix, pred


def head_plan_mix(s, table, allowed: float, heads: int):
    picks = cal.greedy_plan(table, allowed)
    by_layer: Dict[int, Dict[object, torch.Tensor]] = {}
    pred = 0.0
    for (layer, h), j in zip(sorted(table), picks):
        c, m = cal.frontier(table[(layer, h)])[j]
        pred += m.kl
        if not c.dense:
            mask = by_layer.setdefault(layer, {}).setdefault(c, torch.zeros(heads, dtype=torch.bool))
            mask[h] = True
    mix = {layer: [(c.config(s.base), mask) for c, mask in per.items()] for layer, per in by_layer.items()}
    return mix, pred


def measure_mix(s, mix: HeadMix, layers: dict, input_ids=None, dense_ref=None) -> dict:
    mix.layers = layers
    mix.densities = {}
    kl, top1 = _run(s, mix, None, input_ids=input_ids, dense_ref=dense_ref)
    n_layers = s.n_layers
    density = sum(float(mix.densities[i].mean()) if i in mix.densities else 1.0 for i in range(n_layers)) / n_layers
    mix.layers = {}
    return {"mean_kl": kl, "top1": top1, "density": density, "sparse_layers": len(layers)}


def env_info(device: str) -> dict:
    import transformers

    return {**common_env_info("cuda" if device.startswith("cuda") else "cpu"), "transformers": transformers.__version__}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="HF folder, GGUF file or converted folder")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--eval-positions", type=int, default=512)
    ap.add_argument("--text", default="pydoc_topics")
    ap.add_argument("--heldout-text", default="argparse_source")
    ap.add_argument("--thresholds", default="0.9,0.95,0.98,0.99")
    ap.add_argument("--scorings", default="sampled_rows,mean")
    ap.add_argument("--permutes", default="true,false", help="comma list of true, false")
    ap.add_argument("--budgets", default="0.005,0.01,0.02", help="KL budgets; each plan may use --margin of one")
    ap.add_argument("--margin", type=float, default=cal.DEFAULT_MARGIN)
    ap.add_argument("--safety", type=float, default=0.8)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    say = lambda msg: print(msg, flush=True)  # noqa: E731

    from sparseflow.convert import resolve_source
    from sparseflow.eval.evaluate import dense_logits
    from sparseflow.methods.pbs.config import PBSConfig
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    device = torch.device(args.device)
    model, tok, _ = cal.load_model(resolve_source(args.model), args.model, args.dtype, device, None, None, say)
    ids, heldout = cal.calibration_tokens(model, tok, args.tokens, args.text, args.heldout_text)
    if len(ids) != 1 or (heldout is not None and len(heldout) != 1):
        ap.error("--text and --heldout-text name one text each here")
    ids, heldout = next(iter(ids.values())), None if heldout is None else next(iter(heldout.values()))
    base = PBSConfig()
    choices = cal.candidate_choices(
        "pbs",
        base,
        thresholds=[float(t) for t in args.thresholds.split(",")],
        scorings=args.scorings.split(","),
        permutes=[p.strip() == "true" for p in args.permutes.split(",")],
    )
    model.set_attn_implementation("sdpa")
    s = cal.Session(
        model=model,
        input_ids=ids,
        keep=args.eval_positions,
        method="pbs",
        base=base,
        backend=args.backend,
        dense=dense_logits(model, ids, args.eval_positions),
    )
    s.hidden = cal.layer_inputs(model, ids)
    heads = int(model.config.num_attention_heads)
    mix = HeadMix(args.backend)
    AttentionInterface.register(STUDY_IMPL, mix.forward)
    AttentionMaskInterface.register(STUDY_IMPL, sdpa_mask)  # SDPA's masks: none for an unpadded prompt
    model.set_attn_implementation(STUDY_IMPL)
    t0 = time.perf_counter()
    layer_table, head_table = measure_units(s, mix, choices, heads, say)
    say(f"measured {len(choices)} choice(s) on {s.n_layers} layers x {heads} heads in {time.perf_counter() - t0:.0f} s")
    ho_ref = cal.DenseReference(dense_logits(model, heldout, args.eval_positions)) if heldout is not None else None
    rows: List[dict] = []

    def save(rows):  # after the measurement and each plan: a run cut short keeps what it has
        if args.json:
            out = {
                "env": env_info(args.device),
                "args": vars(args),
                "rows": rows,
                "layer_table": {str(k): {c.key: m.to_dict() for c, m in v.items()} for k, v in layer_table.items()},
                "head_table": {
                    f"{k[0]}:{k[1]}": {c.key: m.to_dict() for c, m in v.items()} for k, v in head_table.items()
                },
            }
            with open(args.json, "w") as fh:
                json.dump(out, fh, indent=1)

    save(rows)
    for budget in [float(b) for b in args.budgets.split(",")]:
        allowed = budget * args.margin * args.safety
        for kind, plan_fn, table in (
            ("per layer", layer_plan_mix, layer_table),
            ("per head", head_plan_mix, head_table),
        ):
            layers, pred = plan_fn(s, table, allowed, heads)
            row = {"budget": budget, "allowed_kl_sum": allowed, "plan": kind, "predicted_kl_sum": pred}
            row["calibration"] = measure_mix(s, mix, layers)
            if ho_ref is not None:
                row["heldout"] = measure_mix(s, mix, layers, input_ids=heldout, dense_ref=ho_ref)
            rows.append(row)
            save(rows)
            say(f"budget {budget}: {kind}: {json.dumps({k: v for k, v in row.items() if k != 'budget'})}")
    model.set_attn_implementation("sdpa")
    print("\n| budget | plan | calib. KL | calib. density | held-out KL | held-out density |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        h = r.get("heldout") or {}
        print(
            f"| {r['budget']} | {r['plan']} | {r['calibration']['mean_kl']:.5f} | {r['calibration']['density']:.3f} | "
            f"{h.get('mean_kl', float('nan')):.5f} | {h.get('density', float('nan')):.3f} |"
        )
    save(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
