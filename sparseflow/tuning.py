"""How the Triton kernels run, as opposed to what they compute (the method configs).

A :class:`Tuning` changes speed, never results (but ``pisa_scores`` other than fp32, which keeps
PISA's selection within its tolerance contract): which implementation selects PBS's blocks, how
the PBS kernel reads K/V, whether it may use Hopper's TMA, and the launch settings and score
precision of PISA's selection walk. It is passed to :func:`sparseflow.compile`,
:func:`sparseflow.export` or :func:`sparseflow.attention` and travels with every call as op arguments (each op takes the
fields of its own method, see :func:`fields_of`), so it is read per call and works under
``torch.compile(fullgraph=True)``. The defaults are the measured best choices.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

__all__ = [
    "Tuning",
    "DEFAULT_TUNING",
    "fields_of",
    "PBS_SELECT",
    "PBS_KV_LAYOUTS",
    "PISA_WALKS",
    "PISA_WARPS",
    "PISA_SCORES",
]

PBS_SELECT = ("auto", "triton", "reference")
PBS_KV_LAYOUTS = ("permuted", "gather")
PISA_WALKS = ("auto", "per_token", "tiled", "scan")
PISA_WARPS = (1, 2, 4, 8, 16, 32)  # Triton launches a power-of-two number of warps
PISA_SCORES = ("fp32", "bf16", "tf32")


def _method(name: str, schema: str) -> Dict[str, Any]:
    # which ops take the field (a method name, or a tuple of them), and its type in their schemas
    return {"method": name, "schema": schema}


_SPARSE = ("pbs", "pisa", "bsa")


@dataclass(frozen=True)
class Tuning:
    """Launch options of the Triton backends (``backend="triton"``, or ``"auto"`` choosing it).

    ``pbs_select``: the implementation of PBS's stages 1-3 (proxy scores, permutation, block
    selection). ``"triton"``: the Triton kernels of ``methods/pbs/triton_select``; ``"reference"``:
    the reference's torch stages; ``"auto"``: Triton on CUDA, the reference elsewhere.
    ``pbs_kv_layout``: ``"permuted"`` writes K/V once in permuted order so the attention kernel
    streams contiguous tiles; ``"gather"`` reads the original rows through the permutation.
    ``pbs_tma``: let the PBS attention kernel use TMA loads where the device and layout allow
    (Hopper or newer, permuted layout, 16-byte aligned rows); False never does.
    ``pisa_walk``: how PISA's selection walk is parallelised (the selection is the same):
    ``"per_token"``, one program per query token (``methods/pisa/triton_select_per_token``);
    ``"tiled"``, one program per tile of consecutive queries sharing the scoring of each level
    (``methods/pisa/triton_select_tiled``; shapes it does not cover run per token, logged);
    ``"scan"``, query tiles score every node above the leaves, the per-token walk reads those
    scores down to its leaf candidates, and the (query, leaf) pairs are scored a leaf at a time
    (``methods/pisa/triton_select_scan``; calls it does not cover run per token, logged);
    ``"auto"``: the scan on CUDA where it applies (faster at every shape timed on the H200), else
    per token.
    ``pisa_scores``: the arithmetic of the walk's q . summary dots (the scores of the pyramid's
    nodes above the leaves, and the leaves' own for ``score="mean"``), in every walk and in
    decoding. ``"fp32"``: today's arithmetic, the reference's selection exactly, ties included.
    ``"bf16"`` / ``"tf32"``: both operands rounded to nearest (ties to even) in that format, fp32
    accumulation (one tensor-core dot in the scan walk instead of its three-part fp32 emulation);
    the selection may then differ from the reference's among near-ties only, within PISA's
    selection contract with that precision's tolerance (``methods/pisa/tolerance_check``;
    docs/methods.md, "PISA's selection contract"). The leaf level's exact LSE over the raw 16-bit
    keys stays as it is (its products are exact). Unlike the other fields, a lower precision may
    change the selection, within that contract.
    ``cuda_graphs``: replay an eager ``backend="triton"`` call without gradient from a CUDA graph,
    recorded on the second call of the same signature (method config, shapes, strides, dtypes,
    device, stream), instead of launching its kernels one by one: the same kernels on the same
    inputs, so the same result, at a fraction of the host cost (:mod:`sparseflow.graph_replay`).
    False launches them every call. Calls inside another capture (``torch.cuda.graph``) are
    captured by it as they are, and calls traced by ``torch.compile`` never replay (see
    :meth:`Tuning.traced`).
    ``pdl``: launch PISA's scan walk and the token-sparse attention (PISA's and BSA's) as links
    of a programmatic-dependent-launch chain (:mod:`sparseflow.kernels.pdl`; Hopper or newer,
    compiled Triton), so that each kernel is scheduled while the one before it drains: 1-6 us a
    layer at SmolLM2's 8K on the H200, the same output bit for bit. Eager calls and CUDA graphs
    chain; calls traced by ``torch.compile`` launch plainly (logged), since Inductor's launcher of
    a user kernel has not been checked with it. Elsewhere it changes nothing.
    ``pisa_warps`` / ``pisa_leaf_bytes``: warps per program of PISA's selection walk and the shared
    memory budget of one leaf-level chunk; None picks by the walk's candidate width (1 warp and
    16 KB up to 16 candidates, else 4 warps and 64 KB, measured on the H200); the tiled walk takes
    ``pisa_warps`` (None: 8, chosen by register use, not yet timed) and sizes its chunks by its tile.
    """

    pbs_select: str = field(default="auto", metadata=_method("pbs", "str"))
    pbs_kv_layout: str = field(default="permuted", metadata=_method("pbs", "str"))
    pbs_tma: bool = field(default=True, metadata=_method("pbs", "bool"))
    pisa_walk: str = field(default="auto", metadata=_method("pisa", "str"))
    pisa_warps: Optional[int] = field(default=None, metadata=_method("pisa", "int?"))
    pisa_leaf_bytes: Optional[int] = field(default=None, metadata=_method("pisa", "int?"))
    pisa_scores: str = field(default="fp32", metadata=_method("pisa", "str"))
    cuda_graphs: bool = field(default=True, metadata=_method(_SPARSE, "bool"))
    pdl: bool = field(default=False, metadata=_method(("pisa", "bsa"), "bool"))

    def __post_init__(self):
        _check_choice("pbs_select", self.pbs_select, PBS_SELECT)
        _check_choice("pbs_kv_layout", self.pbs_kv_layout, PBS_KV_LAYOUTS)
        for name in ("pbs_tma", "cuda_graphs", "pdl"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"Tuning.{name} must be a bool, got {type(value).__name__} ({value!r})")
        _check_choice("pisa_walk", self.pisa_walk, PISA_WALKS)
        _check_optional_int("pisa_warps", self.pisa_warps)
        if self.pisa_warps is not None and self.pisa_warps not in PISA_WARPS:
            raise ValueError(f"Tuning.pisa_warps must be None or one of {list(PISA_WARPS)}, got {self.pisa_warps}")
        _check_optional_int("pisa_leaf_bytes", self.pisa_leaf_bytes)
        if self.pisa_leaf_bytes is not None and self.pisa_leaf_bytes < 1:
            raise ValueError(f"Tuning.pisa_leaf_bytes must be None or an int >= 1, got {self.pisa_leaf_bytes}")
        _check_choice("pisa_scores", self.pisa_scores, PISA_SCORES)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, where: str = "tuning") -> "Tuning":
        """Inverse of ``to_dict``; ``where`` names the source in errors. Unknown fields are a
        ``ValueError`` that names them (a field of a newer sparseflow is not silently dropped)."""
        if not isinstance(data, Mapping):
            raise TypeError(f"{where} must be a dict, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{where} has unknown fields {unknown}; known: {sorted(known)}")
        return cls(**data)

    def replace(self, **changes) -> "Tuning":
        return dataclasses.replace(self, **changes)

    def traced(self) -> "Tuning":
        """This tuning for a call that ``torch.compile`` traces into its graph: no op-level CUDA
        graphs. The compiled graph is Inductor's to capture (``mode="reduce-overhead"``), and an
        op-level graph recorded while Inductor warms its graphs up would leave the graph's static
        inputs in Inductor's memory pool, which Inductor refuses at the first call."""
        return self if not self.cuda_graphs else dataclasses.replace(self, cuda_graphs=False)


