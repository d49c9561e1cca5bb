"""pytest plugin (auto-loaded through the ``pytest11`` entry point): ``--sparseflow-methods``
and the ``sparseflow_methods`` fixture, so a project can run sparseflow's equivalence checks
against its own models:

    def test_my_model_rewrites_exactly(sparseflow_methods):
        from sparseflow.testing import assert_rewrite_equivalent
        for method in sparseflow_methods:
            assert_rewrite_equivalent(MyModel().eval(), (x,), method=method)

Importing this module imports neither torch nor sparseflow: pytest loads it in every session.
"""

from __future__ import annotations

import pytest

_ALL = ("dense", "pbs", "pisa", "bsa")


def pytest_addoption(parser):
    group = parser.getgroup("sparseflow")
    group.addoption(
        "--sparseflow-methods",
        default=",".join(_ALL),
        help="comma list of sparseflow methods the sparseflow_methods fixture yields (default: all)",
    )


@pytest.fixture
def sparseflow_methods(request):
    raw = request.config.getoption("--sparseflow-methods")
    methods = [m.strip() for m in raw.split(",") if m.strip()]
    bad = [m for m in methods if m not in _ALL]
    if bad:
        raise pytest.UsageError(f"--sparseflow-methods must name methods among {list(_ALL)}, got {bad}")
    return methods
