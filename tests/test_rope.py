"""sparseflow.rope: RoPE scaling of a loaded transformers model rebuilds its rotary module."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from sparseflow.rope import parse_rope_scaling, set_rope_scaling  # noqa: E402


def _model(max_pos=32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        max_position_embeddings=max_pos,
    )
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).eval()


def _logits(model, n=48):
    ids = torch.arange(n)[None] % 64
    with torch.no_grad():
        return model(ids).logits


def test_yarn_changes_logits_and_none_restores():
    model = _model()
    plain = _logits(model)
    info = set_rope_scaling(model, "yarn:4")
    rot = model.model.rotary_emb
    assert rot.rope_type == "yarn" and info["rope_type"] == "yarn"
    assert rot.attention_scaling == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    assert (
        model.config.rope_parameters["original_max_position_embeddings"]
        == 32
        == info["original_max_position_embeddings"]
    )
    assert model.config.max_position_embeddings == 128
    assert not torch.allclose(_logits(model), plain)
    # a second change starts from the plain model, not from the scaled one
    assert set_rope_scaling(model, "yarn:2")["original_max_position_embeddings"] == 32
    info = set_rope_scaling(model, None)
    assert info["rope_type"] == "default" and model.model.rotary_emb.attention_scaling == 1.0
    assert model.config.max_position_embeddings == 32
    torch.testing.assert_close(_logits(model), plain, rtol=0, atol=0)


def test_yarn_auto_factor_from_the_trained_length():
    model = _model()
    assert set_rope_scaling(model, "yarn:auto:128")["factor"] == 4.0
    assert model.model.rotary_emb.rope_type == "yarn"
    info = set_rope_scaling(model, "yarn:auto:16")  # fits the trained length: plain RoPE
    assert info["factor"] is None and model.model.rotary_emb.rope_type == "default"


@pytest.mark.parametrize("spec", ["linear:2", "dynamic:2"])
def test_linear_and_dynamic(spec):
    model = _model()
    plain = _logits(model)  # 48 tokens > 32 trained positions: dynamic NTK scales too
    info = set_rope_scaling(model, spec)
    assert model.model.rotary_emb.rope_type == spec.split(":")[0] == info["rope_type"]
    assert model.model.rotary_emb.attention_scaling == 1.0
    assert not torch.allclose(_logits(model), plain)
    set_rope_scaling(model, "none")
    torch.testing.assert_close(_logits(model), plain, rtol=0, atol=0)


@pytest.mark.parametrize(
    "spec", ["yarn", "yarn:0.5", "yarn:x", "yarn:auto", "yarn:auto:-3", "ntk:2", "linear:2:3", "linear:inf", 4, ""]
)
def test_bad_specs_raise_one_line(spec):
    with pytest.raises(ValueError, match=r"^rope_scaling must be .*yarn:auto:N.*got") as e:
        parse_rope_scaling(spec)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="rope_scaling"):
        set_rope_scaling(_model(), spec)


def test_none_forms():
    assert (
        parse_rope_scaling(None) is None and parse_rope_scaling("none") is None and parse_rope_scaling("None") is None
    )
    assert parse_rope_scaling("yarn:auto:32768").target == 32768


def test_dense_logits_cache_keys_on_the_rope(tmp_path):
    from sparseflow.eval.evaluate import dense_logits

    model = _model()
    ids = torch.arange(48)[None] % 64
    plain = dense_logits(model, ids, 8, cache_dir=tmp_path)
    set_rope_scaling(model, "yarn:4")
    scaled = dense_logits(model, ids, 8, cache_dir=tmp_path)
    assert not torch.allclose(plain, scaled)  # not the plain-RoPE entry
    torch.testing.assert_close(scaled, dense_logits(model, ids, 8), rtol=0, atol=0)
