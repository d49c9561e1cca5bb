"""``sparseflow bench``: a small benchmark on whatever device is present.

Two parts, both reported side by side in one run (ratios, never a lone time):

* **op timing** (any device): each method's whole op (selection + attention) at its default
  config against dense causal SDPA on the same Q/K/V, with the density it reached. On the CPU the
  shapes are small and the backends are ``reference`` (and ``flex`` when asked: compiled
  FlexAttention); on CUDA the default backend (Triton / Flex) runs.
* **CUDA parts** (CUDA only), named after the repository scripts they stand for
  (``pbs.py``, ``pisa.py``): each method's correctness properties on the GPU backends
  (:mod:`sparseflow.testing`: exact mode equals dense, the output equals masked dense over the
  op's own selection) and the whole op at the benchmark shapes, small lengths, on the structured
  inputs, each writing its JSON into the output folder. They are part of the package, so an
  installed wheel runs them. With ``--benchmarks DIR`` the repository's scripts in ``DIR`` run
  instead at a small size (a missing script is reported as skipped with the reason).
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = [
    "BenchShape",
    "op_timings",
    "find_benchmarks",
    "run_scripts",
    "run_part",
    "structured_qkv",
    "SCRIPTS",
    "parts",
]

# script -> arguments for a small CUDA run of the repository's script under ``--benchmarks DIR``
# (``{json}`` is replaced by the output path; a part's script not listed gets only ``--json``)
SCRIPTS: Dict[str, List[str]] = {
    "pbs.py": ["--part", "check", "--part", "total", "--ns", "8192", "--json", "{json}"],
    "pisa.py": [
        "--part",
        "check",
        "--part",
        "select",
        "--select-ns",
        "4096,8192",
        "--part",
        "attn",
        "--attn-ns",
        "16384",
        "--json",
        "{json}",
    ],
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


def structured_qkv(b, hq, hkv, n, d, dtype, g, topics=24, run=96, strength=2.0):
    """Synthetic long-context Q/K/V on ``g``'s device: an attention sink at token 0, a local band
    (topics change in runs of ``run`` tokens) and scattered heavy hitters (every token belongs to
    one of ``topics`` directions; queries find the keys of their topic wherever they are)."""
    import torch

    dev, f32 = g.device, torch.float32
    dirs = torch.randn(b, hkv, topics, d, device=dev, dtype=f32, generator=g)
    dirs = dirs / dirs.norm(dim=-1, keepdim=True) * math.sqrt(d)
    n_runs = -(-n // run)
    topic = torch.randint(0, topics, (b, n_runs), device=dev, generator=g).repeat_interleave(run, dim=1)[:, :n]
    # every 7th token is a heavy hitter of a random topic
    hh = torch.rand(b, n, device=dev, generator=g) < 1 / 7
    topic = torch.where(hh, torch.randint(0, topics, (b, n), device=dev, generator=g), topic)
    idx = topic[:, None, :, None].expand(b, hkv, n, d)
    tk = torch.gather(dirs, 2, idx)  # [B, Hkv, N, D]
    k = torch.randn(b, hkv, n, d, device=dev, dtype=f32, generator=g) * 0.5 + tk * 0.35
    g_ = hq // hkv
    q = (
        torch.randn(b, hq, n, d, device=dev, dtype=f32, generator=g) * 0.5
        + tk.repeat_interleave(g_, dim=1) * (strength / math.sqrt(d)) * 1.5
    )
    k[:, :, 0] = q.view(b, hkv, g_, n, d).mean(dim=(2, 3)) * 6.0  # sink
    v = torch.randn(b, hkv, n, d, device=dev, dtype=f32, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _inputs(shape: BenchShape, device, dtype, seed: int, structured: bool):
    import torch

    if structured:
        g = torch.Generator(device=device).manual_seed(seed)
        return structured_qkv(shape.b, shape.hq, shape.hkv, shape.n, shape.d, dtype, g)
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(shape.b, shape.hq, shape.n, shape.d, generator=g).to(device, dtype)
    k = torch.randn(shape.b, shape.hkv, shape.n, shape.d, generator=g).to(device, dtype)
    v = torch.randn(shape.b, shape.hkv, shape.n, shape.d, generator=g).to(device, dtype)
    return q, k, v


def op_timings(
    shapes: Sequence[BenchShape],
    methods: Optional[Sequence[str]] = None,
    backends: Sequence[str] = ("auto",),
    *,
    device=None,
    dtype=None,
    reps: int = 3,
    seed: int = 0,
    configs: Optional[Dict[str, object]] = None,
    structured: bool = False,
) -> List[Dict]:
    """One row per (shape, method, backend): median seconds of the op and of dense causal SDPA
    on the same inputs, their ratio, and the density reached. Inputs are random normal Q/K/V
    (density on random data is a property of the selector, not of a model), or with
    ``structured`` the :func:`structured_qkv` of the benchmarks. ``methods``: default every sparse
    method of the registry (:func:`sparseflow.methods.sparse_names`, read at the call, so a method
    registered later counts). ``configs`` maps a method to its config (default: the method's
    default config)."""
    import torch
    import torch.nn.functional as F

    from .config import default_config
    from .methods import sparse_names
    from .ops import attention
    from .recording import capture

    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    methods = sparse_names() if methods is None else methods
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    rows = []
    for shape in shapes:
        q, k, v = _inputs(shape, device, dtype, seed, structured)
        gqa = shape.hq != shape.hkv
        dense_s = _time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa), device, reps)
        for method in methods:
            cfg = (configs or {}).get(method) or default_config(method)
            for backend in backends:
                row = {
                    **shape.to_dict(),
                    "method": method,
                    "backend": backend,
                    "config": cfg.to_dict(),
                    "device": device.type,
                    "dtype": str(dtype).replace("torch.", ""),
                    "dense_sdpa_s": dense_s,
                }
                try:
                    with capture(keep_selections=False) as cap:
                        attention(q, k, v, config=cfg, is_causal=True, backend=backend)
                    call = cap.calls[-1]
                    s = _time(lambda: attention(q, k, v, config=cfg, is_causal=True, backend=backend), device, reps)
                except (RuntimeError, ValueError, ImportError) as exc:  # backend unavailable here
                    row.update(error=f"{type(exc).__name__}: {exc}".splitlines()[0][:300])
                    rows.append(row)
                    continue
                row.update(
                    op_s=s,
                    ratio_vs_dense=s / dense_s,
                    density=call.density,
                    ran=call.backend,
                    sparse=call.sparse,
                    reason=call.reason,
                )
                rows.append(row)
    return rows


# --------------------------------------------------------------------------- CUDA parts

# (B, Hq, Hkv, N, D, padded): the correctness shapes of every part (odd lengths, GQA, padding)
_CHECK_SHAPES = ((1, 9, 3, 1000, 64, False), (2, 6, 2, 301, 64, True))


def parts() -> Dict[str, Tuple[List, List]]:
    """The CUDA parts, from the registry (each method's :class:`sparseflow.methods.registry.BenchPart`,
    read at the call, so a method registered later counts): script -> (configs checked for
    correctness, [(method -> config, shape) timed]); the methods timed at one shape share a row
    group and its dense baseline."""
    from .methods.registry import specs

    found: Dict[str, Tuple[List, Dict]] = {}
    for spec in specs():
        if spec.bench is None:
            continue
        checks, timed = found.setdefault(spec.bench.script, ([], {}))
        checks.extend(spec.bench.checks)
        for cfg, shape in spec.bench.timings:
            timed.setdefault(shape, {})[spec.name] = cfg
    return {
        script: (checks, [(configs, BenchShape(n, hq=hq, hkv=hkv, d=d)) for (n, hq, hkv, d), configs in timed.items()])
        for script, (checks, timed) in found.items()
    }


def _check_row(cfg, shape, backend: str, device, dtype) -> Dict:
    """Exact mode equals dense, and the output equals masked dense over the op's own selection."""
    import torch

    from .testing import check_exact_mode, check_matches_own_selection

    b, hq, hkv, n, d, padded = shape
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(b, h, n, d, generator=g).to(device, dtype) for h in (hq, hkv, hkv))
    kpm = None
    if padded:
        kpm = torch.ones(b, n, dtype=torch.bool, device=device)
        kpm[-1, n - n // 3 :] = False
    row = dict(method=cfg.method, backend=backend, b=b, hq=hq, hkv=hkv, n=n, d=d, padded=padded, status="ok")
    try:
        check_exact_mode(q, k, v, cfg.method, base=cfg, key_padding_mask=kpm, backend=backend)
        check_matches_own_selection(q, k, v, cfg, key_padding_mask=kpm, backend=backend)
    except Exception as exc:  # noqa: BLE001 -- every failure is reported, the part goes on
        row["status"] = f"FAIL: {type(exc).__name__}: {str(exc).splitlines()[0][:240] if str(exc) else ''}"
    return row


def _capped(shape, max_n: Optional[int]):
    if max_n is None:
        return shape
    if isinstance(shape, BenchShape):
        return BenchShape(min(shape.n, max_n), hq=shape.hq, hkv=shape.hkv, d=shape.d, b=shape.b)
    return shape[:3] + (min(shape[3], max_n),) + shape[4:]


def run_part(
    name: str,
    out_json,
    *,
    device=None,
    dtype=None,
    backend: str = "triton",
    reps: int = 10,
    max_n: Optional[int] = None,
) -> Dict:
    """One CUDA part of ``sparseflow bench`` (a key of :func:`parts`): its correctness checks
    and op timings (structured inputs) on ``backend``, written to ``out_json``. ``max_n`` caps
    every length (a smoke run). Returns the JSON's content; ``ok`` is False when a check failed."""
    import torch

    found = parts()
    if name not in found:
        raise ValueError(f"unknown bench part {name!r}; expected one of {sorted(found)}")
    device = torch.device(device or "cuda")
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    checks, timings = found[name]
    check_rows = [
        _check_row(cfg, _capped(shape, max_n), backend, device, dtype) for cfg in checks for shape in _CHECK_SHAPES
    ]
    timing_rows = []
    for configs, shape in timings:
        timing_rows += op_timings(
            [_capped(shape, max_n)],
            list(configs),
            [backend],
            device=device,
            dtype=dtype,
            reps=reps,
            configs=configs,
            structured=True,
        )
    ok = all(r["status"] == "ok" for r in check_rows) and not any("error" in r for r in timing_rows)
    result = {
        "env": environment(),
        "part": name,
        "backend": backend,
        "ok": ok,
        "check": check_rows,
        "op_timing": timing_rows,
    }
    write_json(str(out_json), result)
    return result


def _part_text(result: Dict) -> str:
    lines = [
        f"check {r['method']:<5} {r['backend']:<9} B{r['b']} Hq{r['hq']} Hkv{r['hkv']} N{r['n']} D{r['d']} "
        f"pad={int(r['padded'])}: {r['status']}"
        for r in result["check"]
    ]
    return "\n".join(lines + [format_rows(result["op_timing"])])


def _run_in_package(name: str, out_dir: Path) -> Dict:
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    out_json = Path(out_dir) / f"bench_{Path(name).stem}.json"
    t0 = time.perf_counter()
    try:
        result = run_part(name, out_json)
    except Exception:  # noqa: BLE001 -- a part that breaks is reported failed, the others still run
        return dict(
            status="failed",
            returncode=1,
            seconds=time.perf_counter() - t0,
            json=str(out_json) if out_json.is_file() else None,
            output_tail=traceback.format_exc()[-2000:],
        )
    return dict(
        status="ok" if result["ok"] else "failed",
        returncode=0 if result["ok"] else 1,
        seconds=time.perf_counter() - t0,
        json=str(out_json),
        output_tail=_part_text(result)[-2000:],
    )


def _run_script(name: str, folder: Path, out_dir: Path, timeout: float) -> Dict:
    path = folder / name
    if not path.is_file():
        return dict(status="skipped", reason=f"{name} not found in {folder}")
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    out_json = Path(out_dir) / f"bench_{Path(name).stem}.json"
    args = [a.replace("{json}", str(out_json)) for a in SCRIPTS.get(name, ["--json", "{json}"])]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, str(path), *args], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(status="failed", reason=f"timed out after {timeout:.0f} s")
    return dict(
        status="ok" if proc.returncode == 0 else "failed",
        returncode=proc.returncode,
        seconds=time.perf_counter() - t0,
        json=str(out_json) if out_json.is_file() else None,
        output_tail=(proc.stdout + proc.stderr)[-2000:],
    )


