"""Microseconds per call of a GPU op with no host launch cost: calls captured in one CUDA graph, replayed."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def graph_us(fn: Callable[[], object], iters: int = 20, replays: int = 7) -> float:
    """``iters`` calls of fn captured in one graph (after one warm-up call off the capture stream: Triton compiles,
    cuBLAS picks its algorithm, FlashMLA sets its smem attributes); the median over replays, CUDA events."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(times)