def _check_choice(name: str, value: Any, choices: Tuple) -> None:
    if not isinstance(value, str):
        raise TypeError(f"Tuning.{name} must be a str, one of {list(choices)}, got {type(value).__name__} ({value!r})")
    if value not in choices:
        raise ValueError(f"Tuning.{name} must be one of {list(choices)}, got {value!r}")


def _check_optional_int(name: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise TypeError(f"Tuning.{name} must be None or an int, got {type(value).__name__} ({value!r})")


DEFAULT_TUNING = Tuning()

# method -> ((field name, schema type), ...) in declaration order: the op arguments of that method
_BY_METHOD: Dict[str, Tuple[Tuple[str, str], ...]] = {}
for _f in dataclasses.fields(Tuning):
    _owners = _f.metadata["method"]
    for _owner in (_owners,) if isinstance(_owners, str) else _owners:
        _BY_METHOD[_owner] = _BY_METHOD.get(_owner, ()) + ((_f.name, _f.metadata["schema"]),)


def fields_of(method: str) -> Tuple[Tuple[str, str], ...]:
    """The tuning fields the ``method`` op takes, as ``(name, schema type)`` (empty for none)."""
    return _BY_METHOD.get(method, ())


def check_tuning(tuning: Any, arg: str = "tuning") -> Tuning:
    """``tuning`` (None: the defaults) after checking it is a :class:`Tuning`."""
    if tuning is None:
        return DEFAULT_TUNING
    if not isinstance(tuning, Tuning):
        raise TypeError(f"{arg} must be a sparseflow.Tuning or None, got {type(tuning).__name__}")
    return tuning
