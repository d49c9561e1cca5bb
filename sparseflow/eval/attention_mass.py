"""How much of the true attention a selection keeps, measured on a real model's Q/K.

* :func:`capture_qkv` runs a transformers model once and keeps every layer's post-RoPE Q, K, V
  (through a registered attention function, so nothing of the model is patched).
* :func:`topk_recall` is the PISA diagnostic: for each query ``t >= q_start`` and KV group, the
  reference set is the K blocks of C keys with the most *group-averaged full-attention mass*
  (the forced sink / previous / current blocks plus the best K-3 others); a selector's
  Recall@K is the fraction of that set it picked, its retained mass the attention mass of the
  blocks it picked. Selectors: PISA (any score), BSA, and ``flat_lse`` — an exact scan scoring
  every visible block by the summed per-head LSE over its raw keys (what PISA's pyramid
  approximates, at O(N) cost per query). A PISA selector may carry a beam suffix,
  ``pisa_<score>_beam<B>`` (e.g. ``pisa_lse_beam4``): the walk with ``PISAConfig.beam = B``
  (:func:`parse_selector`).
* :func:`pbs_retained_mass` is the PBS counterpart: the attention mass of the last queries that
  falls on the key blocks PBS selects (through its permutation), per head, with the density.

Everything is exact fp32 torch on whatever device the tensors are on; the quadratic work is done
in query chunks so 8K tokens fit in a few hundred MB.
"""

from __future__ import annotations

import math
import re
from types import SimpleNamespace
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..methods import spec_for

__all__ = [
    "capture_qkv",
    "topk_recall",
    "pbs_retained_mass",
    "spread_positions",
    "recall_diagnostic",
    "parse_selector",
    "check_selectors",
    "TOPK_SELECTORS",
]

TOPK_SELECTORS = ("pisa_lse", "pisa_mean", "pisa_mean_var", "bsa", "flat_lse")
_PISA_SELECTOR = re.compile(r"pisa_(lse|mean_var|mean)(?:_beam([1-9][0-9]*))?")
_CAPTURE_NAME = "sparseflow_capture_qkv"


# --------------------------------------------------------------------------- capture


