"""Launch sizes from symbolic lengths: plain ints, one graph per power-of-two bucket."""

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from sparseflow.kernels.launch_sizes import pow2_at_least


@pytest.mark.parametrize(
    "x,floor,expected",
    [(1, 1, 1), (5, 1, 8), (16, 1, 16), (17, 1, 32), (3, 16, 16), (40, 16, 64), (0, 1, 1)],
    ids=lambda v: str(v),
)
def test_values(x, floor, expected):
    assert pow2_at_least(x, floor) == expected


def test_symbolic_length_gives_an_int_with_guards():
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    n = env.create_symintnode(env.create_symbol(70, ConstantSource("n")), hint=70)
    p = pow2_at_least(n, 16)
    assert type(p) is int and p == 128
    assert env.guards  # the bucket is guarded, not assumed


def test_one_graph_per_bucket():
    def f(x):
        return x.sum() * pow2_at_least(x.shape[0], 16)

    counter = CompileCounter()
    g = torch.compile(f, backend=counter, dynamic=True, fullgraph=True)
    for n, bucket in ((70, 128), (96, 128), (200, 256)):
        assert g(torch.ones(n)).item() == n * bucket
    assert counter.frame_count == 2  # 70 and 96 share a graph; 200 is a new bucket
