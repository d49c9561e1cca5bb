"""How far a PISA score may move when a walk computes its dot products in a lower precision.

The fp32 reference walk (``reference.py``) is the oracle of PISA's selection. A fast walk may
compute the dot products ``q . k`` of its scores with both operands rounded to ``bf16``, ``fp16``
or ``tf32`` (tensor cores) and fp32 accumulation; its selection may then differ from the
reference's among near-ties only, by the rule of ``tolerance_check.selection_within_tolerance``.
This module states the tolerance of that rule: a bound on the absolute error of one node's score.

**What the bound covers.** A score as the reference defines it: the group sum over the ``G``
query heads of a per-head score of the logits ``l = scale * q . k`` of the node (its own summary
for ``"mean"``; its children's summaries, or a leaf's raw keys, for ``"lse"`` and
``"mean_var"``), where the keys are the reference's fp32 summaries and fp32 keys. The bound
``score_error_bound(..., precision)`` holds for ``|computed score - exact score|``, "exact" being
real arithmetic on those same fp32 summaries and keys, for any computation that

* rounds ``q`` (possibly pre-multiplied by ``scale`` in fp32) and the keys to ``precision``
  (round to nearest; gradual underflow: subnormals are kept, not flushed to zero);
* accumulates the ``D`` products in fp32 in any order and multiplies by ``scale`` in fp32 (or
  folded ``scale`` into ``q`` as above);
* evaluates the score from its logits (max, exp, log, sums, means, the head sum) in fp32 with
  ``exp`` / ``log`` within 4 ulp (the GPU's lower-precision walks take the LSE in base 2 with the
  special function unit's ``ex2`` / ``lg2``: relative error about ``2**-22`` for ``ex2``, absolute
  ``2**-22`` for the log of a sum in ``[1, J]``; their leaf pairs take an eighth of the ``ex2``
  by a polynomial on the FMA units, relative error under ``2**-22`` too; all inside step 5's
  allowance below).

``score_tolerance`` adds the same bound for the reference's own fp32 arithmetic: it bounds
``|fast walk's score - reference's fp32 score|``, the quantity the checker needs. A walk whose
summaries differ from the reference's by more than that rounding (summed in another order in
fp32, say) is outside the bound. Rows where an operand does not fit the precision's range (fp16's
65504) or the fp32 accumulation may overflow get ``inf``: no guarantee there.

**Derivation.** With ``u`` the unit roundoff of ``precision`` (half its ulp at 1: bf16 ``2**-8``,
fp16 and tf32 ``2**-11``, fp32 ``2**-24``), ``eta`` its underflow floor (half its subnormal
spacing) and ``gamma_n = n u32 / (1 - n u32)`` (fp32 accumulation, ``u32 = 2**-24``):

1. one operand: ``|x~ - x| <= u |x| + eta``; so one product
   ``|q~_j k~_j - q_j k_j| <= ((1+u)^2 - 1) |q_j||k_j| + (1+u) eta (|q_j| + |k_j|) + eta^2``;
2. fp32 accumulation of ``D`` products, then the fp32 product with ``scale`` (or ``scale``
   rounded into ``q``): a relative ``gamma_{D+1}`` of ``sum_j |q~_j k~_j|`` (Higham's dot-product
   bound, any order), plus ``eta32 = 2**-150`` a product for fp32 underflow;
3. together, with Cauchy-Schwarz ``sum_j |q_j||k_j| <= ||q|| K``, ``K`` the largest norm of
   any summary or valid key of the (batch, KV head) as the reference holds them (a summary is a
   mean, so ``K`` is about the largest key norm; it is measured, not assumed), per logit:
   ``E = ((1+u)^2 (1+gamma_{D+1}) - 1) scale ||q|| K + (1+gamma_{D+1}) F`` with the underflow
   floor ``F = (1+u) eta (scale ||q||_1 + s K_1) + s (D eta^2 + (D+1) eta32)``, ``s =
   max(1, scale)`` (either place of ``scale``), ``K_1`` the largest 1-norm; and
   ``|l| <= R = scale ||q|| K``;
4. through the score, per head: ``"lse"`` is 1-Lipschitz in the max-norm of its logits and
   ``"mean"`` is one logit: ``E``. ``"mean_var"``: the mean moves by at most ``E``; with
   ``d_c = l_c - mean`` and logit errors ``e_c``, the population variance moves by
   ``(2/J) sum d_c e_c + var(e) <= 2 E sqrt(var) + E^2 <= 2 E R + E^2``, so the score moves by
   at most ``E (1 + R + E/2)``;
5. the fp32 evaluation of the score from its ``J`` logits (``J = max(block_size, branching)``,
   1 for ``"mean"``) and the sum over the ``G`` heads, with ``M = R + E`` bounding a computed
   logit: ``4 (J + G + 8) u32 * sum_h V``, ``V = M + log J + 1`` for ``"lse"`` (the log of a
   sum in ``[1, J]`` errs absolutely), ``M`` for ``"mean"``, ``M (1 + 2M)`` for ``"mean_var"``:
   a generous first-order bound on the shifted exponentials, their sum and log, the means and
   the squares, times ``exp(2 (J + G + 8) u32 max_h M)`` for the higher orders
   (``|e^t - 1| <= |t| e^|t|``);
6. summed over the group's heads: ``delta = sum_h (step 4) + (step 5)``.

The bound is worst-case (Cauchy-Schwarz is attained when every ``k`` of the node is parallel to
``q`` and every operand rounds the same way), so it is far above the typical error; the
contract's other checks (99% equal blocks on real layers, the KL against dense) keep the
selection honest in practice. ``q`` already in the scoring dtype (a bf16 model) rounds exactly;
the bound does not use that.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from ...kernels import token_blocks as tb
from .reference import SCORES, build_pyramid

__all__ = [
    "PRECISIONS",
    "unit_roundoff",
    "round_to_precision",
    "score_error_bound",
    "score_tolerance",
    "KeyBounds",
    "key_bounds",
    "grouped_score_error_bound",
]

_U32 = 2.0**-24
_ETA32 = 2.0**-150  # half fp32's subnormal spacing
_FP32_MAX = torch.finfo(torch.float32).max


class _Format(NamedTuple):
    u: float  # unit roundoff: relative error of one rounding to nearest
    eta: float  # underflow floor: absolute error of one rounding below the normal range
    max: float  # largest finite value


PRECISIONS = {
    "fp32": _Format(2.0**-24, _ETA32, _FP32_MAX),
    "tf32": _Format(2.0**-11, 2.0**-137, _FP32_MAX),  # fp32's exponent, 10 stored mantissa bits
    "bf16": _Format(2.0**-8, 2.0**-134, torch.finfo(torch.bfloat16).max),
    "fp16": _Format(2.0**-11, 2.0**-25, torch.finfo(torch.float16).max),
}


def _format(precision: str) -> _Format:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {precision!r}")
    return PRECISIONS[precision]


def unit_roundoff(precision: str) -> float:
    """The unit roundoff ``u`` of a scoring precision: bf16 ``2**-8``, fp16 and tf32 ``2**-11``,
    fp32 ``2**-24``; a ValueError names the known ones for any other name."""
    return _format(precision).u


def round_to_precision(x: torch.Tensor, precision: str) -> torch.Tensor:
    """``x`` (fp32) rounded to nearest in ``precision``, returned as fp32: what a tensor core
    reads. tf32 is emulated by rounding fp32's mantissa to 10 bits (ties to even)."""
    _format(precision)
    x = x.float()
    if precision == "fp32":
        return x.clone()
    if precision in ("bf16", "fp16"):
        return x.to(torch.bfloat16 if precision == "bf16" else torch.float16).float()
    bits = x.view(torch.int32)
    # add half the dropped 13 bits' weight, less one unless the kept bit is odd: ties to even
    rounded = (bits + 0x0FFF + ((bits >> 13) & 1)) & ~0x1FFF
    finite = torch.isfinite(x)  # inf and NaN keep their bits
    return torch.where(finite, rounded, bits).view(torch.float32)


