"""Checks users can run in their own CI: sparse ops and rewritten models against dense attention.

Op level (any q/k/v you give):
    check_exact_mode, check_matches_own_selection, check_causality, check_finite
A method's selection contract, for a selection computed in a lower precision within a stated
tolerance (the method's registry ``selection_check``; PISA's: a walk scoring in bf16 / fp16 /
tf32 keeps what the fp32 reference keeps, up to near-ties; its trace helpers are
``sparseflow.methods.pisa.tolerance_check.walk_trace`` and ``selection_within_tolerance``):
    check_selection_tolerance, check_pisa_selection
Model level:
    assert_rewrite_equivalent(model, example_inputs, method=...)  # rewritten == original in exact mode
Hypothesis strategies for random shapes live in ``sparseflow.testing.strategies``; a pytest plugin
(``-p sparseflow.testing.pytest_plugin``, auto-loaded when sparseflow is installed) adds the
``--sparseflow-methods`` option and the ``sparseflow_methods`` fixture.

Every check raises ``AssertionError`` with the measured error and the bound it broke.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..config import AttentionConfig, default_config
from ..kernels.masked_attention import masked_attention as _dense64
from ..methods import spec_for
from ..ops import attention
from ..recording import capture

__all__ = [
    "exact_config",
    "error_bound",
    "check_exact_mode",
    "check_matches_own_selection",
    "check_causality",
    "check_finite",
    "assert_rewrite_equivalent",
    "run_with_selection",
    "check_selection_tolerance",
    "check_pisa_selection",
]

# Absolute floors under the 2x rule: when plain PyTorch happens to be almost exact, a kernel that
# accumulates in another order must not fail on rounding noise.
_FLOOR = {torch.float64: 1e-10, torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def exact_config(method: str, seq_len: int, base: Optional[AttentionConfig] = None) -> AttentionConfig:
    """The method's config in exact mode at ``seq_len``: every visible block is kept."""
    cfg = base or default_config(method)
    return spec_for(cfg).exact_config(cfg, seq_len)


def _plain(q, k, v, mask_bhqk: Optional[torch.Tensor], is_causal: bool, scale):
    """Plain PyTorch SDPA in the inputs' own dtype: the error yardstick."""
    if mask_bhqk is None:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=is_causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask_bhqk, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def error_bound(
    q, k, v, *, key_mask=None, key_padding_mask=None, is_causal=True, scale=None
) -> Tuple[torch.Tensor, float]:
    """(fp64 oracle output, bound): bound = 2 x max error of plain PyTorch in q's dtype + floor."""
    oracle = _dense64(
        q.double(),
        k.double(),
        v.double(),
        key_padding_mask=key_padding_mask,
        is_causal=is_causal,
        scale=scale,
        key_mask=key_mask,
    )
    full = key_mask
    if full is None and key_padding_mask is not None:
        n_q, n_k = q.shape[2], k.shape[2]
        vis = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device)
        vis = vis.tril(n_k - n_q) if is_causal else vis
        full = (vis[None] & key_padding_mask[:, None, :])[:, None]
    elif full is not None:
        n_q, n_k = q.shape[2], k.shape[2]
        vis = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device)
        vis = vis.tril(n_k - n_q) if is_causal else vis
        full = full & vis
        if key_padding_mask is not None:
            full = full & key_padding_mask[:, None, None, :]
    plain = _plain(q, k, v, full, is_causal and full is None, scale)
    # rows SDPA leaves as 0 (no visible key) agree with the oracle's zeros
    err = (plain.double() - oracle).abs().nan_to_num(0.0).max().item() if plain.numel() else 0.0
    return oracle, 2.0 * err + _FLOOR[q.dtype]


def _assert_close(name: str, out: torch.Tensor, oracle: torch.Tensor, bound: float) -> None:
    if not torch.isfinite(out).all():
        raise AssertionError(f"{name}: output has NaN/inf")
    err = (out.double() - oracle).abs().max().item() if out.numel() else 0.0
    if err > bound:
        raise AssertionError(
            f"{name}: max |out - fp64 oracle| = {err:.3g} exceeds bound {bound:.3g} (2x plain PyTorch error + floor)"
        )


