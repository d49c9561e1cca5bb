"""``backend="auto"`` on CUDA: pick the faster of the fast backends by measuring them on the
device the op runs on, once per shape bucket.

The first call of a (method, device, dtype, heads, head dim, config, length bucket) runs every
candidate backend on the call's own inputs (warm-up runs, which also compile flex and record a
CUDA graph, then timed runs with CUDA events) and keeps the fastest for later calls of that key;
the choice is what the op's report shows as the call's backend. ``chooser.force(<backend>)`` (or
``SPARSEFLOW_AUTO_BACKEND=<backend>`` in the environment) skips the measurement and forces one;
both are read when a key is decided, so a decided call costs no lookup of them. On the CPU
``auto`` is the reference: compiled flex costs seconds per new shape there, and Triton runs only
in its interpreter.

The choices live in a ``BackendChooser`` that a caller may own; the default one is per process,
like Triton's autotuning cache, and ``clear()`` empties it. :func:`auto_choice` is the ops' use
of the default one: the candidates of an op call, how each runs it, and the reason to log when
dense SDPA wins.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Callable, Dict, Optional, Sequence, Tuple

import torch

from . import methods as _methods
from . import op_backends as _backends
from .op_backends import DENSE_CHOICE
from .op_replay import replayed_or_launched
from .op_schema import ConfigEntry
from .op_windows import sdpa, with_window_mask

__all__ = ["BackendChooser", "default_chooser", "ENV_OVERRIDE", "auto_choice"]

ENV_OVERRIDE = "SPARSEFLOW_AUTO_BACKEND"
_log = logging.getLogger("sparseflow")


def _bucket(n: int) -> int:
    # four buckets per octave: lengths within ~19% of each other share a measurement
    return 0 if n <= 0 else int(round(4 * math.log2(n)))


class BackendChooser:
    def __init__(self, reps: int = 3, warmups: int = 4, margin: float = 1.03, forced: Optional[str] = None):
        self.reps = int(reps)
        # the backend every decision takes without measuring (None: measure); set through force(),
        # which also forgets the decisions made before it
        self._forced = _checked_forced(forced)
        # a preferred candidate (dense SDPA: exact) gives way only to one at least this many
        # times faster, so a near-tie measured on one call never trades exactness for noise;
        # 1.03 keeps auto within 3% of the fastest backend
        self.margin = float(margin)
        # four: a call replayed from CUDA graphs runs eagerly once, records its graph on static
        # inputs, then (its inputs at the same addresses) records one that reads them in place;
        # a capture inside the timed calls would stall the GPU behind the host and lose the race
        self.warmups = int(warmups)
        self.choices: Dict[Tuple, str] = {}
        self.timings: Dict[Tuple, Dict[str, float]] = {}
        # the ops' per-call memo over choose(): (config, shape bucket, device, ...) -> (backend,
        # dense reason or None), so a decided call neither rebuilds the key below nor its reason
        self.decisions: Dict[Tuple, Tuple[str, Optional[str]]] = {}
        # sparseflow.attention's memo of eager calls' plans (dense SDPA with its reason, or the
        # sparse backend), per call signature (config and tuning objects, shapes, dtypes, devices,
        # flags): a repeat skips validation and planning
        self.planned_calls: Dict[Tuple, Tuple[object, object, object]] = {}
        # bumped by clear(): callers' notes of which calls run dense (ops.attention_any_layout's
        # ``known``) hold the generation they were made in and count only in it
        self.generation = 0

    def clear(self) -> None:
        self.generation += 1
        self.choices.clear()
        self.timings.clear()
        self.decisions.clear()
        self.planned_calls.clear()

    def force(self, backend: Optional[str]) -> None:
        """Every later decision takes ``backend`` without measuring (``None``: measure again).
        The decisions made so far are forgotten (:meth:`clear`), so the next calls decide anew;
        a backend a call cannot run is refused with a ``ValueError`` when that call decides."""
        forced = _checked_forced(backend)
        self.clear()
        self._forced = forced

    def forcing(self) -> Optional[Tuple[str, str]]:
        """``(backend, where it was set)`` when decisions are forced (:meth:`force` first, then
        the environment), else None."""
        if self._forced:
            return self._forced, "BackendChooser.force"
        env = os.environ.get(ENV_OVERRIDE)
        return (env, ENV_OVERRIDE) if env else None

    def _time(self, run: Callable[[str], torch.Tensor], name: str) -> float:
        """Milliseconds per call after the warm-up calls (which compile / autotune / record a CUDA
        graph): CUDA events on the GPU, the wall clock elsewhere."""
        with torch.no_grad():
            for _ in range(max(1, self.warmups)):
                out = run(name)
            if out.is_cuda:
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(self.reps):
                    run(name)
                end.record()
                torch.cuda.synchronize()
                return start.elapsed_time(end) / self.reps
            t0 = time.perf_counter()
            for _ in range(self.reps):
                run(name)
            return (time.perf_counter() - t0) * 1e3 / self.reps

    def key(self, method: str, q: torch.Tensor, k: torch.Tensor, config_key: Tuple) -> Tuple:
        # the device index identifies the GPU within a process: no name lookup on every call
        return (
            method,
            str(q.device),
            q.dtype,
            q.shape[0],
            q.shape[1],
            k.shape[1],
            q.shape[-1],
            _bucket(q.shape[2]),
            _bucket(k.shape[2]),
            config_key,
        )

    def choose(
        self, key: Tuple, candidates: Sequence[str], run: Callable[[str], torch.Tensor], prefer: Optional[str] = None
    ) -> str:
        """The fastest of ``candidates`` on ``run`` (measured once per key), where ``prefer``
        keeps the choice unless the fastest beats it by :attr:`margin`."""
        return self.decide(key, candidates, run, prefer)[0]

    def decide(
        self, key: Tuple, candidates: Sequence[str], run: Callable[[str], torch.Tensor], prefer: Optional[str] = None
    ) -> Tuple[str, Optional[Tuple[str, str]]]:
        """:meth:`choose`'s choice with the :meth:`forcing` it obeyed (None when it measured or
        recalled), so that a caller reporting why need not read the override again."""
        forcing = self.forcing()
        if forcing is not None:
            forced, source = forcing
            if forced not in candidates:
                raise ValueError(f"{source} must be one of {list(candidates)} for {key[0]}, got {forced!r}")
            return forced, forcing
        return self._measured_choice(key, candidates, run, prefer), None

    def _measured_choice(
        self, key: Tuple, candidates: Sequence[str], run: Callable[[str], torch.Tensor], prefer: Optional[str]
    ) -> str:
        if key in self.choices:
            return self.choices[key]
        if len(candidates) == 1:
            self.choices[key] = candidates[0]
            return candidates[0]
        times: Dict[str, float] = {}
        for name in candidates:
            try:
                times[name] = self._time(run, name)
            except Exception as exc:  # a backend that cannot run this case is not a candidate
                _log.warning(
                    "sparseflow auto backend: %s failed on %s (%s: %s); not a candidate",
                    name,
                    key[0],
                    type(exc).__name__,
                    exc,
                )
        if not times:
            raise RuntimeError(f"backend='auto': no backend among {list(candidates)} could run {key[0]}")
        best = min(times, key=times.get)
        if prefer in times and times[best] * self.margin > times[prefer]:
            best = prefer
        self.choices[key] = best
        self.timings[key] = times
        _log.info(
            "sparseflow auto backend for %s: %s (measured ms: %s)",
            key[0],
            best,
            ", ".join(f"{n}={t:.3f}" for n, t in times.items()),
        )
        return best


def _checked_forced(backend: Optional[str]) -> Optional[str]:
    if backend is not None and (type(backend) is not str or not backend):
        raise TypeError(f"a forced backend must be a backend name (str) or None, got {backend!r}")
    return backend


default_chooser = BackendChooser()


# --------------------------------------------------------------------------- an op call's choice


def _auto_key(entry: ConfigEntry, q, k, mask) -> Tuple:
    # what an auto decision depends on; the chooser's own (coarser) key is built only on a miss
    return (
        entry.serial,
        q.device,
        q.dtype,
        q.shape[0],
        q.shape[1],
        k.shape[1],
        q.shape[3],
        _bucket(q.shape[2]),
        _bucket(k.shape[2]),
        mask.is_causal,
        mask.key_padding_mask is not None,
        mask.sliding_window,
        mask.chunk_size,
    )


def auto_choice(
    method: str, entry: ConfigEntry, q, k, v, attn_mask, is_causal, mask, scale
) -> Tuple[str, Optional[str]]:
    """``(backend, dense reason)`` for ``backend="auto"``: the reason is None when a sparse
    backend runs. Decided once per key of the default chooser (its ``clear()`` forgets them)."""
    chooser = default_chooser
    key = _auto_key(entry, q, k, mask)
    decision = chooser.decisions.get(key)
    if decision is None:
        decision = _decide(chooser, method, entry, q, k, v, attn_mask, is_causal, mask, scale)
        chooser.decisions[key] = decision
    return decision


def _decide(
    chooser, method: str, entry: ConfigEntry, q, k, v, attn_mask, is_causal, mask, scale
) -> Tuple[str, Optional[str]]:
    """The static choice (reference off CUDA), else the fastest measured on this call, with the
    reason to log when that is dense SDPA: the op is never slower than dense at a length it has measured."""
    chosen = _backends.resolve_backend(method, "auto", q.device, q.dtype)
    if chosen != "measure":
        return chosen, None
    kw = entry.kwargs
    window = (mask.sliding_window, mask.chunk_size)
    key = chooser.key(
        method,
        q,
        k,
        (tuple(sorted(kw.items())), mask.is_causal, mask.key_padding_mask is not None, window, entry.tuning),
    )

    def run(name: str):
        # each candidate as it would run this call: a Triton call it may replay is timed replayed
        if name == DENSE_CHOICE:
            if window != (0, 0):
                return sdpa(q, k, v, with_window_mask(attn_mask, q, k.shape[2], window), False, scale)
            return sdpa(q, k, v, attn_mask, is_causal, scale)
        return replayed_or_launched(method, name, entry, q, k, v, mask, scale)

    fast = _backends.fast_backends(method, q.device, q.dtype)
    if window != (0, 0):
        fast = [b for b in fast if _methods.spec_for(method).backend(b).windows]
    candidates = fast + [DENSE_CHOICE]
    choice, forcing = chooser.decide(key, candidates, run, prefer=DENSE_CHOICE)
    if choice != DENSE_CHOICE:
        return choice, None
    times = None if forcing else chooser.timings.get(key)
    if not times:  # decided without measuring
        how = f"forced by {forcing[1]}" if forcing else f"no sparse backend can run {method} here"
        return choice, f"backend='auto' runs dense SDPA, {how} (on {_device_name(q.device)})"
    others = ", ".join(f"{b} {t:.3f} ms" for b, t in times.items() if b != DENSE_CHOICE)
    dense_ms = times.get(DENSE_CHOICE, float("nan"))
    if any(t < dense_ms for b, t in times.items() if b != DENSE_CHOICE):
        lead = f"{method} measured less than {chooser.margin:.2f}x faster than dense here (dense is exact)"
    else:
        lead = f"measured faster than {method} here"
    return choice, (
        f"{lead}: dense SDPA {dense_ms:.3f} ms"
        f" vs {others or 'the sparse backends'} (backend='auto' on {_device_name(q.device)})"
    )


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
