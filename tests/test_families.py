"""Transformers decoder families on the CPU (tiny random configs, conftest.FAMILIES): the
architecture check, exact modes equal to dense through ``sparseflow.compile`` (prefill, padding,
generate) and through a converted checkpoint, and which layers still run dense for their mask.

Each family's model and its compiled copies are built once per worker (``_plain``, ``_compiled``):
compiling is most of the cost, and the file must stay fast on a 2-core CI machine."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import sparseflow
from sparseflow import BSAConfig, PBSConfig, PISAConfig

pytest.importorskip("transformers")

import conftest  # noqa: E402
from sparseflow import hf  # noqa: E402
from sparseflow.convert import ConversionError, check_architecture, convert  # noqa: E402

N = 128  # tokens: 8 blocks of 16, 4 PBS segments of 32, 4 windows of conftest.WINDOW
EXACT = {
    "pbs": PBSConfig(block_size=16, segment_size=32, threshold=1.0),
    "pisa": PISAConfig(block_size=16, top_k=64),  # top_k over the 8 blocks: every block kept
    "bsa": BSAConfig(block_size=16, top_k=64),
}
TOL = dict(atol=1e-4, rtol=1e-4)

# transformers runs Gemma 2's attention eager only (logit soft-capping, which neither SDPA nor
# sparseflow's ops compute): nothing to compile, refused by check_architecture and convert
NO_SDPA = ("gemma2",)
RUNNABLE = [f for f in conftest.FAMILIES if f not in NO_SDPA]
WINDOWED = {f for f, (_, _, windowed) in conftest.FAMILIES.items() if windowed}


def _ids(batch: int = 1, n: int = N, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, conftest.VOCAB, (batch, n), generator=g)


def _padding_mask() -> torch.Tensor:
    """A batch of 2: row 0 right-padded, row 1 left-padded (one forward covers both sides)."""
    mask = torch.ones(2, N, dtype=torch.long)
    mask[0, N - 40 :] = 0
    mask[1, :40] = 0
    return mask


def _logits(model, ids, mask=None):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, use_cache=False).logits


@functools.lru_cache(maxsize=None)
def _plain(family: str):
    return conftest.make_family(family)


@functools.lru_cache(maxsize=None)
def _compiled(family: str, method: str):
    """A copy of the family's model compiled with the exact config of ``method``."""
    return sparseflow.compile(
        copy.deepcopy(_plain(family)),
        method=method,
        config=EXACT[method],
        backend="reference",
        inner_backend="eager",
        recipe=None,
    )


# --------------------------------------------------------------------------- the architecture check


@pytest.mark.parametrize("family", RUNNABLE)
def test_check_architecture_accepts(family):
    check_architecture(conftest.family_config(family))


# configs check_architecture refuses (transformers' defaults: no weights, no model built), with
# the words of its message
REFUSED = {
    "bert": r"model_type='bert' \(BertLMHeadModel\): it is an encoder \(is_decoder=False",
    "bart": r"model_type='bart' \(BartForCausalLM\): it is an encoder-decoder",
    "gemma3": r"model_type='gemma3' \(Gemma3ForConditionalGeneration\): it is a multimodal model",
    "t5": r"model_type='t5' has no causal-LM class",
    "falcon": r"model_type='falcon' \(FalconForCausalLM\): transformers does not mark it as running its attention "
    r"and masks through custom attention functions \(_supports_attention_backend is False\).*sparseflow.compile",
    "gemma2": r"model_type='gemma2' \(Gemma2ForCausalLM\): transformers does not run its attention as SDPA",
}


@pytest.mark.parametrize("model_type,words", list(REFUSED.items()), ids=list(REFUSED))
def test_check_architecture_refuses(model_type, words):
    from transformers import AutoConfig

    with pytest.raises(ConversionError, match=words):
        check_architecture(AutoConfig.for_model(model_type))


