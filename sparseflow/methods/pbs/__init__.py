"""PBS-Attn (permuted block-sparse prefill): its spec in the method registry."""

from ..._config_base import AttentionConfig
from .tuning import PBSTuning
from .config import PBSConfig
from ..registry import Backend, BenchPart, MethodSpec, OnnxBody, register, window_span_blocks

_KERNELS = __name__  # the backends are modules of this package

# the scorings the ONNX body reproduces ("sampled_rows" and "moments" have no body)
ONNX_SCORINGS = ("mean", "antidiagonal")


def dense_rule(cfg: PBSConfig, n_q: int, n_k: int) -> str:
    """PBS permutes whole segments of a prefill: a decode or chunked step, or a sequence without
    one complete segment, runs dense."""
    if n_q != n_k:
        return f"PBS is a prefill method (Nq={n_q}, Nk={n_k}: decode or chunked step)"
    if n_k < cfg.segment_size:
        return f"sequence length {n_k} < segment_size={cfg.segment_size} (no complete segment)"
    return ""


def onnx_refusal(cfg: PBSConfig) -> str:
    if cfg.scoring not in ONNX_SCORINGS:
        return (
            f"the ONNX body of PBSAttention implements scoring 'mean' and 'antidiagonal', got "
            f"scoring={cfg.scoring!r}; export with one of those (or method='dense')"
        )
    for name, default in (("proxy_blocks", 1), ("dense_tail_blocks", 0)):  # the body computes neither
        if getattr(cfg, name) != default:
            return (
                f"the ONNX body of PBSAttention does not implement the config field(s) [{name!r}] "
                f"(got {name}={getattr(cfg, name)!r}, needs {default}); export with method='dense' until it does"
            )
    return ""


# The estimate's rough cost in units of the layer's dense attention (QK^T and PV over the causal
# triangle): the strided scorings compute 1 / stride of the QK^T rows (or samples), about
# 1 / (2 * stride) of dense; block-mean scoring touches O(N^2 / B^2) scores; the moments add the
# blocks' covariances and a 2 D^2 product per block pair, measured at a third of cuDNN's dense
# time at 32K on SmolLM2's heads (a tenth at 128K, more at head dim 256; docs/results.md), their
# torch elementwise work more than the products; the permutation adds one proxy pass and a sort.
MEAN_SCORING_COST = 0.01
MOMENTS_SCORING_COST = 0.3
PERMUTATION_COST = 0.01


def estimate_cost(cfg: PBSConfig) -> float:
    strided = cfg.scoring in ("sampled_rows", "antidiagonal")
    pooled = MOMENTS_SCORING_COST if cfg.scoring == "moments" else MEAN_SCORING_COST
    scoring = 1.0 / (2 * cfg.antidiagonal_stride) if strided else pooled
    return scoring + (PERMUTATION_COST if cfg.permute else 0.0)


def exact(cfg: AttentionConfig, seq_len: int) -> AttentionConfig:
    return cfg.replace(threshold=1.0)  # threshold >= 1 keeps every candidate block


def window_rule(cfg: PBSConfig, sliding_window: int, chunk_size: int) -> str:
    """Why a layer with this local window runs the exact window rather than PBS inside it ("" to
    run PBS). Whatever the scores, PBS keeps a query block's whole segment (``segment_size /
    block_size`` blocks: its own region) and at least one block before it (the threshold keeps the
    most probable candidate). Where the window spans at most twice those blocks, the selection
    could skip no more blocks than it keeps anyway -- at best half of the exact window's work,
    paid for with PBS's scoring passes and an approximation -- so the exact window runs; so it
    does at threshold 1, which skips nothing. (BSA's rule is the same with its top-K as the
    blocks kept: ``topk.top_k_window_rule``.)"""
    if cfg.exact:
        return f"threshold={cfg.threshold} keeps every block inside the window"
    kept = cfg.segment_size // cfg.block_size + 1
    spanned = window_span_blocks(cfg.block_size, sliding_window, chunk_size)
    if spanned <= 2 * kept:
        return (
            f"the window spans {spanned} blocks of {cfg.block_size} keys, at most twice the {kept} blocks PBS keeps "
            f"whatever the scores (its segment of {cfg.segment_size} keys and one block before it)"
        )
    return ""


SPEC = register(
    MethodSpec(
        tuning_type=PBSTuning,
        name="pbs",
        config_type=PBSConfig,
        backends={
            "reference": Backend(f"{_KERNELS}.reference:pbs_attention", differentiable="always", windows=True),
            # forward-only kernel
            "triton": Backend(f"{_KERNELS}.triton_impl:pbs_attention", windows=True, tuned=True),
            "flex": Backend(f"{_KERNELS}.flex:pbs_attention", differentiable="cuda", windows=True),
        },
        onnx=OnnxBody(
            node_type="PBSAttention",
            mask="sparseflow.methods.pbs.onnx:MASK",
            windows=True,
            fields={
                "block_size",
                "segment_size",
                "threshold",
                "force_sink",
                "permute",
                "gqa_permutation",
                "scoring",
                "antidiagonal_stride",
                "moments_sd",
                "causal_proxy",
                "proxy_blocks",
                "min_seq_len",
                "dense_tail_blocks",
            },
            refusal=onnx_refusal,
            optional={"moments_sd"},  # no exportable scoring reads it
        ),
        dense_rule=dense_rule,
        has_permute=True,
        has_threshold=True,
        exact=exact,
        context_parallel="sparseflow.methods.pbs.context_parallel:shared_rows",
        estimate_cost=estimate_cost,
        selection_densities=f"{_KERNELS}.calibration:selection_densities",
        selection=f"{_KERNELS}.reference:pbs_reference_selection",
        window_rule=window_rule,
        bench=BenchPart(
            "pbs.py",
            checks=(PBSConfig(block_size=32, segment_size=64, threshold=0.8),),
            timings=((PBSConfig(), (8192, 32, 8, 128)),),
        ),
    )
)
