"""The context-parallel attention op that ``sparseflow.compile(..., context_parallel=...)`` puts
in a model's graph (torch only, like the other op schemas).

Each rank runs the model on its contiguous shard of the sequence (its ``input_ids`` rows and the
matching global ``position_ids``). The model builds its attention mask from local positions only,
so the op accepts exactly two local pictures of a decoder's self-attention: no mask with
``is_causal=True``, or a mask equal to the local causal triangle; both mean causal attention over
the whole sequence. Any other mask (key padding, a sliding window, a bias) cannot be read across
ranks and is a ``ValueError``, never a silently local answer.

The op is opaque to AOT tracing (its collectives run inside), so Inductor and ``aot_eager`` compile
the rest of the graph around it. Inference only: it has no autograd formula.
"""

from __future__ import annotations

import json
from typing import Optional

import torch
import torch.distributed as dist

from .config import config_from_dict
from .tuning import Tuning

__all__ = ["cp_attention"]


def _group(name: str) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def _is_local_causal(mask: torch.Tensor) -> bool:
    """True for a bool mask whose every [Nq, Nk] slice is the causal lower triangle."""
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[-1] != mask.shape[-2]:
        return False
    n = mask.shape[-1]
    tril = torch.ones(n, n, dtype=torch.bool, device=mask.device).tril()
    return bool((mask == tril).all())


@torch.library.custom_op("sparseflow::cp_attention", mutates_args=())
def cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    is_causal: bool,
    scale: Optional[float],
    config_json: str,
    tuning_json: str,
    group_name: str,
    sharding: str,
    backend: str,
    tag: str,
) -> torch.Tensor:
    from . import context_parallel as _cp

    if attn_mask is not None:
        if not _is_local_causal(attn_mask):
            raise ValueError(
                f"context_parallel: the attention mask of {tag or 'an attention call'} is not the local causal "
                "triangle (key padding, a sliding window or a bias cannot be sharded by sequence); run the "
                "model without attention_mask padding, or without context_parallel"
            )
        is_causal = True
    config = config_from_dict(json.loads(config_json))
    tuning = Tuning(**json.loads(tuning_json))
    cp = _cp.ContextParallel(_group(group_name), sharding=sharding)
    return _cp.attention(
        q,
        k,
        v,
        config=config,
        context_parallel=cp,
        is_causal=is_causal,
        scale=scale,
        backend=backend,
        tag=tag,
        tuning=tuning,
    )


@cp_attention.register_fake
def _(q, k, v, attn_mask, is_causal, scale, config_json, tuning_json, group_name, sharding, backend, tag):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))
