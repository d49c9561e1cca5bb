"""What ``backend="auto"`` costs end to end where it keeps dense SDPA: SmolLM2 (real weights) at
short lengths, where the eager forward is host-bound, through transformers' SDPA, through the
converted-checkpoint path with ``backend="auto"`` (dense chosen), and through an attention
function that calls SDPA and nothing else (the floor any registered function can reach).
Variants take turns (rotated each round); then a cProfile of each variant's forwards lists the
functions whose own time differs most from transformers' SDPA path. Prints a table (kept as a log).

    python benchmarks/studies/auto_dense_overhead.py --ns 4096,8192 | tee benchmarks/results/auto_dense_overhead_h200.log
"""

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, ".."))

import sparseflow  # noqa: E402
import sparseflow.hf  # noqa: E402
from e2e_prefill import converted_plan, env_info, repeated_tokens, set_rope  # noqa: E402
from sparseflow.checkpoints import load_smollm2  # noqa: E402

FLOOR = "sdpa_only"


def sdpa_only(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def use(model, name):
    if name == "hf sdpa":
        model.set_attn_implementation("sdpa")
    elif name == "sdpa-only function":
        model.set_attn_implementation(FLOOR)
    else:
        method = name.split()[0]
        sparseflow.hf.apply_plan(model, converted_plan(method, "auto", model.config.num_hidden_layers))


def profile_own_times(forward, calls=20):
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        forward()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats
    own = {}
    for (path, line, fn), (_cc, _nc, tt, _ct, _callers) in stats.items():
        where = f"{os.path.basename(path)}:{line}({fn})"
        own[where] = own.get(where, 0.0) + tt * 1e6 / calls
    return own


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 8192])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--calls", type=int, default=5)
    args = ap.parse_args()
    from transformers import AttentionInterface

    AttentionInterface.register(FLOOR, sdpa_only)
    print({k: v for k, v in env_info().items()})
    model, tok = load_smollm2(dtype=torch.bfloat16)
    model = model.to("cuda").eval()
    names = ["hf sdpa", "pbs auto", "bsa auto", "sdpa-only function"]
    for n in args.ns:
        set_rope(model, "plain", n)
        ids = repeated_tokens(tok, "pydoc_topics", n).to("cuda")

        def forward():
            with torch.inference_mode():
                model(input_ids=ids, use_cache=False, logits_to_keep=1)

        for name in names:
            use(model, name)
            for _ in range(4):
                forward()
        wall = {k: [] for k in names}
        host = {k: [] for k in names}
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                use(model, name)
                forward()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                hs = []
                for _ in range(args.calls):
                    h0 = time.perf_counter()
                    forward()
                    hs.append(time.perf_counter() - h0)
                torch.cuda.synchronize()
                wall[name].append((time.perf_counter() - t0) / args.calls * 1e3)
                host[name].append(statistics.median(hs) * 1e3)
        base = wall["hf sdpa"]
        print(f"\nN={n}: ms per forward (median of {args.rounds} rounds), paired ratio hf sdpa / variant")
        for name in names:
            ratio = statistics.median(b / t for b, t in zip(base, wall[name]))
            print(
                f"  {name:20s} wall {statistics.median(wall[name]):7.2f}  host-return "
                f"{statistics.median(host[name]):7.2f}  paired {ratio:.3f}x"
            )
        own = {}
        for name in names:
            use(model, name)
            forward()
            own[name] = profile_own_times(forward)
        total = {name: sum(v.values()) for name, v in own.items()}
        print("  cProfile own time per forward (us): " + ", ".join(f"{k} {v:.0f}" for k, v in total.items()))
        for name in ("pbs auto", "sdpa-only function"):
            diff = {f: own[name].get(f, 0.0) - own["hf sdpa"].get(f, 0.0) for f in set(own[name]) | set(own["hf sdpa"])}
            top = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:12]
            print(f"  {name} minus hf sdpa, largest own-time differences (us per forward):")
            for f, d in top:
                print(f"    {d:+8.1f}  {f}")


if __name__ == "__main__":
    main()