def _gamma(n: int) -> float:
    """Higham's ``gamma_n`` for fp32: the relative error of ``n`` chained fp32 roundings."""
    return n * _U32 / (1.0 - n * _U32)


class KeyBounds(NamedTuple):
    """Per (batch, KV head) ``[B, Hkv]`` fp64: the largest 2-norm, 1-norm and |component| of the
    summaries and valid keys a walk can score."""

    norm: torch.Tensor
    l1: torch.Tensor
    absmax: torch.Tensor


def key_bounds(pyramid, k: torch.Tensor, key_padding_mask: Optional[torch.Tensor]) -> KeyBounds:
    """:class:`KeyBounds` of the keys ``k [B, Hkv, Nk, D]`` (padded keys excluded: they are
    never scored) and of every level's summaries of ``pyramid`` (``build_pyramid``'s)."""
    rows = [k.double()]
    if key_padding_mask is not None:
        rows = [torch.where(key_padding_mask[:, None, :, None], rows[0], torch.zeros((), dtype=torch.float64))]
    rows += [summ.double() for summ, _ in pyramid]
    per = [(r.norm(dim=-1), r.abs().sum(-1), r.abs().amax(-1)) for r in rows if r.shape[2]]
    return KeyBounds(*(torch.cat([p[i] for p in per], -1).amax(-1) for i in range(3)))