def test_gemma2_is_refused_with_its_reason(tmp_path):
    """Gemma 2 soft-caps its attention logits: convert refuses it before loading weights, and the
    "sparseflow" attention put on it by hand refuses the soft-capping instead of dropping it."""
    model = conftest.make_family("gemma2", attn_implementation="eager")
    model.save_pretrained(tmp_path / "src")
    with pytest.raises(ConversionError, match="_supports_sdpa is False"):
        convert(tmp_path / "src", tmp_path / "out", "pbs")
    hf.apply_plan(model, hf.Plan(method="pbs", config=EXACT["pbs"]))
    with pytest.raises(ValueError, match=r"passes \['softcap'\], which sparseflow's ops do not compute"):
        _logits(model, _ids(n=40))


# --------------------------------------------------------------------------- sparseflow.compile


@pytest.mark.parametrize("method", list(EXACT))
@pytest.mark.parametrize("family", RUNNABLE)
def test_exact_mode_equals_dense(family, method):
    ids = _ids()
    torch.testing.assert_close(_logits(_compiled(family, method), ids), _logits(_plain(family), ids), **TOL)


@pytest.mark.parametrize("family", RUNNABLE)
def test_padding_is_kept(family):
    ids, mask = _ids(batch=2), _padding_mask()
    valid = mask.bool()
    with sparseflow.capture() as cap:
        got = _logits(_compiled(family, "pbs"), ids, mask)
    torch.testing.assert_close(got[valid], _logits(_plain(family), ids, mask)[valid], **TOL)
    # causal + key padding is in the op contract: only a window's mask may run dense
    assert family in WINDOWED or not cap.fallbacks(), [c.reason for c in cap.fallbacks()]


@pytest.mark.parametrize("family", RUNNABLE)
def test_generate_matches_dense(family):
    ids = _ids(n=72)  # past two windows: the decode steps' masks slide
    kw = dict(max_new_tokens=4, do_sample=False)
    assert _compiled(family, "pbs").generate(ids, **kw).tolist() == _plain(family).generate(ids, **kw).tolist()


# Llama 4's chunk mask is proven in a graph of fixed length, but after the model's dynamic-length
# recompile (generate, earlier in this worker) only at run time, where no windowed layer is
# reported (the op runs the mask's window there): passes or not by test order, so not strict
CHUNK_AT_RUN_TIME = pytest.mark.xfail(strict=False, reason="chunk mask of a dynamic-length graph: run time only")


@pytest.mark.parametrize(
    "family", [pytest.param(f, marks=CHUNK_AT_RUN_TIME) if f == "llama4_text" else f for f in RUNNABLE]
)
def test_no_dense_fallback_for_the_mask(family, fresh_dynamo):
    """The compiled graph holds no N x N tensor: no call fell back to dense SDPA over its mask, and
    a sliding or chunked layer runs its window (the dense method's exact window: PBS at threshold 1
    would skip nothing inside it, registry.windowed).
    Dynamo starts afresh: after the other tests' lengths it would trace these models with dynamic
    sizes, whose window masks are recognised at run time only (see the xfail above)."""
    model = _compiled(family, "pbs")
    with sparseflow.capture() as cap:
        _logits(model, _ids())
    assert cap.calls, "no sparseflow call ran"
    assert not cap.fallbacks(), [c.reason for c in cap.fallbacks()]
    windowed = [e for e in sparseflow.report(model).entries if any("windowed layer" in n for n in e.notes)]
    assert bool(windowed) == (family in WINDOWED)
    assert all(e.method == "dense" and "mask is not built" in e.mask for e in windowed)


# --------------------------------------------------------------------------- converted checkpoints


