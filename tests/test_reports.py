"""The rewrite report says what the model runs, never more: no attention found, a copy that lost
its compilation, rewritten calls that fall back to dense at run time, layers that do not exist."""

from __future__ import annotations

import copy
import io
import logging
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import sparseflow
from sparseflow import PISAConfig


class EagerAttention(nn.Module):
    """Attention written out by hand (what attn_implementation='eager' does): no SDPA call."""

    def __init__(self, dim=48, heads=6):
        super().__init__()
        self.heads, self.hd = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        w = (q @ k.transpose(-1, -2) / self.hd**0.5).softmax(-1)
        return (w @ v).transpose(1, 2).reshape(b, n, -1)


class Layers(nn.Module):
    def __init__(self, make, layers=2):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(make() for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


class WindowAttention(nn.Module):
    """SDPA with a sliding-window mask (``window=None``: plain causal), as Mistral/Gemma layers."""

    def __init__(self, dim=32, heads=2, window=None, both_sides=False):
        super().__init__()
        self.heads, self.hd, self.window, self.both_sides = heads, dim // heads, window, both_sides
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.hd).permute(2, 0, 3, 1, 4)
        if self.window is None:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            i = torch.arange(n, device=x.device)
            band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - self.window)  # transformers' form
            if self.both_sides:  # a local band around each query, not causal: no op takes it
                band = (i[:, None] - i[None, :]).abs() < self.window
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=band[None, None])
        return a.transpose(1, 2).reshape(b, n, -1)


class Mixed(nn.Module):
    """Layer 0 a local band (``both_sides``) or a sliding window, layer 1 full causal."""

    def __init__(self, both_sides=True):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([WindowAttention(window=8, both_sides=both_sides), WindowAttention()])

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


_PISA = PISAConfig(block_size=16, top_k=4)


# --------------------------------------------------------------------------- no attention call


def test_no_sdpa_call_warns_and_says_so(caplog):
    model = sparseflow.compile(Layers(EagerAttention), method="dense", inner_backend="eager")
    x = torch.randn(1, 16, 48)
    with caplog.at_level(logging.WARNING, logger="sparseflow"), torch.no_grad():
        model(x)
        model(x)  # warned once, not per call
    warnings = [r.getMessage() for r in caplog.records if "no scaled_dot_product_attention call" in r.getMessage()]
    assert len(warnings) == 1 and "attn_implementation='sdpa'" in warnings[0]
    text = str(sparseflow.report(model))
    assert "no scaled_dot_product_attention call found" in text and "attn_implementation='sdpa'" in text


def test_hf_eager_attention_is_reported(tiny, caplog):
    model = tiny("llama", layers=1)
    model.config._attn_implementation = "eager"
    sparseflow.compile(model, method="dense", inner_backend="eager")
    with caplog.at_level(logging.WARNING, logger="sparseflow"), torch.no_grad():
        model(torch.randint(0, 100, (1, 8)), use_cache=False)
    assert any("attn_implementation='sdpa'" in r.getMessage() for r in caplog.records)
    assert "no scaled_dot_product_attention call found" in str(sparseflow.report(model))


# --------------------------------------------------------------------------- copies lose the compilation


def _compiled_plain(plain_attention):
    model = sparseflow.compile(plain_attention(layers=2), method="dense", inner_backend="eager")
    x = torch.randn(1, 16, 48)
    with torch.no_grad():
        y = model(x)
    return model, x, y


@pytest.mark.parametrize("how", ["deepcopy", "torch.load"])
def test_copy_of_compiled_model_says_compilation_lost(plain_attention, how, caplog):
    model, x, y = _compiled_plain(plain_attention)
    if how == "deepcopy":
        twin = copy.deepcopy(model)
    else:
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        twin = torch.load(buf, weights_only=False)
    assert "compilation lost" in str(twin._sparseflow_report)
    with caplog.at_level(logging.WARNING, logger="sparseflow"):
        rep = sparseflow.report(twin)
    text = str(rep)
    assert "compilation lost, runs dense SDPA" in text and "sparseflow.compile" in text
    assert "lost (runs dense)" in text
    assert any("runs dense SDPA" in r.getMessage() for r in caplog.records)
    with torch.no_grad():
        torch.testing.assert_close(twin(x), y, atol=1e-5, rtol=1e-5)
    # the original is untouched and still compiled
    assert not sparseflow.report(model).lost and "compilation lost" not in str(sparseflow.report(model))


