"""What the ops keep alive between calls. Inductor's CUDA graphs (``mode="reduce-overhead"``) refuse
any tensor allocated during their warm-up that outlives it and is not the graph's output, so every
tensor an op keeps for later calls (a cache) must be made by ``kernels.lasting.build_lasting``,
which allocates it outside any graph pool. Checked on the CPU: each method's first calls (every
backend that runs here, with and without a local window, padded, through the op and through a
compiled model) leave alive only tensors that ``build_lasting`` made."""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch

import sparseflow
from sparseflow.config import BSAConfig, DenseConfig, PBSConfig, PISAConfig
from sparseflow.kernels import lasting
from sparseflow.kernels import token_blocks as tb


def _live_tensors(collect: bool) -> dict:
    # a full collection and scan take about a second each in a test worker that has run hundreds
    # of tests: the "before" snapshot needs no collection (it holds its tensors, garbage or not, so
    # no later tensor can take one's id), and one snapshot serves all of a test's calls
    if collect:
        gc.collect()
    # by type, not isinstance: isinstance reads a proxy's __class__, which raises on a dead weak
    # proxy (uncollected garbage holds some) and warns on a deprecated module attribute's proxy
    return {id(o): o for o in gc.get_objects() if issubclass(type(o), torch.Tensor)}


@pytest.fixture
def made_lasting(monkeypatch):
    """The storages of the tensors ``build_lasting`` returns (a view's base shares it), wherever a
    module imported it."""
    made = set()
    real = lasting.build_lasting

    def recording(build, device):
        out = real(build, device)
        made.add(_storage(out))
        return out

    for name, module in list(sys.modules.items()):
        if name.startswith("sparseflow") and getattr(module, "build_lasting", None) is real:
            monkeypatch.setattr(module, "build_lasting", recording)
    tb._WINDOW_LISTS.clear()
    yield made
    tb._WINDOW_LISTS.clear()


def _kept_by(calls, made) -> list:
    """``(shape, dtype)`` of the tensors that ``calls`` (run in turn) leave alive that build_lasting
    did not make."""
    before = _live_tensors(collect=False)
    for call in calls:
        call()  # its output is dropped at once
    after = _live_tensors(collect=True)
    return [(tuple(t.shape), t.dtype) for i, t in after.items() if i not in before and _storage(t) not in made]


def _storage(t: torch.Tensor):
    return (t.device, t.untyped_storage().data_ptr())


CONFIGS = [
    PBSConfig(block_size=16, segment_size=32, threshold=0.9),
    PISAConfig(block_size=16, top_k=3),
    BSAConfig(block_size=16, top_k=3),
    DenseConfig(),
]


def _qkv(n=64):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, h, n, 16, generator=g) for h in (4, 2, 2))


def _first_calls_keep(cfg, backend, made) -> list:
    """What a method's first calls keep alive beyond build_lasting's: causal, then causal with
    key padding given as a mask."""
    q, k, v = _qkv()
    n = q.shape[2]
    padded = torch.ones(n, n, dtype=torch.bool).tril().expand(1, 1, n, n).clone()
    padded[..., :5] = False
    calls = [
        lambda mask=mask: sparseflow.attention(
            q, k, v, config=cfg, backend=backend, attn_mask=mask, is_causal=mask is None
        )
        for mask in (None, padded)
    ]
    return _kept_by(calls, made)


@pytest.mark.parametrize("window", [0, 24])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.method)
def test_a_methods_first_reference_calls_keep_only_lasting_tensors(made_lasting, cfg, window):
    assert _first_calls_keep(cfg.replace(sliding_window=window), "reference", made_lasting) == []


# the Triton interpreter is slow: each method once, the windowed ones (PBS, PISA and BSA select
# inside the window; dense runs the window's own block lists, the cache this guards)
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.method)
def test_a_methods_first_triton_calls_keep_only_lasting_tensors(made_lasting, cfg):
    assert _first_calls_keep(cfg.replace(sliding_window=24), "triton", made_lasting) == []
    if cfg.method == "dense":
        assert len(made_lasting) == 1 and len(tb._WINDOW_LISTS) == 1


def test_an_exported_models_first_call_keeps_only_lasting_tensors(made_lasting, plain_attention):
    # an exported program runs the ops eagerly (a compiled model's first call also keeps Dynamo's
    # own artefacts, which say nothing about the ops)
    x = torch.randn(1, 64, 48)
    ep = sparseflow.export(plain_attention(), (x,), method="pbs", config=CONFIGS[0])
    with torch.no_grad():
        assert _kept_by([lambda: ep.module()(x)], made_lasting) == []


def test_the_check_sees_a_cache_that_keeps_a_tensor(made_lasting, monkeypatch):
    # the check must be able to fail: a cache filled without build_lasting is found
    cache = {}

    def leaky(q, k, v):
        cache["x"] = torch.zeros(3, 5)
        return q.clone()

    q, k, v = _qkv()
    assert _kept_by([lambda: leaky(q, k, v)], made_lasting) == [((3, 5), torch.float32)]


class _Node:
    pass


def test_the_check_reads_a_heap_holding_garbage_with_a_dead_weak_proxy(made_lasting):
    # uncollected garbage is in the "before" scan (a test worker holds plenty): a dead weak proxy
    # in it raised ReferenceError from isinstance
    gc.disable()
    try:
        node, target = _Node(), _Node()
        node.me, node.proxy = node, weakref.proxy(target)
        del node, target
        assert _kept_by([lambda: torch.ones(2)], made_lasting) == []
    finally:
        gc.enable()
