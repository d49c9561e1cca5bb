"""What a single-layer run starts from: the hidden state entering every decoder layer (one dense
pass), the model run from one layer on with the earlier ones skipped, and the q/k/v each layer's
attention sees on the calibration text."""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator, List, Tuple

import torch

from ..hf import ATTN_IMPLEMENTATION, apply_plan, attention_layer_index, sparseflow_attention_forward
from .session import Session, plan_for


def decoder_layers(model) -> torch.nn.ModuleList:
    """The model's list of decoder blocks (``model.layers``, ``transformer.h``, ...)."""
    n = int(getattr(model.config, "num_hidden_layers", 0) or 0)
    for _, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) == n and n > 0:
            return mod
    raise ValueError(
        f"cannot find the {n} decoder layers of {type(model).__name__}: calibrate needs a "
        "transformers causal LM with a ModuleList of num_hidden_layers blocks"
    )


class _Skip(torch.nn.Module):
    """Stands in for a skipped decoder layer: passes its hidden-state input through."""

    def __init__(self, original: torch.nn.Module):
        super().__init__()
        if hasattr(original, "attention_type"):
            self.attention_type = original.attention_type

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states


def replace_hidden(hidden: torch.Tensor):
    """A forward pre-hook giving the hooked decoder layer ``hidden`` as its hidden-state input."""

    def hook(module, args, kwargs):
        if args:
            return (hidden,) + tuple(args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    return hook


@contextlib.contextmanager
def start_at(model, layer: int, hidden: torch.Tensor) -> Iterator[None]:
    """Run the model from decoder layer ``layer`` on, with ``hidden`` as its input (the dense
    model's hidden state there): the earlier layers are skipped."""
    layers = decoder_layers(model)
    originals = [layers[i] for i in range(layer)]
    handle = layers[layer].register_forward_pre_hook(replace_hidden(hidden), with_kwargs=True)
    try:
        for i in range(layer):
            layers[i] = _Skip(originals[i])
        yield
    finally:
        handle.remove()
        for i, mod in enumerate(originals):
            layers[i] = mod


def layer_inputs(model, input_ids: torch.Tensor) -> List[torch.Tensor]:
    """The hidden state entering every decoder layer in one dense forward pass."""
    layers = decoder_layers(model)
    seen: Dict[int, torch.Tensor] = {}

    def grab(i):
        def hook(module, args, kwargs):
            seen[i] = (args[0] if args else kwargs["hidden_states"]).detach().clone()

        return hook

    handles = [m.register_forward_pre_hook(grab(i), with_kwargs=True) for i, m in enumerate(layers)]
    try:
        with torch.no_grad():
            model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
    finally:
        for h in handles:
            h.remove()
    return [seen[i] for i in range(len(layers))]


def layer_qkv(s: Session, layer: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The q/k/v the layer's attention sees on the calibration text (one partial dense run)."""
    # transformers is optional (sparseflow[hf]): importing the calibrate package does not need it
    from transformers import AttentionInterface

    got: Dict[str, torch.Tensor] = {}

    def record(module, query, key, value, *args, **kwargs):
        if attention_layer_index(module) == layer:
            got.update(q=query.detach(), k=key.detach(), v=value.detach())
        return sparseflow_attention_forward(module, query, key, value, *args, **kwargs)

    apply_plan_dense = plan_for(s, {}, range(s.n_layers))
    apply_plan(s.model, apply_plan_dense)
    AttentionInterface.register(ATTN_IMPLEMENTATION, record)
    try:
        with start_at(s.model, layer, s.hidden[layer]), torch.no_grad():
            s.model(input_ids=s.input_ids, use_cache=False, logits_to_keep=1)
    finally:
        AttentionInterface.register(ATTN_IMPLEMENTATION, sparseflow_attention_forward)
        s.model.set_attn_implementation("sdpa")
    return got["q"], got["k"], got["v"]


def all_layer_qkv(s: Session) -> None:
    """Fill ``s.qkv`` with every layer's q/k/v (see :func:`each_layer_qkv`)."""
    each_layer_qkv(s, s.qkv.__setitem__)


def each_layer_qkv(s: Session, visit: Callable[[int, Tuple], None]) -> None:
    """``visit(layer, (q, k, v, scale))`` with what every layer's attention sees on the calibration
    text, each layer fed the dense hidden state ``s.hidden[layer]`` (so its q/k/v are exactly those
    of a single-layer run there), in one dense pass, layer by layer."""
    # transformers is optional (sparseflow[hf]): importing the calibrate package does not need it
    from transformers import AttentionInterface

    def record(module, query, key, value, *args, scaling=None, **kwargs):
        visit(
            attention_layer_index(module),
            (query.detach(), key.detach(), value.detach(), None if scaling is None else float(scaling)),
        )
        return sparseflow_attention_forward(module, query, key, value, *args, scaling=scaling, **kwargs)

    layers = decoder_layers(s.model)
    handles = [m.register_forward_pre_hook(replace_hidden(s.hidden[i]), with_kwargs=True) for i, m in enumerate(layers)]
    apply_plan(s.model, plan_for(s, {}, range(s.n_layers)))
    AttentionInterface.register(ATTN_IMPLEMENTATION, record)
    try:
        with torch.no_grad():
            s.model(input_ids=s.input_ids, use_cache=False, logits_to_keep=1)
    finally:
        AttentionInterface.register(ATTN_IMPLEMENTATION, sparseflow_attention_forward)
        s.model.set_attn_implementation("sdpa")
        for h in handles:
            h.remove()