@pytest.mark.parametrize("how", ["deepcopy", "torch.load"])
def test_copy_of_compiled_model_warns_once_at_its_first_call(plain_attention, how):
    model, x, _ = _compiled_plain(plain_attention)
    if how == "deepcopy":
        twin = copy.deepcopy(model)
    else:
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        twin = torch.load(buf, weights_only=False)
    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match="runs dense SDPA") as got:
            twin(x)
        assert len([w for w in got if "sparseflow" in str(w.message)]) == 1
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            twin(x)  # once only
            model(x)  # the compiled original never warns
    # compiled afresh, before or after its first call, a copy runs its rewrite without a warning
    for again in (twin, copy.deepcopy(model)):
        sparseflow.compile(again, method="dense", inner_backend="eager")
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error")
            again(x)
        assert not sparseflow.report(again).lost


def test_recompiled_copy_has_a_fresh_report(plain_attention):
    model, x, _ = _compiled_plain(plain_attention)
    twin = sparseflow.compile(copy.deepcopy(model), method="dense", inner_backend="eager")
    with torch.no_grad():
        twin(x)
    rep = sparseflow.report(twin)
    assert not rep.lost and rep.num_rewritten == 2


def test_copied_export_program_is_not_lost(plain_attention):
    ep = sparseflow.export(plain_attention(layers=1), (torch.randn(1, 16, 48),), method="dense")
    assert not sparseflow.report(copy.deepcopy(ep)).lost


# --------------------------------------------------------------------------- run-time fallbacks


def test_sliding_window_fallback_is_shown_after_a_run():
    model = sparseflow.compile(Mixed(), method="pisa", config=_PISA, backend="reference", inner_backend="eager")
    x = torch.randn(1, 64, 32)
    with torch.no_grad():
        model(x)
    rep = sparseflow.report(model)
    by_layer = {e.layer: e for e in rep.entries}
    window, full = by_layer[0], by_layer[1]
    assert window.rewritten and window.runs_dense
    assert window.status.startswith("rewritten (runs dense at run time: ")
    assert "neither causal nor key padding" in window.status
    assert full.status == "rewritten" and not full.runs_dense
    text = str(rep)
    assert "(1 of them run dense at run time)" in text and "rewritten, runs dense" in text
    assert "neither causal nor key padding" in text
    assert rep.to_dict()["runs_dense"] == 1


def test_window_recognised_at_run_time_runs_the_method_inside_it():
    # this module's band is not one the graph proof reads: the op recognises the window by value
    # at run time, and PISA runs inside it (no dense fallback); its 8 keys span at most 2 blocks
    # of 16, fewer than top_k=4, so every block of the window is kept: the layer is exact
    model = sparseflow.compile(
        Mixed(both_sides=False), method="pisa", config=_PISA, backend="reference", inner_backend="eager"
    )
    x = torch.randn(1, 64, 32)
    with torch.no_grad(), sparseflow.capture() as cap:
        got = model(x)
    with torch.no_grad():
        want = Mixed(both_sides=False)(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert [(c.method, c.sparse) for c in cap.calls] == [("pisa", True)] * 2
    window = {e.layer: e for e in sparseflow.report(model).entries}[0]
    assert window.rewritten and not window.runs_dense and window.status == "rewritten"


def test_hf_sliding_window_layers_run_their_window():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(
        num_hidden_layers=1,
        sliding_window=16,
        hidden_size=96,
        intermediate_size=128,
        num_attention_heads=6,
        num_key_value_heads=2,
        vocab_size=128,
    )
    cfg._attn_implementation = "sdpa"
    model = transformers.MistralForCausalLM(cfg).eval()
    sparseflow.compile(model, method="pisa", config=_PISA, backend="reference", inner_backend="eager")
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 64)), use_cache=False)
    (entry,) = sparseflow.report(model).entries
    assert not entry.runs_dense and entry.method == "dense", str(sparseflow.report(model))
    assert "sliding window 16" in entry.mask