def run_with_selection(q, k, v, config: AttentionConfig, **kw):
    """(output, Selection or None, CallRecord) of one op call."""
    with capture() as cap:
        out = attention(q, k, v, config=config, **kw)
    rec = cap.calls[-1]
    return out, rec.selection, rec


def check_exact_mode(
    q,
    k,
    v,
    method: str,
    *,
    base: Optional[AttentionConfig] = None,
    key_padding_mask=None,
    is_causal: bool = True,
    scale=None,
    backend: str = "auto",
) -> None:
    """Property 1: in exact mode the op equals dense attention (same visibility)."""
    cfg = exact_config(method, k.shape[2], base)
    out, sel, rec = run_with_selection(
        q,
        k,
        v,
        cfg,
        attn_mask=_mask_arg(key_padding_mask, q, k, is_causal),
        is_causal=is_causal and key_padding_mask is None,
        scale=scale,
        backend=backend,
    )
    oracle, bound = error_bound(q, k, v, key_padding_mask=key_padding_mask, is_causal=is_causal, scale=scale)
    _assert_close(
        f"{method} exact mode ({rec.backend}, {'sparse' if rec.sparse else 'dense: ' + rec.reason})", out, oracle, bound
    )
    if sel is not None:
        # batch rows with no valid key have nothing visible: their density is not defined
        rows = key_padding_mask.any(-1) if key_padding_mask is not None else torch.ones(q.shape[0], dtype=torch.bool)
        dens = sel.density[rows.to(sel.density.device)]
        if dens.numel() and not torch.allclose(dens, torch.ones_like(dens), atol=1e-6):
            raise AssertionError(f"{method} exact mode reported density {dens.tolist()}, expected 1.0")


def _mask_arg(key_padding_mask, q, k, is_causal):
    if key_padding_mask is None:
        return None
    n_q, n_k = q.shape[2], k.shape[2]
    vis = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device)
    vis = vis.tril(n_k - n_q) if is_causal else vis
    return (vis[None] & key_padding_mask[:, None, :])[:, None]


def check_matches_own_selection(
    q, k, v, config: AttentionConfig, *, key_padding_mask=None, is_causal=True, scale=None, backend: str = "auto"
):
    """Property 2: the sparse output equals dense attention restricted to the op's own reported
    selection (an independent masked-dense oracle). Returns the selection."""
    out, sel, rec = run_with_selection(
        q,
        k,
        v,
        config,
        attn_mask=_mask_arg(key_padding_mask, q, k, is_causal),
        is_causal=is_causal and key_padding_mask is None,
        scale=scale,
        backend=backend,
    )
    if not rec.sparse:
        raise AssertionError(f"{config.method} ran dense ({rec.reason}); choose a shape the method handles")
    key_mask = sel.key_mask(q.shape[1])
    oracle, bound = error_bound(
        q, k, v, key_mask=key_mask, key_padding_mask=key_padding_mask, is_causal=is_causal, scale=scale
    )
    _assert_close(f"{config.method} vs its own selection ({rec.backend})", out, oracle, bound)
    return sel


def check_causality(
    q, k, v, config: AttentionConfig, t: int, *, scale=None, backend: str = "auto", seed: int = 0
) -> None:
    """Property 3: changing keys/values after position t changes no output at or before t."""
    out, _, rec = run_with_selection(q, k, v, config, is_causal=True, scale=scale, backend=backend)
    g = torch.Generator(device="cpu").manual_seed(seed)
    k2, v2 = k.clone(), v.clone()
    tail = k.shape[2] - t - 1
    if tail > 0:
        k2[:, :, t + 1 :] = (torch.randn(k2[:, :, t + 1 :].shape, generator=g) * 3).to(k.dtype)
        v2[:, :, t + 1 :] = (torch.randn(v2[:, :, t + 1 :].shape, generator=g) * 3).to(v.dtype)
    out2, _, _ = run_with_selection(q, k2, v2, config, is_causal=True, scale=scale, backend=backend)
    err = (out[:, :, : t + 1].double() - out2[:, :, : t + 1].double()).abs().max().item()
    if err > _FLOOR[q.dtype]:
        raise AssertionError(f"{config.method}: output at positions <= {t} moved by {err:.3g} when later keys changed")


