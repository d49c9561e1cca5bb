"""What the top-k block methods (PISA, BSA) share in their specs."""

from .._config_base import AttentionConfig

# the fields of the shared top-k config that every top-k ONNX body implements
TOPK_ONNX_FIELDS = frozenset({"block_size", "top_k", "force_sink", "force_previous", "min_seq_len"})


def exact_top_k(cfg: AttentionConfig, seq_len: int) -> AttentionConfig:
    """Enough blocks to keep every visible one at ``seq_len``."""
    return cfg.replace(top_k=max(cfg.top_k, -(-seq_len // cfg.block_size)))
