"""Compile every sparseflow Triton kernel for Hopper (sm_90) on a machine without a GPU.

The CPU interpreter runs a kernel's Python, not Triton's compiler: a kernel can pass every
interpreter test and still fail to compile for the GPU (a constant Triton types as fp64, a
loop-carried type change, a layout the backend rejects). This script swaps in a driver that
reports an sm_90 target, makes every launch compile only (the full pipeline: TTIR, TTGIR, LLVM,
PTX and ptxas, which ships with the triton wheel), and drives the public entry points on small
CPU tensors so each kernel is compiled with the constexpr variants the GPU uses. Nothing runs:
outputs stay zero (``torch.empty`` is redirected to ``torch.zeros`` so the host code after a
launch sees defined values).

    python tests/sm90_compile.py --json out.json     # exit 1 on any compile error

Used by tests/kernels/test_sm90_compile.py; it must run in its own process (TRITON_INTERPRET=0 before
any sparseflow kernel module is imported).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "0"

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import triton  # noqa: E402
import triton.runtime.autotuner as _autotuner  # noqa: E402
import triton.runtime.jit as _jit  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


class _CompileOnlyDriver:
    """Just enough of a CUDA driver for JITFunction.run to pick an sm_90 target and compile."""

    def is_active(self):
        return True

    def get_current_target(self):
        return TARGET

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def get_benchmarker(self):
        raise RuntimeError("compile-only driver: nothing is timed")


COMPILED: list = []
SECONDS: dict = {}  # each kernel's compile time, its variants together (where the CI's minutes go)
ERRORS: list = []
_orig_run = _jit.JITFunction.run
# False while an autotuner compiles its configs after the first: the fp64-scalar check is about how
# a float argument is typed, which launch sizes do not change, so one config per call is checked
_FP64_CHECK = [True]
_FP64_PATHS: set = set()  # (kernel, its boolean constexprs) already compiled with fp64 scalars
# the shared memory a program may take on the H200 (227 KiB); an autotuner drops configs that need
# more at run time, so only launches without one are held to it
SHARED_LIMIT = 227 * 1024
_SHARED_CHECK = [True]
# whether an autotuner compiles every config that survives pruning (the GPU may pick any) or only
# its first: PBS's forward is the one autotuned kernel, and the "pbs" entry's cases compile all its
# configs over the kernel's specialisations (dtypes, head dims, layouts); the other entries run the
# whole PBS op for the kernels they are about, so its forward's other configs would only repeat
_ALL_CONFIGS = [True]


def _compile_only(self, *args, grid, warmup, **kwargs):
    start = time.perf_counter()
    try:
        kernel = _orig_run(self, *args, grid=grid, warmup=True, **kwargs)
    except Exception as exc:  # a compile error: record it, keep compiling the others
        ERRORS.append({"kernel": self.__name__, "error": f"{type(exc).__name__}: {str(exc)[-1500:]}"})
        return None
    COMPILED.append(self.__name__)
    if _SHARED_CHECK[0] and kernel.metadata.shared > SHARED_LIMIT:
        ERRORS.append(
            {
                "kernel": self.__name__,
                "error": f"needs {kernel.metadata.shared} B of shared memory, over the H200's {SHARED_LIMIT}",
            }
        )
    if _FP64_CHECK[0]:
        _compile_with_fp64_scalars(self, kernel)
    SECONDS[self.__name__] = SECONDS.get(self.__name__, 0.0) + time.perf_counter() - start
    return kernel


def _compile_with_fp64_scalars(fn, kernel) -> None:
    """Compile the same specialisation again with its float scalars typed fp64: Inductor types a
    Python float argument of a user-defined Triton kernel as fp64 (Triton's JIT types it fp32), so a
    kernel behind ``torch.library.triton_op`` must compile both ways under ``torch.compile``."""
    from triton.compiler import ASTSource

    src = kernel.src
    floats = [name for name, ty in src.signature.items() if ty == "fp32"]
    # once per code path: a kernel's boolean constexprs pick its branches (where a scalar's type
    # could matter); tile sizes, head dims and dtypes of the tensors do not change a scalar's use
    path = (fn.__name__, tuple(sorted((str(k), v) for k, v in src.constants.items() if isinstance(v, bool))))
    if not floats or path in _FP64_PATHS:
        return
    _FP64_PATHS.add(path)
    sig = {name: ("fp64" if name in floats else ty) for name, ty in src.signature.items()}
    md = kernel.metadata
    triton.knobs.runtime.add_stages_inspection_hook = _stop_at_ptx
    try:
        triton.compile(
            ASTSource(fn=src.fn, signature=sig, constexprs=src.constants, attrs=src.attrs),
            target=TARGET,
            options={"num_warps": md.num_warps, "num_stages": md.num_stages},
        )
    except _ReachedPtxas:
        pass
    except Exception as exc:
        ERRORS.append(
            {
                "kernel": f"{fn.__name__} (float scalars {floats} typed fp64, as Inductor types them)",
                "error": f"{type(exc).__name__}: {str(exc)[-1500:]}",
            }
        )
        return
    finally:
        triton.knobs.runtime.add_stages_inspection_hook = None
    COMPILED.append(f"{fn.__name__}[fp64 scalars]")


class _ReachedPtxas(Exception):
    """The fp64-scalar compile got to valid PTX: done."""


def _stop_at_ptx(backend, stages, options, language, capability) -> None:
    """End the fp64-scalar compile before ptxas. A scalar's type is settled by then: Triton types it
    when it builds the TTIR (a loop-carried type change or an fp64 constant fails there) and
    lowers its arithmetic by LLVM and PTX, and the same specialisation with fp32 scalars went
    through ptxas already. ptxas is about half the compile time of the large kernels. Raising
    (rather than returning an empty cubin) keeps the unfinished kernel out of Triton's cache."""

    def stop(src, metadata):
        raise _ReachedPtxas

    stages["cubin"] = stop


def _autotune_all(self, *args, **kwargs):
    # compile every config that survives pruning (the GPU may pick any of them)
    self.nargs = dict(zip(self.arg_names, args))
    configs = self.prune_configs(kwargs) if len(self.configs) > 1 else self.configs
    configs = configs if _ALL_CONFIGS[0] else configs[:1]
    _SHARED_CHECK[0] = False
    try:
        for i, config in enumerate(configs):
            _FP64_CHECK[0] = i == 0
            self.fn.run(*args, **kwargs, **config.all_kwargs())
    finally:
        _FP64_CHECK[0] = True
        _SHARED_CHECK[0] = True
    self.nargs = None


def install() -> None:
    driver.set_active(_CompileOnlyDriver())
    _jit.JITFunction.run = _compile_only
    _autotuner.Autotuner.run = _autotune_all
    # launches write nothing: give the host code after them zeros, not garbage
    torch.empty = _zeros_like_empty(torch.empty)
    torch.empty_like = lambda *a, **k: torch.zeros_like(*a, **k)


def _zeros_like_empty(empty):
    def zeros(*args, **kwargs):
        kwargs.pop("memory_format", None)
        kwargs.pop("pin_memory", None)
        return torch.zeros(*args, **kwargs)

    return zeros


# --------------------------------------------------------------------------- entry points


def _qkv(b, hq, hkv, n, d, dtype, grad=False):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, hq, n, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, n, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, n, d, generator=g).to(dtype)
    if grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


