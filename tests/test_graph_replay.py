"""Eager sparse calls replayed from CUDA graphs (``Tuning.cuda_graphs``, sparseflow.graph_replay).

The replayed result must be exactly what launching the kernels gives on the same inputs, for
fresh inputs every call; calls with gradient, inside another capture or with another signature
must not replay a graph recorded for something else. GPU tests skip on the CPU; the cache's
bookkeeping (first call eager, failed captures stay eager and are logged) is checked everywhere.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from _cuda_graphs import capture

import sparseflow
from sparseflow import BSAConfig, PBSConfig, PISAConfig, Tuning
from sparseflow.graph_replay import GraphReplays, default_replays

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# small enough for a quick test, several blocks and a partial last one, sparse (not every block)
_CONFIGS = {
    "pbs": PBSConfig(block_size=64, segment_size=128, min_seq_len=0),
    "pisa": PISAConfig(block_size=64, top_k=4, min_seq_len=0),
    "bsa": BSAConfig(block_size=64, top_k=4, min_seq_len=0),
}
_NO_GRAPHS = Tuning(cuda_graphs=False)


# --------------------------------------------------------------------------- the cache itself


def test_limit_is_checked():
    with pytest.raises(ValueError, match="limit must be an int >= 1"):
        GraphReplays(limit=0)
    with pytest.raises(ValueError, match="limit must be an int >= 1"):
        GraphReplays(limit=True)
    with pytest.raises(ValueError, match="max_bytes must be an int >= 1"):
        GraphReplays(max_bytes=0.5)


def test_first_call_is_eager_and_a_failed_capture_stays_eager_and_is_logged(monkeypatch, caplog):
    cache = GraphReplays()
    calls = []

    def fn(x):
        calls.append(x)
        return x * 2

    def refused(self, fn, inputs, in_place):
        raise RuntimeError("capture refused by the test")

    monkeypatch.setattr(GraphReplays, "_capture_into_pool", refused)
    x = torch.arange(4.0)
    assert torch.equal(cache.run("key", fn, (x,)), x * 2)  # first call: eager, no capture tried
    with caplog.at_level(logging.WARNING, logger="sparseflow"):
        assert torch.equal(cache.run("key", fn, (x + 1,)), (x + 1) * 2)  # capture fails: eager
    assert "could not be replayed from a CUDA graph" in caplog.text and "capture refused by the test" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sparseflow"):
        assert torch.equal(cache.run("key", fn, (x + 2,)), (x + 2) * 2)  # remembered: eager, no retry
    assert caplog.text == "" and len(calls) == 3 and len(cache) == 0 and cache.captures == 0


def test_inputs_with_strides_empty_like_cannot_keep_stay_eager(caplog):
    cache = GraphReplays()
    x = torch.arange(4.0).expand(3, 4)  # stride 0: overlapping, empty_like lays it out afresh
    cache.run("key", lambda t: t + 1, (x,))
    with caplog.at_level(logging.WARNING, logger="sparseflow"):
        assert torch.equal(cache.run("key", lambda t: t + 1, (x,)), x + 1)
    assert "are not dense" in caplog.text and len(cache) == 0


def test_cpu_calls_never_use_the_cache():
    default_replays.clear()
    q = torch.randn(1, 4, 256, 16)
    k, v = torch.randn(1, 2, 256, 16), torch.randn(1, 2, 256, 16)
    for _ in range(3):
        sparseflow.attention(q, k, v, config=_CONFIGS["bsa"], backend="reference")
    assert len(default_replays) == 0 and default_replays.captures == 0


# --------------------------------------------------------------------------- on the GPU


def _hf_qkv(n: int, seed: int, batch: int = 1, hq: int = 6, hkv: int = 2, d: int = 64):
    """q/k/v as a Llama layer hands them over: [B, N, H, D] memory viewed as [B, H, N, D]."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def one(h):
        return torch.randn(batch, n, h, d, generator=g, device="cuda", dtype=torch.bfloat16).transpose(1, 2)

    return one(hq), one(hkv), one(hkv)


