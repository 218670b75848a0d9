"""Per-layer timing of a replayed CUDA graph on a GPU: the timing events ``GraphStepBuffers.enter``
records while ``torch.cuda.CUDAGraph`` captures (``GraphLayerMarks``, ``external=True``) become
event nodes of the graph, every replay stamps them again, and ``LayerTimer`` reads a sampled
replay's per-layer times from them -- the layers of the replay sized 1:2:4:8 by work, and the
times in that order. The CPU half (which events, which replay, a sample a later replay
overwrote): ``test_graph_layer_marks.py``."""

from __future__ import annotations

import time

import pytest
import torch

from sglang_ext.dataplane.graph_step_buffers import GraphStepBuffers
from sglang_ext.layer_timing import LayerTimer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

LAYERS, SIZE = 4, 8


def _graph() -> tuple[torch.cuda.CUDAGraph, GraphStepBuffers]:
    """Layer l's work is 2**l matmuls of a 1024-square matrix, after its ``enter``."""
    buffers = GraphStepBuffers(LAYERS, SIZE, 16, "cuda")
    assert buffers.marks is not None, "torch.cuda.Event has no external= here: graphs record no timing"
    buffers.batch = SIZE
    x = torch.randn(1024, 1024, device="cuda")

    def layers() -> torch.Tensor:
        y = x
        for layer in range(LAYERS):
            buffers.enter(layer)
            for _ in range(2 ** layer):
                y = torch.tanh(y @ x)
        return y

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-ups: eager, they record nothing
            layers()
    torch.cuda.current_stream().wait_stream(stream)
    assert buffers.marks.of(SIZE) is None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layers()
    assert buffers.marks.of(SIZE) is not None
    return graph, buffers


def test_a_replayed_graph_times_its_layers():
    graph, buffers = _graph()
    timer = LayerTimer(LAYERS, "cuda", every=1)
    graph.replay()  # warm
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    timer.begin(True)
    timer.replayed(buffers.marks.of(SIZE))
    graph.replay()
    timer.end()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3
    got = timer.take()
    assert got is not None and all(ms > 0 for ms in got), got
    assert list(got) == sorted(got) and got[-1] > 3 * got[0], got  # 1:2:4:8 work
    assert sum(got) <= wall_ms * 1.05, (got, wall_ms)
    assert all(0 <= s < 0.5 for s in timer.last_stall_ms), timer.last_stall_ms  # nothing to wait for


def test_a_sample_a_later_replay_overwrote_is_dropped():
    graph, buffers = _graph()
    timer = LayerTimer(LAYERS, "cuda", every=1)
    for _ in range(2):
        timer.begin(True)
        timer.replayed(buffers.marks.of(SIZE))
        graph.replay()
        timer.end()
    assert timer.take() is None  # the first: its events stamped again by the second replay
    got = timer.take()
    assert got is not None and all(ms > 0 for ms in got), got