def _pad(b, n):
    m = torch.ones(b, n, dtype=torch.bool)
    m[-1, n - n // 3 :] = False
    return m


PBS_EVERY_CONFIG = (0, 3)  # indices into main's PBS cases


def run_pbs(cases):
    from sparseflow import Tuning
    from sparseflow.methods.pbs import triton_attention as TA
    from sparseflow.methods.pbs import triton_gather as TG
    from sparseflow.methods.pbs import triton_impl as TI

    TG._use_kernels = lambda t: True
    tma_default = TA._tma_ok
    # CPU tensors launch head by head (triton_attention.heads_first); the first case also heads first
    orders = [(case, None) for case in cases] + [(case, True) for case in cases[:1]]
    every_config = _ALL_CONFIGS[0]
    for i, ((d, dtype, gqa, pad, causal, thr, tma, proxies), order) in enumerate(orders):
        # every autotune config (the GPU may pick any) at the head dims whose tiles differ: 128 with
        # TMA, 80 without. The other cases are about the selection's paths and dtypes and compile
        # the first config: fp32's IEEE dot unrolls into scalar FMAs, about 20 s of ptxas a config
        # (bf16: 2-5 s), and what a config changes is its tiles, not how a dtype compiles
        _ALL_CONFIGS[0] = every_config and i in PBS_EVERY_CONFIG
        TA.HEADS_FIRST = order
        TA._tma_ok = (lambda *a, **k: True) if tma else (lambda *a, **k: False)
        q, k, v = _qkv(2, 8, 2, 700, d, dtype)
        TI.pbs_attention(
            q,
            k,
            v,
            key_padding_mask=_pad(2, 700) if pad else None,
            is_causal=causal,
            block_size=128,
            segment_size=256,
            threshold=thr,
            gqa_permutation=gqa,
            proxy_blocks=proxies,
            tuning=Tuning(pbs_select="triton"),
        )
    TA._tma_ok = tma_default
    TA.HEADS_FIRST = None
    _ALL_CONFIGS[0] = every_config


# PBS inside local windows: layout, TMA, padding, threshold, scoring, window (the attention's
# WINDOW variant, the selection rows' HAS_WINDOW -- pooled logits, exact, strided with the
# renormalised rows -- and the strided estimate's HAS_WINDOW segment skip)
PBS_WINDOW = [
    ("permuted", True, False, 0.9, "mean", dict(sliding_window=300)),
    ("gather", False, True, 0.9, "sampled_rows", dict(chunk_size=512)),
    ("permuted", False, False, 1.0, "mean", dict(sliding_window=300)),
    ("permuted", False, True, 0.9, "antidiagonal", dict(sliding_window=300)),
]


def run_pbs_window(cases):
    from sparseflow import Tuning
    from sparseflow.methods.pbs import triton_attention as TA
    from sparseflow.methods.pbs import triton_gather as TG
    from sparseflow.methods.pbs import triton_impl as TI

    TG._use_kernels = lambda t: True
    tma_default = TA._tma_ok
    every_config = _ALL_CONFIGS[0]
    for i, (layout, tma, pad, thr, scoring, window) in enumerate(cases):
        # the window adds a bound to the forward's loop, not to its tiles: every config once (with
        # TMA), the first config for the window's other paths
        _ALL_CONFIGS[0] = every_config and i == 0
        TA._tma_ok = (lambda *a, **k: True) if tma else (lambda *a, **k: False)
        q, k, v = _qkv(2, 8, 2, 700, 128, torch.bfloat16)
        TI.pbs_attention(
            q,
            k,
            v,
            key_padding_mask=_pad(2, 700) if pad else None,
            block_size=128,
            segment_size=256,
            threshold=thr,
            scoring=scoring,
            tuning=Tuning(pbs_select="triton", pbs_kv_layout=layout),
            **window,
        )
    TA._tma_ok = tma_default
    _ALL_CONFIGS[0] = every_config


def run_pbs_strided(cases):
    """The strided estimates (``scoring="sampled_rows"|"antidiagonal"``) through the op, and the
    block-probability kernel the tests use."""
    from sparseflow import Tuning
    from sparseflow.methods.pbs import triton_estimate as TE
    from sparseflow.methods.pbs import triton_gather as TG
    from sparseflow.methods.pbs import triton_impl as TI

    TG._use_kernels = lambda t: True
    for n, d, dtype, gqa, pad, causal, scoring, stride in cases:
        q, k, v = _qkv(2, 8, 2, n, d, dtype)
        TI.pbs_attention(
            q,
            k,
            v,
            key_padding_mask=_pad(2, n) if pad else None,
            is_causal=causal,
            block_size=128,
            segment_size=256,
            threshold=0.9,
            gqa_permutation=gqa,
            scoring=scoring,
            antidiagonal_stride=stride,
            tuning=Tuning(pbs_select="triton"),
        )
    q, k, _ = _qkv(1, 4, 2, 700, 128, torch.bfloat16)
    perm = torch.arange(700).expand(1, 2, 700).contiguous()
    TE.block_probabilities(q, k, perm, block_size=128, segment_size=256, scoring="antidiagonal", antidiagonal_stride=8)
    # the GPU's default at short lengths: 64-row tiles, keys split over programs, their row masses combined
    q, k, _ = _qkv(1, 9, 3, 2048, 64, torch.bfloat16)
    for splits in (2, 4):
        TE.strided_estimate(
            q,
            k,
            None,
            None,
            None,
            scoring="sampled_rows",
            stride=8,
            hp=3,
            block_size=128,
            segment_size=256,
            block_m=64,
            key_splits=splits,
        )


def _pair_index(n_seg, **launch):
    """The scan's pair index (one program of it) for ``n_seg`` segments (CPU tensors: the selection would
    take its torch form), with extra ``launch`` arguments."""
    from sparseflow.methods.pisa import triton_select_scan as PS

    seg_end, chunk_end, prog_seg = (torch.empty(n, dtype=torch.int32) for n in (n_seg, n_seg, 2 * n_seg))
    PS._pair_index_kernel[(1,)](
        torch.zeros(n_seg, dtype=torch.int32),
        seg_end,
        chunk_end,
        prog_seg,
        n_seg,
        prog_seg.numel(),
        128,
        SEG_P=triton.next_power_of_2(n_seg),
        LOG_SEG=triton.next_power_of_2(n_seg).bit_length() - 1,
        BLOCK=1024,
        num_warps=4,
        **launch,
    )


def run_pisa_bsa(cases):
    from sparseflow.methods.bsa import triton_impl as BI
    from sparseflow.methods.pisa import triton_impl as PI

    for d, dtype, pad, top_k, beam, score in cases:
        q, k, v = _qkv(2, 8, 2, 900, d, dtype, grad=True)
        kpm = _pad(2, 900) if pad else None
        out = PI.pisa_attention(q, k, v, key_padding_mask=kpm, block_size=64, top_k=top_k, beam=beam, score=score)
        out.float().sum().backward()
        BI.bsa_attention(q.detach(), k.detach(), v.detach(), key_padding_mask=kpm, block_size=64, top_k=top_k)
    # the attention's largest key/value blocks: its pipeline stages must fit the shared memory, at
    # each stage count _fwd_launch picks (a block pair of 128 KiB: one stage; 64 KiB: two; 32: three).
    # fp32 blocks of 128 x 128 (one stage, as bf16 256 x 128) compiled within the H200's shared
    # memory at 3fa6659; they left this check for their FMA-unrolled dot's compile time (about a minute)
    from sparseflow.kernels.token_sparse_triton import token_sparse_attention

    for d, c, dtype in ((256, 128, torch.bfloat16), (128, 128, torch.bfloat16), (128, 64, torch.bfloat16)):
        q, k, v = _qkv(1, 4, 1, 300, d, dtype)
        token_sparse_attention(q, k, v, torch.zeros(1, 1, 300, 4, dtype=torch.int32), block_size=c)
    # each tile's distinct blocks (on a GPU tile_block_lists launches this; here tensors are CPU)
    for block_m, top_k in ((16, 8), (64, 16), (1, 6)):
        sel = torch.zeros(2, 2, 900, top_k, dtype=torch.int32)
        torch.ops.sparseflow.token_tile_lists(sel, block_m, 15)
    # the pyramid's level tables and the scan's leaf-pair index (on a GPU the selection launches
    # these one-program kernels; CPU tensors take their torch forms)

    torch.ops.sparseflow.pisa_level_tables(15, 2, 5, torch.device("cpu"))
    for n_seg in (384, 4096):
        _pair_index(n_seg)


# the token-sparse attention under local windows: Hq, Hkv, N, D, dtype, block, sliding_window,
# chunk_size, padding (SmolLM2's group of 3 in bf16; a chunk alone; both with padding in fp16; the
# largest fp32 blocks)
TOKEN_WINDOW = [
    (9, 3, 900, 64, torch.bfloat16, 64, 256, 0, False),
    (8, 2, 700, 128, torch.bfloat16, 64, 0, 300, False),
    (4, 2, 700, 64, torch.float16, 64, 100, 192, True),
    # fp32 takes the IEEE dot, which Triton unrolls into scalar FMAs: at D 128 and blocks of 128
    # the three kernels' ptxas alone took about 4 minutes of the CI's 2 cores, so fp32 is checked
    # at D 64 / 64, and the largest blocks by bf16 at D 256 / 128 (one pipeline stage)
    (4, 4, 300, 64, torch.float32, 64, 200, 0, True),
    (2, 2, 300, 256, torch.bfloat16, 128, 200, 0, False),
]


def run_token_window(cases):
    """The attention's forward and both backward kernels with the window's lower bound compiled in
    (``HAS_WINDOW``), over each window's own block lists."""
    from sparseflow.kernels.token_blocks import window_block_indices
    from sparseflow.kernels.token_sparse_triton import token_sparse_attention

    for hq, hkv, n, d, dtype, c, w, chunk, pad in cases:
        q, k, v = _qkv(1, hq, hkv, n, d, dtype, grad=True)
        sel = window_block_indices(n, n, c, w, chunk).expand(1, hkv, -1, -1)
        out = token_sparse_attention(
            q, k, v, sel, key_padding_mask=_pad(1, n) if pad else None, block_size=c, sliding_window=w, chunk_size=chunk
        )
        out.float().sum().backward()


def run_pisa_window(walk, windows=((300, 0),)):
    """A PISA walk inside a local window (``HAS_WINDOW``; the scan's node scan too): SmolLM2's
    group of 3 in bf16, each ``(sliding_window, chunk_size)`` of ``windows``."""
    from sparseflow import Tuning
    from sparseflow.methods.pisa import triton_select as PT

    q, k, _ = _qkv(1, 9, 3, 900, 64, torch.bfloat16)
    for sliding_window, chunk_size in windows:
        PT.pisa_select(
            q,
            k,
            block_size=64,
            top_k=8,
            sliding_window=sliding_window,
            chunk_size=chunk_size,
            tuning=Tuning(pisa_walk=walk),
        )


def run_pisa_scores():
    """Each walk scoring its dots in bf16 and tf32 (``Tuning(pisa_scores=...)``): the rounded
    operands' tensor-core dots are GPU-only code (the interpreter runs them as fp32 dots); the
    leaf-pairs walk in fp32 and bf16; every walk with 64-bit row offsets."""
    from sparseflow import Tuning
    from sparseflow.methods.pisa import triton_select as PT

    q, k, _ = _qkv(1, 9, 3, 2000, 64, torch.bfloat16)
    for walk in ("per_token", "tiled", "scan"):
        for scores in ("bf16", "tf32"):
            for score in ("lse", "mean") if walk == "scan" else ("lse",):
                PT.pisa_select(
                    q, k, block_size=64, top_k=8, score=score, tuning=Tuning(pisa_walk=walk, pisa_scores=scores)
                )
    # the leaf-pairs walk: the per-token kernel scoring its nodes and writing leaf candidates; the
    # leaf pairs take the approximate log, and an eighth of their exponentials on the FMA units,
    # only below fp32 (the flags are host code, as on a GPU here)
    from sparseflow.methods.pisa import triton_select_scan as scan

    flags, run = [], scan._leaf_pairs_kernel.run
    scan._leaf_pairs_kernel.run = lambda *a, **kw: flags.append((kw["FAST_LOG"], kw["FMA_EXPS"])) or run(*a, **kw)
    try:
        for scores in ("fp32", "bf16", "tf32"):
            PT.pisa_select(q, k, block_size=64, top_k=8, tuning=Tuning(pisa_walk="leaf_pairs", pisa_scores=scores))
    finally:
        scan._leaf_pairs_kernel.run = run
    want = [(False, 0), (True, 8), (True, 8)]
    assert flags == want, f"the leaf pairs' (FAST_LOG, FMA_EXPS) for fp32, bf16, tf32 scores: {flags}"
    # every walk with 64-bit row offsets (I64_ROWS: a (batch, head) slice past 2**31 elements,
    # which no tensor of this size has)
    from sparseflow.methods.pisa import triton_select_common as common

    passes_int32 = common.passes_int32
    common.passes_int32 = lambda t: True
    try:
        for walk, scores in (("per_token", "bf16"), ("tiled", "bf16"), ("scan", "bf16"), ("leaf_pairs", "fp32")):
            PT.pisa_select(q, k, block_size=64, top_k=8, tuning=Tuning(pisa_walk=walk, pisa_scores=scores))
    finally:
        common.passes_int32 = passes_int32


def run_pisa_tiled(cases):
    from sparseflow import Tuning
    from sparseflow.methods.pisa import triton_select as PT

    for hq, d, dtype, pad, top_k, beam, score, causal in cases:
        q, k, _ = _qkv(2, hq, 2, 900, d, dtype)
        kpm = _pad(2, 900) if pad else None
        PT.pisa_select(
            q,
            k,
            key_padding_mask=kpm,
            is_causal=causal,
            block_size=64,
            top_k=top_k,
            beam=beam,
            score=score,
            tuning=Tuning(pisa_walk="tiled"),
        )


def run_pisa_scan(cases):
    from sparseflow import Tuning
    from sparseflow.methods.pisa import triton_select as PT

    for hq, hkv, d, dtype, pad, top_k, beam, score, causal, branching, n in cases:
        q, k, _ = _qkv(1, hq, hkv, n, d, dtype)
        PT.pisa_select(
            q,
            k,
            key_padding_mask=_pad(1, n) if pad else None,
            is_causal=causal,
            block_size=64,
            top_k=top_k,
            beam=beam,
            score=score,
            branching=branching,
            tuning=Tuning(pisa_walk="scan"),
        )


def run_pisa_scan_layouts(cases):
    """The scan's layouts besides the default (``LAUNCH``): each pair covering a kept parent's
    children (the walk's per-parent counters, the sibling keys in one dot), and the heads' layout
    forced either way (the default, "auto", packs a power-of-two group and loops over the others)."""
    from sparseflow.methods.pisa import triton_select_scan as scan

    saved = dict(scan.LAUNCH)
    try:
        for unit, heads in (("siblings", "packed"), ("leaf", "packed"), ("leaf", "loop"), ("siblings", "loop")):
            scan.LAUNCH.update(pair_unit=unit, heads=heads)
            run_pisa_scan(cases)
    finally:
        scan.LAUNCH.clear()
        scan.LAUNCH.update(saved)


def run_pdl_chain():
    """The scan's and the attention's kernels launched as links of a PDL chain (``Tuning(pdl=True)``,
    kernels.pdl): their griddepcontrol instructions are GPU-only PTX."""
    from sparseflow import Tuning
    from sparseflow.kernels import pdl
    from sparseflow.kernels import token_sparse_triton as TS
    from sparseflow.methods.bsa import triton_impl as BI
    from sparseflow.methods.pisa import triton_impl as PI

    saved = pdl.device_supports
    pdl.device_supports = lambda t: True
    try:
        q, k, v = _qkv(1, 9, 3, 2048, 64, torch.bfloat16)
        PI.pisa_attention(q, k, v, block_size=64, top_k=8, tuning=Tuning(pisa_walk="scan", pdl=True))
        BI.bsa_attention(q, k, v, block_size=64, top_k=8, tuning=Tuning(pdl=True))
        sel = torch.zeros(1, 3, 2048, 8, dtype=torch.int32)
        torch.ops.sparseflow.token_tile_lists(sel, 21, 32, True)
        TS.token_sparse_attention(q, k, v, sel, block_size=64, pdl=True)
        _pair_index(384, PDL=True, launch_pdl=True)
    finally:
        pdl.device_supports = saved


# prompts shorter than, equal to and just past one block (a pyramid of one leaf takes its own
# compile-time path: its walk has no level below the start)
SHORT_LENGTHS = (1, 2, 3, 5, 64, 65)


def run_short_prompts():
    """PISA (every walk), BSA and PBS on prompts of a few tokens: q ``[1, 7, N, 64]`` fp16 with one
    KV head, block 64, K 3 (the launch shapes of a chat's first turn)."""
    from sparseflow import Tuning
    from sparseflow.methods.bsa import triton_impl as BI
    from sparseflow.methods.pbs import triton_gather as TG
    from sparseflow.methods.pbs import triton_impl as TI
    from sparseflow.methods.pisa import triton_impl as PI

    TG._use_kernels = lambda t: True
    for n in SHORT_LENGTHS:
        q, k, v = _qkv(1, 7, 1, n, 64, torch.float16)
        for walk in ("auto", "per_token", "tiled", "scan"):
            PI.pisa_attention(q, k, v, block_size=64, top_k=3, tuning=Tuning(pisa_walk=walk))
        BI.bsa_attention(q, k, v, block_size=64, top_k=3)
        TI.pbs_attention(q, k, v, block_size=64, segment_size=128, tuning=Tuning(pbs_select="triton"))


def run_bsa_bf16():
    from sparseflow.methods.bsa import triton_select as BS

    q, k, _ = _qkv(1, 8, 2, 900, 64, torch.bfloat16)
    for merge in ("packed", "bitonic", "rounds"):
        saved = dict(BS._SELECT_LAUNCH)
        BS._SELECT_LAUNCH.update(merge=merge, block_n=128 if merge == "packed" else 64)
        try:
            for precision in ("ieee", "bf16"):
                BS.bsa_select(q, k, block_size=64, top_k=8, precision=precision)
            BS.bsa_select(q, k, block_size=64, top_k=8, sliding_window=300)  # HAS_WINDOW
            BS.bsa_select(q, k, block_size=64, top_k=8, chunk_size=256)
        finally:
            BS._SELECT_LAUNCH.clear()
            BS._SELECT_LAUNCH.update(saved)


def run_decode(cases):
    from sparseflow import Tuning
    from sparseflow.methods.pisa.pyramid_cache import PyramidCache

    for d, dtype, top_k, beam in cases:
        q, k, v = _qkv(1, 8, 2, 600, d, dtype)
        cache = PyramidCache(k, capacity=1024, block_size=64)
        k1 = torch.randn(1, 2, 1, d).to(dtype)
        kk = torch.cat([k, k1], dim=2)  # decode_step appends the new key itself
        vv = torch.cat([v, torch.randn(1, 2, 1, d).to(dtype)], dim=2)
        cache.decode_step(q[:, :, -1:], kk, vv, top_k=top_k, beam=beam)
        # the graph-capturable step (device length: the append and walk variants that read it)
        static = PyramidCache(k, capacity=1024, block_size=64)
        k_buf, v_buf, length = static.static_buffers(k, v)
        static.decode_step_static(
            q[:, :, -1:], kk[:, :, -1:], vv[:, :, -1:], k_buf, v_buf, length + 1, top_k=top_k, beam=beam
        )
        # the walk with its leaf level split off (Tuning(pisa_walk="leaf_pairs")), bf16 scores
        static.decode_step_static(
            q[:, :, -1:],
            kk[:, :, -1:],
            vv[:, :, -1:],
            k_buf,
            v_buf,
            length + 2,
            top_k=top_k,
            beam=beam,
            tuning=Tuning(pisa_walk="leaf_pairs", pisa_scores="bf16"),
        )


# the split-K decode attention: Hq, Hkv, Nq, D, dtype, C, K, padding, splits (None: the default)
SPLIT_DECODE = [
    (32, 8, 1, 128, torch.bfloat16, 64, 32, False, None),
    (8, 2, 2, 64, torch.float16, 64, 7, True, 3),
    (4, 4, 1, 128, torch.float32, 8, 9, True, 16),
]


def run_split_decode(cases):
    """The split-K decode attention on its own: the benchmark's shape (Hq 32, Hkv 8, C 64, K 32:
    two blocks per loop step), the dtypes, padding, several rows, more splits than blocks."""
    from sparseflow.kernels.token_sparse_decode_triton import token_sparse_decode

    for hq, hkv, nq, d, dtype, c, top_k, pad, splits in cases:
        n = c * top_k + 37  # more blocks than K, the last one partial
        q = _qkv(1, hq, hkv, nq, d, dtype)[0]
        _, k, v = _qkv(1, hq, hkv, n, d, dtype)
        idx = torch.randperm(-(-n // c))[:top_k].expand(1, hkv, nq, top_k).contiguous()
        token_sparse_decode(q, k, v, idx, key_padding_mask=_pad(1, n) if pad else None, block_size=c, splits=splits)


def selftest() -> int:
    """The checker must catch what the interpreter misses: a constant below fp32's smallest
    normal (typed fp64 by Triton) re-typing a loop-carried fp32 value -- this compiled under the
    interpreter and failed on the H200."""
    import triton.language as tl

    @triton.jit
    def _fp64_constant(X, N):
        acc = tl.full([16], float("-inf"), dtype=tl.float32)
        i = 0
        while i < N:
            acc = tl.maximum(acc, tl.log2(tl.maximum(tl.load(X + tl.arange(0, 16)), 1e-38)))
            i += 1
        tl.store(X + tl.arange(0, 16), acc)

    @triton.jit
    def _float_scalar(X, scale, N):
        # compiles with scale typed fp32 (Triton's JIT); typed fp64 (Inductor) the loop-carried
        # fp32 accumulator turns fp64 -- the H200 failure of torch.compile on the PBS attention op
        acc = tl.zeros([16], dtype=tl.float32)
        i = 0
        while i < N:
            acc = acc * scale + tl.load(X + tl.arange(0, 16))
            i += 1
        tl.store(X + tl.arange(0, 16), acc)

    @triton.jit
    def _large_tiles(X):
        # two 256 x 256 fp32 operands of one dot: more shared memory than a program may take
        offs = tl.arange(0, 256)[:, None] * 256 + tl.arange(0, 256)[None, :]
        tl.store(X + offs, tl.dot(tl.load(X + offs), tl.load(X + 65536 + offs)))

    _fp64_constant[(1,)](torch.zeros(16), 3)
    _float_scalar[(1,)](torch.zeros(16), 0.5, 3)
    _large_tiles[(1,)](torch.zeros(2 * 65536))
    too_big = [e for e in ERRORS if e["kernel"] == "_large_tiles" and "shared memory" in e["error"]]
    print("selftest: the large-tile kernel", "was held to the shared memory" if too_big else "PASSED (checker broken)")
    caught = [e for e in ERRORS if e["kernel"] == "_fp64_constant" and "fp64" in e["error"]]
    print(
        "selftest: the fp64-constant kernel", "failed to compile, as it must" if caught else "COMPILED (checker broken)"
    )
    as_jit = "_float_scalar" in COMPILED
    as_inductor = [e for e in ERRORS if e["kernel"].startswith("_float_scalar (float scalars")]
    print(
        "selftest: the float-scalar kernel",
        "compiled with fp32 scalars and failed with fp64 ones, as it must"
        if as_jit and as_inductor
        else "was not caught (checker broken)",
    )
    return 0 if caught and as_jit and as_inductor and too_big else 1


EXPECTED = {
    "_proxy_pass",
    "_lse_combine_kernel",
    "_segment_sort_kernel",
    "_gather_pool_kernel",
    "_select_rows_kernel",
    "_pbs_fwd_kernel",
    "_leaf_kernel",
    "_node_kernel",
    "_pisa_select_kernel",
    "_fwd_kernel",
    "_bwd_dq_kernel",
    "_bwd_dkdv_kernel",
    "_append_kernel",
    "_bsa_select_kernel",
    "_strided_estimate_kernel",
    "_strided_probs_kernel",
    "_split_lse_kernel",
    "_pisa_select_tiled_kernel",
    "_node_scan_kernel",
    "_leaf_pairs_kernel",
    "_leaf_keep_kernel",
    "_append_static_kernel",
    "_decode_split_kernel",
    "_decode_combine_kernel",
    "_tile_lists_kernel",
    "_pair_order_kernel",
    "_level_tables_kernel",
    "_pair_index_kernel",
    "_leaf_split_kernel",
    "scan_walk_rows_kernel",
}


ENTRIES = [
    "pbs",
    "pbs_strided",
    "pisa_bsa",
    "pisa_tiled",
    "pisa_scan",
    "token_window",
    "bsa_select",
    "decode",
    "split_decode",
    "short",
    "pisa_scores",
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write compiled kernels and errors here")
    ap.add_argument("--quick", action="store_true", help="one case per entry point")
    ap.add_argument("--selftest", action="store_true", help="only check that a known-bad kernel is caught")
    ap.add_argument(
        "--entries",
        help=f"comma list of the entry points to drive (default all: {','.join(ENTRIES)}); a subset "
        "reports its kernels and leaves the check for missing ones to whoever joins the subsets",
    )
    args = ap.parse_args(argv)
    install()
    if args.selftest:
        return selftest()
    bf16, fp16 = torch.bfloat16, torch.float16
    pbs = [
        (128, bf16, "query_head", False, True, 0.9, True, 1),
        (64, fp16, "kv_head", True, True, 0.9, False, 1),
        (128, bf16, "query_head", False, True, 1.0, False, 1),
        (80, bf16, "kv_head", True, False, 0.8, False, 1),
        (64, bf16, "query_head", True, True, 0.9, False, 3),
        # fp32 (the strided entry's last case): every config of the forward for it too
        (64, torch.float32, "query_head", False, True, 0.9, False, 1),
    ]
    pisa = [
        (64, bf16, False, 8, 1, "lse"),
        (128, bf16, True, 32, 1, "lse"),
        (64, fp16, True, 8, 2, "mean_var"),
        (64, bf16, False, 8, 4, "lse"),
    ]
    dec = [(64, bf16, 8, 1), (128, bf16, 8, 2)]
    # the tiled walk: Hq, D, dtype, padding, K, beam, score, causal. The widest group is 8 (Hq 16 /
    # Hkv 2): the benchmark's group of 16 (a non-default walk) took 52 s of the CI's CPU to compile
    # against 3 s for 8; it compiles on the GPU in benchmarks/pisa.py's runs
    tiled = [
        (16, 64, bf16, False, 8, 1, "lse", True),
        (6, 128, fp16, True, 8, 2, "mean_var", True),
        (4, 64, torch.float32, True, 8, 1, "mean", False),
        (2, 64, bf16, False, 16, 2, "lse", True),
    ]
    # the scan walk: Hq, Hkv, D, dtype, padding, K, beam, score, causal, g, N (SmolLM2's 8K and 32K
    # shapes first)
    scan = [
        (9, 3, 64, bf16, False, 8, 1, "lse", True, 2, 8192),
        (9, 3, 64, bf16, False, 8, 1, "lse", True, 2, 32768),
        (32, 2, 64, bf16, True, 8, 2, "mean_var", True, 2, 2000),
        (4, 2, 128, fp16, False, 8, 1, "mean", False, 2, 2000),
        (2, 2, 64, torch.float32, True, 4, 1, "lse", True, 3, 900),
    ]
    # n, d, dtype, gqa, padding, causal, scoring, stride (n = 768: every query and key valid, EXACT_CNT)
    strided = [
        (700, 128, bf16, "kv_head", False, True, "sampled_rows", 8),
        (700, 128, bf16, "query_head", True, True, "antidiagonal", 8),
        (768, 128, bf16, "kv_head", False, True, "antidiagonal", 4),
        (700, 64, fp16, "kv_head", True, False, "sampled_rows", 1),
        (700, 64, torch.float32, "query_head", False, True, "antidiagonal", 2),
        (700, 128, bf16, "query_head", False, True, "sampled_rows", 3),
    ]
    if args.quick:
        pbs, pisa, dec, strided, tiled, scan = pbs[:1], pisa[:1], dec[:1], strided[:1], tiled[:1], scan[:1]
    runs = {
        "pbs": lambda: (run_pbs(pbs), run_pbs_window(PBS_WINDOW[: 1 if args.quick else None])),
        "pbs_strided": lambda: run_pbs_strided(strided),
        "pisa_bsa": lambda: (run_pisa_bsa(pisa), run_pisa_window("per_token", ((300, 0), (0, 256)))),
        "pisa_tiled": lambda: (run_pisa_tiled(tiled), run_pisa_window("tiled")),
        "pisa_scan": lambda: (
            run_pisa_scan(scan),
            run_pisa_scan_layouts(scan[::2]),
            run_pdl_chain(),
            run_pisa_window("scan"),
        ),
        "token_window": lambda: run_token_window(TOKEN_WINDOW[: 1 if args.quick else None]),
        "bsa_select": run_bsa_bf16,
        "short": run_short_prompts,
        "pisa_scores": run_pisa_scores,
        "decode": lambda: run_decode(dec),
        "split_decode": lambda: run_split_decode(SPLIT_DECODE[: 1 if args.quick else None]),
    }
    entries = ENTRIES if args.entries is None else [e.strip() for e in args.entries.split(",") if e.strip()]
    unknown = sorted(set(entries) - set(runs))
    if unknown or not entries:
        ap.error(f"--entries takes a comma list of {','.join(ENTRIES)}; got {args.entries!r}")
    failures = []
    seconds = {}
    for name in entries:
        _ALL_CONFIGS[0] = name == "pbs"
        start, before = time.perf_counter(), len(COMPILED)
        try:
            runs[name]()
        except Exception:  # host-side failure around the launches: report, go on
            failures.append({"entry": name, "error": traceback.format_exc()[-2000:]})
        seconds[name] = {"seconds": round(time.perf_counter() - start, 1), "compiles": len(COMPILED) - before}
    everything = set(entries) == set(ENTRIES)
    missing = sorted(EXPECTED - set(COMPILED)) if everything else []
    report = {
        "target": f"{TARGET.backend} sm_{TARGET.arch}",
        "triton": triton.__version__,
        "compiled": sorted(set(COMPILED)),
        "compiles": len(COMPILED),
        "errors": ERRORS,
        "host_failures": failures,
        "missing": missing,
        "entries": entries,
        "entry_seconds": seconds,
        "kernel_seconds": {k: round(v, 1) for k, v in sorted(SECONDS.items(), key=lambda kv: -kv[1])},
        "expected": sorted(EXPECTED),
        "all_entries": ENTRIES,
    }
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    print(
        f"compiled {len(COMPILED)} kernel variants ({len(set(COMPILED))} kernels) for sm_90; "
        f"{len(ERRORS)} compile errors; {len(failures)} host failures; missing {missing}"
    )
    for e in ERRORS:
        print(f"COMPILE ERROR in {e['kernel']}: {e['error']}")
    for f in failures:
        print(f"HOST FAILURE in {f['entry']}:\n{f['error']}")
    return 1 if (ERRORS or failures or missing) else 0


if __name__ == "__main__":
    sys.exit(main())
