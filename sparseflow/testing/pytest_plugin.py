"""pytest plugin (auto-loaded through the ``pytest11`` entry point): ``--sparseflow-methods``
and the ``sparseflow_methods`` fixture, so a project can run sparseflow's equivalence checks
against its own models:

    def test_my_model_rewrites_exactly(sparseflow_methods):
        from sparseflow.testing import assert_rewrite_equivalent
        for method in sparseflow_methods:
            assert_rewrite_equivalent(MyModel().eval(), (x,), method=method)

The methods are the registry's, read when the fixture runs: a method the project registers (in
its conftest, say) is among them.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("sparseflow")
    group.addoption(
        "--sparseflow-methods",
        default=None,
        help="comma list of sparseflow methods the sparseflow_methods fixture yields "
        "(default: every method in sparseflow's registry)",
    )


def _registered_methods():
    from sparseflow.methods import names

    return names()


@pytest.fixture
def sparseflow_methods(request):
    known = _registered_methods()
    raw = request.config.getoption("--sparseflow-methods")
    if raw is None:
        return list(known)
    methods = [m.strip() for m in raw.split(",") if m.strip()]
    bad = [m for m in methods if m not in known]
    if bad:
        raise pytest.UsageError(f"--sparseflow-methods must name methods among {list(known)}, got {bad}")
    return methods
