"""PISA's selection contract on SmolLM2's real layers, on the GPU (issue 49): the walks
``pisa_select`` runs (``Tuning.pisa_walk="auto"``) scoring in bf16 / tf32 against the fp32
reference walk, on q / k captured from the real checkpoint on real text.

For each length and layer: one dense bf16 forward of SmolLM2-135M (YaRN to N beyond its 8K)
records the layer's post-RoPE q / k (``capture_qkv``), and ``pisa_walk_precision.check_contract``
walks ``--rows`` query rows (four groups ending at 1/4 .. 4/4 of the prompt, each the last rows of
its causal prefix) with the Triton walk, then replays the fp32 reference walk on them: the share
of the reference's leaf blocks kept (the issue's bar: 99%), the tightest near-tie margin and
whether the contract held. PISA's defaults (C 64, K 8). The model's KL under the bf16 walk is
``e2e_prefill.py --tuning pisa_scores=bf16``'s.

    python benchmarks/studies/pisa_real_layers_gpu.py --ns 8192,32768 --json out.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import e2e_prefill as e2e  # noqa: E402
from common import write_result  # noqa: E402
from pisa_walk_precision import check_contract  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ns", default="8192,32768")
    ap.add_argument("--layers", default="3,9,15,21,27")
    ap.add_argument("--scores", default="bf16,tf32", help="comma list of Tuning.pisa_scores to check")
    ap.add_argument("--rows", type=int, default=256, help="query rows checked per layer")
    ap.add_argument("--mem-gib", type=float, default=8.0, help="memory budget of the reference replay")
    ap.add_argument("--text", default="pydoc_topics")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("pisa_real_layers_gpu: needs a CUDA GPU", file=sys.stderr)
        return 2
    from sparseflow import PISAConfig, Tuning
    from sparseflow.checkpoints import load_smollm2
    from sparseflow.eval.attention_mass import capture_qkv

    torch.set_grad_enabled(False)
    model, tok = load_smollm2(dtype=torch.bfloat16)
    model.to("cuda").eval()
    cfg = PISAConfig()
    layers = [int(x) for x in args.layers.split(",") if x.strip()]
    rows = []
    for n in [int(x) for x in args.ns.split(",") if x.strip()]:
        e2e.set_rope(model, "yarn" if n > e2e.TRAINED_POSITIONS else "plain", n)
        ids = e2e.repeated_tokens(tok, args.text, n).to("cuda")
        captured = capture_qkv(model, ids)
        for layer in layers:
            q, k, _ = captured[layer]
            q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)  # what the bf16 model's attention sees
            for scores in [s.strip() for s in args.scores.split(",") if s.strip()]:
                found = check_contract(q, k, cfg, Tuning(pisa_scores=scores), args.rows, args.mem_gib)
                row = dict(n=n, layer=layer, scores=scores, **found)
                rows.append(row)
                print(
                    f"N={n:6d} layer {layer:2d} {scores}: walk {','.join(found['ran'])}, leaves kept "
                    f"{100 * found['leaf_agreement']:.2f}%, min margin {found['min_margin']:.3g}, "
                    f"contract {'ok' if found['ok'] else 'BROKEN: ' + str(found['broken'])}",
                    flush=True,
                )
        del captured
        torch.cuda.empty_cache()
        if args.json:
            write_result(args.json, e2e.env_info(), args, config=cfg.to_dict(), rows=rows)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
