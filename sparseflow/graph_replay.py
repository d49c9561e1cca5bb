"""Eager sparse calls replayed from CUDA graphs.

A sparse op's Triton pipeline launches 15-40 kernels per call; in eager mode at 4K-16K tokens
their host cost (about 1 ms per call on the H200's host) exceeds the kernels' own time, so a
model's eager forward waits on Python. The pipelines never synchronise with the host and read no
data-dependent host value, so one call with given shapes records as a CUDA graph and replays
exactly: the second call of a signature captures, later calls copy their inputs into the
graph's static tensors, replay it and clone its output (four copies and one launch). Inputs
whose addresses recur (a model's layer, forward after forward) get a graph of their own that
reads them in place: one launch and the output's copy.

What a signature is, and when a call may replay, is the caller's business (``sparseflow.op_replay``
keys on the method's config and tuning, shapes, strides, dtypes, device, stream and flags, and
replays only calls without gradient, outside any other capture). A capture that fails leaves
its signature eager for good, logged once with the reason. The cache keeps the most recent
``limit`` graphs; see :class:`GraphReplays` for the memory they hold. ``clear()`` frees it.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Any, Callable, Dict, Hashable, NamedTuple, Optional, Sequence, Tuple, Union

import torch

__all__ = ["GraphReplays", "ReplayHandle", "default_replays"]

_log = logging.getLogger("sparseflow")

Inputs = Sequence[Optional[torch.Tensor]]


class _Recorded(NamedTuple):
    graph: "torch.cuda.CUDAGraph"
    inputs: Tuple[Optional[torch.Tensor], ...]  # the static tensors the graph reads
    output: torch.Tensor  # the static tensor the graph writes


class ReplayHandle(NamedTuple):
    """An in-place graph as :meth:`GraphReplays.in_place_handle` found it; it replays through
    :meth:`GraphReplays.replay_handle` while no graph has left the cache since."""

    key: Hashable  # the signature's key
    at: Hashable  # the in-place graph's key: the signature's and its inputs' addresses
    entry: _Recorded
    version: int


_SEEN = "seen"  # one eager call so far: it compiled and autotuned the kernels outside any capture
_EAGER = "eager"  # the capture failed: this signature always runs eagerly (addresses: always copy)


class GraphReplays:
    """Captures and replays ``fn(*inputs)`` per signature key; see the module docstring.

    Memory: graphs recorded on one stream share one memory pool and, per input layout, one set
    of static inputs. Both are safe because a stream runs its replays one after the other and
    every replay's output is cloned (on that stream) before the next replay can start: what one
    graph leaves in the pool is dead by then. So a model whose layers differ only in their
    configs holds its intermediates once, not once per layer. What each graph keeps alive is its
    output; with the static inputs these stay within ``max_bytes`` (the oldest graphs go first),
    and at most ``limit`` graphs are kept.
    """

    def __init__(self, limit: int = 64, max_bytes: int = 2 << 30, in_place: bool = True):
        for name, value in (("limit", limit), ("max_bytes", max_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.limit = limit
        self.max_bytes = max_bytes
        self.in_place = bool(in_place)
        self._entries: "OrderedDict[Hashable, Union[str, _Recorded]]" = OrderedDict()
        self._statics: Dict[Hashable, Tuple[Optional[torch.Tensor], ...]] = {}
        self._pools: Dict[Tuple[torch.device, int], Any] = {}
        self._lock = threading.RLock()
        self.captures = 0  # graphs recorded since the last clear (tests and benchmarks read it)
        self.replays = 0
        self._version = 0  # bumped whenever a graph leaves the cache: older handles stop replaying

    def clear(self) -> None:
        with self._lock:
            self._version += 1
            self._entries.clear()
            self._statics.clear()
            self._pools.clear()
            self.captures = 0
            self.replays = 0

    def __len__(self) -> int:
        return sum(isinstance(e, _Recorded) for e in self._entries.values())

    def run(
        self,
        key: Hashable,
        fn: Callable[..., torch.Tensor],
        inputs: Inputs,
        out_layout: Optional[Sequence[int]] = None,
    ) -> torch.Tensor:
        """``fn(*inputs)``: eagerly the first time ``key`` is seen, then from a graph recorded on
        the second call (a fresh tensor each time, never the graph's static output). ``key`` must
        identify the current stream (its graph replays there). ``out_layout``: the memory order of
        a replayed result's dimensions (``torch.empty_permuted``'s ``physical_layout``; None:
        contiguous), so a caller that wants another layout gets it from the one copy a replay
        makes anyway."""
        with self._lock:  # static tensors are shared by every caller of a key
            entry = self._entries.get(key)
            if entry is None:
                self._remember(key, _SEEN)
                return fn(*inputs)
            if entry is _EAGER:
                return fn(*inputs)
            self._entries.move_to_end(key)
            if entry is _SEEN:
                entry = self._record(key, fn, inputs, in_place=False)
                if entry is None:
                    return fn(*inputs)
                return self._replay(entry, out_layout)
            in_place = self._in_place_graph(key, entry, fn, inputs) if self.in_place else None
            if in_place is not None:
                return self._replay(in_place, out_layout)
            _copy_into(entry.inputs, inputs)
            return self._replay(entry, out_layout)

    def _in_place_graph(
        self, key: Hashable, copying: _Recorded, fn: Callable[..., torch.Tensor], inputs: Inputs
    ) -> Optional[_Recorded]:
        """The graph of ``key`` that reads these inputs where they are, if their addresses came
        before (recorded on their second visit), else None (``copying``, the signature's graph on
        static inputs, serves the call). A model's layer tends to get its q/k/v at the same
        addresses forward after forward (the caching allocator repeats itself), so such a graph
        saves the copies into the static inputs. Replaying it is exact whatever tensor now lives
        there: the key fixes shapes, strides and dtypes, and the graph reads the memory of the
        tensors this very call was given. In-place graphs are recorded only while they fit in
        half the byte budget and leave room under the graph limit, so a model with more layers
        than fit keeps copying instead of evicting and recording graphs call after call."""
        at = _at_addresses(key, inputs)
        entry = self._entries.get(at)
        if entry is None:
            self._remember(at, _SEEN)
            return None
        if entry is _EAGER:
            return None
        self._entries.move_to_end(at)
        if entry is not _SEEN:
            return entry
        if len(self) + 2 > self.limit or self.held_bytes() + _nbytes(copying.output) > self.max_bytes // 2:
            self._entries[at] = _EAGER
            return None
        return self._record(at, fn, inputs, in_place=True)

    def in_place_handle(self, key: Hashable, inputs: Inputs) -> Optional[ReplayHandle]:
        """The in-place graph :meth:`run` has recorded for ``key`` on these inputs' addresses, as
        a handle a caller may keep to replay it without looking it up, or None."""
        at = _at_addresses(key, inputs)
        with self._lock:
            entry = self._entries.get(at)
            return ReplayHandle(key, at, entry, self._version) if isinstance(entry, _Recorded) else None

    def replay_handle(self, handle: ReplayHandle, out_layout: Optional[Sequence[int]] = None) -> Optional[torch.Tensor]:
        """What :meth:`run` returns for the key and inputs of ``handle`` (the caller has checked
        that this call is such a call: same key, same input addresses), or None when a graph left
        the cache since the handle was made (its pool memory may be another graph's now)."""
        with self._lock:
            if handle.version != self._version:
                return None
            if handle.key in self._entries:  # both graphs stay as recent as run() keeps them
                self._entries.move_to_end(handle.key)
            self._entries.move_to_end(handle.at)
            return self._replay(handle.entry, out_layout)

    def _replay(self, entry: _Recorded, out_layout: Optional[Sequence[int]]) -> torch.Tensor:
        entry.graph.replay()
        self.replays += 1
        return _fresh_copy(entry.output, out_layout)

    def held_bytes(self) -> int:
        """Bytes of the graphs' outputs and static inputs (not their pool's intermediates)."""
        outputs = sum(_nbytes(e.output) for e in self._entries.values() if isinstance(e, _Recorded))
        return outputs + sum(_nbytes(t) for statics in self._statics.values() for t in statics if t is not None)

    def _remember(self, key: Hashable, entry: Union[str, _Recorded]) -> None:
        self._entries[key] = entry
        self._entries.move_to_end(key)
        if isinstance(entry, _Recorded):
            while len(self) > self.limit or (len(self) > 1 and self.held_bytes() > self.max_bytes):
                self._evict_oldest_graph()
        elif len(self._entries) > 8 * self.limit:  # markers of signatures seen once, eventually forgotten
            self._forget_oldest_marker()

    def _forget_oldest_marker(self) -> None:
        for key, entry in self._entries.items():
            if not isinstance(entry, _Recorded):
                del self._entries[key]
                return

    def _evict_oldest_graph(self) -> None:
        for key, entry in self._entries.items():
            if isinstance(entry, _Recorded):
                del self._entries[key]
                self._version += 1
                self._drop_unused_statics()
                return

    def _drop_unused_statics(self) -> None:
        used = {id(e.inputs) for e in self._entries.values() if isinstance(e, _Recorded)}
        for layout in [k for k, statics in self._statics.items() if id(statics) not in used]:
            del self._statics[layout]

    def _record(
        self, key: Hashable, fn: Callable[..., torch.Tensor], inputs: Inputs, in_place: bool
    ) -> Optional[_Recorded]:
        try:
            recorded = self._capture_into_pool(fn, inputs, in_place)
        except Exception as exc:  # a call that cannot be captured: this signature stays eager
            return self._give_up(key, f"{type(exc).__name__}: {exc}", in_place)
        self._remember(key, recorded)
        self.captures += 1
        return recorded

    def _capture_into_pool(self, fn: Callable[..., torch.Tensor], inputs: Inputs, in_place: bool) -> _Recorded:
        device = next(t.device for t in inputs if t is not None)
        for given in inputs:
            if given is not None and torch.empty_like(given).stride() != given.stride():
                # empty_like keeps the strides of dense, non-overlapping tensors only; the kernels
                # compiled for the eager call's strides, so a graph on other strides is not that call
                raise _NotReplayable(f"input strides {tuple(given.stride())} are not dense")
        stream = torch.cuda.current_stream(device)
        if in_place:  # the graph reads the caller's tensors; it keeps no reference to them
            statics, read = (), inputs
        else:
            statics = read = self._static_inputs(device, stream, inputs)
            _copy_into(statics, inputs)
        pool = self._pools.get((device, stream.cuda_stream))
        if pool is None:
            pool = self._pools[(device, stream.cuda_stream)] = torch.cuda.graph_pool_handle()
        graph, output = _capture(fn, read, stream, pool)
        if not isinstance(output, torch.Tensor):
            raise _NotReplayable(f"the call returned {type(output).__name__}, not a tensor")
        return _Recorded(graph, statics, output)

    def _static_inputs(self, device: torch.device, stream, inputs: Inputs) -> Tuple[Optional[torch.Tensor], ...]:
        layout = (device, stream.cuda_stream) + tuple(
            None if t is None else (t.shape, t.stride(), t.dtype) for t in inputs
        )
        statics = self._statics.get(layout)
        if statics is None:
            statics = self._statics[layout] = tuple(None if t is None else torch.empty_like(t) for t in inputs)
        return statics

    def _give_up(self, key: Hashable, reason: str, in_place: bool) -> None:
        if in_place:  # these addresses keep using the signature's graph on static inputs
            _log.info("sparseflow: no in-place CUDA graph for a sparse call, it copies its inputs: %s", reason)
        else:
            _log.warning(
                "sparseflow: a sparse call could not be replayed from a CUDA graph; it runs eagerly: %s", reason
            )
        self._entries[key] = _EAGER
        self._drop_unused_statics()
        return None


class _NotReplayable(Exception):
    pass


def _at_addresses(key: Hashable, inputs: Inputs) -> Tuple:
    """The key of ``key``'s in-place graph on these inputs: the signature and their addresses."""
    return (key, *[0 if t is None else t.data_ptr() for t in inputs])


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def _fresh_copy(output: torch.Tensor, layout: Optional[Sequence[int]]) -> torch.Tensor:
    if layout is None:
        return output.clone(memory_format=torch.contiguous_format)
    fresh = torch.empty_permuted(output.shape, tuple(layout), dtype=output.dtype, device=output.device)
    return fresh.copy_(output)


def _copy_into(statics: Tuple[Optional[torch.Tensor], ...], inputs: Inputs) -> None:
    for static, given in zip(statics, inputs):
        if given is not None:
            static.copy_(given)


def _capture(fn: Callable[..., torch.Tensor], statics, stream, pool):
    """(graph, output) of ``fn`` on ``statics``, recorded into ``pool`` on a side stream that
    waits for ``stream`` (the current one). Not ``torch.cuda.graph``: it synchronises the device
    and empties the allocator's cache before every capture, which later allocations pay again."""
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream(device=stream.device)
    side.wait_stream(stream)
    with torch.cuda.device(stream.device), torch.cuda.stream(side):
        graph.capture_begin(pool=pool)
        try:
            output = fn(*statics)
        finally:
            graph.capture_end()
    stream.wait_stream(side)
    return graph, output


default_replays = GraphReplays()
