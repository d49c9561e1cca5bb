"""sparseflow.compile's rewrite options: each bad argument is named, with what was expected."""

import pytest
import torch.nn as nn

import sparseflow
from sparseflow.option_checks import make_options


def _compile(**kw):
    return sparseflow.compile(nn.Linear(2, 2), **kw)


@pytest.mark.parametrize(
    "kw, error, match",
    [
        ({"method": 3}, TypeError, "method must be a str"),
        ({"method": "nope"}, ValueError, "method must be one of"),
        ({"method": "pbs", "config": sparseflow.BSAConfig()}, ValueError, "pass method='bsa'"),
        ({"method": "pbs", "config": {"block_size": 64}}, TypeError, "config must be a sparseflow config"),
        ({"filter_fn": "layers.0"}, TypeError, "filter_fn must be a callable"),
        ({"skip_layers": "0,1"}, TypeError, "skip_layers must be an iterable"),
        ({"skip_layers": [0, True]}, TypeError, "skip_layers entries must be int layer indices, got True"),
        ({"skip_layers": [-1]}, ValueError, "skip_layers entries must be non-negative layer indices, got -1"),
        ({"layer_configs": [sparseflow.PBSConfig()]}, TypeError, "layer_configs must be a dict"),
        ({"layer_configs": {"0": None}}, TypeError, "layer_configs keys must be int layer indices, got '0'"),
        ({"layer_configs": {-2: None}}, ValueError, "layer_configs keys must be non-negative layer indices, got -2"),
        ({"layer_configs": {0: "pbs"}}, TypeError, r"layer_configs\[0\] must be a sparseflow config"),
        (
            {"skip_layers": [1], "layer_configs": {1: sparseflow.PBSConfig()}},
            ValueError,
            "layer 1 is both in skip_layers and given a config",
        ),
    ],
)
def test_bad_options_are_named(kw, error, match):
    kw = {"method": "pbs", **kw}
    with pytest.raises(error, match=match):
        _compile(**kw)


def test_good_options_are_kept():
    cfg = sparseflow.PBSConfig(block_size=32)
    opts = make_options("pbs", None, "auto", None, (2, 0), {1: cfg, 3: None})
    assert opts.config == sparseflow.PBSConfig() and opts.skip_layers == frozenset({0, 2})
    assert opts.layer_configs == {1: cfg, 3: None}