def test_partly_dense_calls_are_counted():
    # a 64-token prefill runs sparse; 8 tokens is below min_seq_len and runs dense
    cfg = _PISA.replace(min_seq_len=32)
    model = sparseflow.compile(
        Layers(WindowAttention, layers=1),
        method="pisa",
        config=cfg,
        backend="reference",
        inner_backend="eager",
        dynamic=False,
    )
    with torch.no_grad():
        model(torch.randn(1, 64, 32))
        model(torch.randn(1, 8, 32))
    (entry,) = sparseflow.report(model).entries
    assert entry.runtime == {"": 1, "sequence length 8 < min_seq_len=32": 1}
    assert entry.status == "rewritten (ran dense in 1 of 2 calls at run time: sequence length 8 < min_seq_len=32)"
    assert "partly dense" in str(sparseflow.report(model))


def test_inspect_shows_fallbacks_for_export():
    x = torch.randn(1, 64, 32)
    ep = sparseflow.export(Mixed(), (x,), method="pisa", config=_PISA, backend="reference")
    assert all(e.status == "rewritten" for e in sparseflow.report(ep).entries)  # nothing ran yet
    res = sparseflow.inspect(ep, x)
    by_layer = {e.layer: e for e in res.report.entries}
    assert by_layer[0].runs_dense and not by_layer[1].runs_dense
    assert "runs dense at run time" in by_layer[0].status


def test_snapshot_does_not_follow_later_runs():
    model = sparseflow.compile(Mixed(), method="pisa", config=_PISA, backend="reference", inner_backend="eager")
    x = torch.randn(1, 64, 32)
    res = sparseflow.inspect(model, x)
    snap = res.report
    with torch.no_grad():
        model(x)
    assert sum(snap.entries[0].runtime.values()) == 1
    assert sum(sparseflow.report(model).entries[0].runtime.values()) == 2


# --------------------------------------------------------------------------- layers that do not exist


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(skip_layers=[5]), r"skip_layers names layers \[5\] .* 2 layers \(0\.\.1\)"),
        (dict(skip_layers=[0, 2, 7]), r"skip_layers names layers \[2, 7\]"),
        (dict(layer_configs={3: None}), r"layer_configs names layers \[3\] .* 2 layers"),
    ],
)
def test_unknown_layers_are_refused(plain_attention, kwargs, match):
    with pytest.raises(ValueError, match=match):
        sparseflow.compile(plain_attention(layers=2), method="dense", inner_backend="eager", **kwargs)


def test_unknown_layers_in_a_model_without_numbered_layers():
    with pytest.raises(ValueError, match="skip_layers .* no numbered layers"):
        sparseflow.compile(EagerAttention(), method="dense", skip_layers=[0])


def test_unknown_layers_refused_by_export(plain_attention):
    with pytest.raises(ValueError, match=r"layer_configs names layers \[9\]"):
        sparseflow.export(plain_attention(layers=2), (torch.randn(1, 8, 48),), method="pisa", layer_configs={9: None})


def test_known_layers_are_accepted(tiny):
    model = tiny("llama", layers=2)
    sparseflow.compile(model, method="dense", skip_layers=[1], layer_configs={0: None}, inner_backend="eager")
    with pytest.raises(ValueError, match=r"skip_layers names layers \[2\] .* 2 layers"):
        sparseflow.compile(tiny("llama", layers=2), method="dense", skip_layers=[2])


def test_routed_mha_sdpa_fallback_is_logged_and_counted(caplog):
    from sparseflow import recording
    from sparseflow.passes import mha_route

    q = k = v = torch.randn(1, 2, 8, 4)
    token = mha_route._MHA_SPEC.set(("pisa", (), "reference", "mha.tag"))
    tally: recording.RunTally = {}
    try:
        with caplog.at_level(logging.INFO, logger="sparseflow"), recording.tallying(tally):
            torch.manual_seed(0)
            mha_route._routed_sdpa(q, k, v, dropout_p=0.5)
    finally:
        mha_route._MHA_SPEC.reset(token)
    assert tally == {("mha.tag", "pisa"): {"dropout_p=0.5 (the ops have no dropout)": 1}}
    assert any("mha.tag runs dense: dropout_p=0.5" in r.getMessage() for r in caplog.records)
