"""PBS's ``scoring="moments"``: the variance of a block pair's logits from its blocks' centred
second moments, and how far a lower-precision product may move it.

For a query block ``I`` and a key block ``J`` (each over the positions its mean is taken over), a
query of ``I`` and a key of ``J`` drawn independently have

    var(q·k) = <E_I[q qᵀ], C_J> + k̄_Jᵀ C_I k̄_J

where ``C`` is a block's covariance about its own mean. Both terms are inner products of positive
semi-definite matrices, so nothing cancels: the uncentred form ``<E_I[q qᵀ], E_J[k kᵀ]> - (q̄·k̄)²``
loses the variance's digits to the squared mean where a block's vectors are alike, which no
low-precision product survives. The variance of every pair is one product of two operands of
``2·D²`` columns per block: ``left_I = [E_I[q qᵀ] | C_I]``, ``right_J = [C_J | k̄_J k̄_Jᵀ]``.

**Precision.** The reference computes it in fp32. The Triton selection runs the covariances and the
pairs' product on TF32 tensor cores by default (``Tuning(pbs_moments_product="tf32")``; ``"ieee"``:
fp32 without TF32, the reference's arithmetic). Either way each block logit is within
:func:`logit_tolerance` of its exact value, a bound derived from the rounding of each product's
operands (TF32 keeps 10 of fp32's 23 mantissa bits: a relative error of at most ``2**-10`` whether
the hardware rounds or truncates), their fp32 accumulation (a bit more for tensor cores, which
truncate their aligned partial sums) and the fp32 means; the selection is the threshold rule
applied to those logits, so it differs from the reference's only among blocks whose logits are
within the two tolerances of each other.
"""

from __future__ import annotations

import contextlib
from typing import Tuple

import torch
from torch import Tensor

from .tuning import MOMENTS_PRODUCTS as PRODUCTS

__all__ = ["PRODUCTS", "products", "block_moments", "left_operand", "right_operand", "pair_variance", "logit_tolerance"]

_UNIT = {"tf32": 2.0**-10, "ieee": 2.0**-24}  # relative rounding of a product's operands
# a product's accumulation: tensor cores align their fp32 partial sums to the largest term and
# truncate (one more bit than IEEE round-to-nearest's)
_ACC = {"tf32": 2.0**-23, "ieee": 2.0**-24}
_FP32 = 2.0**-24  # fp32's unit roundoff (sums, the means)
_DIV = 3 * _FP32  # one fp32 division (Triton's fast division is within 2 ulp)


@contextlib.contextmanager
def products(product: str, cuda: bool):
    """fp32 matmuls inside in ``product``'s arithmetic (TF32 tensor cores or IEEE fp32), whatever
    the global setting; restored after (by the API the setting was made with). Off CUDA every
    product is IEEE fp32."""
    if product not in PRODUCTS:
        raise ValueError(f"moments product must be one of {PRODUCTS}, got {product!r}")
    if not cuda:
        yield
        return
    matmul = torch.backends.cuda.matmul
    new_api = hasattr(matmul, "fp32_precision")  # torch >= 2.9: reading allow_tf32 may raise there
    name = "fp32_precision" if new_api else "allow_tf32"
    prev = getattr(matmul, name)
    setattr(matmul, name, product if new_api else product == "tf32")
    try:
        yield
    finally:
        setattr(matmul, name, prev)


def _mm(a: Tensor, b: Tensor, product: str) -> Tensor:
    # every product of the spread goes through here, in the arithmetic :func:`products` set for
    # ``product`` (a test emulates TF32's rounding on the CPU here)
    return torch.matmul(a, b)


def block_moments(x: Tensor, use: Tensor, product: str = "ieee") -> Tuple[Tensor, Tensor]:
    """``(mean [..., nB, D], covariance [..., nB, D, D])`` of ``x [..., nB, bs, D]`` over each
    block's rows where ``use [..., nB, bs]`` (zeros for a block without any), in ``x``'s dtype,
    the covariance's product in ``product``'s arithmetic (inside :func:`products`)."""
    w = use[..., None]
    count = use.sum(-1).clamp_min(1).to(x.dtype)[..., None]  # [..., nB, 1]
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    mean = torch.where(w, x, zero).sum(-2) / count
    centred = torch.where(w, x - mean[..., None, :], zero)
    cov = _mm(centred.transpose(-1, -2), centred, product) / count[..., None]
    return mean, cov


def _outer(m: Tensor) -> Tensor:
    return m[..., :, None] * m[..., None, :]


def left_operand(qbar: Tensor, qcov: Tensor) -> Tensor:
    """``[..., nB, 2D²]``: query blocks' ``[E[q qᵀ] | C]`` (see the module docstring)."""
    return torch.cat([(qcov + _outer(qbar)).flatten(-2), qcov.flatten(-2)], dim=-1)


def right_operand(kbar: Tensor, kcov: Tensor) -> Tensor:
    """``[..., nB, 2D²]``: key blocks' ``[C | k̄ k̄ᵀ]``: ``left_I · right_J`` is the pair's
    variance of ``q·k``."""
    return torch.cat([kcov.flatten(-2), _outer(kbar).flatten(-2)], dim=-1)


