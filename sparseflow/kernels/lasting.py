"""Device tensors that outlive the call that builds them (caches shared by many calls), allocated
where no CUDA graph's memory pool holds them.

Inductor's CUDA graphs (``mode="reduce-overhead"``) warm each graph up by running it eagerly with
every allocation of the running thread routed to the graph's private pool, then refuse any live
tensor in that pool which the graph does not return. A cache filled during that warm-up would be
such a tensor (measured: Gemma 3's window lists on an H100). So a lasting tensor is built by one
worker thread, whose allocations no pool takes, on a side stream that the caller's stream then
waits for."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, Optional

import torch

__all__ = ["build_lasting"]

# made on first use: the worker thread, and one side stream per CUDA device
_WORKER: Optional[ThreadPoolExecutor] = None
_SIDE_STREAMS: Dict[int, "torch.cuda.Stream"] = {}
_LOCK = threading.Lock()


def build_lasting(build: Callable[[], torch.Tensor], device: torch.device) -> torch.Tensor:
    """``build()``'s tensor (made on ``device``), allocated outside any CUDA graph pool.

    The side stream first waits for the caller's stream, so a block freed by an evicted cache entry
    and reused by the next build is no longer read by any kernel."""
    if device.type != "cuda":
        return build()
    index = device.index if device.index is not None else torch.cuda.current_device()
    current = torch.cuda.current_stream(index)
    side = _side_stream(index)
    side.wait_stream(current)

    def on_worker() -> torch.Tensor:
        with torch.cuda.device(index), torch.cuda.stream(side):
            return build()

    out = _worker().submit(on_worker).result()
    current.wait_stream(side)
    return out


def _worker() -> ThreadPoolExecutor:
    global _WORKER
    with _LOCK:
        if _WORKER is None:
            _WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparseflow-lasting")
        return _WORKER


def _side_stream(index: int) -> "torch.cuda.Stream":
    with _LOCK:
        stream = _SIDE_STREAMS.get(index)
        if stream is None:
            stream = _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
        return stream
