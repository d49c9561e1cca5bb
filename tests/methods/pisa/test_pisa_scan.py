"""The scan PISA walk (``Tuning.pisa_walk="scan"``) against the reference, on the CPU through
Triton's interpreter (TRITON_INTERPRET=1, set in conftest.py) on small, odd shapes; the same
tests run compiled on CUDA. Selections must equal the reference's exactly.
"""

from __future__ import annotations

import logging

import pytest
import torch
from _cuda_graphs import capture
from _pisa_walk_inputs import walk_inputs

import sparseflow
from sparseflow import Tuning
from sparseflow.methods.pisa import reference as pisa_ref

triton = pytest.importorskip("triton")
from sparseflow.methods.pisa import triton_select  # noqa: E402  (imports triton)
from sparseflow.methods.pisa import triton_select_common as common  # noqa: E402
from sparseflow.methods.pisa import triton_select_scan as scan  # noqa: E402
import triton.language as tl  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SCAN = Tuning(pisa_walk="scan")
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.fixture
def scan_calls(monkeypatch):
    """Counts the scan walk's launches."""
    calls = []
    real = scan.pisa_select_scan_fwd

    def op(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(scan, "pisa_select_scan_fwd", op)
    return calls


# (LAUNCH["pair_unit"], LAUNCH["heads"]): scored pairs of one leaf or of a kept parent's children,
# and a group's heads packed into one dot's rows or one dot a head
LAYOUTS = {
    "leaf-pairs-packed-heads": ("leaf", "packed"),
    "sibling-pairs-packed-heads": ("siblings", "packed"),
    "leaf-pairs-head-loop": ("leaf", "loop"),
    "sibling-pairs-head-loop": ("siblings", "loop"),
}


def _use_layout(monkeypatch, layout):
    unit, heads = layout
    monkeypatch.setitem(scan.LAUNCH, "pair_unit", unit)
    monkeypatch.setitem(scan.LAUNCH, "heads", heads)
    return layout


# the small tiles run the default and the layout with both changes (each change alone runs
# with the reference cases), to keep the interpreter's time in CI down
EDGE_LAYOUTS = {k: LAYOUTS[k] for k in ("leaf-pairs-packed-heads", "sibling-pairs-head-loop")}


# id: (B, Hq, Hkv, Nq, Nk, D, C, K, g, score, causal, pad, dtype, beam)
CASES = {
    "lse-bf16-g2-nq40-nk133": (1, 2, 1, 40, 133, 32, 16, 3, 2, "lse", True, False, BF16, 1),
    "lse-fp16-g3-hq9-pad-nq29-nk83": (1, 9, 3, 29, 83, 16, 8, 3, 2, "lse", True, True, F16, 1),
    "mean_var-g3-br3-pad-b2-nq30-nk97": (2, 3, 1, 30, 97, 24, 8, 5, 3, "mean_var", True, True, F32, 1),
    "mean-g1-noncausal-pad-nq25-nk77": (1, 2, 2, 25, 77, 16, 8, 3, 2, "mean", False, True, F32, 1),
    "lse-beam2-g2-nq40-nk150": (1, 4, 2, 40, 150, 16, 8, 5, 2, "lse", True, False, F32, 2),
    "mean_var-beam2-g4-noncausal-nq21-nk101": (1, 8, 2, 21, 101, 16, 8, 3, 2, "mean_var", False, False, F32, 2),
}


# each case runs under one layout, the four taking turns: every layout meets at least one case,
# every pair unit and every head mode three, spread over the scores, dtypes and beams (the
# interpreter's time in CI: a case under every layout ran twice as long for no branch of its own)
TURNS = ("leaf-pairs-packed-heads", "sibling-pairs-head-loop", "leaf-pairs-head-loop", "sibling-pairs-packed-heads")
SCAN_RUNS = [
    pytest.param(case, LAYOUTS[TURNS[i % 4]], id=f"{TURNS[i % 4]}-{name}")
    for i, (name, case) in enumerate(CASES.items())
]


@pytest.mark.parametrize("case, layout", SCAN_RUNS)
def test_scan_selection_equals_reference(case, layout, scan_calls, monkeypatch):
    _use_layout(monkeypatch, layout)
    b, hq, hkv, nq, nk, d, c, kk, g, score, causal, pad, dtype, beam = case
    q, k, kpm = walk_inputs(b, hq, hkv, nq, nk, d, dtype, pad, seed=nq)
    kw = dict(key_padding_mask=kpm, is_causal=causal, block_size=c, top_k=kk, branching=g, score=score, beam=beam)
    want = pisa_ref.pisa_select(q, k, **kw)
    got = triton_select.pisa_select(q, k, tuning=SCAN, **kw)
    assert len(scan_calls) == 1, "the scan walk must have run"
    assert got.dtype == torch.long and got.shape == want.shape
    assert len(triton_select.level_sizes(-(-nk // c), g)) >= 3, "the case must exercise scored intermediate levels"
    assert ((want >= 0).sum(-1) < -(-nk // c)).any(), "the case must be sparse somewhere"
    assert torch.equal(got, want)


# (chunks per program, heads per KV head, layout): every value of each axis, and the layouts
# each with one and with several chunks and heads (the interpreter's time in CI)
SMALL_TILE_CASES = [
    (1, 1, "leaf-pairs-packed-heads"),
    (3, 1, "sibling-pairs-head-loop"),
    (3, 3, "leaf-pairs-packed-heads"),
    (3, 17, "sibling-pairs-head-loop"),
]


@pytest.mark.parametrize(
    "chunks, group, layout",
    SMALL_TILE_CASES,
    ids=[f"{lay}-{c}-chunks-per-program-group-{g}" for c, g, lay in SMALL_TILE_CASES],
)
def test_small_tiles_and_pair_chunks(scan_calls, monkeypatch, poisoned, chunks, group, layout):
    """16-row node tiles with dots of 16 summary columns, and leaf-pair chunks of 16 rows, one
    or three per program (a leaf's pairs span several programs, and a program's last chunk or
    chunks run past its segment's end): still the reference's selection. A group of 3 heads packs
    5 queries (15 rows) into a tile or chunk of 16 rows; a group of 17, one query in 32 rows. Fresh buffers come poisoned (floats
    NaN), so a pair left unscored cannot pass for a scored one."""
    _use_layout(monkeypatch, EDGE_LAYOUTS[layout])
    monkeypatch.setitem(scan.LAUNCH, "rows", 16)
    monkeypatch.setitem(scan.LAUNCH, "pair_rows", 16)
    monkeypatch.setitem(scan.LAUNCH, "pair_chunks", chunks)
    monkeypatch.setitem(scan.LAUNCH, "scan_cols", 16)  # 8 nodes of 2 children per node-scan dot
    assert scan.packed_rows(group, 16) == {1: (16, 16), 3: (5, 16), 17: (1, 32)}[group]
    index = []  # each segment's scored pairs and the pairs a program takes, as the walk asks
    real_index = scan.leaf_pair_index

    def spy(counts, slots, per_program, chain=None):
        index.append((counts.cpu(), per_program))
        return real_index(counts, slots, per_program, chain)

    monkeypatch.setattr(scan, "leaf_pair_index", spy)
    # the last 64 queries of 190 keys (bottom-right aligned): a leaf still gets more scored pairs
    # than a program takes (up to 64 against at most 48), at 2/5 of 160 queries' interpreter time
    q, k, _ = walk_inputs(1, group, 1, 64, 190, 16, F32, False, seed=4)
    kw = dict(is_causal=True, block_size=8, top_k=5)  # 3 forced blocks: 2 kept by score
    want = pisa_ref.pisa_select(q, k, **kw)
    got = poisoned(triton_select.pisa_select, q, k, tuning=SCAN, **kw)
    assert torch.equal(got, want)
    assert len(scan_calls) == 1
    ((counts, per_program),) = index
    assert (counts > per_program).any(), "a segment's pairs must span several programs"
    assert (counts % per_program != 0).any(), "a program's chunks must run past its segment's end"


def test_auto_runs_the_scan_on_cuda_only(scan_calls):
    """``"auto"`` takes the scan where it was timed (CUDA); interpreted, the per-token walk."""
    q, k, _ = walk_inputs(1, 2, 1, 12, 70, 16, F32, False)
    kw = dict(block_size=8, top_k=3)
    got = triton_select.pisa_select(q, k, tuning=Tuning(), **kw)
    assert torch.equal(got, pisa_ref.pisa_select(q, k, **kw))
    assert len(scan_calls) == (1 if DEVICE == "cuda" else 0)
    triton_select.pisa_select(q, k, tuning=Tuning(pisa_walk="per_token"), **kw)
    assert len(scan_calls) == (1 if DEVICE == "cuda" else 0)


UNITS = {"one-leaf": (1, 1), "sibling-pairs": (2, 2), "three-siblings-in-4-slots": (3, 4)}


@pytest.mark.parametrize("unit", UNITS.values(), ids=UNITS.keys())
def test_leaf_pair_index_groups_the_scored_pairs_by_unit(unit):
    """The index alone, from candidates, per-segment counts and ranks as the walk leaves them
    (ranks in a random order, as atomics hand them out): every unit holding a scored slot once, by
    its first slot, grouped by (row block, unit), the chunks covering each group and the programs
    past the last chunk marked with the segment count. A unit is one leaf, or a kept parent's
    ``leaves`` children in ``slots`` consecutive slots (some of them invalid or forced)."""
    leaves, slots = unit
    g = torch.Generator().manual_seed(2)
    rows, n_q, cw, n_leaves, top_k, qb = 2, 9, 8, 7, 2, 2
    n_units = -(-n_leaves // leaves)
    parent = torch.randint(0, n_units, (rows, n_q, cw // slots), generator=g, dtype=torch.int32)
    child = torch.arange(slots, dtype=torch.int32).repeat(cw // slots)
    cand = parent.repeat_interleave(slots, -1) * leaves + child
    cand[(child >= leaves).expand_as(cand) | (cand >= n_leaves) | (torch.rand(cand.shape, generator=g) < 0.3)] = -1
    cand[0, :, 0] = cand[0, :, 0].clamp_min(0) | (1 << 30)  # forced
    cand[1, 3, 2:] = -1  # a row with no more valid candidates than top_k: nothing to score
    valid = cand >= 0
    scored = valid & (cand < (1 << 30)) & (valid.sum(-1, keepdim=True) > top_k)
    unit_scored = scored.view(rows, n_q, cw // slots, slots).any(-1).view(-1)
    seg_of = (torch.arange(rows).view(rows, 1, 1) * n_units + parent).view(-1)
    first_slot = torch.arange(cand.numel()).view(-1, slots)[:, 0]
    counts = torch.zeros(rows * n_units, dtype=torch.int32)
    rank = torch.full((cand.numel(),), -7, dtype=torch.int32)
    for u in torch.randperm(unit_scored.numel(), generator=g).tolist():
        if unit_scored[u]:
            rank[first_slot[u]] = counts[seg_of[u]]
            counts[seg_of[u]] += 1
    assert (counts > 1).any() and unit_scored.any() and not unit_scored.all()
    seg_end, chunk_end, prog_seg = scan.leaf_pair_index(counts.to(DEVICE), cand.numel() // slots, qb)
    order = scan.pair_order(
        cand.to(DEVICE), rank.view(cand.shape).to(DEVICE), seg_end, top_k, n_leaves, 4, unit=unit
    ).cpu()
    seg = torch.cat([torch.zeros(1, dtype=torch.long), seg_end.cpu().long()])
    assert sorted(order[: int(seg[-1])].tolist()) == first_slot[unit_scored].tolist()
    for s in range(rows * n_units):
        members = order[seg[s] : seg[s + 1]].long()
        assert (members // (n_q * cw) == s // n_units).all() and (seg_of[members // slots] == s).all()
    counts = counts.long()
    assert torch.equal(seg[1:], torch.cumsum(counts, 0))
    assert torch.equal(chunk_end.cpu().long(), torch.cumsum((counts + qb - 1) // qb, 0))
    n_chunks = int(chunk_end[-1])
    prog_seg = prog_seg.cpu()
    assert prog_seg.numel() >= n_chunks and prog_seg.dtype == torch.int32
    assert (prog_seg[n_chunks:] == rows * n_units).all() and (prog_seg[:n_chunks] < rows * n_units).all()
    assert torch.equal(
        prog_seg[:n_chunks].long(), torch.repeat_interleave(torch.arange(rows * n_units), (counts + qb - 1) // qb)
    )


def test_dot_rows_of_each_head_layout(monkeypatch):
    monkeypatch.setitem(scan.LAUNCH, "heads", "loop")
    assert [scan.dot_rows(g, 128) for g in (1, 3, 16)] == [(128, 128, True), (64, 64, True), (16, 16, True)]
    monkeypatch.setitem(scan.LAUNCH, "heads", "packed")
    assert scan.dot_rows(3, 128) == (42, 128, False)
    monkeypatch.setitem(scan.LAUNCH, "heads", "auto")  # packed for a power-of-two group, else the loop
    assert [scan.dot_rows(g, 128) for g in (1, 3, 4, 6, 16)] == [
        (128, 128, False),
        (64, 64, True),
        (32, 128, False),
        (32, 32, True),
        (8, 128, False),
    ]
    monkeypatch.setitem(scan.LAUNCH, "heads", "padded")
    with pytest.raises(ValueError, match=r'LAUNCH\["heads"\] must be "auto", "packed" or "loop", got \'padded\''):
        scan.dot_rows(3, 128)


def test_pair_unit_names_the_expected_values(monkeypatch):
    monkeypatch.setitem(scan.LAUNCH, "pair_unit", "siblings")
    assert scan.pair_unit(3) == (3, 4) and scan.pair_unit(2) == (2, 2)
    monkeypatch.setitem(scan.LAUNCH, "pair_unit", "parent")
    with pytest.raises(ValueError, match=r'LAUNCH\["pair_unit"\] must be "leaf" or "siblings", got \'parent\''):
        scan.pair_unit(2)


@pytest.mark.parametrize(
    "n_seg,qb,most",
    [(1, 4, 3), (7, 2, 5), (300, 8, 0), (1500, 128, 700), (2049, 16, 40), (4096, 2, 9), (5000, 4, 3)],
    ids=lambda v: str(v),
)
def test_leaf_pair_index_program_matches_torch(n_seg, qb, most, poisoned):
    """The Triton index (GPU / interpreter) equals the torch ops' on random counts: empty
    segments, segments of many chunks, programs over several blocks (one program of the index
    each), no pair at all, the most segments a program holds (4096) and more (torch). Its fresh buffers are poisoned with -7,
    so a slot it fails to write shows."""
    g = torch.Generator().manual_seed(n_seg)
    counts = torch.randint(0, most + 1, (n_seg,), generator=g, dtype=torch.int32)
    counts[::7] = 0
    slots = int(counts.sum()) + 5 * qb + 3
    want = scan.leaf_pair_index_torch(counts, slots, qb)
    got = poisoned(scan.leaf_pair_index, counts.to(DEVICE), slots, qb)
    for name, w, o in zip(("seg_end", "chunk_end", "prog_seg"), want, got):
        assert o.dtype == torch.int32 and torch.equal(o.cpu(), w), name


# each pair of (queries a program, pair unit, case) once: half the cross product's interpreter time
ROWS_WALK_RUNS = [
    (1, "leaf", "lse-fp16-g3-hq9-pad-nq29-nk83"),
    (4, "siblings", "lse-fp16-g3-hq9-pad-nq29-nk83"),
    (1, "siblings", "lse-bf16-g2-nq40-nk133"),
    (4, "leaf", "lse-bf16-g2-nq40-nk133"),
]


@pytest.mark.parametrize("queries, unit, case", ROWS_WALK_RUNS, ids=lambda v: str(v))
def test_rows_walk_by_other_query_counts_keeps_the_reference(queries, unit, case, scan_calls, monkeypatch, poisoned):
    """The scan's walk from its table takes ``WALK_QUERIES`` queries a program (2); one, and four
    (29 queries: the last program's rows run past the last query), select the reference's blocks.
    The walk writes into views of larger buffers: rows past the last query stay untouched, and
    every segment's ranks are 0 .. its count - 1 (a row past the last query that counted a pair
    would break both). Fresh buffers come poisoned, so a candidate or rank left unwritten shows."""
    from sparseflow.methods.pisa import triton_select_scan_walk as rows_walk

    monkeypatch.setattr(rows_walk, "WALK_QUERIES", queries)
    monkeypatch.setitem(scan.LAUNCH, "pair_unit", unit)
    seen = []
    real = scan._rows_walk

    def padded(call, table, cand, counts, rank, cw, unit_, trace):
        rows, n_q, _ = cand.shape
        big_cand, big_rank = (torch.full((rows, n_q + 4, cw), -7, dtype=torch.int32) for _ in range(2))
        real(call, table, big_cand[:, :n_q], counts, big_rank[:, :n_q], cw, unit_, trace)
        cand.copy_(big_cand[:, :n_q])
        rank.copy_(big_rank[:, :n_q])
        seen.append((big_cand[:, n_q:], big_rank[:, n_q:], cand.clone(), counts.clone(), rank.clone(), unit_))

    monkeypatch.setattr(scan, "_rows_walk", padded)
    b, hq, hkv, nq, nk, d, c, kk, g, score, causal, pad, dtype, beam = CASES[case]
    q, k, kpm = walk_inputs(b, hq, hkv, nq, nk, d, dtype, pad, seed=nq)
    kw = dict(key_padding_mask=kpm, is_causal=causal, block_size=c, top_k=kk, branching=g, score=score, beam=beam)
    want = pisa_ref.pisa_select(q, k, **kw)
    got = poisoned(triton_select.pisa_select, q, k, tuning=SCAN, **kw)
    assert len(scan_calls) == 1 and len(seen) == 1, "the rows walk must have run"
    assert torch.equal(got, want)
    past_cand, past_rank, cand, counts, rank, (leaves, slots) = seen[0]
    assert (past_cand == -7).all() and (past_rank == -7).all(), "a row past the last query was written"
    valid = cand >= 0
    scored = valid & (cand < (1 << 30)) & (valid.sum(-1, keepdim=True) > kk)
    first = scored.view(*cand.shape[:2], -1, slots).any(-1)  # a unit's pair sits at its first slot
    ids = torch.where(valid, cand & ((1 << 30) - 1), -1).view(*cand.shape[:2], -1, slots).amax(-1) // leaves
    segment = torch.arange(cand.shape[0]).view(-1, 1, 1) * (counts.numel() // cand.shape[0]) + ids
    ranks = rank.view(*cand.shape[:2], -1, slots)[..., 0]
    for s in range(counts.numel()):
        mine = ranks[first & (segment == s)]
        assert sorted(mine.tolist()) == list(range(int(counts[s]))), f"segment {s}"


def test_queries_before_every_key_select_nothing(scan_calls):
    """Causal with more queries than keys: the first queries see no key (all -1)."""
    q, k, _ = walk_inputs(1, 2, 1, 70, 40, 16, F32, False)
    kw = dict(is_causal=True, block_size=4, top_k=3)
    want = pisa_ref.pisa_select(q, k, **kw)
    got = triton_select.pisa_select(q, k, tuning=SCAN, **kw)
    assert len(scan_calls) == 1 and (want[..., :30, :] == -1).all()
    assert torch.equal(got, want)


@pytest.mark.parametrize("score", ["lse", "mean_var"])
def test_ties_go_to_the_lower_block(score, scan_calls):
    """Every leaf block holds the same keys: all scores tie, at every level, and each row keeps
    the lowest ids (the reference's order), in the scan and in the per-token walk (whose keep
    breaks ties at every level, the leaves included). Small integers: every dot is exact in any
    summation order (the interpreter's matmul, a BLAS, sums edge columns in another order than
    the rest on some CPUs, which would part ties of random floats by an ulp)."""
    g = torch.Generator().manual_seed(5)
    q = torch.randint(-3, 4, (1, 2, 30, 16), generator=g).float().to(DEVICE)
    k = (
        torch.randint(-3, 4, (1, 1, 8, 16), generator=g).float().repeat(1, 1, 12, 1)[:, :, :93].to(DEVICE)
    )  # 12 blocks, the last short
    kw = dict(is_causal=True, block_size=8, top_k=3, score=score, force_sink=False, force_previous=False)
    want = pisa_ref.pisa_select(q, k, **kw)
    got = triton_select.pisa_select(q, k, tuning=SCAN, **kw)
    assert len(scan_calls) == 1 and (want[..., -1, :2] == torch.tensor([0, 1], device=DEVICE)).all()
    assert torch.equal(got, want)
    assert torch.equal(triton_select.pisa_select(q, k, tuning=Tuning(pisa_walk="per_token"), **kw), want)


@pytest.mark.parametrize(
    "nk,top_k,table_limit,words",
    [(40, 8, None, "5 leaf blocks <= top_k=5"), (200, 3, 1000, "node-score table")],
    ids=["nothing-to-score", "table-too-large"],
)
def test_uncovered_call_runs_per_token_and_says_why(nk, top_k, table_limit, words, scan_calls, monkeypatch, caplog):
    if table_limit is not None:
        monkeypatch.setattr(scan, "MAX_TABLE_BYTES", table_limit)
    q, k, _ = walk_inputs(1, 2, 1, 12, nk, 16, F32, False)
    kw = dict(block_size=8, top_k=top_k)
    with caplog.at_level(logging.INFO, logger="sparseflow"):
        got = triton_select.pisa_select(q, k, tuning=SCAN, **kw)
    assert scan_calls == []
    assert "per-token walk" in caplog.text and words in caplog.text
    assert torch.equal(got, pisa_ref.pisa_select(q, k, **kw))


def test_covers_names_each_reason():
    assert scan.scan_covers(20, 8, 1000, 1000) is None
    assert "int32" in scan.scan_covers(20, 8, 1000, 2**31)
    assert "MiB" in scan.scan_covers(20, 8, scan.MAX_TABLE_BYTES + 1, 1000)
    assert "top_k=8" in scan.scan_covers(8, 8, 1000, 1000)


def test_op_carries_the_walk_to_the_kernel(scan_calls):
    """Through sparseflow.attention (the op's flattened tuning arguments), eager: the same output."""
    q, k, v = (t.to(DEVICE) for t in (torch.randn(1, 2, 24, 16), torch.randn(1, 1, 24, 16), torch.randn(1, 1, 24, 16)))
    cfg = sparseflow.PISAConfig(block_size=4, top_k=3)
    want = sparseflow.attention(q, k, v, config=cfg, backend="triton", tuning=Tuning(pisa_walk="per_token"))
    assert scan_calls == []
    got = sparseflow.attention(q, k, v, config=cfg, backend="triton", tuning=SCAN)
    assert len(scan_calls) == 1
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_walk_choice_lists_scan():
    with pytest.raises(ValueError) as info:
        Tuning(pisa_walk="scans")
    assert "'scan'" in str(info.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_scan_opcheck_and_compile():
    """The op's schema and fake, and the walk under torch.compile(fullgraph=True): the eager selection."""
    q, k = (torch.randn(1, h, 700, 64, device="cuda", dtype=torch.bfloat16) for h in (6, 2))
    kw = dict(block_size=64, top_k=4, is_causal=True)
    want = triton_select.pisa_select(q, k, **kw)
    fn = torch.compile(lambda q, k: triton_select.pisa_select(q, k, tuning=SCAN, **kw), fullgraph=True)
    assert torch.equal(fn(q, k), want)
    summ, nfv, _, lvl_off, lvl_span = triton_select.build_pyramid(k, block_size=64, branching=2)
    args = (q, k, None, summ, nfv, lvl_off, lvl_span, 0.125, True, 0, 64, 2, 4, True, True, 1)
    torch.library.opcheck(torch.ops.sparseflow.pisa_select_scan_fwd.default, args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_scan_selection_has_no_host_sync():
    q, k, v = (torch.randn(1, 4, 1000, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    run = lambda: sparseflow.pisa_attention(q, k, v, is_causal=True, backend="triton", tuning=SCAN)  # noqa: E731
    run()  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="needs a Hopper GPU"
)
@pytest.mark.parametrize("method", ["pisa", "bsa"])
def test_cuda_pdl_chain_computes_the_plain_launches_output(method):
    """The op with its kernels chained by programmatic dependent launch (``Tuning(pdl=True)``,
    kernels.pdl), eager, replayed from a CUDA graph and under torch.compile (which launches
    plainly): bitwise the plain launches' output."""
    g = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = (torch.randn(1, h, 3000, 64, device="cuda", dtype=torch.bfloat16, generator=g) for h in (9, 3, 3))
    op = getattr(sparseflow, f"{method}_attention")

    def run(tuning):
        return op(q, k, v, is_causal=True, backend="triton", tuning=tuning)

    chained = SCAN.replace(pdl=True, cuda_graphs=False)
    plain = run(SCAN.replace(cuda_graphs=False))
    assert torch.equal(run(chained), plain)
    graph, out = capture(lambda: run(chained))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, plain)
    compiled = torch.compile(lambda: run(chained), fullgraph=True)
    assert torch.equal(compiled(), plain)


@triton.jit
def _parts_probe(s_ptr, out_ptr, N: tl.constexpr):
    ar = tl.arange(0, N)
    hi, mid, lo = scan._bf16x3_parts(tl.load(s_ptr + ar))
    tl.store(out_ptr + ar, hi.to(tl.float32))
    tl.store(out_ptr + N + ar, mid.to(tl.float32))
    tl.store(out_ptr + 2 * N + ar, lo.to(tl.float32))


def test_bf16x3_parts_keep_fp32s_bits():
    """The node scan's bf16x3 dot splits each fp32 summary into three bf16 parts: each part is a
    bf16 value and their sum is the summary to within 2**-20 of its size (2**-24 when the
    conversion rounds to nearest, as on the GPU; the interpreter truncates), where one bf16
    keeps only 2**-8."""
    g = torch.Generator().manual_seed(3)
    n = 256
    s = torch.randn(n, generator=g) * torch.logspace(-6, 4, n)
    out = torch.empty(3 * n, device=DEVICE)
    _parts_probe[(1,)](s.to(DEVICE), out, N=n)
    parts = out.cpu().view(3, n)
    assert torch.equal(parts.to(BF16).float(), parts), "every part must be a bf16 value"
    rel = ((parts.double().sum(0) - s.double()).abs() / s.double().abs()).max().item()
    one = ((s.to(BF16).double() - s.double()).abs() / s.double().abs()).max().item()
    assert rel <= 2.0**-20, rel
    assert one > 2.0**-10, "a single bf16 part must be visibly coarser (the check can fail)"


@triton.jit
def _summary_dot_probe(q_ptr, s_ptr, out_ptr, M: tl.constexpr, D: tl.constexpr, U: tl.constexpr, PREC: tl.constexpr):
    ar_m, ar_d, ar_u = tl.arange(0, M), tl.arange(0, D), tl.arange(0, U)
    q = tl.load(q_ptr + ar_m[:, None] * D + ar_d[None, :])
    s_t = tl.load(s_ptr + ar_d[:, None] * U + ar_u[None, :])
    tl.store(out_ptr + ar_m[:, None] * U + ar_u[None, :], scan._summary_dot(q, s_t, PREC))


@pytest.mark.skipif(
    DEVICE != "cuda", reason="the interpreter's bf16 tl.dot is not the hardware's (the CPU checks the parts)"
)
@pytest.mark.parametrize("prec", ["bf16x3", "tf32x3"])
def test_summary_dot_is_near_fp32(prec):
    """The node scan's dot of bf16 queries with fp32 summaries (magnitudes 1e-4 to 1e2 here) is
    within twice a plain fp32 matmul's error of the fp64 product (a single bf16 dot would be
    ~100x off)."""
    g = torch.Generator().manual_seed(7)
    m, d, u = 32, 64, 32
    q = torch.randn(m, d, generator=g).to(BF16)
    s = torch.randn(d, u, generator=g) * torch.logspace(-4, 2, u)[None, :]
    want = q.double() @ s.double()
    fp32_err = (q.float() @ s - want).abs().max().item()
    bf16_err = (q.float() @ s.to(BF16).float() - want).abs().max().item()
    out = torch.empty(m, u, device=DEVICE)
    q_in = q if prec == "bf16x3" else q.float()
    _summary_dot_probe[(1,)](q_in.to(DEVICE), s.to(DEVICE), out, M=m, D=d, U=u, PREC=prec)
    err = (out.cpu().double() - want).abs().max().item()
    assert err <= 2 * fp32_err + 1e-6, (err, fp32_err)
    assert bf16_err > 50 * max(err, 1e-7), "a single bf16 dot must be visibly worse (the check can fail)"


@triton.jit
def _reduce_probe(x_ptr, ok_ptr, out_ptr, M: tl.constexpr, U: tl.constexpr, J: tl.constexpr):
    ar_m, ar_u, ar_j = tl.arange(0, M), tl.arange(0, U), tl.arange(0, J)
    flat = ar_m[:, None, None] * (U * J) + ar_u[None, :, None] * J + ar_j[None, None, :]
    ok = tl.load(ok_ptr + ar_u[:, None] * J + ar_j[None, :]) != 0
    out = common._reduce(tl.load(x_ptr + flat), ok[None, :, :], 0)
    tl.store(out_ptr + ar_m[:, None] * U + ar_u[None, :], out)


@triton.jit
def _lse2_probe(x_ptr, ok_ptr, out_ptr, scale, M: tl.constexpr, U: tl.constexpr, J: tl.constexpr):
    ar_m, ar_u, ar_j = tl.arange(0, M), tl.arange(0, U), tl.arange(0, J)
    flat = ar_m[:, None, None] * (U * J) + ar_u[None, :, None] * J + ar_j[None, None, :]
    ok = tl.load(ok_ptr + ar_u[:, None] * J + ar_j[None, :]) != 0
    out = common._lse2_scaled(tl.load(x_ptr + flat), ok[None, :, :], scale)
    tl.store(out_ptr + ar_m[:, None] * U + ar_u[None, :], out)


def test_lse_of_unscaled_logits_scales_them_in_the_exponent():
    """The leaf pairs' and node scan's LSE takes the dot's unscaled logits and the base-2 scale
    (one fused multiply-add a logit): the natural LSE of the scaled logits, -inf for none."""
    g = torch.Generator().manual_seed(6)
    m, u, j, scale = 16, 4, 32, 0.125
    x = torch.randn(m, u, j, generator=g) * 200
    ok = torch.rand(u, j, generator=g) < 0.7
    ok[2] = False
    ok[0, 0] = True
    want = torch.where(ok, x.double() * scale, float("-inf")).logsumexp(-1)
    out = torch.empty(m, u, device=DEVICE)
    _lse2_probe[(1,)](x.to(DEVICE), ok.to(torch.int8).to(DEVICE), out, common.log2_scale(scale, 0), M=m, U=u, J=j)
    got = out.cpu().double()
    assert torch.equal(torch.isinf(got[:, 2]) & (got[:, 2] < 0), torch.ones(m, dtype=torch.bool))
    fin = torch.isfinite(want)
    assert torch.allclose(got[fin], want[fin], rtol=2e-6, atol=1e-5), (got[fin] - want[fin]).abs().max()


def test_lse_is_the_natural_lse():
    """The per-token walk's LSE scores: within fp32 rounding of the fp64 LSE over the unmasked
    entries, -inf where a row has none, large logits included (the scan's base-2 form is
    checked by :func:`test_lse_of_unscaled_logits_scales_them_in_the_exponent`)."""
    g = torch.Generator().manual_seed(5)
    m, u, j = 16, 4, 32
    x = torch.randn(m, u, j, generator=g) * 30
    ok = torch.rand(u, j, generator=g) < 0.7
    ok[3] = False  # a unit with no valid entry
    ok[0, 0] = True
    want = torch.where(ok, x.double(), float("-inf")).logsumexp(-1)
    assert common.log2_scale(0.5, 2) == 0.5, "other scores keep the plain scale"
    out = torch.empty(m, u, device=DEVICE)
    _reduce_probe[(1,)](x.to(DEVICE), ok.to(torch.int8).to(DEVICE), out, M=m, U=u, J=j)
    got = out.cpu().double()
    assert torch.equal(torch.isinf(got[:, 3]) & (got[:, 3] < 0), torch.ones(m, dtype=torch.bool))
    fin = torch.isfinite(want)
    assert torch.allclose(got[fin], want[fin], rtol=2e-6, atol=1e-5), (got[fin] - want[fin]).abs().max()
