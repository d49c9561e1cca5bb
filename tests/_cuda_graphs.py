"""Capturing a call into a CUDA graph the way torch's docs advise, shared by the GPU tests."""

import torch


def capture(fn):
    """``(graph, out)``: ``fn`` run once on a side stream (so its kernels compile and its
    allocations settle outside the capture), then captured. Replaying ``graph`` rewrites ``out``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
