"""The calibration session: the model, its tokens and the dense reference every measurement is
against, and the :class:`sparseflow.hf.Plan` of a set of per-layer choices."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..config import AttentionConfig
from ..hf import Plan
from .choices import Choice

if TYPE_CHECKING:  # measure.py builds it from a session: a runtime import would be a cycle
    from .measure import DenseReference


@dataclass
class Session:
    """What every measurement needs: the model, the tokens, the dense reference."""

    model: Any
    input_ids: torch.Tensor
    keep: int
    dense: torch.Tensor  # [keep, V]
    method: str
    base: AttentionConfig
    backend: str = "auto"
    cost: str = "density"
    hidden: List[torch.Tensor] = field(default_factory=list)
    timing: Optional[Tuple[int, Tuple[torch.Tensor, ...], float]] = None  # cost="time": (layer, q/k/v, dense s)
    reference: Optional[DenseReference] = None  # the dense side of every KL, computed once
    qkv: Dict[int, Tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[float]]] = field(default_factory=dict)
    fast_density: Optional[bool] = None  # the reference selection gives the op's density (checked once)
    # layer -> (sliding_window, chunk_size) of the layers the model limits to a local window: they
    # run what registry.windowed makes of the base config there (the method inside the window
    # where its selection can skip enough, else the window exactly) and are not calibrated, so no choice
    windows: Dict[int, Tuple[int, int]] = field(default_factory=dict)

    @property
    def n_layers(self) -> int:
        return int(self.model.config.num_hidden_layers)

    def layer_choices(self, layer: int, choices: Sequence[Choice]) -> List[Choice]:
        """The grid's choices a layer is calibrated over: none for a windowed layer."""
        return [] if layer in self.windows else list(choices)

    @property
    def targets(self) -> torch.Tensor:
        return self.input_ids[0, -self.keep :]


def grid_size(s: Session, choices: Sequence[Choice]) -> int:
    """How many single-layer choices the grid has over all layers (windowed layers have none)."""
    return sum(len(s.layer_choices(layer, choices)) for layer in range(s.n_layers))


def plan_for(s: Session, configs: Mapping[int, AttentionConfig], dense_layers: Sequence[int]) -> Plan:
    """The session's plan with ``configs`` at their layers and ``dense_layers`` dense."""
    return Plan(
        method=s.method,
        config=s.base,
        backend=s.backend,
        dense_layers=tuple(sorted(dense_layers)),
        layer_configs=dict(configs),
        num_layers=s.n_layers,
    )


def single_layer_plan(s: Session, layer: int, cfg: AttentionConfig) -> Plan:
    """Only ``layer`` running ``cfg``; every other layer dense."""
    return plan_for(s, {layer: cfg}, [i for i in range(s.n_layers) if i != layer])


def plan_of_choices(s: Session, chosen: Sequence[Choice]) -> Plan:
    """The plan running ``chosen[i]`` at layer ``i``."""
    configs = {i: c.config(s.base) for i, c in enumerate(chosen) if not c.dense}
    return plan_for(s, configs, [i for i, c in enumerate(chosen) if c.dense])