def check_finite(q, k, v, config: AttentionConfig, **kw) -> torch.Tensor:
    """Property 7 (valid input never gives NaN/inf)."""
    out = attention(q, k, v, config=config, **kw)
    if not torch.isfinite(out).all():
        raise AssertionError(f"{config.method}: NaN/inf in the output")
    return out


def check_selection_tolerance(method: str, q, k, trace=None, config=None, **kw):
    """Property 8: ``method``'s selection contract (its registry ``selection_check``) on a
    selection computed in a lower precision: AssertionError when it breaks it, else the report.
    ``trace`` / ``config`` / ``kw``: as the method's check takes them (PISA's:
    :func:`check_pisa_selection`). A ValueError for a method whose selection is exact."""
    return spec_for(method).check_selection(q, k, trace, config, **kw)


def check_pisa_selection(q, k, trace=None, config=None, *, tuning=None, **kw):
    """PISA's selection contract: a walk's ``trace`` (its kept nodes per level, leaves first;
    ``sparseflow.methods.pisa.tolerance_check.walk_trace`` gives the reference's) keeps what the
    fp32 reference walk keeps, up to near-ties within the tolerance of the precision it scores in
    (``precision=``, default "bf16"; ``delta=0`` asks for the reference's selection). ``tuning``:
    a :class:`sparseflow.Tuning` whose Triton walk (``pisa_walk``, scoring in ``pisa_scores``) is
    checked: without a ``trace`` its trace is taken from that walk (needs Triton, and a call the
    walk covers), and ``precision`` defaults to its ``pisa_scores``. ``kw``: the call's
    ``key_padding_mask``, ``is_causal``, ``scale`` and config fields. Returns the report."""
    return check_selection_tolerance("pisa", q, k, trace, config, tuning=tuning, **kw)


def assert_rewrite_equivalent(
    model: torch.nn.Module,
    example_inputs: Sequence[Any] = (),
    example_kwargs: Optional[Dict[str, Any]] = None,
    *,
    method: str = "dense",
    config: Optional[AttentionConfig] = None,
    expected_rewrites: Optional[int] = None,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    output_fn=None,
):
    """Property 6: rewrite a copy of ``model`` with ``method`` in exact mode and check it gives the
    original outputs. ``output_fn`` picks the tensor to compare (default: ``out.logits`` if
    present, else the output itself). Returns the rewrite report."""
    from ..api import compile as sf_compile, report as sf_report

    kwargs = dict(example_kwargs or {})
    pick = output_fn or (lambda o: getattr(o, "logits", o[0] if isinstance(o, (tuple, list)) else o))
    with torch.no_grad():
        want = pick(model(*example_inputs, **kwargs))
    twin = copy.deepcopy(model)
    if config is None:
        seq = _longest_seq(example_inputs, kwargs)
        config = exact_config(method, seq)  # DenseConfig() for the dense method
    sf_compile(twin, method=method, config=config, inner_backend="eager", recipe=None)  # exact mode everywhere
    with torch.no_grad():
        got = pick(twin(*example_inputs, **kwargs))
    rep = sf_report(twin)
    if expected_rewrites is not None and rep.num_rewritten != expected_rewrites:
        raise AssertionError(f"expected {expected_rewrites} rewritten attention calls, got {rep.num_rewritten}:\n{rep}")
    if rep.num_rewritten == 0:
        raise AssertionError(f"no attention call was rewritten:\n{rep}")
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    return rep


def _longest_seq(args, kwargs) -> int:
    lengths = [t.shape[-1] for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor) and t.dim() >= 2]
    return max(lengths + [1])