def find_benchmarks(folder: Optional[str] = None) -> Optional[Path]:
    """The ``--benchmarks`` folder whose scripts run instead of the in-package parts: ``folder``
    when given (must exist), else None (the parts in this package run)."""
    if folder is None:
        return None
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"--benchmarks {folder!r} is not a folder")
    return path


def run_scripts(
    folder: Optional[Path], out_dir: Path, *, timeout: float = 1800.0, scripts: Optional[Sequence[str]] = None
) -> List[Dict]:
    """Each CUDA part at its small size, one status row per part: the in-package part
    (:func:`run_part`), or with ``folder`` the repository script of that name in it. ``scripts``:
    default every part of :func:`parts`."""
    import torch

    known = list(parts())
    rows = []
    for name in known if scripts is None else scripts:
        if name not in known:
            raise ValueError(f"unknown benchmark script {name!r}; expected one of {sorted(known)}")
        row: Dict = {"script": name}
        if not torch.cuda.is_available():
            row.update(status="skipped", reason="needs a CUDA device (the CPU runs the op timing above)")
        elif folder is None:
            row.update(_run_in_package(name, out_dir))
        else:
            row.update(_run_script(name, folder, out_dir, timeout))
        rows.append(row)
    return rows


def environment() -> Dict[str, str]:
    import torch

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "threads": str(torch.get_num_threads()),
    }
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
        lines.append(
            f"{r['n']:>6} {r['method']:<6} {r['backend']:<9} {r['ran']:<9} {r['density']:>7.3f} "
            f"{1e3 * r['op_s']:>9.2f} {1e3 * r['dense_sdpa_s']:>9.2f} {r['ratio_vs_dense']:>8.2f}"
        )
    return "\n".join(lines)


def write_json(path: str, payload: Dict) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as fh:
        json.dump(payload, fh, indent=2, default=str)
