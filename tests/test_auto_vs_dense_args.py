"""benchmarks/auto_vs_dense.py's round order and paired ratios (pure functions, no model)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

import auto_vs_dense  # noqa: E402


def test_each_variant_leads_one_round_in_turn():
    names = ["dense", "a", "b"]
    orders = [auto_vs_dense.round_order(names, r) for r in range(4)]
    assert orders == [["dense", "a", "b"], ["a", "b", "dense"], ["b", "dense", "a"], ["dense", "a", "b"]]


def test_paired_ratios_cancel_drift_between_rounds():
    # the host drifts 2x between rounds; "a" is always 5% slower than dense in the same round
    dense = [10.0, 20.0, 10.0, 20.0, 10.0]
    times = {"dense": dense, "a": [t * 1.05 for t in dense]}
    med, lo, hi = auto_vs_dense.paired_ratios(times)["a"]
    assert med == pytest.approx(1 / 1.05) and lo == pytest.approx(1 / 1.05) and hi == pytest.approx(1 / 1.05)
    assert auto_vs_dense.paired_ratios(times)["dense"] == (1.0, 1.0, 1.0)
    times["b"] = [5.0, 10.0, 20.0, 40.0, 10.0]  # per round: 2x, 2x, 0.5x, 0.5x and 1x as fast as dense
    med, lo, hi = auto_vs_dense.paired_ratios(times)["b"]
    assert (med, lo, hi) == (1.0, 0.5, 2.0)


def test_auto_timings_report_each_decision_by_method_and_length_bucket(monkeypatch):
    from sparseflow.autobackend import BackendChooser

    chooser = BackendChooser()
    key = chooser.key("pbs", torch.zeros(1, 9, 8192, 64), torch.zeros(1, 3, 8192, 64), ("cfg",))
    chooser.timings[key] = {"triton": 0.3, "sdpa": 0.2}
    monkeypatch.setattr(auto_vs_dense.sparseflow.autobackend, "default_chooser", chooser)
    assert auto_vs_dense.auto_timings() == [{"method": "pbs", "q_len_bucket": 52, "ms": {"triton": 0.3, "sdpa": 0.2}}]


@pytest.mark.parametrize("name, pdl", [("pisa pdl", True), ("bsa pdl", True), ("pisa triton", False)])
def test_pdl_variants_apply_a_plan_that_chains(monkeypatch, name, pdl):
    applied = []
    monkeypatch.setattr(auto_vs_dense.sparseflow.hf, "apply_plan", lambda model, plan: applied.append(plan))

    class Model:
        class config:
            num_hidden_layers = 2

    auto_vs_dense.use(Model(), auto_vs_dense.VARIANTS[name])
    (plan,) = applied
    assert plan.tuning.pdl is pdl and plan.backend == "triton" and plan.method == name.split()[0]