def pair_variance(left: Tensor, right: Tensor, product: str = "ieee") -> Tensor:
    """``[..., nBq, nBk]`` raw (unscaled) variances of the block pairs' ``q·k``, in ``product``'s
    arithmetic (inside :func:`products`)."""
    return _mm(left, right.transpose(-1, -2), product)


def _moment_errors(x: Tensor, use: Tensor, unit: float, acc: float):
    """One side's blocks ``x [..., nB, bs, D]`` in fp64: ``(mean, bound of the fp32 mean's
    magnitude, bound of its outer product's error, covariance, bound of its error)``."""
    bs = x.shape[-2]
    x = x.double()
    w = use[..., None]
    count = use.sum(-1).clamp_min(1).double()[..., None]
    mean = torch.where(w, x, 0.0).sum(-2) / count
    # the fp32 mean is off by at most bs sums and a division of the mean absolute value
    mean_err = (bs * _FP32 + _DIV) * torch.where(w, x.abs(), 0.0).sum(-2) / count
    centred = torch.where(w, x - mean[..., None, :], 0.0)
    # each fp32 centred value is off by the mean's error plus one rounding of |x| + |mean|
    big = centred.abs() + torch.where(w, mean_err[..., None, :] + _FP32 * (x.abs() + mean.abs()[..., None, :]), 0.0)

    def second(a: Tensor, b: Tensor) -> Tensor:
        return (a.transpose(-1, -2) @ b) / count[..., None]

    # the covariance's product: both operands rounded (2u + u^2), bs-term sums, the division
    e_cov = 2 * unit + unit * unit + bs * acc + _DIV
    cov_err = (1 + e_cov) * second(big, big) - second(centred.abs(), centred.abs())
    mean_abs = mean.abs() + mean_err
    outer_err = (1 + _FP32) * _outer(mean_abs) - _outer(mean.abs())
    return mean, mean_abs, outer_err, second(centred, centred), cov_err


def logit_tolerance(
    q_blocks: Tensor, q_use: Tensor, k_blocks: Tensor, k_use: Tensor, *, sds: float, product: str
) -> Tensor:
    """fp64 ``[..., nBq, nBk]``: how far a raw (unscaled) moments logit ``q̄·k̄ + sds·sd`` computed
    in ``product``'s arithmetic (means and mean logits in fp32) may be from its exact value, for
    query blocks ``q_blocks [..., nBq, bs, D]`` (rows ``q_use``) and key blocks ``k_blocks``
    (``k_use``). Multiply by ``|scale|`` for the scaled logits.

    The variance's bound adds, over both operands' halves, each operand's own error against the
    other's magnitude and the product's rounding (both operands rounded, ``2·D²`` fp32 sums)
    against both magnitudes; a standard deviation moves by at most ``min(√e, e/√var)`` for a
    variance error ``e``; the mean logit by ``D + 2`` fp32 roundings of ``|q̄|·|k̄|`` plus the
    means' own errors; the logit's last steps (root, product, sum) by three fp32 roundings."""
    unit, acc = _UNIT[product], _ACC[product]
    d = q_blocks.shape[-1]
    qbar, qabs, qouter_err, qcov, qcov_err = _moment_errors(q_blocks, q_use, unit, acc)
    kbar, kabs, kouter_err, kcov, kcov_err = _moment_errors(k_blocks, k_use, unit, acc)
    left, right = left_operand(qbar, qcov), right_operand(kbar, kcov)
    sum_err = qcov_err + qouter_err + _FP32 * (qcov.abs() + _outer(qbar).abs())  # E[q qᵀ] = C + q̄ q̄ᵀ
    left_err = torch.cat([sum_err.flatten(-2), qcov_err.flatten(-2)], -1)
    right_err = torch.cat([kcov_err.flatten(-2), kouter_err.flatten(-2)], -1)
    left_abs, right_abs = left.abs() + left_err, right.abs() + right_err
    tr = lambda t: t.transpose(-1, -2)  # noqa: E731
    e_prod = 2 * unit + unit * unit + 2 * d * d * acc
    var_err = left_err @ tr(right_abs) + left.abs() @ tr(right_err) + e_prod * (left_abs @ tr(right_abs))
    var = (left @ tr(right)).clamp_min(0.0)
    sd_err = torch.minimum(var_err.sqrt(), var_err / var.sqrt().clamp_min(1e-300))
    mu_err = (d + 2) * _FP32 * (qabs @ tr(kabs)) + (qabs - qbar.abs()) @ tr(kabs) + qbar.abs() @ tr(kabs - kbar.abs())
    # the square root, the product with sds and the sum: three fp32 roundings of the logit's terms
    sds = abs(float(sds))
    last = 3 * _FP32 * ((qbar @ tr(kbar)).abs() + mu_err + sds * (var.sqrt() + sd_err))
    return mu_err + sds * sd_err + last
