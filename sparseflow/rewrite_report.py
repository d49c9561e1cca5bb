"""The rewrite report: what the pass did to each attention call site of a compiled model or
exported program (deduplicated across the graphs Dynamo captures), what the ops did with those
calls at run time, and their text tables; and ``inspect``'s result, the report with one run's
op calls."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import recording as _recording
from .passes.rewrite_entry import RewriteEntry

__all__ = ["RewriteReport", "InspectionResult", "LOST_MODEL"]

logger = logging.getLogger("sparseflow")


def _fmt_shape(s) -> str:
    return "-" if s is None else "[" + ",".join(str(x) for x in s) + "]"


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


@dataclass
class RewriteReport:
    """What the rewrite pass did, one entry per attention call site.

    Deduplication: Dynamo may compile a model several times (a new graph for decode steps, a
    recompile for new shapes, a graph per graph break). An entry is identified by
    ``(graph kind, module tag, index of the call among that tag's calls in its graph, target,
    decision)``, so the same call site seen in several graphs is one entry whose ``graphs``
    counts them, while a call site that was rewritten in one graph and skipped in another
    gets one entry per decision. (A graph break *between* two SDPA calls of one module would
    make both index 0 of their graphs and merge them: a limitation we accept.)
    """

    method: str
    config: Dict[str, Any]
    backend: str
    entries: List[RewriteEntry] = field(default_factory=list)
    graphs: int = 0  # graphs the pass has seen
    source: str = "compile"  # "compile" (a model's lazy compilation) or "export" (a program's graph)
    recipe: Optional[str] = None  # the recipe applied (its name, or the path of its file)
    # Set when the report no longer describes what its model runs (a copied model lost its
    # compilation); says so at the top of the text.
    lost: str = ""
    runtime: _recording.RunTally = field(default_factory=dict, repr=False)  # what the ops did, per (tag, method)
    _index: Dict[Tuple, RewriteEntry] = field(default_factory=dict, repr=False, compare=False)
    _warned_no_attention: bool = field(default=False, repr=False, compare=False)

    def add_graph(self, entries: Sequence[RewriteEntry]) -> None:
        self.graphs += 1
        for e in entries:
            key = e.key()
            old = self._index.get(key)
            if old is not None:
                old.graphs += 1
                continue
            self._index[key] = e
            self.entries.append(e)
            self._link_runtime(e)
            if not e.rewritten:
                logger.info("sparseflow: %s at %s kept as is: %s", e.target, e.tag or "<root>", e.reason)
            else:
                logger.debug("sparseflow: %s at %s -> %s", e.target, e.tag or "<root>", e.method)

    def _link_runtime(self, e: RewriteEntry) -> None:
        # the ops count their calls per (tag, method) into self.runtime; the entry reads them live
        if e.rewritten:
            e.runtime = self.runtime.setdefault((e.tag, e.method), e.runtime)

    def __getstate__(self) -> Dict[str, Any]:
        # copy.deepcopy and pickle (torch.save/torch.load of a model) come through here; a model
        # copied that way has lost the compiled call (Module drops _compiled_call_impl).
        state = dict(self.__dict__)
        if self.source == "compile" and not self.lost:
            state["lost"] = _COPIED_REPORT
        return state

    def mark_lost(self, why: str) -> None:
        if self.lost != why:
            logger.warning("sparseflow: %s", why)
        self.lost = why

    def check_attention_found(self) -> None:
        """After a call of the model: warn once when the captured graphs hold no attention call."""
        if self.graphs == 0 or self.entries or self._warned_no_attention:
            return
        self._warned_no_attention = True
        logger.warning("sparseflow: %s", _NO_ATTENTION)

    @property
    def runs_dense(self) -> List[RewriteEntry]:
        """Rewritten entries whose op fell back to dense in every call seen at run time."""
        return [e for e in self.entries if e.runs_dense]

    @property
    def rewritten(self) -> List[RewriteEntry]:
        return [e for e in self.entries if e.rewritten]

    @property
    def skipped(self) -> List[RewriteEntry]:
        return [e for e in self.entries if not e.rewritten]

    @property
    def num_rewritten(self) -> int:
        return len(self.rewritten)

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)

    def counts(self) -> Dict[str, int]:
        return {
            "calls": len(self.entries),
            "rewritten": self.num_rewritten,
            "skipped": self.num_skipped,
            "graphs": self.graphs,
        }

    def tags(self, rewritten: Optional[bool] = None) -> List[str]:
        return [e.tag for e in self.entries if rewritten is None or e.rewritten == rewritten]

    def copy(self) -> "RewriteReport":
        """A snapshot (the live report keeps filling up as the model runs)."""
        new = RewriteReport(
            self.method, dict(self.config), self.backend, source=self.source, lost=self.lost, recipe=self.recipe
        )
        new.graphs = self.graphs
        new.runtime = {k: dict(v) for k, v in self.runtime.items()}
        new._warned_no_attention = self._warned_no_attention
        for e in self.entries:
            e2 = dataclasses.replace(e, notes=list(e.notes), runtime=dict(e.runtime))
            new.entries.append(e2)
            new._index[e2.key()] = e2
            new._link_runtime(e2)
        return new

    def to_dict(self) -> Dict[str, Any]:
        return {
            "method": self.method,
            "config": self.config,
            "backend": self.backend,
            "recipe": self.recipe,
            "counts": self.counts(),
            "runs_dense": len(self.runs_dense),
            "lost": self.lost,
            "entries": [{**dataclasses.asdict(e), "status": e.status} for e in self.entries],
        }

    def _head(self) -> str:
        c = self.counts()
        n_dense = len(self.runs_dense)
        dense = f" ({n_dense} of them run dense at run time)" if n_dense else ""
        counts = f"{c['rewritten']} rewritten{dense}, {c['skipped']} skipped, {c['graphs']} graph(s)"
        head = (
            f"sparseflow rewrite report: method={self.method} backend={self.backend} recipe={self.recipe or 'none'} - "
        )
        if self.lost:
            return f"{head}compilation lost, runs dense SDPA (the compiled original: {counts})\n{self.lost}"
        return head + counts

    def __str__(self) -> str:
        head = self._head()
        if not self.entries and self.graphs:
            return head + f"\n({_NO_ATTENTION})"
        if not self.entries:
            return head + "\n(no attention calls seen yet: the graph is captured on the first call)"
        rows = [
            (
                e.tag or "<root>",
                "-" if e.layer is None else e.layer,
                "lost (runs dense)" if self.lost and e.rewritten else _status_cell(e),
                e.method or "-",
                e.target,
                _fmt_shape(e.q_shape),
                _fmt_shape(e.k_shape),
                e.gqa or "-",
                e.mask,
                e.graphs,
                e.reason or _runtime_reason(e),
            )
            for e in self.entries
        ]
        return (
            head
            + "\n"
            + _table(
                ("module", "layer", "status", "op", "target", "q", "k (to op)", "gqa", "mask", "graphs", "reason"), rows
            )
        )


_NO_ATTENTION = (
    "no scaled_dot_product_attention call found in the captured graph(s): the model computes attention "
    "some other way, so nothing was rewritten; for a Hugging Face model load it with attn_implementation='sdpa'"
)
_COPIED_REPORT = (
    "this report was copied with its model (copy.deepcopy, pickle, torch.save/torch.load): the copy has lost "
    "the sparseflow compilation (torch.nn.Module drops the compiled call when copied) and runs dense SDPA, "
    "so the rewrites listed are not what it runs; call sparseflow.compile on the copy to rewrite it again"
)
LOST_MODEL = (
    "this model is a copy (copy.deepcopy, pickle, torch.save/torch.load) of a sparseflow-compiled model: "
    "torch.nn.Module drops the compiled call when copied, so it now runs dense SDPA and the rewrites listed "
    "no longer apply; call sparseflow.compile on it to rewrite it again"
)


def _status_cell(e: RewriteEntry) -> str:
    # the table's reason column carries the run-time reasons, so the status stays short
    if not e.dense_calls:
        return e.status
    return "rewritten, runs dense" if e.runs_dense else "rewritten, partly dense"


def _runtime_reason(e: RewriteEntry) -> str:
    dense = e.dense_calls
    if not dense:
        return ""
    return "run time: " + "; ".join(f"{r} ({n} call(s))" for r, n in sorted(dense.items(), key=lambda x: -x[1]))


@dataclass
class InspectionResult:
    """The rewrite report plus what each op call did on one run of the example inputs."""

    report: RewriteReport
    calls: List[_recording.CallRecord]
    output: Any = None

    @property
    def sparse_calls(self) -> List[_recording.CallRecord]:
        return [c for c in self.calls if c.sparse]

    @property
    def dense_calls(self) -> List[_recording.CallRecord]:
        return [c for c in self.calls if not c.sparse]

    def mean_density(self) -> float:
        vals = [c.density for c in self.calls if c.density is not None]
        return float(sum(vals) / len(vals)) if vals else float("nan")

    def __str__(self) -> str:
        rows = [
            (
                c.tag or "<root>",
                c.method,
                "sparse" if c.sparse else "dense",
                c.backend,
                _fmt_shape(c.q_shape),
                _fmt_shape(c.k_shape),
                "-" if c.density is None else f"{c.density:.3f}",
                c.reason,
            )
            for c in self.calls
        ]
        runtime = (
            f"runtime: {len(self.calls)} op call(s), {len(self.sparse_calls)} sparse, "
            f"{len(self.dense_calls)} dense, mean density {self.mean_density():.3f}"
        )
        table = (
            _table(("module", "op", "path", "backend", "q", "k", "density", "reason"), rows)
            if rows
            else "(no op calls)"
        )
        return f"{self.report}\n\n{runtime}\n{table}"