@gpu
@pytest.mark.parametrize("method", list(_CONFIGS))
def test_replayed_calls_equal_launched_kernels_on_fresh_inputs(method):
    default_replays.clear()
    cfg = _CONFIGS[method]
    with torch.no_grad():
        results = []
        for seed in range(4):
            q, k, v = _hf_qkv(400, seed)
            got = sparseflow.attention(q, k, v, config=cfg, backend="triton")
            want = sparseflow.attention(q, k, v, config=cfg, backend="triton", tuning=_NO_GRAPHS)
            assert got.is_contiguous() and torch.isfinite(got).all()
            assert torch.equal(got, want), f"{method}: call {seed} differs from its launched kernels"
            results.append((got, got.clone()))
    # calls 2-4 of the signature ran from one graph, and no result aliases the graph's output
    assert default_replays.captures == 1 and default_replays.replays == 3
    assert all(torch.equal(kept, copy) for kept, copy in results)
    assert not torch.equal(results[-1][0], results[-2][0])


@gpu
def test_a_model_layers_replayed_result_is_already_in_its_token_major_memory():
    # sparseflow.hf transposes the result back to [B, N, H, D]: a replay's one copy lands there
    from sparseflow.ops import attention_any_layout

    default_replays.clear()
    cfg = _CONFIGS["pbs"]
    with torch.no_grad():
        for seed in range(3):
            q, k, v = _hf_qkv(400, seed)
            got = attention_any_layout(q, k, v, config=cfg, is_causal=True, scale=None, backend="triton", tag="t")
            want = sparseflow.attention(q, k, v, config=cfg, backend="triton", tuning=_NO_GRAPHS)
            assert torch.equal(got, want), f"call {seed}"
            if seed:  # replayed
                assert got.transpose(1, 2).is_contiguous(), got.stride()
    assert default_replays.replays == 2


@gpu
@pytest.mark.parametrize("method", list(_CONFIGS))
def test_inputs_at_recurring_addresses_replay_in_place_exactly(method):
    # a model's layer gets q/k/v at the same addresses forward after forward: buffers refilled here
    default_replays.clear()
    cfg = _CONFIGS[method]
    bufs = _hf_qkv(400, 0)
    with torch.no_grad():
        for seed in range(6):
            for buf, new in zip(bufs, _hf_qkv(400, seed + 1)):
                buf.copy_(new)
            got = sparseflow.attention(*bufs, config=cfg, backend="triton")
            want = sparseflow.attention(*bufs, config=cfg, backend="triton", tuning=_NO_GRAPHS)
            assert torch.equal(got, want), f"{method}: call {seed}"
    # one graph on static inputs (call 2), one that reads the buffers where they are (call 4)
    assert default_replays.captures == 2 and default_replays.replays == 5


@gpu
def test_padded_calls_launch_their_kernels():
    # the pipelines ask the host whether anything is padded: a graph could not redo that
    default_replays.clear()
    cfg = _CONFIGS["pbs"]
    with torch.no_grad():
        for valid in (400, 300, 173, 390):
            q, k, v = _hf_qkv(400, valid, batch=2)
            kpm = torch.ones(2, 400, dtype=torch.bool, device="cuda")
            kpm[1, valid:] = False
            mask = kpm[:, None, None, :]
            got = sparseflow.attention(q, k, v, config=cfg, attn_mask=mask, backend="triton")
            want = sparseflow.attention(q, k, v, config=cfg, attn_mask=mask, backend="triton", tuning=_NO_GRAPHS)
            assert torch.equal(got, want), f"{valid} valid keys"
    assert default_replays.captures == 0 and default_replays.replays == 0


@gpu
def test_other_signatures_get_their_own_graphs():
    default_replays.clear()
    cfg = _CONFIGS["bsa"]
    with torch.no_grad():
        for n in (400, 520, 400, 520, 400):
            q, k, v = _hf_qkv(n, n)
            got = sparseflow.attention(q, k, v, config=cfg, backend="triton")
            want = sparseflow.attention(q, k, v, config=cfg, backend="triton", tuning=_NO_GRAPHS)
            assert torch.equal(got, want), f"n={n}"
        q, k, v = _hf_qkv(400, 9)
        causal = sparseflow.attention(q[:, :, :300], k, v, config=cfg, backend="triton", is_causal=False)
        want = sparseflow.attention(
            q[:, :, :300], k, v, config=cfg, backend="triton", is_causal=False, tuning=_NO_GRAPHS
        )
        assert torch.equal(causal, want)
    assert default_replays.captures == 2 and len(default_replays) == 2