def capture_qkv(model, input_ids: torch.Tensor) -> List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Run ``model`` (a transformers causal LM using the AttentionInterface) dense on
    ``input_ids`` ([1, N]) and return ``[(q, k, v)]`` per layer: q ``[1, Hq, N, D]``, k/v
    ``[1, Hkv, N, D]`` fp32, post-RoPE, exactly what attention saw. The model's attention
    implementation is restored afterwards."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, N], got {tuple(input_ids.shape)}")
    store: Dict[int, Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def record(module, query, key, value, attention_mask, **kwargs):
        idx = getattr(module, "layer_idx", None)
        if not isinstance(idx, int):
            raise ValueError(f"capture_qkv needs attention modules with an int layer_idx, got {type(module).__name__}")
        store[idx] = (query.detach().float().clone(), key.detach().float().clone(), value.detach().float().clone())
        groups = query.shape[1] // key.shape[1]
        if attention_mask is None and groups > 1:
            # transformers passes enable_gqa here, which sends fp32 on CUDA to SDPA's math kernel
            # (N x N scores: out of memory at 32K); repeated heads reach the memory-efficient one
            key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
            module = SimpleNamespace(num_key_value_groups=1, is_causal=getattr(module, "is_causal", True))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(_CAPTURE_NAME, record)
    AttentionMaskInterface.register(_CAPTURE_NAME, sdpa_mask)
    previous = getattr(model.config, "_attn_implementation", "sdpa") or "sdpa"
    model.set_attn_implementation(_CAPTURE_NAME)
    try:
        with torch.no_grad():
            model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
    finally:
        model.set_attn_implementation(previous)
    n_layers = int(getattr(model.config, "num_hidden_layers", len(store)))
    missing = [i for i in range(n_layers) if i not in store]
    if missing:
        raise ValueError(f"capture_qkv saw no attention call for layers {missing}")
    return [store[i] for i in range(n_layers)]


# --------------------------------------------------------------------------- PISA / BSA Recall@K


def _check_qk(q: torch.Tensor, k: torch.Tensor) -> Tuple[int, int, int, int]:
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != 1 or k.shape[0] != 1:
        raise ValueError(f"q and k must be [1, H, N, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    _, hq, n, d = q.shape
    hkv = k.shape[1]
    if hq % hkv or k.shape[2] != n or k.shape[3] != d:
        raise ValueError(
            f"q [1, Hq, N, D] and k [1, Hkv, N, D] with Hq a multiple of Hkv, got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    return hq, hkv, n, d


def parse_selector(name) -> Tuple[str, Optional[str], int]:
    """``(kind, score, beam)`` of a Recall@K selector name: ``("pisa", score, beam)`` for
    ``pisa_<score>`` / ``pisa_<score>_beam<B>`` (score ``lse``, ``mean`` or ``mean_var``, B >= 1;
    no suffix = beam 1), ``("bsa", None, 1)``, ``("flat_lse", None, 1)``. Anything else raises a
    ValueError listing the accepted names."""
    if isinstance(name, str):
        if name in ("bsa", "flat_lse"):
            return name, None, 1
        m = _PISA_SELECTOR.fullmatch(name)
        if m is not None:
            return "pisa", m.group(1), int(m.group(2) or 1)
    raise ValueError(
        f"selector must be one of {list(TOPK_SELECTORS)} or pisa_<score>_beam<B> (score lse, mean or "
        f"mean_var; B an int >= 1, e.g. pisa_lse_beam4), got {name!r}"
    )


def check_selectors(selectors: Sequence[str]) -> List[str]:
    """``selectors`` as a list after checking every name (:func:`parse_selector`) and that they
    are distinct and non-empty; a ValueError otherwise."""
    if isinstance(selectors, str) or not selectors:
        raise ValueError(f"selectors must be a non-empty list of selector names, got {selectors!r}")
    for s in selectors:
        parse_selector(s)
    dup = sorted({s for s in selectors if list(selectors).count(s) > 1})
    if dup:
        raise ValueError(f"selectors must be distinct, got {dup} more than once")
    return list(selectors)


def _selector_indices(name: str, q, k, block_size: int, top_k: int, branching: int) -> Optional[torch.Tensor]:
    """``[Hkv, N, K]`` block ids of a library selector (its method's reference selection, through
    the registry), or None for ``flat_lse`` (done inline)."""
    kind, score, beam = parse_selector(name)
    if kind == "flat_lse":
        return None
    fields = dict(block_size=block_size, top_k=top_k)
    if score is not None:  # a pyramid walk's options
        fields.update(branching=branching, score=score, beam=beam)
    spec = spec_for(kind)
    return spec.select(q, k, spec.config_type(**fields), is_causal=True).block_indices[0]


def topk_recall(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    selectors: Sequence[str] = TOPK_SELECTORS,
    block_size: int = 64,
    top_k: int = 8,
    branching: int = 2,
    q_start: int = 512,
    chunk: int = 256,
) -> Dict[str, Dict[str, float]]:
    """Recall@K and retained attention mass of each selector against the mass-oracle reference,
    averaged over queries ``t >= q_start`` and KV groups (see the module docstring). Returns
    ``{selector: {"recall", "recall_free", "retained_mass"}, "oracle": {"retained_mass"}}``;
    ``recall_free`` counts only the K-3 blocks that are not forced."""
    hq, hkv, n, d = _check_qk(q, k)
    selectors = check_selectors(selectors)
    _check_recall_window(n, block_size, top_k, q_start)
    g = hq // hkv
    nb = -(-n // block_size)
    scale = 1.0 / math.sqrt(d)
    picked = {s: _selector_indices(s, q, k, block_size, top_k, branching) for s in selectors}
    sums = {s: {"recall": 0.0, "recall_free": 0.0, "retained_mass": 0.0} for s in selectors}
    oracle_mass = 0.0
    count = 0
    kf = k[0].float()  # [Hkv, N, D]
    for t0 in range(q_start, n, chunk):
        t = torch.arange(t0, min(n, t0 + chunk), device=q.device)
        m = t.numel()
        qc = q[0, :, t0 : t0 + m].float().view(hkv, g, m, d)
        logits = torch.einsum("hgmd,hnd->hgmn", qc, kf) * scale  # [Hkv, g, m, N]
        future = torch.arange(n, device=q.device)[None, :] > t[:, None]  # [m, N]
        logits = logits.masked_fill(future, float("-inf"))
        blocks = _ChunkBlocks.of(logits, t, block_size, top_k)
        oracle_mass += float((blocks.mass * blocks.ref).sum(-1).sum())
        for s in selectors:
            if picked[s] is None:
                sel = blocks.flat_lse_selection(logits)
            else:
                sel = _index_mask(picked[s][:, t0 : t0 + m], nb)
            for key, value in blocks.scores(sel).items():
                sums[s][key] += value
        count += hkv * m
    out = {s: {key: v / count for key, v in vals.items()} for s, vals in sums.items()}
    out["oracle"] = {"retained_mass": oracle_mass / count}
    return out


def _check_recall_window(n: int, block_size: int, top_k: int, q_start: int) -> None:
    if top_k < 4:
        raise ValueError(f"top_k must be >= 4 (3 forced blocks + at least one chosen), got {top_k}")
    if not (0 <= q_start < n):
        raise ValueError(f"q_start must be in [0, {n - 1}], got {q_start}")
    if q_start < block_size * top_k:
        raise ValueError(
            f"q_start must be >= block_size*top_k={block_size * top_k} so every query has more "
            f"visible blocks than K (else recall is trivially 1), got {q_start}"
        )


class _ChunkBlocks(NamedTuple):
    """One chunk of queries' block view: the group-averaged attention mass per block, the
    forced / free blocks and the mass oracle's selection (forced plus the K-3 heaviest free)."""

    mass: torch.Tensor  # [Hkv, m, nB]
    forced: torch.Tensor  # [1, m, nB]
    free: torch.Tensor  # [1, m, nB]
    ref: torch.Tensor  # [Hkv, m, nB]
    block_size: int
    top_k: int

    @classmethod
    def of(cls, logits: torch.Tensor, t: torch.Tensor, block_size: int, top_k: int) -> "_ChunkBlocks":
        hkv, g, m, n = logits.shape
        nb = -(-n // block_size)
        probs = torch.softmax(logits, dim=-1)
        blocks = torch.nn.functional.pad(probs, (0, nb * block_size - n)).view(hkv, g, m, nb, block_size)
        mass = blocks.sum(-1).mean(1)  # [Hkv, m, nB] group-averaged mass per block
        cur = (t // block_size)[None, :, None]  # [1, m, 1]
        bidx = torch.arange(nb, device=logits.device)[None, None, :]
        forced = (bidx == 0) | (bidx == cur) | (bidx == cur - 1)
        free = (bidx <= cur) & ~forced
        ref = forced.expand(hkv, m, nb) | _topk_mask(mass.masked_fill(~free, -1.0), top_k - 3, free)
        return cls(mass, forced, free, ref, block_size, top_k)

    def flat_lse_selection(self, logits: torch.Tensor) -> torch.Tensor:
        """Flat exact LSE: forced plus the best free blocks by the sum over the group's heads of
        each head's block LSE."""
        hkv, g, m, n = logits.shape
        nb = self.mass.shape[-1]
        lse = torch.nn.functional.pad(logits, (0, nb * self.block_size - n), value=float("-inf"))
        score = torch.logsumexp(lse.view(hkv, g, m, nb, self.block_size), dim=-1)
        score = torch.where(torch.isfinite(score), score, torch.zeros_like(score)).sum(1)  # [Hkv, m, nB]
        chosen = _topk_mask(score.masked_fill(~self.free, float("-inf")), self.top_k - 3, self.free)
        return self.forced.expand(hkv, m, nb) | chosen

    def scores(self, sel: torch.Tensor) -> Dict[str, float]:
        """Sums over the chunk's rows of recall, free-block recall and retained mass of ``sel``."""
        ref, free = self.ref, self.free
        hit = (sel & ref).sum(-1).float()
        hit_free = (sel & ref & free).sum(-1).float()
        return {
            "recall": float((hit / ref.sum(-1).float()).sum()),
            "recall_free": float((hit_free / (ref & free).sum(-1).clamp_min(1).float()).sum()),
            "retained_mass": float((self.mass * sel).sum(-1).sum()),
        }


def _index_mask(idx: torch.Tensor, nb: int) -> torch.Tensor:
    """``[Hkv, m, K]`` block indices (-1: none) as a ``[Hkv, m, nB]`` mask."""
    sel = torch.zeros(*idx.shape[:2], nb + 1, dtype=torch.bool, device=idx.device)
    sel.scatter_(-1, torch.where(idx < 0, torch.full_like(idx, nb), idx), True)
    return sel[..., :nb]


def _topk_mask(scores: torch.Tensor, k: int, allowed: torch.Tensor) -> torch.Tensor:
    # top-k along the last axis among ``allowed`` entries; ties to the lower block index
    # (torch.topk on CPU is not guaranteed stable, so sort stably instead)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    allowed = allowed.expand(scores.shape)
    mask = torch.zeros_like(allowed)
    mask.scatter_(-1, order, True)
    return mask & allowed


# --------------------------------------------------------------------------- PBS retained mass


def spread_positions(n: int, count: int, start: int = 0, width: int = 64) -> torch.Tensor:
    """``count`` runs of ``width`` consecutive query positions, evenly spread over ``[start, n)``:
    a cheap sample of the whole sequence (errors at early positions reach the last tokens through
    later layers' keys and values, so the last queries alone under-report the damage)."""
    if not (0 <= start < n) or count < 1 or width < 1:
        raise ValueError(
            f"need 0 <= start < n, count >= 1 and width >= 1, got start={start}, n={n}, count={count}, width={width}"
        )
    starts = torch.linspace(start, n - width, count).round().long().clamp_min(start)
    pos = (starts[:, None] + torch.arange(width)[None, :]).reshape(-1)
    return torch.unique(pos[pos < n])


def pbs_retained_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    config,
    *,
    last: int = 512,
    chunk: int = 128,
    positions: Optional[torch.Tensor] = None,
) -> Dict[str, object]:
    """The share of the true attention mass of the last ``last`` queries (or of the query
    ``positions`` given, e.g. :func:`spread_positions`) that falls on the keys PBS (``config``, a
    PBSConfig) selects for them, per query head, plus the density of the whole selection (as
    ``sparseflow eval`` reports it) and of the evaluated queries alone."""
    from ..config import PBSConfig

    if not isinstance(config, PBSConfig):
        raise TypeError(f"config must be a PBSConfig, got {type(config).__name__}")
    hq, _, n, _ = _check_qk(q, k)
    positions = _query_positions(positions, last, n).to(q.device)
    with torch.no_grad():
        perm, mask, density = _pbs_selection(q, k, config)
    kept, sel_keys, vis_keys = _selected_mass(q, k, perm, mask, positions, config.block_size, chunk)
    count = positions.numel()
    return {
        "retained_mass": (kept / count).tolist(),
        "mean_retained_mass": float(kept.sum() / (count * hq)),
        "density": float(density.mean()),
        "density_last": float(sel_keys.sum() / (vis_keys * hq)),
    }


def _query_positions(positions: Optional[torch.Tensor], last: int, n: int) -> torch.Tensor:
    """The checked 1-D long tensor of query positions: ``positions``, or the last ``last``."""
    if positions is None:
        if not (1 <= last <= n):
            raise ValueError(f"last must be in [1, {n}], got {last}")
        positions = torch.arange(n - last, n)
    positions = torch.as_tensor(positions, dtype=torch.long).reshape(-1)
    if positions.numel() == 0 or int(positions.min()) < 0 or int(positions.max()) >= n:
        raise ValueError(f"positions must be a non-empty set of query positions in [0, {n - 1}]")
    return positions


def _pbs_selection(q: torch.Tensor, k: torch.Tensor, config):
    """PBS's ``(permutation, block mask, density)`` for causal attention, by its reference (through
    the registry)."""
    sel = spec_for(config).select(q, k, config, is_causal=True)
    return sel.permutation, sel.block_mask, sel.density


def _selected_mass(q, k, perm, mask, positions, bs: int, chunk: int):
    """Per query head, the true attention mass of the queries ``positions`` on the keys the
    selection ``(perm, mask)`` keeps, and the selected key count; plus the visible key count."""
    hq, n, d = q.shape[1], q.shape[2], q.shape[3]
    g = hq // k.shape[1]
    hp = perm.shape[1]
    slot_block = torch.arange(n, device=q.device) // bs
    scale = 1.0 / math.sqrt(d)
    kept = torch.zeros(hq, dtype=torch.float64)
    sel_keys = torch.zeros(hq, dtype=torch.float64)
    vis_keys = 0.0
    for c0 in range(0, positions.numel(), chunk):
        t = positions[c0 : c0 + chunk]
        m = t.numel()
        future = torch.arange(n, device=q.device)[None, :] > t[:, None]
        vis_keys += float((~future).sum())
        for h in range(hq):
            logits = (q[0, h].index_select(0, t).float() @ k[0, h // g].float().t()) * scale
            probs = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)  # [m, N]
            per_slot = mask[0, h][t // bs][:, slot_block]  # [m, N] over permuted slots
            per_key = torch.zeros_like(per_slot)
            per_key.scatter_(1, perm[0, h * hp // hq][None, :].expand(m, n), per_slot)
            per_key &= ~future
            kept[h] += float((probs * per_key).sum())
            sel_keys[h] += float(per_key.sum())
    return kept, sel_keys, vis_keys


def recall_diagnostic(
    model,
    input_ids: torch.Tensor,
    *,
    selectors: Sequence[str] = TOPK_SELECTORS,
    block_size: int = 64,
    top_k: int = 8,
    branching: int = 2,
    q_start: int = 512,
    progress=None,
) -> Dict[str, object]:
    """:func:`topk_recall` for every layer of a transformers model on ``input_ids``: per-layer
    rows and the mean over layers of each selector's recall, free-block recall and retained mass.
    ``selectors``: names accepted by :func:`parse_selector` (e.g. add ``pisa_lse_beam2``)."""
    selectors = check_selectors(selectors)
    layers = capture_qkv(model, input_ids)
    rows = []
    for i, (q, k, _) in enumerate(layers):
        r = topk_recall(
            q, k, selectors=selectors, block_size=block_size, top_k=top_k, branching=branching, q_start=q_start
        )
        rows.append({"layer": i, **r})
        if progress is not None:
            progress(f"  layer {i}: " + ", ".join(f"{s} {r[s]['recall_free']:.3f}" for s in selectors))
    names = list(selectors) + ["oracle"]
    mean = {s: {m: float(sum(r[s][m] for r in rows) / len(rows)) for m in rows[0][s]} for s in names}
    return {
        "block_size": block_size,
        "top_k": top_k,
        "forced": 3,
        "branching": branching,
        "q_start": q_start,
        "tokens": int(input_ids.shape[1]),
        "selectors": list(selectors),
        "mean": mean,
        "layers": rows,
    }
