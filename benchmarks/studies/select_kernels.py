"""Launch variants of the selection kernels at one length (SmolLM2's attention shape: B 1, Hq 9,
Hkv 3, D 64, bf16, causal; keys with a drift so block means differ): the BSA selector's merge /
tile / warps, the PBS strided estimate's row tile and key splits, PISA's walk settings, and the
token-sparse tiles' block lists (kernel against torch). Each variant's selection is checked equal
to the default's. Times are CUDA-event walls of back-to-back calls: a launch-bound call reads
its host cost. Prints a table (kept as a log).

    python benchmarks/studies/select_kernels.py 8192 | tee benchmarks/results/select_kernels_8k_h200.log
"""

import sys
import itertools
import torch

sys.path.insert(0, __import__("os").path.join(__import__("os").path.dirname(__file__), "..", ".."))
import sparseflow
from sparseflow.tuning import Tuning
from sparseflow.methods.bsa import triton_select as bs
from sparseflow.methods.pisa import triton_select as ps
from sparseflow.methods.pbs import triton_estimate as est
from sparseflow.kernels.block_summaries_triton import leaf_sums

N = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
torch.manual_seed(0)
B, HQ, HKV, D = 1, 9, 3, 64
dev = "cuda"
q = torch.randn(B, HQ, N, D, device=dev, dtype=torch.bfloat16)
k = torch.randn(B, HKV, N, D, device=dev, dtype=torch.bfloat16)
k = k + torch.linspace(0, 2, N, device=dev, dtype=torch.bfloat16)[None, None, :, None] * torch.randn(
    1, HKV, 1, D, device=dev, dtype=torch.bfloat16
)


def tm(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    s = torch.cuda.Event(enable_timing=True)
    e = torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / reps * 1e3


sdpa = tm(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True))
print(f"N={N} sdpa {sdpa:.1f} us")
# ---------------- BSA select kernel
sums, cnt, lfv = leaf_sums(k, None, 64)
best = None
for topk in (8, 16):
    args = (q, sums, cnt, lfv, N, 0.125, True, 64, topk, True, True)
    bs._SELECT_LAUNCH.update(block_m=32, block_n=64, num_warps=4, merge="bitonic")
    ref = bs._bsa_select_fwd(*args, "ieee").clone()
    rows = []
    grid = list(itertools.product(("bitonic", "packed"), (16, 32, 64), (64, 128), (2, 4, 8)))
    if best is not None:
        grid = [("bitonic", 32, 64, 4)] + [r[1:5] for r in best[:4]]
    for merge, bm, bn, w in grid:
        bs._SELECT_LAUNCH.update(block_m=bm, block_n=bn, num_warps=w, merge=merge)
        try:
            got = bs._bsa_select_fwd(*args, "ieee")
            same = torch.equal(got, ref)
            t = tm(lambda: bs._bsa_select_fwd(*args, "ieee"))
        except Exception as ex:
            print("fail", merge, bm, bn, w, type(ex).__name__, str(ex)[:100])
            continue
        rows.append((t, merge, bm, bn, w, same))
    rows.sort()
    best = best or rows
    print(f"-- bsa select K={topk}")
    for r in rows[:8]:
        print(f"   {r[0]:7.1f} us  merge={r[1]} bm={r[2]} bn={r[3]} w={r[4]} same={r[5]}", flush=True)
    for r in rows:
        if r[1:5] == ("bitonic", 32, 64, 4):
            print(f"   default {r[0]:.1f} us")
    b = rows[0]
    bs._SELECT_LAUNCH.update(block_m=b[2], block_n=b[3], num_warps=b[4], merge=b[1])
    print(f"   best + bf16: {tm(lambda: bs._bsa_select_fwd(*args, 'bf16')):.1f} us", flush=True)
    bs._SELECT_LAUNCH.update(block_m=32, block_n=64, num_warps=4, merge="bitonic")
# ---------------- PBS strided estimate (recipe)
rows = []
ref = None
for (bm, bn, w), sp in itertools.product(
    [(128, 128, 8), (128, 64, 4), (64, 128, 8), (64, 64, 4), (32, 64, 4), (32, 128, 4)], (1, 2, 4, 8, 16)
):

    def f(bm=bm, bn=bn, w=w, sp=sp):
        return est.strided_estimate(
            q,
            k,
            None,
            None,
            None,
            scoring="sampled_rows",
            stride=8,
            hp=HKV,
            block_size=128,
            segment_size=256,
            block_m=bm,
            block_n=bn,
            num_warps=w,
            key_splits=sp,
        )

    try:
        lbm, lse = f()
        if ref is None:
            ref = (lbm.clone(), lse.clone())
        err = max(
            (lbm - ref[0]).nan_to_num(0, 0, 0).abs().max().item(), (lse - ref[1]).nan_to_num(0, 0, 0).abs().max().item()
        )
        rows.append((tm(f), bm, bn, w, sp, err))
    except Exception as ex:
        print("fail est", bm, bn, w, sp, type(ex).__name__, str(ex)[:100])
print("-- strided estimate (sampled_rows, bs128, stride 8); default = 128/128/8 splits None")
for r in sorted(rows):
    print(f"   {r[0]:7.1f} us  bm={r[1]} bn={r[2]} w={r[3]} splits={r[4]} maxdiff={r[5]:.2e}", flush=True)
# ---------------- PISA select

ref = ps.pisa_select(q, k, tuning=Tuning())
for name, tu in [
    ("auto", Tuning()),
    ("w1", Tuning(pisa_warps=1)),
    ("w2", Tuning(pisa_warps=2)),
    ("w4", Tuning(pisa_warps=4)),
    ("w1-32k", Tuning(pisa_warps=1, pisa_leaf_bytes=32768)),
    ("tiled", Tuning(pisa_walk="tiled")),
    ("tiled-w4", Tuning(pisa_walk="tiled", pisa_warps=4)),
]:
    try:
        got = ps.pisa_select(q, k, tuning=tu)
        print(
            f"   pisa {name:8s} {tm(lambda: ps.pisa_select(q, k, tuning=tu), 5):8.1f} us same={torch.equal(got, ref)}"
        )
    except Exception as ex:
        print("fail pisa", name, type(ex).__name__, str(ex)[:100])
# ---------------- tile lists
from sparseflow.kernels import token_sparse_triton as ts  # noqa: E402
from sparseflow.methods.bsa.triton_select import bsa_select  # noqa: E402

for topk in (8, 16):
    idx = bsa_select(q, k, top_k=topk).to(torch.int32).contiguous()
    a = ts.tile_block_lists(idx, 16, N // 64)
    r = ts.tile_block_lists_torch(idx, 16, N // 64)
    print(
        f"-- lists K={topk}: same={torch.equal(a[0], r[0]) and torch.equal(a[1], r[1])} kernel {tm(lambda: ts.tile_block_lists(idx, 16, N // 64)):.1f} us torch {tm(lambda: ts.tile_block_lists_torch(idx, 16, N // 64)):.1f} us"
    )
    sel = idx
    for name, fn in (
        (
            "bsa op",
            lambda: sparseflow.attention(q, k, k, config=sparseflow.config.BSAConfig(top_k=topk), backend="triton"),
        ),
    ):
        print(f"   {name} K={topk}: {tm(fn):.1f} us")
