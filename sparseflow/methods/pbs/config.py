"""The PBSConfig: what the pbs method computes (validated, frozen, versioned)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..._config_base import AttentionConfig, _check_bool, _check_choice, _check_int


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
    :func:`sparseflow.methods.pbs.permutation.key_scores`.
    ``scoring``: how a query block's distribution over its candidate key blocks is estimated.
    ``"mean"`` (the paper's): softmax of the block-mean query against block-mean keys (the
    Triton selection kernels). ``"moments"``: the block-mean logit plus ``moments_sd`` standard
    deviations of the block pair's logits, from the blocks' centred second moments (no per-key
    exponential; a ``2·D²`` product per block pair where ``"mean"`` takes a ``D`` one, on TF32
    tensor cores in the Triton selection within a stated tolerance: ``methods/pbs/moments.py``): a
    block with a few keys aligned to the queries keeps its score; ``moments_sd`` standard deviations
    are added (0.5: at 4K on SmolLM2 the lowest KL on the worst of prose and copy-heavy text at equal
    density among 0.5, 1 and 2; docs/results.md). ``"antidiagonal"`` (PBS+ / XAttention): logits from strided
    antidiagonal samples of each tile. ``"sampled_rows"``: every ``antidiagonal_stride``-th query
    row of the block takes its exact softmax over the candidate keys, and the block's distribution
    is the mean of those rows' mass per key block -- no averaging before the exponential, so one
    dominant key keeps its mass (stride 1 is the exact block mass). The two strided scorings cost
    O(N^2 D / stride): one fused Triton pass on the triton backend on CUDA, the torch reference
    elsewhere; ``antidiagonal_stride`` is the stride of both. ONNX export supports ``"mean"`` and ``"antidiagonal"``.
    ``dense_tail_blocks``: the prompt's last this many query blocks attend every visible key (0:
    none). The last positions hold the question of a long-context prompt and read the first
    answer token; a block-level selection can drop the few key tokens one such row needs (a
    needle). One 128-row block costs ``128 * N`` of the ``N**2 / 2`` dense work (3% at 8K). The
    tail is whole blocks counted from the end of the sequence: with right padding it covers the
    padded rows of shorter prompts (pad on the left), and with ``N % block_size == 1`` one block
    is the last token alone. Every backend runs it; context parallelism and ONNX export refuse it.
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
    moments_sd: float = 0.5
    causal_proxy: bool = False
    proxy_blocks: int = 1
    min_seq_len: int = 0
    dense_tail_blocks: int = 0

    def _validate(self) -> None:
        _check_int("block_size", self.block_size, 1)
        _check_int("segment_size", self.segment_size, 1)
        if self.segment_size % self.block_size:
            raise ValueError(
                f"segment_size must be a multiple of block_size={self.block_size}, got segment_size={self.segment_size}"
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
        _check_choice("scoring", self.scoring, ("mean", "moments", "antidiagonal", "sampled_rows"))
        _check_int("antidiagonal_stride", self.antidiagonal_stride, 1)
        if isinstance(self.moments_sd, bool) or not isinstance(self.moments_sd, (int, float)):
            raise TypeError(f"moments_sd must be a float >= 0, got {self.moments_sd!r}")
        if not (0.0 <= float(self.moments_sd) < float("inf")):
            raise ValueError(f"moments_sd must be a finite float >= 0, got {self.moments_sd}")
        if self.scoring == "antidiagonal" and self.block_size % self.antidiagonal_stride:
            raise ValueError(
                f"antidiagonal_stride must divide block_size={self.block_size}, got {self.antidiagonal_stride}"
            )
        _check_int("min_seq_len", self.min_seq_len, 0)
        _check_int("dense_tail_blocks", self.dense_tail_blocks, 0)

    @property
    def exact(self) -> bool:
        return float(self.threshold) >= 1.0
