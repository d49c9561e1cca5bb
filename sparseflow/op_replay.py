"""When a sparse op call replays from a CUDA graph (:mod:`sparseflow.graph_replay`), and under
which key: the op's side of the graph cache, which knows nothing of attention."""

from __future__ import annotations

import contextvars
from typing import List, Optional, Tuple

import torch

from . import graph_replay as _graph_replay
from .op_backends import call_impl
from .op_schema import ConfigEntry
from .op_windows import MaskView

__all__ = ["TOKENS_MAJOR", "REPLAY_NOTE", "needs_autograd", "replayable", "replayed_or_launched"]

TOKENS_MAJOR = (0, 2, 1, 3)  # [B, H, N, D] held in [B, N, H, D] memory: what a model transposes back to

# set while attention_any_layout runs a call the full way: replayed_impl notes the in-place
# graph that served it
REPLAY_NOTE: contextvars.ContextVar[Optional[List]] = contextvars.ContextVar("sparseflow_replay_note", default=None)


def needs_autograd(q, k, v, attn_mask) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, attn_mask))


def replayed_or_launched(
    method: str, chosen: str, entry: ConfigEntry, q, k, v, mask, scale, out_layout: Optional[Tuple[int, ...]] = None
) -> torch.Tensor:
    """The implementation's output without a selection: from the CUDA-graph cache when the call
    may replay (in ``out_layout``'s memory order, see ``GraphReplays.run``), else by launching its
    kernels."""
    if replayable(chosen, entry, q, k, v, mask.key_padding_mask):
        return replayed_impl(method, chosen, entry, q, k, v, mask, scale, out_layout)
    return call_impl(method, chosen, entry, q, k, v, mask, scale, False)


def replayable(chosen: str, entry: ConfigEntry, q, k, v, kpm) -> bool:
    """Whether this sparse call may replay from a CUDA graph: a Triton call on CUDA that the
    tuning allows, without gradient or key padding, outside any other capture (which records it
    as it is). Padded calls launch their kernels: the pipelines read the mask on the host (is
    anything padded at all?), which a graph could not redo."""
    if chosen != "triton" or not entry.tuning.cuda_graphs or not q.is_cuda or kpm is not None:
        return False
    if needs_autograd(q, k, v, None):
        return False
    if (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16:
        # the kernels specialise on 16-byte alignment, which a graph's static inputs always have
        return False
    return not torch.cuda.is_current_stream_capturing()


def replayed_impl(method: str, chosen: str, entry: ConfigEntry, q, k, v, mask, scale, out_layout) -> torch.Tensor:
    """``call_impl`` through the CUDA-graph cache (a call without key padding), keyed on
    everything the pipeline's launches depend on besides the tensors' values."""
    key = (
        entry.serial,
        chosen,
        mask.is_causal,
        mask.sliding_window,
        mask.chunk_size,
        scale,
        torch._C._cuda_getCurrentRawStream(q.device.index),  # what current_stream().cuda_stream is, 5 us cheaper
        q.device,
        (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype),
    )
    view = MaskView(None, mask.is_causal, mask.sliding_window, mask.chunk_size)

    def call(q_, k_, v_):
        return call_impl(method, chosen, entry, q_, k_, v_, view, scale, False)

    out = _graph_replay.default_replays.run(key, call, (q, k, v), out_layout)
    note = REPLAY_NOTE.get()
    # only the call that serves attention_any_layout asks for this layout (auto's timing runs do not)
    if note is not None and out_layout == TOKENS_MAJOR:
        handle = _graph_replay.default_replays.in_place_handle(key, (q, k, v))
        if handle is not None:
            note.append(handle)
    return out