@gpu
def test_training_calls_give_the_launched_kernels_outputs_and_gradients():
    # the op's autograd runs its forward without grad mode (it may replay); the backward
    # recomputes through the launched kernels
    default_replays.clear()
    cfg = _CONFIGS["pisa"]
    for seed in range(3):
        runs = []
        for tuning in (None, _NO_GRAPHS):
            q, k, v = (t.detach().requires_grad_(True) for t in _hf_qkv(400, seed))
            out = sparseflow.attention(q, k, v, config=cfg, backend="triton", tuning=tuning)
            out.float().square().sum().backward()
            runs.append((out.detach(), q.grad, k.grad, v.grad))
        assert torch.equal(runs[0][0], runs[1][0]), f"forward of call {seed}"
        for name, got, want in zip("qkv", runs[0][1:], runs[1][1:]):
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2, msg=f"d{name} of call {seed}")
    assert default_replays.captures == 1 and default_replays.replays == 2


@gpu
def test_a_users_own_capture_records_the_kernels():
    default_replays.clear()
    cfg = _CONFIGS["pbs"]
    q, k, v = (t.contiguous() for t in _hf_qkv(400, 0))
    with torch.no_grad():
        graph, out = capture(lambda: sparseflow.attention(q, k, v, config=cfg, backend="triton"))
        for seed in (1, 2):
            fresh = _hf_qkv(400, seed)
            for static, new in zip((q, k, v), fresh):
                static.copy_(new)
            graph.replay()
            want = sparseflow.attention(q, k, v, config=cfg, backend="triton", tuning=_NO_GRAPHS)
            assert torch.equal(out, want)
    assert default_replays.captures == 0


@gpu
def test_graphs_of_one_stream_share_their_pool_and_inputs_and_stay_exact():
    # layers with their own configs (a calibrated plan): one graph each, replayed in turn from one
    # memory pool and one set of static inputs
    default_replays.clear()
    configs = [BSAConfig(block_size=64, top_k=t, min_seq_len=0) for t in (3, 4, 5, 6)]
    configs += [PBSConfig(block_size=64, segment_size=128, threshold=t, min_seq_len=0) for t in (0.8, 0.9)]
    with torch.no_grad():
        for seed in range(3):
            q, k, v = _hf_qkv(400, seed)
            for cfg in configs:
                got = sparseflow.attention(q, k, v, config=cfg, backend="triton")
                want = sparseflow.attention(q, k, v, config=cfg, backend="triton", tuning=_NO_GRAPHS)
                assert torch.equal(got, want), f"{cfg} on inputs {seed}"
    assert default_replays.captures == len(configs) and len(default_replays) == len(configs)
    assert len(default_replays._statics) == 1 and len(default_replays._pools) == 1


class _FakeGraph:
    """Stands in for a CUDA graph on the CPU: a replay reruns the recorded call on the static
    inputs into the recorded output, which is what a real replay does to their memory."""

    def __init__(self, fn, statics, output):
        self.fn, self.statics, self.output = fn, statics, output

    def replay(self):
        self.output.copy_(self.fn(*self.statics))


@pytest.fixture
def fake_cuda_graphs(monkeypatch):
    from sparseflow import graph_replay

    class Stream:
        cuda_stream = 7

    def capture(fn, statics, stream, pool):
        out = fn(*statics)
        return _FakeGraph(fn, statics, out), out

    monkeypatch.setattr(graph_replay, "_capture", capture)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())


def test_replays_read_fresh_inputs_and_never_hand_out_the_static_output(fake_cuda_graphs):
    cache = GraphReplays()
    outs = [cache.run("k", lambda x: x * 3, (torch.full((4,), float(i)),)) for i in range(4)]
    assert [o.tolist() for o in outs] == [[3.0 * i] * 4 for i in range(4)]
    assert cache.captures == 1 and cache.replays == 3 and len(cache) == 1


def test_a_replay_copies_its_output_into_the_memory_order_asked_for(fake_cuda_graphs):
    cache = GraphReplays()
    x = torch.arange(24.0).reshape(1, 2, 3, 4)
    for layout in (None, None, (0, 2, 1, 3), None):
        got = cache.run("k", lambda t: t * 2, (x,), layout)
        assert torch.equal(got, x * 2)
        assert got.is_contiguous() if layout is None else got.transpose(1, 2).is_contiguous()
    assert cache.replays == 3


