"""Issue 8 on SmolLM2-135M: what makes PBS's permutation pay, and how close PISA's pyramid gets to a
flat scan -- every measurement in one script, so a GPU runs the whole study in minutes (the CPU
takes ~5 minutes per 8K point).

    python benchmarks/studies/smollm2_study.py --parts pbs --lengths 8192 --out results/   # GPU
    python benchmarks/studies/smollm2_study.py --parts pbs --lengths 1024 --variants paper,no_permute \\
        --thresholds 0.9 --texts pydoc_topics --device cpu --out /tmp/s                 # CPU smoke

Parts (each writes ``smollm2_study_<part>.json`` into ``--out`` after every point, so a run that
is cut short keeps what it measured):

* ``pbs``: PBS variants (permutation on/off, per query head vs per KV head, causal proxy, segment
  size against block size, antidiagonal scoring) x thresholds, per text and length: density, mean
  / p99 KL and top-1 agreement against the same model run dense, over the last positions.
* ``calib``: a per-layer choice of permuting or not. For each layer the attention mass kept by
  PBS with and without permutation is measured on the calibration text (the last 512 queries,
  several thresholds), each variant's missed mass is interpolated at equal density, and the
  layer permutes when that wins. The calibrated plans (the per-layer flags as ``layer_configs``)
  are then evaluated like ``pbs`` on every text -- the other text is the held-out check.
* ``calib_kl``: the per-layer choice by the model's own KL instead: from no permutation, each
  layer permuted alone on the calibration text, kept where its (density, KL) point falls below the
  no-permutation curve; the plan evaluated like ``pbs``.
* ``recipe``: the shipped recipes' PBS plans (``--recipes``; their config and per-layer overrides)
  at ``--thresholds`` on every text and length, rows like ``pbs`` with the recipe's name.
* ``recall``: PISA's Recall@K diagnostic (pyramid vs flat exact-LSE scan vs BSA, plus any
  ``--recall-selectors`` such as beams) per text at ``--recall-tokens``.

Every run uses the reference backend (fp32 torch on ``--device``), the evaluation's semantics.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))  # the repository root

from sparseflow import PBSConfig  # noqa: E402
from smollm2_study_plots import kl_at  # noqa: E402  (the log-linear equal-density interpolation)

# name -> PBSConfig changes from the paper's defaults (block 128, segment 256, last-block proxy,
# permutation per query head, mean-pooled block scoring)
VARIANTS = {
    "paper": {},
    "no_permute": {"permute": False},
    "kv_head": {"gqa_permutation": "kv_head"},
    "causal_proxy": {"causal_proxy": True},
    "segment512": {"segment_size": 512},
    "segment1024": {"segment_size": 1024},
    "block64": {"block_size": 64},
    "block64_no_permute": {"block_size": 64, "permute": False},
    "antidiag": {"scoring": "antidiagonal"},
    "no_permute_antidiag": {"permute": False, "scoring": "antidiagonal"},
    "segment512_antidiag": {"segment_size": 512, "scoring": "antidiagonal"},
    "no_permute_antidiag4": {"permute": False, "scoring": "antidiagonal", "antidiagonal_stride": 4},
    "sampled_rows": {"scoring": "sampled_rows"},
    "no_permute_sampled_rows": {"permute": False, "scoring": "sampled_rows"},
    "proxy4": {"proxy_blocks": 4},
    # diagnostics, not selectors one would ship: antidiagonal scoring with stride 1 scores a block by
    # its queries' exact softmax mass over the candidate keys -- the oracle for the threshold rule
    "oracle_no_permute": {"permute": False, "scoring": "antidiagonal", "antidiagonal_stride": 1},
    "oracle": {"scoring": "antidiagonal", "antidiagonal_stride": 1},
}
DENSE_LAYERS = (0,)  # as the smollm2 recipe: layer 0 stays dense in every row


def env_info(device: str) -> dict:
    import transformers

    info = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": torch.cuda.get_device_name() if device == "cuda" else f"{platform.machine()} cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


class Writer:
    """One JSON file per part, rewritten after every point."""

    def __init__(self, out: str, part: str, meta: dict):
        self.path = os.path.join(out, f"smollm2_study_{part}.json")
        self.data = {**meta, "part": part, "rows": []}

    def add(self, row: dict) -> None:
        self.data["rows"].append(row)
        self.flush()

    def flush(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(self.data, fh, indent=1)
        os.replace(tmp, self.path)


def eval_positions_for(n: int) -> int:
    return min(512, n // 4)


def plan_for(cfg, num_layers: int, layer_configs=None):
    from sparseflow.hf import Plan

    return Plan(
        method="pbs",
        config=cfg,
        backend="reference",
        dense_layers=DENSE_LAYERS,
        layer_configs=dict(layer_configs or {}),
        num_layers=num_layers,
    )


def result_row(res, **extra) -> dict:
    f = res.fidelity
    return {
        **extra,
        "density": res.density,
        "mean_kl": f.mean_kl,
        "p99_kl": f.p99_kl,
        "top1": f.top1_agreement,
        "seconds": res.seconds,
        "density_per_layer": res.density_per_layer,
        "config": res.config,
        "layer_configs": res.plan.get("layer_configs", {}),
    }


def eval_inputs(model, tok, args):
    """(text, tokens, ids, eval positions, dense logits) for every text and length asked for."""
    from sparseflow.checkpoints import real_tokens
    from sparseflow.eval.evaluate import dense_logits

    for text in args.texts:
        for n in args.lengths:
            ids = real_tokens(tok, n, text=text).to(args.device)
            keep = eval_positions_for(n)
            yield text, n, ids, keep, dense_logits(model, ids, keep)


def evaluate_layer_plans(model, tok, args, writer, plans, tag):
    """Evaluate per-layer plans -- ``{variant: plan_at}`` with ``plan_at(threshold) -> (config,
    {layer: config})`` -- at every text, length and threshold, writing one row each (the dense
    logits of a text and length computed once for all plans)."""
    from sparseflow.eval.evaluate import evaluate_plans

    nl = model.config.num_hidden_layers
    for text, n, ids, keep, dense in eval_inputs(model, tok, args):
        for variant, plan_at in plans.items():
            for thr in args.thresholds:
                cfg, per_layer = plan_at(thr)
                res = evaluate_plans(model, ids, [plan_for(cfg, nl, per_layer)], eval_positions=keep, dense=dense)[0]
                row = result_row(
                    res,
                    text=text,
                    tokens=n,
                    eval_positions=keep,
                    variant=variant,
                    threshold=thr,
                    permuted_layers=sorted(i for i, c in per_layer.items() if c.permute),
                )
                writer.add(row)
                print(
                    f"{tag} {text:15s} n={n:5d} {variant:24s} thr={thr:<5} density {row['density']:.3f} "
                    f"KL {row['mean_kl']:.4f} top1 {row['top1']:.3f} ({row['seconds']:.1f}s)",
                    flush=True,
                )


def permuting(plain, layers):
    """The plan ``plain`` (an unpermuted PBSConfig) with permutation in ``layers``, per threshold."""

    def plan_at(thr):
        cfg = plain.replace(threshold=thr)
        return cfg, {i: cfg.replace(permute=True) for i in layers}

    return plan_at


def run_pbs(model, tok, args, writer):
    from sparseflow.eval.evaluate import evaluate_plans

    layers = model.config.num_hidden_layers
    for text, n, ids, keep, dense in eval_inputs(model, tok, args):
        for name in args.variants:
            for thr in args.thresholds:
                cfg = PBSConfig(**{"threshold": thr, **VARIANTS[name]})
                res = evaluate_plans(model, ids, [plan_for(cfg, layers)], eval_positions=keep, dense=dense)[0]
                row = result_row(res, text=text, tokens=n, eval_positions=keep, variant=name, threshold=thr)
                writer.add(row)
                print(
                    f"pbs {text:15s} n={n:5d} {name:20s} thr={thr:<5} density {row['density']:.3f} "
                    f"KL {row['mean_kl']:.4f} top1 {row['top1']:.3f} ({row['seconds']:.1f}s)",
                    flush=True,
                )


def _missed_at(points, density):
    """Missed attention mass at ``density``, log-linear between the (density, missed) points of one
    layer and variant, clamped to the measured range."""
    pts = sorted(points)
    if density <= pts[0][0]:
        return pts[0][1]
    if density >= pts[-1][0]:
        return pts[-1][1]
    return kl_at(pts, density, floor=1e-9)


def calibrate(model, tok, args, base_variant: str, thresholds):
    """{layer: permute?} from the retained attention mass on ``args.calib_text``."""
    from sparseflow.eval.attention_mass import capture_qkv, pbs_retained_mass, spread_positions
    from sparseflow.checkpoints import real_tokens

    ids = real_tokens(tok, args.calib_tokens, text=args.calib_text).to(args.device)
    # "last": the last 512 queries (what the fidelity is scored on); "spread": 8 runs of 64 queries
    # over the whole sequence (errors at early positions reach the scored ones through later
    # layers' keys and values)
    positions = (
        None if args.calib_positions == "last" else spread_positions(args.calib_tokens, 8, start=args.calib_tokens // 8)
    )
    layers = capture_qkv(model, ids)
    base = VARIANTS[base_variant]
    choice, table = {}, []
    for i, (q, k, _) in enumerate(layers):
        if i in DENSE_LAYERS:
            continue
        curves = {}
        for perm in (True, False):
            pts = []
            for thr in thresholds:
                cfg = PBSConfig(**{**base, "threshold": thr, "permute": perm})
                r = pbs_retained_mass(q, k, cfg, last=512, positions=positions)
                pts.append((r["density"], 1.0 - r["mean_retained_mass"]))
            curves[perm] = pts
        # compare at the measured densities both variants reach, within the range the targets
        # care about (0.25-0.75); with no overlap, at the nearest edge of the two ranges
        grid = sorted({d for pts in curves.values() for d, _ in pts})
        lo = max(min(d for d, _ in curves[True]), min(d for d, _ in curves[False]))
        hi = min(max(d for d, _ in curves[True]), max(d for d, _ in curves[False]))
        grid = (
            [d for d in grid if lo <= d <= hi and 0.25 <= d <= 0.75]
            or [d for d in grid if lo <= d <= hi]
            or [min(lo, hi)]
        )
        wins = sum(_missed_at(curves[True], d) < _missed_at(curves[False], d) for d in grid)
        permute = wins * 2 > len(grid)
        choice[i] = permute
        table.append(
            {
                "layer": i,
                "permute": permute,
                "wins": wins,
                "of": len(grid),
                "curves": {str(p): pts for p, pts in curves.items()},
            }
        )
        print(
            f"calib layer {i:2d}: permute={permute} ({wins}/{len(grid)} densities) "
            f"perm {[(round(d, 3), round(m, 4)) for d, m in curves[True]]} "
            f"plain {[(round(d, 3), round(m, 4)) for d, m in curves[False]]}",
            flush=True,
        )
    del layers
    return choice, table


def run_calib(model, tok, args, writer):
    for base_variant in args.calib_variants:
        choice, table = calibrate(model, tok, args, base_variant, args.calib_thresholds)
        writer.data.setdefault("calibration", {})[base_variant] = {
            "text": args.calib_text,
            "tokens": args.calib_tokens,
            "thresholds": args.calib_thresholds,
            "positions": args.calib_positions,
            "permuted_layers": sorted(i for i, p in choice.items() if p),
            "layers": table,
        }
        writer.flush()
        suffix = "" if args.calib_positions == "last" else f"_{args.calib_positions}"
        plain = PBSConfig(**{**VARIANTS[base_variant], "permute": False})
        evaluate_layer_plans(
            model,
            tok,
            args,
            writer,
            {f"calibrated_{base_variant}{suffix}": permuting(plain, [i for i, p in choice.items() if p])},
            "calib",
        )


def run_calib_kl(model, tok, args, writer):
    """A per-layer choice by the model's own KL: starting from no permutation, each layer is
    permuted alone (threshold ``args.calib_kl_threshold``) on the calibration text, and it permutes
    in the calibrated plan when its (density, KL) point lies below the no-permutation curve
    (measured at ``args.thresholds``, interpolated log-linearly). The plan is then evaluated on
    every text and length like ``pbs``."""
    from sparseflow.checkpoints import real_tokens
    from sparseflow.eval.evaluate import dense_logits, evaluate_plans

    nl = model.config.num_hidden_layers
    ids = real_tokens(tok, args.calib_tokens, text=args.calib_text).to(args.device)
    keep = eval_positions_for(args.calib_tokens)
    dense = dense_logits(model, ids, keep)
    for base_variant in args.calib_variants:
        plain = PBSConfig(**{**VARIANTS[base_variant], "permute": False})
        curve = []
        for thr in args.thresholds:
            res = evaluate_plans(
                model, ids, [plan_for(plain.replace(threshold=thr), nl)], eval_positions=keep, dense=dense
            )[0]
            curve.append((res.density, res.fidelity.mean_kl))
        base = plain.replace(threshold=args.calib_kl_threshold)
        chosen, table = [], []
        for i in range(nl):
            if i in DENSE_LAYERS:
                continue
            res = evaluate_plans(
                model, ids, [plan_for(base, nl, {i: base.replace(permute=True)})], eval_positions=keep, dense=dense
            )[0]
            d, kl = res.density, res.fidelity.mean_kl
            ref = kl_at(curve, d)
            wins = ref is not None and kl < ref
            table.append({"layer": i, "density": d, "mean_kl": kl, "no_permute_kl_at_density": ref, "permute": wins})
            if wins:
                chosen.append(i)
            print(f"calib_kl layer {i:2d}: density {d:.4f} KL {kl:.5f} vs curve {ref} -> permute={wins}", flush=True)
        writer.data.setdefault("calibration", {})[base_variant] = {
            "text": args.calib_text,
            "tokens": args.calib_tokens,
            "threshold": args.calib_kl_threshold,
            "no_permute_curve": curve,
            "permuted_layers": chosen,
            "layers": table,
        }
        writer.flush()
        evaluate_layer_plans(
            model, tok, args, writer, {f"calibrated_kl_{base_variant}": permuting(plain, chosen)}, "calib_kl"
        )


def run_recipe(model, tok, args, writer):
    from sparseflow.recipes import get_recipe

    nl = model.config.num_hidden_layers
    suffix = "".join(f"_{k_}={v_}" for k_, v_ in sorted(args.recipe_set.items()))
    plans = {}
    for name in args.recipes:
        recipe = get_recipe(name)
        if tuple(recipe.dense_layers) != DENSE_LAYERS:
            raise SystemExit(
                f"recipe {name!r} keeps layers {recipe.dense_layers} dense; this study keeps {DENSE_LAYERS}"
            )

        def plan_at(thr, recipe=recipe):
            cfg = recipe.config_for("pbs").replace(threshold=thr, **args.recipe_set)
            return cfg, recipe.layer_configs_for("pbs", cfg, nl)

        plans[f"recipe_{name}{suffix}"] = plan_at
    evaluate_layer_plans(model, tok, args, writer, plans, "recipe")


def run_recall(model, tok, args, writer):
    from sparseflow.eval.attention_mass import recall_diagnostic
    from sparseflow.checkpoints import real_tokens

    for text in args.texts:
        ids = real_tokens(tok, args.recall_tokens, text=text).to(args.device)
        start = time.perf_counter()
        r = recall_diagnostic(
            model, ids, selectors=args.recall_selectors, block_size=64, top_k=8, branching=2, q_start=512
        )
        row = {"text": text, "tokens": args.recall_tokens, "seconds": time.perf_counter() - start, **r}
        writer.add(row)
        print(
            f"recall {text}: " + ", ".join(f"{s} {r['mean'][s]['recall']:.4f}" for s in args.recall_selectors),
            flush=True,
        )


RUNNERS = {"pbs": run_pbs, "calib": run_calib, "calib_kl": run_calib_kl, "recipe": run_recipe, "recall": run_recall}


def _recipe_set(text: str) -> dict:
    """``"field=value,..."`` -> PBSConfig changes, each value typed like the field (the parser of
    ``sparseflow eval --sweep``)."""
    from sparseflow.eval.sweep import parse_config_field

    try:
        return {
            key: parse_config_field("pbs", key, value)
            for key, _, value in (kv.partition("=") for kv in text.split(",") if kv)
        }
    except ValueError as exc:  # argparse shows an ArgumentTypeError's own message
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    floats = lambda s: [float(x) for x in s.split(",")]  # noqa: E731
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    names = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--parts", type=names, default=["pbs"], help=f"{', '.join(RUNNERS)} (comma list)")
    ap.add_argument("--texts", type=names, default=["pydoc_topics", "argparse_source"])
    ap.add_argument("--lengths", type=ints, default=[8192])
    ap.add_argument("--variants", type=names, default=list(VARIANTS))
    ap.add_argument("--thresholds", type=floats, default=[0.8, 0.9, 0.95, 0.98, 0.99])
    ap.add_argument("--calib-text", default="pydoc_topics")
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument(
        "--calib-positions",
        choices=["last", "spread"],
        default="last",
        help="queries whose retained mass calibrates the per-layer choice (default: the last 512)",
    )
    ap.add_argument("--calib-variants", type=names, default=["paper", "antidiag"])
    ap.add_argument("--calib-thresholds", type=floats, default=[0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995])
    ap.add_argument(
        "--calib-kl-threshold",
        type=float,
        default=0.95,
        help="threshold at which calib_kl permutes one layer at a time (default 0.95)",
    )
    ap.add_argument("--recipes", type=names, default=["smollm2", "smollm2-code"])
    ap.add_argument(
        "--recipe-set",
        type=_recipe_set,
        default={},
        help="recipe part: PBSConfig fields replaced in the recipes' config, e.g. scoring=sampled_rows",
    )
    ap.add_argument("--recall-tokens", type=int, default=4096)
    ap.add_argument("--recall-selectors", type=names, default=["pisa_lse", "flat_lse", "bsa"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    bad = [v for v in args.variants if v not in VARIANTS] + [v for v in args.calib_variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variants {bad}; known: {sorted(VARIANTS)}")
    bad = [p for p in args.parts if p not in RUNNERS]
    if bad:
        ap.error(f"unknown parts {bad}; known: {', '.join(RUNNERS)}")
    if args.device == "cuda":
        # exact fp32 everywhere: the selections must be the reference's, not TF32 approximations
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    os.makedirs(args.out, exist_ok=True)
    from sparseflow.checkpoints import load_smollm2, smollm2_gguf

    t0 = time.perf_counter()
    model, tok = load_smollm2()
    model = model.to(args.device)
    print(f"loaded {smollm2_gguf()} in {time.perf_counter() - t0:.1f}s", flush=True)
    meta = {
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to fp32)",
        "env": env_info(args.device),
        "backend": "reference",
        "dense_layers": list(DENSE_LAYERS),
        "variants": VARIANTS,
        "args": {k: v for k, v in vars(args).items()},
    }
    for part in args.parts:
        RUNNERS[part](model, tok, args, Writer(args.out, part, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
