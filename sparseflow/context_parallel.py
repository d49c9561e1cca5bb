"""Context (sequence) parallel prefill on ``torch.distributed``, for every registered method.

Every rank of a 1-D :class:`~torch.distributed.device_mesh.DeviceMesh` (or a process group) holds
a shard of the sequence (dim 2) of ``q``, ``k`` and ``v`` and gets the output rows of its own
queries, as with torch's ``context_parallel``. Two shardings:

* ``"contiguous"``: rank ``r`` holds the ``r``-th piece of the sequence; pieces may differ in
  length (any sequence length works; :func:`shard` splits like ``torch.tensor_split``);
* ``"zigzag"`` (torch's head-tail load balancing, for causal attention): the sequence is cut into
  ``2W`` equal chunks and rank ``r`` holds chunks ``r`` and ``2W-1-r``, so every rank gets the same
  causal work. Needs ``N % (2W) == 0``.

Strategy (the all-gather form of torch's context parallelism): K and V are all-gathered into the
whole sequence; each rank computes the selection of its own query rows only, then attends them
over the gathered K/V with the method's own functions, so every rank selects exactly what the
single-device op selects:

* ``"token_chunks"`` (PISA, BSA): a query token's selection and attention read only keys ``<= p_i`` (causal), so each
  of the rank's chunks ``[s, e)`` runs the implementation on ``(q[s:e], k[:e], v[:e])``, whose
  bottom-right alignment puts the chunk at positions ``s..e-1``. Non-causal chunks run on the
  queries ``[s, N)`` (zeros past ``e``, discarded) so their positions stay right: correct, but
  the work is not balanced.
* a method whose selection needs more names its own strategy in its registry entry
  (``MethodSpec.context_parallel``); PBS's shares the proxy and boundary query rows first
  (:mod:`sparseflow.methods.pbs.context_parallel`).

Communication per rank and call: the all-gather of K and V, ``2 (W-1)/W N Hkv D`` elements
received; for PBS also the shared query rows, ``(proxy_blocks + boundary blocks) * block_size *
Hq * D`` elements; and a small metadata all-gather that checks the ranks agree. The backward pass
all-reduces dK and dV (``2 N Hkv D`` per rank; gloo has no reduce-scatter). There is no ring
variant (K/V passed around the ranks, partial outputs merged by log-sum-exp): every method's
selection reads keys of the whole prefix, which the all-gather gives in one step.

A call is recorded in :func:`sparseflow.capture` with the global shapes and without its
selection; key padding and other masks are refused (``attn_mask`` must be None).
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from . import methods as _methods
from .methods.registry import TOKEN_CHUNKS, load_target
from . import op_backends as _backends
from . import op_plan as _planning
from . import recording as _capture
from .config import AttentionConfig
from .op_backends import DENSE_CHOICE
from .op_schema import impl_kwargs
from .op_validation import TRITON_DTYPES
from .op_windows import sdpa
from .tuning import DEFAULT_TUNING, Tuning

__all__ = ["ContextParallel", "SHARDINGS", "shard", "unshard", "attention", "gather_sequence", "Layout"]

SHARDINGS = ("contiguous", "zigzag")
SEQ_DIM = 2  # [B, H, N, D]: the sequence dimension of q, k, v and the output


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """Where and how the sequence is sharded: ``group`` a 1-D DeviceMesh or a ProcessGroup,
    ``sharding`` ``"zigzag"`` (default; causal load balance) or ``"contiguous"``."""

    group: Any
    sharding: str = "zigzag"

    def __post_init__(self):
        if self.sharding not in SHARDINGS:
            raise ValueError(f"context_parallel sharding must be one of {list(SHARDINGS)}, got {self.sharding!r}")
        if not (_is_mesh(self.group) or isinstance(self.group, dist.ProcessGroup)):
            raise TypeError(
                f"ContextParallel group must be a 1-D DeviceMesh or a ProcessGroup, got {type(self.group).__name__}"
            )


def as_context_parallel(obj: Any) -> ContextParallel:
    """A :class:`ContextParallel` from itself, a DeviceMesh or a ProcessGroup (zigzag sharding)."""
    if isinstance(obj, ContextParallel):
        return obj
    if _is_mesh(obj) or isinstance(obj, dist.ProcessGroup):
        return ContextParallel(obj)
    raise TypeError(
        "context_parallel must be a DeviceMesh, a ProcessGroup or a sparseflow.ContextParallel, "
        f"got {type(obj).__name__}"
    )


def _is_mesh(obj: Any) -> bool:
    from torch.distributed.device_mesh import DeviceMesh

    return isinstance(obj, DeviceMesh)


def process_group(group: Any) -> dist.ProcessGroup:
    """The process group of a 1-D DeviceMesh or a ProcessGroup."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("context_parallel needs torch.distributed initialised (dist.init_process_group)")
    if _is_mesh(group):
        if group.ndim != 1:
            raise ValueError(
                f"context_parallel needs a 1-D DeviceMesh, got {group.ndim} dims "
                "(pass mesh['cp'], the sequence-parallel sub-mesh)"
            )
        return group.get_group()
    return group


