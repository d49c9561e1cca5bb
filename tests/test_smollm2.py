"""The real checkpoint: SmolLM2-135M-Instruct at 1K tokens of real text, every method
rewritten at its defaults: all 30 attention calls rewritten, really sparse, close to dense."""

import pytest

from sparseflow.checkpoints import SMOLLM2_PACKAGE_HINT, smollm2_gguf

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(smollm2_gguf() is None, reason=f"SmolLM2 GGUF not installed ({SMOLLM2_PACKAGE_HINT})"),
]

TOKENS = 1024
EVAL = 256

if smollm2_gguf() is not None:
    import _smollm2_cache  # noqa: F401  (session cache of the dequantised checkpoint, set at collection)


@pytest.fixture(scope="module")
def smollm2():
    from sparseflow.checkpoints import load_smollm2, real_tokens

    model, tok = load_smollm2()
    assert model.config.num_attention_heads == 9 and model.config.num_key_value_heads == 3
    return model, real_tokens(tok, TOKENS)


@pytest.fixture(scope="module")
def results(smollm2):
    from sparseflow.eval.evaluate import evaluate_methods, format_results

    model, ids = smollm2
    out = evaluate_methods(model, ids, ("dense", "pbs", "pisa", "bsa"), eval_positions=EVAL)
    print("\n" + format_results(out))
    return {r.method: r for r in out}


def test_dense_rewrite_is_identical(results):
    r = results["dense"]
    assert r.rewritten == 30 and r.skipped == 0
    assert r.fidelity.mean_kl < 1e-9 and r.fidelity.top1_agreement == 1.0


@pytest.mark.parametrize("method", ["pbs", "pisa", "bsa"])
def test_sparse_methods_at_defaults(results, method):
    r = results[method]
    assert r.rewritten == 30 and r.skipped == 0, r
    assert r.sparse_calls == 30 and r.dense_calls == 0, r.fallback_reasons
    assert 0.0 < r.density < 0.9, r.density  # really sparse at 1K
    # close to dense: loose bounds that a broken selection or a wrong mask would break by far
    assert r.fidelity.mean_kl < 0.5, r.fidelity
    assert r.fidelity.top1_agreement > 0.7, r.fidelity
    assert abs(r.fidelity.ppl_delta) < 0.5 * r.fidelity.ppl_dense, r.fidelity