def test_inputs_at_recurring_addresses_get_a_graph_that_reads_them_in_place(fake_cuda_graphs):
    cache = GraphReplays()
    x = torch.zeros(8)
    for i in range(6):  # one buffer refilled each call, as a model's layer gets its q forward after forward
        x.fill_(float(i))
        assert torch.equal(cache.run("k", lambda t: t + 1, (x,)), x + 1), f"call {i}"
    # call 1 eager, call 2 records the copying graph, call 3 first sees the address, call 4
    # records the in-place graph, calls 5-6 replay it
    assert cache.captures == 2 and cache.replays == 5 and len(cache) == 2
    in_place = [e for k, e in cache._entries.items() if isinstance(k, tuple) and not isinstance(e, str)]
    assert len(in_place) == 1 and in_place[0].inputs == ()  # it holds no static inputs (nor the caller's)
    y = torch.full((8,), 7.0)  # another address: the copying graph serves it
    assert torch.equal(cache.run("k", lambda t: t + 1, (y,)), y + 1) and cache.captures == 2


@pytest.mark.parametrize(
    "cache",
    [GraphReplays(in_place=False), GraphReplays(max_bytes=3 * 8 * 4), GraphReplays(limit=2)],
    ids=["switched-off", "past-half-the-byte-budget", "no-room-under-the-limit"],
)
def test_in_place_graphs_are_recorded_only_where_asked_and_where_they_fit(fake_cuda_graphs, cache):
    x = torch.zeros(8)
    for i in range(6):
        x.fill_(float(i))
        assert torch.equal(cache.run("k", lambda t: t * 2, (x,)), x * 2)
    assert cache.captures == 1 and len(cache) == 1


def test_oldest_graphs_go_past_the_limit_and_their_static_inputs_with_them(fake_cuda_graphs):
    cache = GraphReplays(limit=2)
    for n in (4, 5, 6):  # three layouts, each seen then captured
        x = torch.ones(n)
        for _ in range(2):
            cache.run(("f", n), lambda t: t + 1, (x,))
    assert len(cache) == 2 and cache.captures == 3
    assert sorted(s[0].shape[0] for s in cache._statics.values()) == [5, 6]
    # the evicted signature starts over: seen (eager), then recorded again
    assert torch.equal(cache.run(("f", 4), lambda t: t + 1, (torch.zeros(4),)), torch.ones(4))
    assert cache.captures == 3
    cache.run(("f", 4), lambda t: t + 1, (torch.zeros(4),))
    assert cache.captures == 4 and len(cache) == 2


def test_graphs_past_the_byte_budget_go_oldest_first(fake_cuda_graphs):
    cache = GraphReplays(max_bytes=3 * 1024 * 4)  # 3K floats: one graph's input plus output is 2K
    for name in ("a", "b"):
        for _ in range(2):
            cache.run(name, lambda t: t * 2, (torch.ones(1024) if name == "a" else torch.ones(1024, 1),))
    assert len(cache) == 1 and cache.held_bytes() <= cache.max_bytes
    assert [k for k, e in cache._entries.items() if not isinstance(e, str)] == ["b"]


def test_configs_sharing_a_layout_share_static_inputs(fake_cuda_graphs):
    cache = GraphReplays()
    for _ in range(3):
        x = torch.randn(8)
        for scale in (1.0, 2.0, 3.0):
            got = cache.run(("f", scale), lambda t, s=scale: t * s, (x,))
            assert torch.equal(got, x * scale)
    assert cache.captures == 3 and len(cache._statics) == 1


def test_auto_times_a_replayed_candidate_only_after_every_capture(fake_cuda_graphs):
    # a capture among the timed calls would stall the GPU behind the host: auto would time that
    from sparseflow.autobackend import BackendChooser

    cache = GraphReplays()
    x = torch.ones(8)
    captures_seen = []

    def run(name):
        out = cache.run(name, lambda t: t * 2, (x,))
        captures_seen.append(cache.captures)
        return out

    chooser = BackendChooser()
    chooser._time(run, "triton")
    timed = captures_seen[-chooser.reps :]
    assert cache.captures == 2 and timed == [2] * chooser.reps, captures_seen


