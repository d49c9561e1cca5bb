"""Where the compiled model's time goes against the converted path's at the same setting: one
forward of each under the PyTorch profiler, CUDA kernel time grouped by kernel name, side by side
(SmolLM2 real weights, YaRN beyond the trained 8K). Also each path's per-layer recorded calls
(method, density) so a difference in what runs shows beside a difference in how fast. Prints a
table (kept as a log).

    python benchmarks/studies/compile_vs_converted_kernels.py --n 131072 --setting smollm2:pbs \\
        | tee benchmarks/results/compile_vs_converted_kernels_128k_h200.log
"""

import argparse
import copy
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, ".."))

import sparseflow  # noqa: E402
import sparseflow.hf  # noqa: E402
from e2e_prefill import compile_kwargs, converted_plan, env_info, repeated_tokens, set_rope  # noqa: E402
from sparseflow.checkpoints import load_smollm2  # noqa: E402


def kernel_ms(forward):
    forward()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        forward()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            out[ev.key] = out.get(ev.key, 0.0) + ev.device_time_total / 1e3
    return out


def recorded(forward):
    with sparseflow.capture() as cap:
        forward()
    return [(c.tag.split(".")[2] if c.tag.count(".") >= 2 else c.tag, c.sparse, c.density) for c in cap.calls]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=131072)
    ap.add_argument("--setting", default="smollm2:pbs")
    ap.add_argument("--top", type=int, default=18)
    args = ap.parse_args()
    print(env_info())
    model, tok = load_smollm2(dtype=torch.bfloat16)
    model = model.to("cuda").eval()
    set_rope(model, "plain" if args.n <= 8192 else "yarn", args.n)
    ids = repeated_tokens(tok, "pydoc_topics", args.n).to("cuda")
    n_layers = model.config.num_hidden_layers

    def forward_of(m):
        def forward():
            with torch.inference_mode():
                m(input_ids=ids, use_cache=False, logits_to_keep=1)

        return forward

    sparseflow.hf.apply_plan(model, converted_plan(args.setting, "triton", n_layers))
    conv = forward_of(model)
    conv()
    times = {"converted": kernel_ms(conv)}
    calls = {"converted": recorded(conv)}
    model.set_attn_implementation("sdpa")
    compiled = copy.deepcopy(model)
    sparseflow.compile(compiled, **compile_kwargs(args.setting, "triton"))
    comp = forward_of(compiled)
    for _ in range(2):
        comp()
    times["compile"] = kernel_ms(comp)
    calls["compile"] = recorded(comp)
    names = sorted(
        set(times["converted"]) | set(times["compile"]), key=lambda k: -max(t.get(k, 0) for t in times.values())
    )
    print(f"\nN={args.n} {args.setting}: CUDA kernel ms in one forward")
    print(f"  {'converted':>10s} {'compile':>10s}  kernel")
    for name, t in (("TOTAL", {p: sum(v.values()) for p, v in times.items()}),):
        print(f"  {t['converted']:10.1f} {t['compile']:10.1f}  {name}")
    for k in names[: args.top]:
        print(f"  {times['converted'].get(k, 0):10.2f} {times['compile'].get(k, 0):10.2f}  {k[:110]}")
    for path, cs in calls.items():
        sparse = [d for _, s, d in cs if s and d is not None]
        print(
            f"  {path}: {len(cs)} recorded calls, {len(sparse)} sparse, mean sparse density "
            f"{sum(sparse) / max(1, len(sparse)):.3f}; dense layers {[t for t, s, _ in cs if not s]}"
        )


if __name__ == "__main__":
    main()
