"""What the top-k block methods (PISA, BSA) share in their specs."""

from .._config_base import AttentionConfig
from .registry import window_span_blocks

# the fields of the shared top-k config that every top-k ONNX body implements
TOPK_ONNX_FIELDS = frozenset({"block_size", "top_k", "force_sink", "force_previous", "min_seq_len"})


def exact_top_k(cfg: AttentionConfig, seq_len: int) -> AttentionConfig:
    """Enough blocks to keep every visible one at ``seq_len``."""
    return cfg.replace(top_k=max(cfg.top_k, -(-seq_len // cfg.block_size)))


def top_k_window_rule(cfg: AttentionConfig, sliding_window: int, chunk_size: int) -> str:
    """A windowed layer runs the exact window when the top-K can hold every block its window
    spans: the selection would keep them all anyway (``registry.windowed``)."""
    spanned = window_span_blocks(cfg.block_size, sliding_window, chunk_size)
    if cfg.top_k >= spanned:
        return f"top_k={cfg.top_k} keeps the {spanned} blocks the window spans"
    return ""
