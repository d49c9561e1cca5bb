"""The local-window block lists of ``token_blocks`` (``window_block_indices``,
``restrict_to_window``) and the window in its torch oracle ``attend_selected_blocks``, against
brute force over every query and key."""

from __future__ import annotations

import itertools

import pytest
import torch
from _window_oracle import dense_window_attention

from sparseflow.kernels import token_blocks as tb


def _visible_keys(p: int, n_k: int, w: int, chunk: int) -> list:
    """The keys a query at position ``p`` sees, straight from the definitions."""
    return [j for j in range(n_k) if j <= p and (not w or p - w < j) and (not chunk or j // chunk == p // chunk)]


def _window_blocks(p, n_k, c, w, chunk):
    return sorted({j // c for j in _visible_keys(p, n_k, w, chunk)})


# (Nq, Nk, C, W, chunk): W below / equal to / not a multiple of / above the block size, chunks
# aligned to the blocks or not, both, Nq < Nk, one query
SHAPES = [
    (23, 23, 4, 3, 0),
    (23, 23, 4, 4, 0),
    (23, 23, 4, 9, 0),
    (17, 40, 8, 30, 0),
    (20, 20, 4, 0, 8),
    (29, 29, 4, 0, 6),
    (13, 31, 8, 0, 5),
    (26, 26, 4, 7, 10),
    (1, 33, 8, 12, 0),
    (9, 9, 16, 100, 0),
    (9, 9, 4, 1, 0),
]


@pytest.mark.parametrize("n_q, n_k, c, w, chunk", SHAPES)
def test_window_block_indices_equal_brute_force(n_q, n_k, c, w, chunk):
    got = tb.window_block_indices(n_q, n_k, c, w, chunk)
    want = [_window_blocks(i + n_k - n_q, n_k, c, w, chunk) for i in range(n_q)]
    assert got.dtype == torch.int32 and got.shape == (1, 1, n_q, max(1, max(map(len, want))))
    for i, blocks in enumerate(want):
        row = got[0, 0, i].tolist()
        assert row == blocks + [-1] * (len(row) - len(blocks)), i


def _random_selection(b, hkv, n_q, n_blocks, k, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(n_blocks, generator=g)[:k] for _ in range(b * hkv * n_q)])
    ids = ids.view(b, hkv, n_q, k)
    return torch.where(torch.rand(ids.shape, generator=g) < 0.2, torch.full_like(ids, -1), ids)


@pytest.mark.parametrize("n_q, n_k, c, w, chunk", SHAPES[:8])
def test_restrict_to_window_keeps_the_selected_blocks_the_window_touches_in_order(n_q, n_k, c, w, chunk):
    n_blocks = -(-n_k // c)
    sel = _random_selection(2, 3, n_q, n_blocks, min(5, n_blocks), seed=n_q + w)
    got = tb.restrict_to_window(sel, n_k, c, w, chunk)
    assert got.shape == sel.shape and got.dtype == sel.dtype
    for bi, h, i in itertools.product(range(2), range(3), range(n_q)):
        window = set(_window_blocks(i + n_k - n_q, n_k, c, w, chunk))
        kept = [x for x in sel[bi, h, i].tolist() if x in window]
        assert got[bi, h, i].tolist() == kept + [-1] * (sel.shape[-1] - len(kept))


def test_window_arguments_are_checked():
    with pytest.raises(ValueError, match="sliding_window"):
        tb.check_window(4, 0, is_causal=False)
    with pytest.raises(ValueError, match="chunk_size"):
        tb.check_window(0, 8, is_causal=False)
    with pytest.raises(ValueError, match="sliding_window"):
        tb.check_window(-1, 0, is_causal=True)
    with pytest.raises(TypeError, match="chunk_size"):
        tb.check_window(0, 2.5, is_causal=True)
    tb.check_window(0, 0, is_causal=False)  # no window: anything goes


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(sliding_window=-1), ValueError),
        (dict(chunk_size=-3), ValueError),
        (dict(sliding_window=2.5), TypeError),
        (dict(chunk_size="8"), TypeError),
        (dict(sliding_window=True), TypeError),
    ],
    ids=["window-negative", "chunk-negative", "window-float", "chunk-str", "window-bool"],
)
def test_configs_and_kernels_check_a_window_alike(kwargs, error):
    # one check (sparseflow._config_base.check_window) behind both: the same error, the same words
    from sparseflow.config import PBSConfig, PISAConfig

    window = (kwargs.get("sliding_window", 0), kwargs.get("chunk_size", 0))
    with pytest.raises(error, match=r"(sliding_window|chunk_size) must be an int >= 0 \(0 = none\), got") as kernel:
        tb.check_window(*window, is_causal=True)
    for cls in (PBSConfig, PISAConfig):
        with pytest.raises(error) as config:
            cls(**kwargs)
        assert str(config.value) == str(kernel.value)


@pytest.mark.parametrize("n_q, n_k, c, w, chunk", [(23, 23, 4, 6, 0), (13, 31, 8, 0, 5), (26, 26, 4, 7, 10)])
def test_reference_attention_applies_the_window(n_q, n_k, c, w, chunk):
    g = torch.Generator().manual_seed(n_q)
    q = torch.randn(2, 4, n_q, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, n_k, 8, generator=g, dtype=torch.float64) for _ in range(2))
    kpm = torch.ones(2, n_k, dtype=torch.bool)
    kpm[1, -5:] = False
    sel = _random_selection(2, 2, n_q, -(-n_k // c), 3, seed=1)
    kw = dict(key_padding_mask=kpm, block_size=c, sliding_window=w, chunk_size=chunk)
    got = tb.attend_selected_blocks(q, k, v, sel, **kw)
    want = dense_window_attention(q, k, v, w, chunk, kpm, sel, c)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    full = tb.window_block_indices(n_q, n_k, c, w, chunk).expand(2, 2, -1, -1)
    torch.testing.assert_close(
        tb.attend_selected_blocks(q, k, v, full, **kw), dense_window_attention(q, k, v, w, chunk, kpm)
    )
    with pytest.raises(ValueError, match="sliding_window|chunk_size"):
        tb.attend_selected_blocks(q, k, v, sel, is_causal=False, **kw)


def test_a_windows_lists_are_built_once_per_length():
    # the lists depend on the arguments alone: a model's windowed layers share one tensor
    first = tb.window_block_indices(40, 40, 8, 12, 0)
    assert tb.window_block_indices(40, 40, 8, 12, 0) is first
    assert tb.window_block_indices(40, 40, 8, 13, 0) is not first  # another window: its own lists
    torch.testing.assert_close(first, tb._build_window_block_indices(40, 40, 8, 12, 0, torch.device("cpu")))
    # meta tensors and traced calls keep nothing
    meta = tb.window_block_indices(40, 40, 8, 12, 0, "meta")
    assert meta.is_meta and tb.window_block_indices(40, 40, 8, 12, 0, "meta") is not meta
    # a bounded number of lengths is kept
    for n in range(50, 50 + 2 * tb._WINDOW_LISTS_KEPT):
        tb.window_block_indices(n, n, 8, 12, 0)
    assert len(tb._WINDOW_LISTS) <= tb._WINDOW_LISTS_KEPT


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["triton", "flex"])
def test_window_lists_kept_during_inductors_graph_warm_up_stay_out_of_its_pool(backend):
    # Inductor's reduce-overhead warm-up routes the current stream's allocations to its graph's
    # pool and refuses a live tensor there that the graph does not return: the first windowed call
    # of a length, in that warm-up, keeps its lists outside the pool
    import sparseflow
    from sparseflow.config import DenseConfig

    tb._WINDOW_LISTS.clear()
    cfg = DenseConfig(sliding_window=96)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, 2, 384, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    f = torch.compile(
        lambda q, k, v: sparseflow.attention(q, k, v, config=cfg, backend=backend) * 1.0, mode="reduce-overhead"
    )
    outs = [f(q, k, v).clone() for _ in range(3)]
    assert len(tb._WINDOW_LISTS) == 1
    want = dense_window_attention(q.double(), k.double(), v.double(), 96, 0, None)
    for out in outs:
        torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=0)
