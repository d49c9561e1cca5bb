"""How much of the token-sparse attention's work is its tiles' unions. A tile of ``T`` consecutive
query tokens walks the union of the key blocks its tokens keep, for all ``T`` of them: the
row-blocks visited over the blocks the tokens keep is the work done per block kept.

For SmolLM2-135M-Instruct's layers on real text (their q/k captured by one dense forward, on the
CPU by default) and PISA's reference selection at its defaults (C 64, K 8):

    python benchmarks/studies/pisa_tile_unions.py --n 8192 --layers 3,15,27 \\
        --json benchmarks/results/pisa_tile_unions_8k_cpu.json
"""

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, ".."))

from common import env_info, write_result  # noqa: E402
from sparseflow.methods.pisa import reference as pisa_ref  # noqa: E402


def _tile_distinct(sel: torch.Tensor, tile: int):
    """``(sorted ids, first-of-a-run flags)`` of each tile's kept blocks, ``[B, Hkv, tiles,
    tile * K]`` (unused slots sort last and are never first)."""
    b, hkv, n, k = sel.shape
    pad = -n % tile
    ids = torch.nn.functional.pad(sel, (0, 0, 0, pad), value=-1).reshape(b, hkv, -1, tile * k)
    big = torch.iinfo(ids.dtype).max
    srt = torch.where(ids >= 0, ids, big).sort(-1).values
    first = torch.ones_like(srt, dtype=torch.bool)
    first[..., 1:] = srt[..., 1:] != srt[..., :-1]
    return srt, first & (srt != big)


def union_rows_blocks(sel: torch.Tensor, tile: int) -> int:
    """The row-blocks a tiled walk visits: each tile of ``tile`` consecutive rows times the
    distinct blocks its rows keep, summed (``sel [B, Hkv, Nq, K]``, ``-1`` unused)."""
    n = sel.shape[2]
    _, first = _tile_distinct(sel, tile)
    distinct = first.sum(-1)  # [B, Hkv, tiles]
    rows = torch.full((distinct.shape[-1],), tile)
    rows[-1] = n - tile * (distinct.shape[-1] - 1)
    return int((distinct * rows).sum())


def whole_block_share(sel: torch.Tensor, tile: int, block_size: int) -> float:
    """Of the blocks the causal tiles list (``Nq == Nk``), the share that lie wholly before each
    tile's first row: the attention's trips that need no per-key causal test."""
    srt, first = _tile_distinct(sel, tile)
    first_row = torch.arange(srt.shape[2]) * tile
    whole = first & (srt < ((first_row + 1) // block_size)[:, None])
    return int(whole.sum()) / max(1, int(first.sum()))


def main(argv=None) -> int:
    from pisa_layer_kernels import real_layer_qkv

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--layers", default="3,15,27")
    ap.add_argument("--tiles", default="1,8,16,21,32,42,64", help="tile heights in tokens, comma list")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    tiles = [int(x) for x in args.tiles.split(",")]
    layers = [int(x) for x in args.layers.split(",")]
    rows = []
    for layer, (q, k, _) in sorted(real_layer_qkv(args.n, layers, device=args.device).items()):
        sel = pisa_ref.pisa_select(q.float(), k.float(), block_size=64, top_k=8)
        kept = int((sel >= 0).sum())
        factors = {t: union_rows_blocks(sel, t) / kept for t in tiles}
        whole = {t: whole_block_share(sel, t, 64) for t in tiles}
        rows.append({"layer": layer, "kept_blocks": kept, "union_over_kept": factors, "whole_block_share": whole})
        print(
            f"layer {layer:2d}: row-blocks visited / blocks kept, by tile height "
            + ", ".join(f"{t}: {f:.2f}x" for t, f in factors.items())
        )
        print(
            f"layer {layer:2d}: listed blocks wholly before the tile's first row, by tile height "
            + ", ".join(f"{t}: {f:.1%}" for t, f in whole.items())
        )
    if args.json:
        write_result(args.json, env_info(args.device), args, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
