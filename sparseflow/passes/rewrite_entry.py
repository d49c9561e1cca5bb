"""What the rewrite pass reports of one attention call site: rewritten or kept (and why), the
shapes, mask and GQA form it saw, its notes, and what the op did with it at run time."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

__all__ = ["RewriteEntry", "Shape"]


Shape = Tuple[Any, ...]


@dataclass
class RewriteEntry:
    """One attention call site found in a graph."""

    tag: str  # qualified module name, e.g. "model.layers.3.self_attn" ("" = the root module)
    layer: Optional[int]  # first integer path component of the tag
    rewritten: bool
    reason: str  # why it was skipped ("" when rewritten)
    method: Optional[str]  # the op it became (None when skipped)
    config: Optional[Dict[str, Any]]  # that op's config, as a dict
    target: str  # what the graph called ("F.scaled_dot_product_attention", "aten....", ...)
    graph: str  # "dynamo" or "export"
    site: int  # index of this call among the calls of the same tag in its graph
    q_shape: Optional[Shape] = None
    k_shape: Optional[Shape] = None  # as handed to the op (after the GQA fold)
    v_shape: Optional[Shape] = None
    gqa: str = ""  # "", "enable_gqa", "folded repeat xR", "broadcast", "K/V passed repeated"
    mask: str = "none"
    is_causal: Optional[bool] = None
    notes: List[str] = field(default_factory=list)
    graphs: int = 1  # how many compiled graphs held this call site with this decision
    # What the op did at run time, {dense reason: calls} with "" counting sparse calls (filled
    # while the model runs, shared by the entries of one tag and method: the op knows only those)
    runtime: Dict[str, int] = field(default_factory=dict)

    @property
    def dense_calls(self) -> Dict[str, int]:
        """{reason: calls} of the run-time calls that ran dense."""
        return {r: n for r, n in self.runtime.items() if r}

    @property
    def runs_dense(self) -> bool:
        """Rewritten, but every call seen at run time fell back to dense attention."""
        return self.rewritten and bool(self.runtime) and not self.runtime.get("", 0)

    @property
    def status(self) -> str:
        if not self.rewritten:
            return "skipped"
        dense = self.dense_calls
        if not dense:
            return "rewritten"
        n_dense, total = sum(dense.values()), sum(self.runtime.values())
        how = "runs dense at run time" if n_dense == total else f"ran dense in {n_dense} of {total} calls at run time"
        return f"rewritten ({how}: {_reasons(dense)})"

    def key(self) -> Tuple:
        """Deduplication key across recompiles: the same call site (tag + its index among that
        tag's calls in the graph) with the same decision (a recipe's band for longer prompts may
        give it another config) is one entry."""
        config = None if self.config is None else json.dumps(self.config, sort_keys=True, default=str)
        return (self.graph, self.tag, self.site, self.target, self.rewritten, self.reason, self.method, config)


def _reasons(dense: Mapping[str, int], most: int = 2) -> str:
    ranked = sorted(dense, key=lambda r: -dense[r])
    text = "; ".join(ranked[:most])
    return text + (f"; and {len(ranked) - most} other reason(s)" if len(ranked) > most else "")
