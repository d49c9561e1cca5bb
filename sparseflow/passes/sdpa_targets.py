"""The graph calls the rewrite pass looks for: scaled-dot-product attention as Dynamo and export
spell it (each with the schema its arguments bind to), and the fused fast paths that hide SDPA
inside one kernel (reported as skipped, never rewritten)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F

__all__ = ["SdpaTarget", "SDPA_TARGETS", "FUSED_TARGETS", "FASTPATH_REASON"]

aten = torch.ops.aten


@dataclass(frozen=True)
class SdpaTarget:
    name: str  # readable name for reports
    schema: Any  # torch._C.FunctionSchema used to bind args/kwargs (with defaults)
    returns_tuple: bool  # backend variants return (output, logsumexp, ...)
    mask_arg: Optional[str]  # name of the mask/bias argument, if the variant has one


def _build_targets() -> Dict[Any, SdpaTarget]:
    base = aten.scaled_dot_product_attention.default._schema
    targets: Dict[Any, SdpaTarget] = {
        torch._C._nn.scaled_dot_product_attention: SdpaTarget(
            "F.scaled_dot_product_attention", base, False, "attn_mask"
        ),
        F.scaled_dot_product_attention: SdpaTarget("F.scaled_dot_product_attention", base, False, "attn_mask"),
        aten.scaled_dot_product_attention.default: SdpaTarget(
            "aten.scaled_dot_product_attention", base, False, "attn_mask"
        ),
    }
    variants = {
        "_scaled_dot_product_flash_attention_for_cpu": "attn_mask",
        "_scaled_dot_product_efficient_attention": "attn_bias",
        "_scaled_dot_product_flash_attention": None,
        "_scaled_dot_product_cudnn_attention": "attn_bias",
        "_scaled_dot_product_attention_math": "attn_mask",
    }
    for name, mask_arg in variants.items():
        packet = getattr(aten, name, None)
        if packet is None or not hasattr(packet, "default"):
            continue
        targets[packet.default] = SdpaTarget(f"aten.{name}", packet.default._schema, True, mask_arg)
    return targets


SDPA_TARGETS: Dict[Any, SdpaTarget] = _build_targets()

# Fused paths that hide SDPA inside one kernel: reported as skipped, never rewritten.
FUSED_TARGETS: Dict[Any, str] = {}
for _obj, _name in (
    (getattr(torch, "_transformer_encoder_layer_fwd", None), "torch._transformer_encoder_layer_fwd"),
    (getattr(torch, "_native_multi_head_attention", None), "torch._native_multi_head_attention"),
    (
        getattr(getattr(aten, "_transformer_encoder_layer_fwd", None), "default", None),
        "aten._transformer_encoder_layer_fwd",
    ),
    (
        getattr(getattr(aten, "_native_multi_head_attention", None), "default", None),
        "aten._native_multi_head_attention",
    ),
):
    if _obj is not None:
        FUSED_TARGETS[_obj] = _name

FASTPATH_REASON = (
    "{name}: the fused nn.TransformerEncoderLayer/nn.MultiheadAttention fast path (taken in eval mode "
    "without gradients) hides SDPA inside one kernel; disable it with "
    "torch.backends.mha.set_fastpath_enabled(False) or run with gradients enabled to rewrite this layer"
)
