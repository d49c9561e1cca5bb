"""Host synchronisations and CUDA-graph capture of the sparse ops, and what a graph saves.

For each method with ``backend="triton"`` on SmolLM2's attention shape (B 1, Hq 9, Hkv 3, D 64,
bf16, causal, no padding): does one call synchronise with the host
(``torch.cuda.set_sync_debug_mode("error")``), can it be captured in a CUDA graph, and the time of
an eager call with every kernel launched (``Tuning.cuda_graphs=False``) against a graph replay. Then the same for the whole forward of a randomly
initialised SmolLM2-135M-shaped model through the converted path (transformers
``AttentionInterface``, PBS defaults).

    python benchmarks/graph_capture.py --json benchmarks/results/graph_capture_h200.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import traceback

import torch

import sparseflow

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import mean_ms_cuda_events as _ms  # noqa: E402


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:240] if str(exc).strip() else ''}"


LAUNCHED = sparseflow.Tuning(cuda_graphs=False)


def check(fn):
    """(syncs, sync error, captured, capture error, eager ms, replay ms)."""
    row = {}
    fn()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        row["host_sync"] = False
    except RuntimeError as exc:
        row["host_sync"] = True
        row["sync_where"] = (
            _first_line(exc)
            + " | "
            + " < ".join(
                f"{os.path.basename(f.filename)}:{f.lineno}" for f in traceback.extract_tb(exc.__traceback__)[-4:]
            )
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    row["eager_ms"] = _ms(fn)
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        row["captured"] = True
        row["replay_ms"] = _ms(graph.replay)
    except Exception as exc:
        row["captured"] = False
        row["capture_error"] = _first_line(exc)
        torch.cuda.synchronize()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", type=lambda s: [int(x) for x in s.split(",")], default=[8192, 32768])
    ap.add_argument("--json")
    ap.add_argument("--model", action="store_true", help="also the whole random-init SmolLM2 forward")
    args = ap.parse_args(argv)
    rows = []
    with torch.inference_mode():
        for n in args.ns:
            g = torch.Generator(device="cuda").manual_seed(n)
            q = torch.randn(1, 9, n, 64, device="cuda", dtype=torch.bfloat16, generator=g)
            k = torch.randn(1, 3, n, 64, device="cuda", dtype=torch.bfloat16, generator=g)
            v = torch.randn_like(k)
            cases = {
                "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=True, enable_gqa=True
                )
            }
            for method, cfg in (
                ("pbs", sparseflow.PBSConfig()),
                ("pbs sampled_rows", sparseflow.PBSConfig(scoring="sampled_rows", threshold=0.98)),
                ("pisa", sparseflow.PISAConfig()),
                ("bsa", sparseflow.BSAConfig()),
            ):
                # every kernel launched (no replay of sparseflow's own): what this study captures itself
                cases[method] = lambda c=cfg: sparseflow.attention(q, k, v, config=c, backend="triton", tuning=LAUNCHED)
            for name, fn in cases.items():
                row = {"n": n, "case": name}
                try:
                    row.update(check(fn))
                except Exception as exc:
                    row["error"] = _first_line(exc)
                rows.append(row)
                print(json.dumps(row), flush=True)
        if args.model:
            from e2e_prefill import converted_plan, random_smollm2

            from sparseflow import hf as sparseflow_hf

            model, _ = random_smollm2(torch.bfloat16)
            model.cuda()
            for n in args.ns:
                ids = torch.randint(0, 49152, (1, n), device="cuda")
                for setting in ("dense", "pbs"):
                    model.set_attn_implementation("sdpa")
                    if setting != "dense":
                        sparseflow_hf.apply_plan(model, converted_plan(setting, "triton", 30, cuda_graphs=False))
                    row = {"n": n, "case": f"model {setting}"}
                    try:
                        row.update(check(lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1)))
                    except Exception as exc:
                        row["error"] = _first_line(exc)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if args.json:
        import triton

        env = {
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        with open(args.json, "w") as fh:
            json.dump({"env": env, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