def _logit_error(q_norm, q_l1, keys: KeyBounds, d: int, scale: float, fmt: _Format):
    """Step 3: the bound ``E`` on one logit's error, shaped like ``q_norm``."""
    g = _gamma(d + 1)
    s = max(1.0, scale)
    kn, k1 = keys.norm.view(*keys.norm.shape, 1, 1), keys.l1.view(*keys.l1.shape, 1, 1)
    floor = (1 + fmt.u) * fmt.eta * (scale * q_l1 + s * k1) + s * (d * fmt.eta**2 + (d + 1) * _ETA32)
    return ((1 + fmt.u) ** 2 * (1 + g) - 1) * scale * q_norm * kn + (1 + g) * floor


def _moved(e: torch.Tensor, r: torch.Tensor, score: str) -> torch.Tensor:
    """Step 4: how far one head's score moves when each of its logits (``|l| <= r``) moves by
    at most ``e``."""
    return e * (1 + r + e / 2) if score == "mean_var" else e


def _evaluation(m: torch.Tensor, score: str, n_terms: int) -> torch.Tensor:
    """Step 5: the fp32 evaluation of the group-summed score from computed logits ``|l| <= m``
    (``m [B, Hkv, G, Nq]``), ``n_terms`` logits a head; ``[B, Hkv, Nq]``."""
    if score == "lse":  # the log of a sum in [1, J] errs absolutely
        per_head = m + math.log(n_terms) + 1
    else:  # the means and squares err relatively
        per_head = m * (1 + 2 * m) if score == "mean_var" else m
    terms = n_terms + m.shape[2] + 8
    higher = torch.exp((2 * terms * _U32 * m.amax(2)).clamp_max(700.0))
    return 4 * terms * _U32 * per_head.sum(2) * higher


def _no_guarantee(q64, q_norm, m, keys: KeyBounds, scale: float, fmt: _Format, score: str) -> torch.Tensor:
    """``[B, Hkv, Nq]``: rows where an operand leaves the precision's range or fp32 may overflow."""
    limit = _FP32_MAX / 16
    over = (q64.abs().amax(-1) > fmt.max).any(2) | (keys.absmax > fmt.max)[..., None]
    over = over | (max(1.0, scale) * q_norm * keys.norm[..., None, None] > limit).any(2)
    if score == "mean_var":
        over = over | (m * m > limit).any(2)
    return over


def grouped_score_error_bound(
    qg: torch.Tensor,
    keys: KeyBounds,
    *,
    precision: str,
    score: str,
    scale: float,
    block_size: int,
    branching: int,
) -> torch.Tensor:
    """:func:`score_error_bound` from grouped queries ``qg [B, Hkv, G, Nq, D]`` and the keys'
    :class:`KeyBounds`: ``[B, Hkv, Nq]`` fp64 (``inf`` where there is no guarantee)."""
    fmt = _format(precision)
    if score not in SCORES:
        raise ValueError(f"score must be one of {list(SCORES)}, got {score!r}")
    q64 = qg.double()
    q_norm, q_l1 = q64.norm(dim=-1), q64.abs().sum(-1)  # [B, Hkv, G, Nq]
    e = _logit_error(q_norm, q_l1, keys, qg.shape[-1], scale, fmt)
    r = scale * q_norm * keys.norm.view(*keys.norm.shape, 1, 1)
    n_terms = 1 if score == "mean" else max(block_size, branching)
    delta = _moved(e, r, score).sum(2) + _evaluation(r + e, score, n_terms)  # step 6
    bad = _no_guarantee(q64, q_norm, r + e, keys, scale, fmt, score) | ~torch.isfinite(delta)
    return torch.where(bad, torch.full_like(delta, math.inf), delta)


def score_error_bound(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    precision: str,
    score: str,
    block_size: int,
    branching: int,
    scale: Optional[float] = None,
    key_padding_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``delta [B, Hkv, Nq]`` fp64: a bound on ``|score computed in precision - exact score|``
    of every node and leaf the walk of query ``i`` may score for KV head ``h`` (module
    docstring: what it covers and how it is derived). ``q [B, Hq, Nq, D]``, ``k [B, Hkv, Nk, D]``."""
    kpm = None if key_padding_mask is None else key_padding_mask.to(device=k.device, dtype=torch.bool)
    kf = k.to(tb.compute_dtype(k.dtype))
    pyramid = build_pyramid(kf, block_size=block_size, branching=branching, key_padding_mask=kpm)
    return grouped_score_error_bound(
        tb.group_queries(q, k.shape[1]),
        key_bounds(pyramid, kf, kpm),
        precision=precision,
        score=score,
        scale=tb.default_scale(q, scale),
        block_size=block_size,
        branching=branching,
    )


def score_tolerance(q: torch.Tensor, k: torch.Tensor, *, precision: str, **kw) -> torch.Tensor:
    """``[B, Hkv, Nq]``: a bound on ``|a walk's score in precision - the reference's fp32
    score|`` of the same node: the precision's :func:`score_error_bound` plus fp32's (the
    reference's own distance to the exact score). ``kw``: :func:`score_error_bound`'s."""
    return score_error_bound(q, k, precision=precision, **kw) + score_error_bound(q, k, precision="fp32", **kw)