def test_markers_of_addresses_seen_once_are_forgotten_but_never_a_graph(fake_cuda_graphs):
    cache = GraphReplays(limit=3)
    for key in ("a", "b"):
        for _ in range(2):  # each signature's graph on static inputs
            cache.run(key, lambda t: t + 1, (torch.ones(4),))
    kept = []  # fresh addresses for "b", each seen once (kept alive, so none is reused)
    for i in range(40):
        kept.append(torch.full((4,), float(i)))
        assert torch.equal(cache.run("b", lambda t: t + 1, (kept[-1],)), kept[-1] + 1)
    # "a" has not run since its capture, yet markers never push a graph out
    assert len(cache._entries) <= 8 * cache.limit and len(cache) == 2 and cache.captures == 2
    assert torch.equal(cache.run("a", lambda t: t + 1, (torch.zeros(4),)), torch.ones(4))
    assert cache.captures == 2 and cache.replays == 2 + 40 + 1


def test_a_handle_replays_its_in_place_graph_until_a_graph_leaves_the_cache(fake_cuda_graphs):
    cache = GraphReplays(limit=3)
    x = torch.zeros(8)
    for i in range(4):  # call 4 records the graph that reads x in place
        cache.run("k", lambda t: t + 1, (x,))
    assert cache.in_place_handle("k", (torch.zeros(8),)) is None  # another address: no graph of its own
    handle = cache.in_place_handle("k", (x,))
    assert handle is not None and handle.entry.inputs == ()
    x.fill_(5.0)
    assert torch.equal(cache.replay_handle(handle, (0,)), torch.full((8,), 6.0)) and cache.replays == 4
    for n in (3, 4):  # two more signatures' graphs: past the limit, the oldest graph goes
        for _ in range(2):
            cache.run(("other", n), lambda t: t * 2, (torch.ones(n),))
    assert len(cache) == 3 and cache.replay_handle(handle) is None  # its pool memory may be reused now
    fresh = cache.in_place_handle("k", (x,))
    assert fresh is not None and torch.equal(cache.replay_handle(fresh), torch.full((8,), 6.0))
    cache.clear()
    assert cache.replay_handle(fresh) is None


# --------------------------------------------------------------------------- a layer's repeat call


@pytest.fixture
def replayable_on_cpu(fake_cuda_graphs, monkeypatch):
    """The reference backend on the CPU replays through fake graphs as the Triton one does on the
    GPU, so the path a converted model's layer takes call after call runs here."""
    from sparseflow import op_replay, ops

    def replayable(chosen, entry, q, k, v, kpm):
        return entry.tuning.cuda_graphs and kpm is None and not op_replay.needs_autograd(q, k, v, None)

    monkeypatch.setattr(op_replay, "replayable", replayable)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 7, raising=False)
    full_calls = []
    real = ops._attention

    def counted(*args):
        if args[8] == "layer":  # the tag: calls of the layer under test, not the tests' references
            full_calls.append(args[0].data_ptr())
        return real(*args)

    monkeypatch.setattr(ops, "_attention", counted)
    default_replays.clear()
    yield full_calls
    default_replays.clear()


def _layer_call(q, k, v, known, cfg=_CONFIGS["pbs"], tuning=sparseflow.Tuning()):
    from sparseflow.ops import attention_any_layout

    return attention_any_layout(
        q, k, v, config=cfg, is_causal=True, scale=None, backend="reference", tag="layer", tuning=tuning, known=known
    )


def _refilled(bufs, seed):
    g = torch.Generator().manual_seed(seed)
    for buf in bufs:
        buf.copy_(torch.randn(buf.shape, generator=g))
    return bufs


def _cpu_hf_qkv(n=256):
    def one(h):
        return torch.zeros(1, n, h, 16).transpose(1, 2)

    return one(4), one(2), one(2)


def _want(q, k, v):
    return sparseflow.attention(
        q, k, v, config=_CONFIGS["pbs"], backend="reference", tuning=Tuning(cuda_graphs=False)
    ).transpose(1, 2)