# --------------------------------------------------------------------------- layout


class Layout(NamedTuple):
    """Who holds which positions: ``lengths[r]`` local sequence length of rank ``r``."""

    sharding: str
    lengths: Tuple[int, ...]
    rank: int

    @property
    def world(self) -> int:
        return len(self.lengths)

    @property
    def total(self) -> int:
        return sum(self.lengths)

    def chunks(self, r: Optional[int] = None) -> List[Tuple[int, int]]:
        """Global ``[start, end)`` pieces of rank ``r`` (default: this rank), in local order."""
        r = self.rank if r is None else r
        if self.sharding == "contiguous":
            start = sum(self.lengths[:r])
            return [(start, start + self.lengths[r])]
        c = self.lengths[r] // 2
        far = 2 * self.world - 1 - r
        return [(r * c, (r + 1) * c), (far * c, (far + 1) * c)]

    def positions(self, r: Optional[int] = None, device=None) -> Tensor:
        """int64 global positions of rank ``r``'s rows, in local order."""
        parts = [torch.arange(s, e, device=device) for s, e in self.chunks(r)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)


def split_lengths(n: int, world: int, sharding: str) -> Tuple[int, ...]:
    """Local lengths of a length-``n`` sequence sharded over ``world`` ranks."""
    if sharding == "zigzag":
        if n % (2 * world):
            raise ValueError(
                f"context_parallel sharding='zigzag' needs the sequence length divisible by "
                f"2 * world size = {2 * world}, got {n}; use sharding='contiguous'"
            )
        return (n // world,) * world
    return tuple(n // world + (1 if r < n % world else 0) for r in range(world))


def shard(x: Tensor, context_parallel: Any, seq_dim: int = SEQ_DIM) -> Tensor:
    """This rank's shard of a full-sequence tensor (every rank passes the same ``x``)."""
    cp = as_context_parallel(context_parallel)
    pg = process_group(cp.group)
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    layout = Layout(cp.sharding, split_lengths(x.shape[seq_dim], world, cp.sharding), rank)
    return torch.cat([x.narrow(seq_dim, s, e - s) for s, e in layout.chunks()], dim=seq_dim)


def unshard(x: Tensor, context_parallel: Any, seq_dim: int = SEQ_DIM) -> Tensor:
    """The full sequence from every rank's shard (the inverse of :func:`shard`; a collective)."""
    cp = as_context_parallel(context_parallel)
    pg = process_group(cp.group)
    lengths = _gather_ints([x.shape[seq_dim]], x.device, pg)[:, 0].tolist()
    layout = Layout(cp.sharding, tuple(lengths), dist.get_rank(pg))
    moved = x.movedim(seq_dim, SEQ_DIM) if x.dim() > SEQ_DIM else x
    out = gather_sequence(moved, layout, pg)
    return out.movedim(SEQ_DIM, seq_dim) if x.dim() > SEQ_DIM else out


# --------------------------------------------------------------------------- collectives


def _gather_ints(values: Sequence[int], device, pg) -> Tensor:
    """``[W, len(values)]`` int64: every rank's ``values`` (on ``device``: NCCL takes CUDA tensors)."""
    mine = torch.tensor(list(values), dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(out, mine, group=pg)
    return torch.stack(out).cpu()


def _all_gather_rows(x: Tensor, layout: Layout, pg) -> Tensor:
    """The whole sequence in global order from every rank's ``x`` ``[B, H, n_r, D]``."""
    longest = max(layout.lengths)
    padded = torch.nn.functional.pad(x, (0, 0, 0, longest - x.shape[SEQ_DIM])).contiguous()
    parts = [torch.empty_like(padded) for _ in range(layout.world)]
    dist.all_gather(parts, padded, group=pg)
    pieces = []
    for r, part in enumerate(parts):
        offset = 0
        for s, e in layout.chunks(r):
            pieces.append((s, part[:, :, offset : offset + e - s]))
            offset += e - s
    pieces.sort(key=lambda p: p[0])
    return torch.cat([p for _, p in pieces], dim=SEQ_DIM)


class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence; the backward sums every rank's gradient and keeps the
    rank's own rows (an all-reduce: gloo has no reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, layout, pg):
        ctx.layout, ctx.pg = layout, pg
        return _all_gather_rows(x, layout, pg)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.pg)
        own = ctx.layout.positions(device=grad.device)
        return grad.index_select(SEQ_DIM, own), None, None


def gather_sequence(x: Tensor, layout: Layout, pg) -> Tensor:
    """``x`` ``[B, H, n_r, D]`` of every rank as the whole ``[B, H, N, D]`` sequence (differentiable)."""
    return _GatherSequence.apply(x, layout, pg)


def share_rows(q: Tensor, rows: Tensor, layout: Layout, pg) -> Tensor:
    """``[B, H, len(rows), D]``: the query rows at global positions ``rows``, whoever holds them
    (each rank fills the rows it holds, zeros elsewhere, and the ranks sum: ``x + 0`` is exact)."""
    own = layout.positions(device=q.device)
    buf = q.new_zeros(q.shape[0], q.shape[1], rows.numel(), q.shape[3])
    held = torch.isin(rows, own)
    if bool(held.any()):
        local = _local_rows(own, rows[held])
        buf[:, :, held] = q.detach().index_select(SEQ_DIM, local)
    dist.all_reduce(buf, group=pg)
    return buf


def _local_rows(own: Tensor, positions: Tensor) -> Tensor:
    """The local rows holding the global ``positions`` (all held by this rank)."""
    order = torch.argsort(own)
    return order[torch.searchsorted(own[order], positions)]


# --------------------------------------------------------------------------- validation


_META = (
    "batch",
    "query heads",
    "key/value heads",
    "query length",
    "key length",
    "value length",
    "head dim",
    "value head dim",
    "dtype",
    "is_causal",
    "sharding",
)


def exchange_layout(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, sharding: str, pg) -> Layout:
    """Every rank's shapes gathered and checked (ValueError naming what disagrees, raised on every
    rank alike so none waits in a later collective); the call's :class:`Layout`."""
    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    mine = [
        q.shape[0],
        q.shape[1],
        k.shape[1],
        q.shape[2],
        k.shape[2],
        v.shape[2],
        q.shape[3],
        v.shape[3],
        dtypes.index(q.dtype),
        int(is_causal),
        SHARDINGS.index(sharding),
    ]
    meta = _gather_ints(mine, q.device, pg)
    for i, name in enumerate(_META):
        if i in (3, 4, 5):
            continue
        if not bool((meta[:, i] == meta[0, i]).all()):
            raise ValueError(f"context_parallel: the ranks disagree on {name}: {meta[:, i].tolist()}")
    nq, nk, nv = meta[:, 3], meta[:, 4], meta[:, 5]
    if not (bool((nq == nk).all()) and bool((nk == nv).all())):
        raise ValueError(
            "context_parallel: every rank's q, k and v shards must have the same sequence length "
            f"(self-attention prefill), got q {nq.tolist()}, k {nk.tolist()}, v {nv.tolist()}"
        )
    lengths = tuple(nq.tolist())
    if sharding == "zigzag":
        _check_zigzag(lengths, is_causal)
    return Layout(sharding, lengths, dist.get_rank(pg))


def _check_zigzag(lengths: Tuple[int, ...], is_causal: bool) -> None:
    if not is_causal:
        raise ValueError(
            "context_parallel sharding='zigzag' balances causal attention only; "
            "use ContextParallel(group, sharding='contiguous') with is_causal=False"
        )
    if len(set(lengths)) != 1 or lengths[0] % 2:
        raise ValueError(
            "context_parallel sharding='zigzag' needs equal, even shard lengths on every rank "
            f"(sequence length divisible by 2 * world size), got {list(lengths)}; "
            "use sharding='contiguous'"
        )


def _cp_backend(method: str, backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """The implementation a context-parallel call runs: the reference or the Triton kernels."""
    if backend == "flex":
        raise ValueError("backend='flex' is not available with context_parallel; use 'auto', 'reference' or 'triton'")
    if backend == "auto":
        fast = device.type == "cuda" and _backends.triton_installed() and dtype in TRITON_DTYPES
        return "triton" if fast else "reference"
    if backend == "triton":
        _backends.resolve_backend(method, backend, device, dtype)
    return backend


# --------------------------------------------------------------------------- the op


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    config: AttentionConfig,
    context_parallel: Any,
    attn_mask: Optional[Tensor] = None,
    is_causal: bool = True,
    scale: Optional[float] = None,
    backend: str = "auto",
    tag: str = "",
    tuning: Tuning = DEFAULT_TUNING,
) -> Tensor:
    """Context-parallel :func:`sparseflow.attention`: ``q, k, v`` are this rank's shards
    ``[B, H, n_r, D]``; returns the output rows of this rank's queries ``[B, Hq, n_r, Dv]``."""
    cp = as_context_parallel(context_parallel)
    if getattr(config, "dense_tail_blocks", 0):
        raise ValueError(
            f"context_parallel does not run dense_tail_blocks={config.dense_tail_blocks} (the tail rows are on one "
            "rank); use dense_tail_blocks=0 with context_parallel"
        )
    if attn_mask is not None:
        raise ValueError(
            "attn_mask is not supported with context_parallel; pass is_causal=True/False "
            "(causal or full attention over the whole sequence)"
        )
    pg = process_group(cp.group)
    layout = exchange_layout(q, k, v, is_causal, cp.sharding, pg)
    method = config.method
    chosen = _cp_backend(method, backend, q.device, q.dtype)
    k_all, v_all = gather_sequence(k, layout, pg), gather_sequence(v, layout, pg)
    reason = _dense_reason(method, config, q, k_all, v_all, is_causal)
    _record(method, tag, chosen, reason, q, k_all)
    if reason is not None:
        return _dense_local(q, k_all, v_all, layout, is_causal, scale)
    kwargs = impl_kwargs(config)
    strategy = strategy_of(method)
    return strategy(method, q, k_all, v_all, layout, pg, config, kwargs, is_causal, scale, chosen, tuning)


def _token_chunks(method, q, k_all, v_all, layout, pg, config, kwargs, is_causal, scale, chosen, tuning) -> Tensor:
    """The ``"token_chunks"`` strategy: the rank's query chunks as calls of the implementation."""
    backend = _methods.spec_for(method).backend(chosen)
    impl = backend.load()
    if backend.tuned:
        kwargs = {**kwargs, "tuning": tuning}
    return _token_local(impl, q, k_all, v_all, layout, kwargs, is_causal, scale)


def _record(method: str, tag: str, backend: str, reason: Optional[str], q: Tensor, k_all: Tensor) -> None:
    """The call in the run's tally and the active capture (global shapes, no selection); a dense
    fallback logged with its reason."""
    sparse = reason is None
    if reason:
        _capture.log_fallback(method, tag, reason)
    elif sparse:
        _capture.note_call(method, tag, True)
    cap = _capture.active_capture()
    if cap is not None:
        q_shape = (q.shape[0], q.shape[1], k_all.shape[2], q.shape[3])
        cap.calls.append(
            _capture.CallRecord(
                tag, method, backend if sparse else DENSE_CHOICE, sparse, reason or "", q_shape, tuple(k_all.shape)
            )
        )


def _dense_reason(method: str, config: AttentionConfig, q, k_all, v_all, is_causal: bool) -> Optional[str]:
    """None: sparse; else why the whole sequence runs dense ("" for the dense method), decided on
    the global length exactly as the single-device op decides."""
    if not _methods.spec_for(method).sparse:
        return ""
    if v_all.shape[-1] != q.shape[-1]:
        return f"value head dim {v_all.shape[-1]} != query head dim {q.shape[-1]}"
    n = k_all.shape[2]  # the queries of all ranks together span the global length
    return _planning.dense_reason(method, config, n, n, is_causal) or None


def _dense_local(q, k_all, v_all, layout: Layout, is_causal: bool, scale) -> Tensor:
    """SDPA of the rank's query chunks over the gathered keys (causal: keys ``<= p_i``)."""
    outs, offset = [], 0
    for s, e in layout.chunks():
        qc = q[:, :, offset : offset + e - s]
        offset += e - s
        if is_causal:
            mask = torch.ones(e - s, e, dtype=torch.bool, device=q.device).tril(diagonal=s)
            outs.append(sdpa(qc, k_all[:, :, :e], v_all[:, :, :e], mask, False, scale))
        else:
            outs.append(sdpa(qc, k_all, v_all, None, False, scale))
    return torch.cat(outs, dim=SEQ_DIM).contiguous()


def _token_local(impl, q, k_all, v_all, layout: Layout, kwargs, is_causal: bool, scale) -> Tensor:
    """PISA / BSA: each chunk ``[s, e)`` as the implementation's bottom-right aligned call."""
    n = layout.total
    outs, offset = [], 0
    for s, e in layout.chunks():
        qc = q[:, :, offset : offset + e - s]
        offset += e - s
        if is_causal:
            out = impl(
                qc,
                k_all[:, :, :e],
                v_all[:, :, :e],
                key_padding_mask=None,
                is_causal=True,
                scale=scale,
                return_selection=False,
                **kwargs,
            )
        else:
            # positions s.. need Nk - Nq = s: the queries up to N, the rows past e zero and dropped
            qx = torch.cat([qc, qc.new_zeros(qc.shape[0], qc.shape[1], n - e, qc.shape[3])], dim=SEQ_DIM)
            out = impl(
                qx, k_all, v_all, key_padding_mask=None, is_causal=False, scale=scale, return_selection=False, **kwargs
            )[:, :, : e - s]
        outs.append(out)
    return torch.cat(outs, dim=SEQ_DIM).contiguous()


def strategy_of(method: str):
    """How the ranks run ``method``: the shared ``"token_chunks"`` strategy, or the method's own
    function named by its registry entry (``MethodSpec.context_parallel``)."""
    named = _methods.spec_for(method).context_parallel
    return _token_chunks if named == TOKEN_CHUNKS else load_target(named)
