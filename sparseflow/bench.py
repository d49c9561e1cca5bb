"""``sparseflow bench``: a small benchmark on whatever device is present.

Two parts, both reported side by side in one run (SPEC §8: ratios, never a lone time):

* **op timing** (any device): each method's whole op (selection + attention) at its default
  config against dense causal SDPA on the same Q/K/V, with the density it reached. On the CPU the
  shapes are small and the backends are ``reference`` (and ``flex`` when asked: compiled
  FlexAttention); on CUDA the default backend (Triton / Flex) runs.
* **benchmark scripts** (CUDA only): the repository's ``benchmarks/pbs.py`` and
  ``benchmarks/pisa.py`` at a small size, each writing its JSON into the output folder (never
  over the committed results). They live in the source tree, not in the installed package, so
  they are looked up next to the package (a source checkout) or under ``--benchmarks DIR``; a
  missing script is reported as skipped with the reason, not an error.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

__all__ = ["BenchShape", "op_timings", "find_benchmarks", "run_scripts", "SCRIPTS"]

# script -> arguments for a small CUDA run (``{json}`` is replaced by the output path)
SCRIPTS: Dict[str, List[str]] = {
    "pbs.py": ["--part", "check", "--part", "total", "--ns", "8192", "--json", "{json}"],
    "pisa.py": ["--part", "check", "--part", "select", "--select-ns", "4096,8192", "--part", "attn",
                "--attn-ns", "16384", "--json", "{json}"],
}


class BenchShape:
    """B, Hq, Hkv, N, D of one op timing (validated: Hq a multiple of Hkv, all positive)."""

    def __init__(self, n: int, hq: int = 8, hkv: int = 2, d: int = 64, b: int = 1):
        for name, value in (("n", n), ("hq", hq), ("hkv", hkv), ("d", d), ("b", b)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if hq % hkv:
            raise ValueError(f"hq must be a multiple of hkv={hkv}, got hq={hq}")
        self.n, self.hq, self.hkv, self.d, self.b = n, hq, hkv, d, b

    def to_dict(self) -> Dict[str, int]:
        return {"b": self.b, "hq": self.hq, "hkv": self.hkv, "n": self.n, "d": self.d}


def _time(fn, device, reps: int) -> float:
    import torch

    fn()  # warm-up (and compilation for flex)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def op_timings(shapes: Sequence[BenchShape], methods: Sequence[str] = ("pbs", "pisa", "bsa"),
               backends: Sequence[str] = ("auto",), *, device=None, dtype=None, reps: int = 3,
               seed: int = 0) -> List[Dict]:
    """One row per (shape, method, backend): median seconds of the op and of dense causal SDPA
    on the same inputs, their ratio, and the density reached. Inputs are random normal Q/K/V
    (density on random data is a property of the selector, not of a model)."""
    import torch
    import torch.nn.functional as F

    from .config import default_config
    from .ops import attention
    from .recording import capture

    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    rows = []
    for shape in shapes:
        g = torch.Generator(device="cpu").manual_seed(seed)
        q = torch.randn(shape.b, shape.hq, shape.n, shape.d, generator=g).to(device, dtype)
        k = torch.randn(shape.b, shape.hkv, shape.n, shape.d, generator=g).to(device, dtype)
        v = torch.randn(shape.b, shape.hkv, shape.n, shape.d, generator=g).to(device, dtype)
        gqa = shape.hq != shape.hkv
        dense_s = _time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa), device, reps)
        for method in methods:
            cfg = default_config(method)
            for backend in backends:
                row = {**shape.to_dict(), "method": method, "backend": backend, "config": cfg.to_dict(),
                       "device": device.type, "dtype": str(dtype).replace("torch.", ""), "dense_sdpa_s": dense_s}
                try:
                    with capture(keep_selections=False) as cap:
                        attention(q, k, v, config=cfg, is_causal=True, backend=backend)
                    call = cap.calls[-1]
                    s = _time(lambda: attention(q, k, v, config=cfg, is_causal=True, backend=backend), device, reps)
                except (RuntimeError, ValueError, ImportError) as exc:  # backend unavailable here
                    row.update(error=f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
                    rows.append(row)
                    continue
                row.update(op_s=s, ratio_vs_dense=s / dense_s, density=call.density, ran=call.backend,
                           sparse=call.sparse, reason=call.reason)
                rows.append(row)
    return rows


def find_benchmarks(folder: Optional[str] = None) -> Optional[Path]:
    """The ``benchmarks`` folder: ``folder`` when given (must exist), else the one next to the
    package in a source checkout, else None."""
    if folder is not None:
        path = Path(folder).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"--benchmarks {folder!r} is not a folder")
        return path
    path = Path(__file__).resolve().parents[1] / "benchmarks"
    return path if path.is_dir() else None


def run_scripts(folder: Optional[Path], out_dir: Path, *, timeout: float = 1800.0,
                scripts: Sequence[str] = tuple(SCRIPTS)) -> List[Dict]:
    """Run each benchmark script at its small CUDA size; one status row per script."""
    import torch

    rows = []
    for name in scripts:
        if name not in SCRIPTS:
            raise ValueError(f"unknown benchmark script {name!r}; expected one of {sorted(SCRIPTS)}")
        row: Dict = {"script": name}
        path = folder / name if folder is not None else None
        if not torch.cuda.is_available():
            row.update(status="skipped", reason="needs a CUDA device (the CPU runs the op timing above)")
        elif path is None or not path.is_file():
            row.update(status="skipped", reason=f"{name} not found" + (f" in {folder}" if folder else
                                                                         " (no benchmarks folder; pass --benchmarks DIR)"))
        else:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            out_json = Path(out_dir) / f"bench_{Path(name).stem}.json"
            args = [a.replace("{json}", str(out_json)) for a in SCRIPTS[name]]
            t0 = time.perf_counter()
            try:
                proc = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=timeout)
                row.update(status="ok" if proc.returncode == 0 else "failed", returncode=proc.returncode,
                           seconds=time.perf_counter() - t0, json=str(out_json) if out_json.is_file() else None,
                           output_tail=(proc.stdout + proc.stderr)[-2000:])
            except subprocess.TimeoutExpired:
                row.update(status="failed", reason=f"timed out after {timeout:.0f} s")
        rows.append(row)
    return rows


def environment() -> Dict[str, str]:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
           "threads": str(torch.get_num_threads())}
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
    return env


def format_rows(rows: Sequence[Dict]) -> str:
    head = f"{'N':>6} {'method':<6} {'backend':<9} {'ran':<9} {'density':>7} {'op ms':>9} {'SDPA ms':>9} {'op/SDPA':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['n']:>6} {r['method']:<6} {r['backend']:<9} unavailable: {r['error']}")
            continue
        lines.append(f"{r['n']:>6} {r['method']:<6} {r['backend']:<9} {r['ran']:<9} {r['density']:>7.3f} "
                     f"{1e3 * r['op_s']:>9.2f} {1e3 * r['dense_sdpa_s']:>9.2f} {r['ratio_vs_dense']:>8.2f}")
    return "\n".join(lines)


def write_json(path: str, payload: Dict) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as fh:
        json.dump(payload, fh, indent=2, default=str)