def test_a_layers_repeat_call_replays_its_graph_without_the_full_path(replayable_on_cpu):
    full_calls, known, bufs = replayable_on_cpu, {}, _cpu_hf_qkv()
    with torch.no_grad():
        for seed in range(8):
            q, k, v = _refilled(bufs, seed)
            got = _layer_call(q, k, v, known).transpose(1, 2)
            assert torch.equal(got, _want(q, k, v)), f"call {seed}"
            assert got.is_contiguous() or not seed, "a replay's copy lands in [B, N, H, D] memory"
    # calls 1-4: eager, copying graph, addresses seen, in-place graph; 5-8 replay it directly
    assert len(full_calls) == 4 and default_replays.captures == 2 and default_replays.replays == 7
    other = _refilled(_cpu_hf_qkv(), 9)  # other tensors: the full path, on the copying graph
    assert torch.equal(_layer_call(*other, known).transpose(1, 2), _want(*other)) and len(full_calls) == 5


@pytest.mark.parametrize(
    "change",
    ["gradient", "recording", "intercepted", "chooser-cleared", "graph-evicted", "not-causal"],
)
def test_a_repeat_call_takes_the_full_path_when_anything_it_matched_on_changes(replayable_on_cpu, change):
    from sparseflow import autobackend, ops

    full_calls, known = replayable_on_cpu, {}
    q, k, v = _refilled(_cpu_hf_qkv(), 0)
    with torch.no_grad():
        for _ in range(5):  # the fifth replays directly
            _layer_call(q, k, v, known)
    assert len(full_calls) == 4
    scope = contextlib.nullcontext()
    causal = True
    if change == "gradient":
        q.requires_grad_(True)
    elif change == "recording":
        scope = sparseflow.capture()
    elif change == "intercepted":
        scope = ops.intercepting(lambda method, args: torch.zeros_like(args[0]))
    elif change == "chooser-cleared":
        autobackend.default_chooser.clear()
    elif change == "graph-evicted":
        default_replays.clear()
    else:
        causal = False
    with scope as cap:
        from sparseflow.ops import attention_any_layout

        got = attention_any_layout(
            q,
            k,
            v,
            config=_CONFIGS["pbs"],
            is_causal=causal,
            scale=None,
            backend="reference",
            tag="layer",
            tuning=sparseflow.Tuning(),
            known=known,
        )
    assert len(full_calls) == 5, f"{change}: the repeat replayed without the full path"
    if change == "recording":
        assert len(cap.calls) == 1 and cap.calls[0].tag == "layer"
    elif change == "intercepted":
        assert torch.equal(got, torch.zeros_like(q))
    else:
        want = sparseflow.attention(
            q.detach(),
            k,
            v,
            config=_CONFIGS["pbs"],
            backend="reference",
            is_causal=causal,
            tuning=Tuning(cuda_graphs=False),
        )
        assert torch.equal(got.detach(), want)


def test_a_repeat_call_is_counted_in_the_models_tally(replayable_on_cpu):
    from sparseflow import recording

    known, tally = {}, {}
    q, k, v = _refilled(_cpu_hf_qkv(), 0)
    with torch.no_grad(), recording.tallying(tally):
        for _ in range(7):
            _layer_call(q, k, v, known)
    assert tally == {("layer", "pbs"): {"": 7}} and len(replayable_on_cpu) == 4


@gpu
@pytest.mark.parametrize("method", list(_CONFIGS))
def test_a_layers_repeat_call_on_the_gpu_replays_directly_and_exactly(method, monkeypatch):
    from sparseflow import ops

    default_replays.clear()
    full_calls = []
    real = ops._attention
    monkeypatch.setattr(ops, "_attention", lambda *a: full_calls.append(a[8]) or real(*a))
    cfg, known, bufs = _CONFIGS[method], {}, _hf_qkv(400, 0)
    with torch.no_grad():
        for seed in range(7):
            for buf, new in zip(bufs, _hf_qkv(400, seed + 1)):
                buf.copy_(new)
            got = ops.attention_any_layout(
                *bufs, config=cfg, is_causal=True, scale=None, backend="triton", tag="layer", known=known
            )
            want = sparseflow.attention(*bufs, config=cfg, backend="triton", tuning=_NO_GRAPHS)
            assert torch.equal(got, want), f"{method}: call {seed}"
    assert full_calls.count("layer") == 4 and default_replays.captures == 2 and default_replays.replays == 6
