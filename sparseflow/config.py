"""Frozen, versioned, serialisable configurations, one per method.

A config says *what* to compute (block sizes, thresholds, K); the backend says *how*. Configs
validate themselves on construction, so a bad value fails where the user wrote it, with the
field's name and the expected range in the message.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Mapping, Optional, Type, Union

__all__ = [
    "AttentionConfig",
    "DenseConfig",
    "PBSConfig",
    "PISAConfig",
    "BSAConfig",
    "config_from_dict",
    "default_config",
    "METHODS",
    "BACKENDS",
]

BACKENDS = ("auto", "reference", "triton", "flex")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")


def _check_choice(name: str, value: Any, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


@dataclass(frozen=True)
class AttentionConfig:
    """Base class: serialisation shared by all configs."""

    method: ClassVar[str] = ""
    version: ClassVar[int] = 1

    def to_dict(self) -> Dict[str, Any]:
        d = dataclasses.asdict(self)
        return {"method": self.method, "version": self.version, **d}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def replace(self, **changes) -> "AttentionConfig":
        return dataclasses.replace(self, **changes)

    @property
    def exact(self) -> bool:
        """True when this config computes dense attention exactly (every visible block)."""
        raise NotImplementedError


@dataclass(frozen=True)
class DenseConfig(AttentionConfig):
    """The rewrite with a dense body: proves the pass itself changes nothing."""

    method: ClassVar[str] = "dense"

    @property
    def exact(self) -> bool:
        return True


@dataclass(frozen=True)
class PBSConfig(AttentionConfig):
    """PBS-Attn (permuted block-sparse prefill).

    threshold >= 1 is the exact mode: every candidate block is kept.
    ``min_seq_len``: shorter sequences run dense (logged); 0 means only the structural minimum
    (one complete segment).
    ``causal_proxy``: normalise the proxy softmax per segment instead of over all complete
    segments, so the permutation of a segment depends on no key of another segment; the paper's
    scheme (False) lets later keys reorder earlier segments. True makes the output causal in keys
    and values: the output at query ``i`` (its block selection included) depends on no key or
    value after ``i``. It is *not* causal in queries: the selection of ``i``'s query block
    depends on the proxy queries (the prompt's last positions) and on the block's mean query
    (later positions of the same block), so a later query (in a model: a later token) changes
    earlier outputs. So neither setting is causal at model level, and a
    fidelity measured as next-token KL over prompt positions is a prefill measurement: the proxy
    has seen the future of every position, which token-by-token decoding would not have.
    ``proxy_blocks``: how many query blocks score the keys for the permutation. 1 (default) is
    the paper's proxy, the last ``block_size`` valid queries, which sees every complete segment.
    With P > 1 the proxies are P query blocks spread evenly over the row's valid query blocks
    (proxy ``j = 1..P`` ends the first ``j/P`` of them; the last one is the paper's proxy); an
    earlier proxy sees only the complete segments strictly before its own segment, and a key's
    score is the mean of the probabilities it gets from the proxies that see it. Combines with
    ``causal_proxy`` (each proxy then normalises per segment). See
    :func:`sparseflow.methods.pbs.reference.key_scores`.
    ``scoring``: how a query block's distribution over its candidate key blocks is estimated.
    ``"mean"`` (the paper's): softmax of the block-mean query against block-mean keys (the
    Triton selection kernels). ``"antidiagonal"`` (PBS+ / XAttention): logits from strided
    antidiagonal samples of each tile. ``"sampled_rows"``: every ``antidiagonal_stride``-th query
    row of the block takes its exact softmax over the candidate keys, and the block's distribution
    is the mean of those rows' mass per key block -- no averaging before the exponential, so one
    dominant key keeps its mass (stride 1 is the exact block mass). The two strided scorings cost
    O(N^2 D / stride): one fused Triton pass on the triton backend on CUDA, the torch reference
    elsewhere; ``antidiagonal_stride`` is the stride of both. ONNX export supports ``"mean"`` and ``"antidiagonal"``.
    """

    method: ClassVar[str] = "pbs"
    block_size: int = 128
    segment_size: int = 256
    threshold: float = 0.9
    force_sink: bool = True
    permute: bool = True
    gqa_permutation: str = "query_head"
    scoring: str = "mean"
    antidiagonal_stride: int = 8
    causal_proxy: bool = False
    proxy_blocks: int = 1
    min_seq_len: int = 0

    def __post_init__(self):
        _check_int("block_size", self.block_size, 1)
        _check_int("segment_size", self.segment_size, 1)
        if self.segment_size % self.block_size:
            raise ValueError(
                f"segment_size must be a multiple of block_size={self.block_size}, "
                f"got segment_size={self.segment_size}"
            )
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)):
            raise TypeError(f"threshold must be a float in (0, 1], got {self.threshold!r}")
        if not (0.0 < float(self.threshold) <= 1.0):
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold}")
        _check_bool("force_sink", self.force_sink)
        _check_bool("permute", self.permute)
        _check_bool("causal_proxy", self.causal_proxy)
        _check_int("proxy_blocks", self.proxy_blocks, 1)
        _check_choice("gqa_permutation", self.gqa_permutation, ("query_head", "kv_head"))
        _check_choice("scoring", self.scoring, ("mean", "antidiagonal", "sampled_rows"))
        _check_int("antidiagonal_stride", self.antidiagonal_stride, 1)
        if self.scoring == "antidiagonal" and self.block_size % self.antidiagonal_stride:
            raise ValueError(
                f"antidiagonal_stride must divide block_size={self.block_size}, "
                f"got {self.antidiagonal_stride}"
            )
        _check_int("min_seq_len", self.min_seq_len, 0)

    @property
    def exact(self) -> bool:
        return float(self.threshold) >= 1.0


@dataclass(frozen=True)
class _TopKConfig(AttentionConfig):
    block_size: int = 64
    top_k: int = 8
    force_sink: bool = True
    force_previous: bool = True
    min_seq_len: int = 0

    @property
    def num_forced(self) -> int:
        return 1 + int(self.force_sink) + int(self.force_previous)

    def _validate_common(self) -> None:
        _check_int("block_size", self.block_size, 1)
        _check_int("top_k", self.top_k, 1)
        _check_bool("force_sink", self.force_sink)
        _check_bool("force_previous", self.force_previous)
        if self.top_k < self.num_forced:
            raise ValueError(
                f"top_k must be >= the number of forced blocks ({self.num_forced}: current"
                f"{', sink' if self.force_sink else ''}{', previous' if self.force_previous else ''}),"
                f" got top_k={self.top_k}"
            )
        _check_int("min_seq_len", self.min_seq_len, 0)

    @property
    def exact(self) -> bool:
        return False  # exact only when top_k covers every visible block: depends on N


@dataclass(frozen=True)
class PISAConfig(_TopKConfig):
    """PISA (pyramid block selection). Forced blocks count inside ``top_k``.

    ``beam``: width of the coarse-to-fine walk. At every level above the leaves the walk keeps
    the best ``beam * top_k`` candidates (forced ones included) instead of ``top_k``; the leaf
    level still keeps ``top_k``, so the attention cost is unchanged and the selection cost grows
    about ``beam``-fold (still ``O(g * beam * K * log(N / C))`` per query). A wider beam lets a
    block whose coarse ancestor scores poorly survive until its own, finer score is known, which
    closes most of the recall gap to a flat exact scan over every block. ``beam=1`` is the
    original walk, bit for bit.
    """

    method: ClassVar[str] = "pisa"
    branching: int = 2
    score: str = "lse"
    beam: int = 1

    def __post_init__(self):
        self._validate_common()
        _check_int("branching", self.branching, 2)
        _check_choice("score", self.score, ("lse", "mean", "mean_var"))
        _check_int("beam", self.beam, 1)


@dataclass(frozen=True)
class BSAConfig(_TopKConfig):
    """Block-sparse baseline: score every visible block by q·mean(K_block), take the top K."""

    method: ClassVar[str] = "bsa"

    def __post_init__(self):
        self._validate_common()


METHODS: Dict[str, Type[AttentionConfig]] = {
    "dense": DenseConfig,
    "pbs": PBSConfig,
    "pisa": PISAConfig,
    "bsa": BSAConfig,
}


def default_config(method: str) -> AttentionConfig:
    _check_choice("method", method, tuple(METHODS))
    return METHODS[method]()


def config_from_dict(data: Union[Mapping[str, Any], str]) -> AttentionConfig:
    """Inverse of ``to_dict``/``to_json``; rejects unknown methods, versions and fields."""
    if isinstance(data, str):
        data = json.loads(data)
    data = dict(data)
    method = data.pop("method", None)
    _check_choice("method", method, tuple(METHODS))
    cls = METHODS[method]
    version = data.pop("version", cls.version)
    if version != cls.version:
        raise ValueError(
            f"version must be {cls.version} for {cls.__name__}, got {version}; "
            "this sparseflow cannot read that config"
        )
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown fields for {cls.__name__}: {unknown}; expected a subset of {sorted(known)}")
    return cls(**data)


_BACKEND_DEFAULTS: Dict[type, AttentionConfig] = {}


def backend_config(cls: type, config: Optional[AttentionConfig], fields: Mapping[str, Any]) -> AttentionConfig:
    """The config a method's backend runs: ``config`` (default ``cls()``), with ``fields`` (the
    keyword form of direct calls, e.g. ``block_size=64``) replaced and validated by the config.
    The defaults live in the config alone."""
    if config is None:
        config = _BACKEND_DEFAULTS.get(cls) or _BACKEND_DEFAULTS.setdefault(cls, cls())
    elif not isinstance(config, cls):
        raise TypeError(f"config must be a {cls.__name__} or None, got {type(config).__name__}")
    if not fields:
        return config
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise TypeError(f"unknown {cls.__name__} field(s) {unknown}; the fields are "
                        f"{[f.name for f in dataclasses.fields(cls)]}")
    return config.replace(**fields)