@pytest.mark.parametrize("family", RUNNABLE)
def test_converted_checkpoint_is_exact(family, tmp_path):
    from transformers import AutoModelForCausalLM

    _plain(family).save_pretrained(tmp_path / "src")
    out = convert(tmp_path / "src", tmp_path / "out", "pbs", config=EXACT["pbs"].to_dict())
    hf.register()
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert model.config._attn_implementation == "sparseflow"
    ids, mask = _ids(batch=2), _padding_mask()  # the mask must reach the op through the mask interface
    with sparseflow.capture() as cap:
        got = _logits(model, ids, mask)
    assert len(cap.calls) == model.config.num_hidden_layers
    # a sliding layer runs its window exactly (the dense method: PBS at threshold 1 skips nothing in it)
    methods = {c.method for c in cap.calls}
    assert methods <= {"pbs", "dense"} if family in WINDOWED else methods == {"pbs"}
    assert all(c.sparse for c in cap.calls if c.method == "dense")
    assert family in WINDOWED or not cap.fallbacks(), [c.reason for c in cap.fallbacks()]
    valid = mask.bool()
    torch.testing.assert_close(got[valid], _logits(_plain(family), ids, mask)[valid], **TOL)


@pytest.mark.parametrize("family", RUNNABLE)
def test_converted_prefill_runs_the_config_windows(family, tmp_path):
    """Without padding, a converted model's prefill builds no window mask (the mask function
    leaves it out) and each layer ``hf.local_windows`` names runs its window in the op: exact,
    and the windowed layers are exactly those."""
    from transformers import AutoModelForCausalLM

    _plain(family).save_pretrained(tmp_path / "src")
    out = convert(tmp_path / "src", tmp_path / "out", "pbs", config=EXACT["pbs"].to_dict())
    hf.register()
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    windows = hf.local_windows(model.config)
    assert bool(windows) == (family in WINDOWED)
    ids = _ids()
    with sparseflow.capture() as cap:
        got = _logits(model, ids)
    ran_window = {int(c.tag.split(".")[2]) for c in cap.calls if c.method == "dense"}
    assert ran_window == set(windows)
    assert not cap.fallbacks(), [c.reason for c in cap.fallbacks()]
    torch.testing.assert_close(got, _logits(_plain(family), ids), **TOL)


def _mask_args(config, **changes):
    args = dict(batch_size=1, q_length=N, kv_length=N, q_offset=0, kv_offset=0, attention_mask=None)
    args.update(local_size=config.sliding_window, config=config)
    return {**args, **changes}


def test_mask_function_leaves_out_only_a_prefill_window():
    """The window's [N, N] mask is left out for an unpadded prefill from position 0 only; padding,
    a cache offset or a window the config does not give keep transformers' mask."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    config = _plain("gemma3_text").config
    fn = sliding_window_causal_mask_function(config.sliding_window)
    assert hf.sparseflow_mask(**_mask_args(config, mask_function=fn)) is None
    padded = torch.ones(1, N, dtype=torch.bool)
    padded[0, :3] = False
    kept = [
        dict(attention_mask=padded),
        dict(q_length=N - 8, q_offset=8),
        dict(local_size=config.sliding_window + 1),
    ]
    for changes in kept:
        mask = hf.sparseflow_mask(**_mask_args(config, mask_function=fn, **changes))
        assert mask is not None and mask.shape[-1] == N, changes


def test_eval_names_what_each_layer_ran():
    """``sparseflow eval``'s per-layer table says which layers ran their window and which the method."""
    from sparseflow.eval.evaluate import evaluate_plans, format_density

    model = copy.deepcopy(_plain("gemma3_text"))
    plan = hf.Plan(method="pbs", config=EXACT["pbs"], num_layers=model.config.num_hidden_layers)
    (result,) = evaluate_plans(model, _ids(), [plan], eval_positions=32)
    windows = hf.local_windows(model.config)
    assert result.layer_kinds == [
        f"dense in window {windows[i][0]}" if i in windows else "pbs" for i in range(model.config.num_hidden_layers)
    ]
    assert "dense in window" in format_density(result) and result.to_dict()["layer_kinds"] == result.layer_kinds
