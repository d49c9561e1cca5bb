"""Programmatic dependent launch (kernels.pdl): which launches chain. That the chained kernels
compile for sm_90 is checked by tests/sm90_compile.py (``run_pdl_chain``); that they compute
what the plain launches compute, on a Hopper GPU by tests/methods/pisa/test_pisa_scan.py."""

import pytest
import torch

pytest.importorskip("triton")
from sparseflow.kernels import pdl  # noqa: E402  (imports triton)

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # where the Triton backend runs (the CPU: interpreted)


def test_cpu_and_interpreted_launches_never_chain():
    t = torch.zeros(1)
    assert pdl.device_supports(t) is False
    assert pdl.pdl_launch(t, True) == {"PDL": False, "launch_pdl": False}


@pytest.mark.parametrize("wanted", [True, False, 1, 0], ids=["true", "false", "one", "zero"])
def test_a_capable_device_chains_when_asked(monkeypatch, wanted):
    monkeypatch.setattr(pdl, "device_supports", lambda t: True)
    on = bool(wanted)
    assert pdl.pdl_launch(torch.zeros(1), wanted) == {"PDL": on, "launch_pdl": on}


def test_a_call_traced_by_torch_compile_launches_plainly_and_says_so(monkeypatch, caplog):
    monkeypatch.setattr(pdl, "device_supports", lambda t: True)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    pdl._note_plain_under_compile.cache_clear()
    with caplog.at_level("INFO", logger="sparseflow"):
        assert pdl.pdl_launch(torch.zeros(1), True) == {"PDL": False, "launch_pdl": False}
    assert "launches plainly inside torch.compile" in caplog.text


@pytest.mark.parametrize("method", ["pisa", "bsa"])
@pytest.mark.parametrize("chained", [True, False], ids=["pdl", "plain"])
def test_tuning_pdl_reaches_every_chainable_launch(monkeypatch, method, chained):
    """``Tuning(pdl=...)`` through the public op reaches the launches of PISA's scan walk and of
    the token-sparse attention (PISA's and BSA's), and only as asked."""
    import sparseflow
    from sparseflow.kernels import token_sparse_triton as tst
    from sparseflow.methods.pisa import triton_select_scan as scan

    asked = []

    def record(t, wanted):
        asked.append(bool(wanted))
        return {"PDL": False, "launch_pdl": False}  # the interpreter runs no griddepcontrol

    monkeypatch.setattr(scan, "pdl_launch", record)
    monkeypatch.setattr(tst, "pdl_launch", record)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 40, 16, generator=g).to(DEV) for h in (4, 2, 2))
    cfg = {"pisa": sparseflow.PISAConfig, "bsa": sparseflow.BSAConfig}[method](block_size=8, top_k=3)
    tuning = sparseflow.Tuning(pisa_walk="scan", pdl=chained, cuda_graphs=False)
    sparseflow.attention(q, k, v, config=cfg, backend="triton", tuning=tuning)
    # PISA: the scan (one decision for its six kernels) and the attention's two; BSA: the attention's two
    assert asked == [chained] * (3 if method == "pisa" else 2)
