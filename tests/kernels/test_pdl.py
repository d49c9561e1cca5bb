"""Programmatic dependent launch (kernels.pdl): which launches chain. That the chained kernels
compile for sm_90 is checked by tests/sm90_compile.py (``run_pdl_chain``); that they compute
what the plain launches compute, on a Hopper GPU by tests/methods/pisa/test_pisa_scan.py."""

import pytest
import torch

pytest.importorskip("triton")
from sparseflow.kernels import pdl  # noqa: E402  (imports triton)


def test_cpu_and_interpreted_launches_never_chain():
    t = torch.zeros(1)
    assert pdl.device_supports(t) is False
    assert pdl.pdl_launch(t, True) == {"PDL": False, "launch_pdl": False}


@pytest.mark.parametrize("wanted", [True, False, 1, 0], ids=["true", "false", "one", "zero"])
def test_a_capable_device_chains_when_asked(monkeypatch, wanted):
    monkeypatch.setattr(pdl, "device_supports", lambda t: True)
    on = bool(wanted)
    assert pdl.pdl_launch(torch.zeros(1), wanted) == {"PDL": on, "launch_pdl": on}
