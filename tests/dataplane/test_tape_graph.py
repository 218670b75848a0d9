"""TapeGraph: CUDA-graph capture and replay emulated on the CPU (``sglang_ext/testing/tape_graph.py``).

What a replay must do (the same kernels on the same memory, no Python) and what it must not (see
data the captured function rebuilt from Python), each with the control that tells them apart: an
eager re-run of the function (what the probe's tests stood in before) passes where the tape
shows the stale read."""

from __future__ import annotations

import pytest
import torch

from kernels.block_copy import copy_segments_triton
from sglang_ext.testing.tape_graph import CAPTURE_ERROR, TapeGraph


def test_replay_reads_persistent_inputs_at_their_addresses():
    """A function over persistent buffers: after the buffers change, the replay computes from the
    new contents into the captured output (same tensor), running no Python."""
    x = torch.arange(6, dtype=torch.float32)
    w = torch.full((6,), 2.0)
    calls = []

    def fn():
        calls.append(1)
        return [(x * w).cumsum(0) + 1]

    graph = TapeGraph()
    (out,) = graph.capture(fn)
    assert len(calls) == 3  # two warm-ups, the captured run
    assert torch.isnan(out).all()  # made by the capture: garbage until replayed, as on a GPU
    graph.replay()
    assert torch.equal(out, (x * w).cumsum(0) + 1)
    x.copy_(torch.tensor([1.0, 0, 0, 0, 0, 5]))
    graph.replay()
    assert len(calls) == 3  # no Python ran
    assert torch.equal(out, torch.tensor([3.0, 3, 3, 3, 3, 13]))
    assert graph.replays == 2 and graph.ops >= 3


def test_a_table_rebuilt_each_step_replays_stale_and_an_eager_rerun_hides_it():
    """The bug a graph punishes: the step's index table made fresh from Python values each step.
    Made by a kernel from Python ints (``arange``), the tape replays the captured table; re-running
    the function reads the new one. Made from a Python list (``torch.tensor``: a host copy on a
    GPU) the capture is refused, as CUDA refuses it. Negative control for the stand-in the
    probe's tests used before."""
    pool = torch.arange(10, dtype=torch.float32) * 10
    step = {"first": 1}

    def fn():
        return [pool[torch.arange(step["first"], step["first"] + 2)].clone()]

    graph = TapeGraph()
    (out,) = graph.capture(fn)
    step["first"] = 7
    graph.replay()
    assert out.tolist() == [10.0, 20.0]  # stale: what a CUDA graph would read
    assert fn()[0].tolist() == [70.0, 80.0]  # the eager re-run would have passed
    with pytest.raises(RuntimeError, match="copies host data"):
        TapeGraph().capture(lambda: [pool[torch.tensor([step["first"]])].clone()])
    scalar = {"x": 2.0}  # a 0-dim tensor of Python data: a CPU scalar on a GPU, baked into the graph
    graph = TapeGraph()
    (out,) = graph.capture(lambda: [pool * torch.tensor(scalar["x"])])
    scalar["x"] = 3.0
    graph.replay()
    assert out.tolist() == (pool * 2).tolist()


def test_in_place_writes_replay_into_the_captured_destination():
    """``index_copy_`` (the KV write) and ``copy_`` into persistent buffers: the replay writes the
    rows the buffers hold now, and a captured Python int (the batch) stays the capture's."""
    kv = torch.zeros(8, 2)
    rows = torch.tensor([0, 1, 2])
    new = torch.ones(3, 2)
    batch = 2  # sliced with a Python int: baked into the graph

    def fn():
        kv.index_copy_(0, rows[:batch], new[:batch])
        return [kv]

    graph = TapeGraph()
    graph.capture(fn)
    kv.zero_()
    rows.copy_(torch.tensor([5, 6, 7]))
    new.fill_(3.0)
    graph.replay()
    assert kv[:, 0].tolist() == [0, 0, 0, 0, 0, 3, 3, 0]  # rows 5, 6 (not 7: the batch was 2 at capture)


@pytest.mark.parametrize("sync", ["item", "bool", "tolist", "nonzero", "cpu", "equal", "mask-index", "mask-put",
                                  "repeat-interleave", "host-list"])
def test_capture_refuses_host_reads(sync):
    """Whatever would sync the host with the stream is refused with CUDA's message; the tape is
    left empty and the warm-ups (eager) ran."""
    t = torch.tensor([1.0, 2.0])
    reads = {
        "item": lambda: t.sum().item(),
        "bool": lambda: bool(t.sum() > 0),
        "tolist": lambda: t.tolist(),
        "nonzero": lambda: t.nonzero(),
        "cpu": lambda: t.cpu(),
        "equal": lambda: torch.equal(t, t),
        # refused since session 64 (graph review): on CUDA each reads a size back or copies host data
        "mask-index": lambda: t[t > 1],
        "mask-put": lambda: t.clone().index_put_((t > 1,), torch.zeros(())),
        "repeat-interleave": lambda: torch.repeat_interleave(t, torch.tensor([1, 2])),
        "host-list": lambda: t + torch.tensor([1.0, 2.0]),
    }

    def fn():
        reads[sync]()
        return [t * 2]

    with pytest.raises(RuntimeError, match=CAPTURE_ERROR):
        TapeGraph().capture(fn)
    fn()  # the host reads work again after the capture


def test_what_a_graph_may_do_instead_is_captured():
    """Controls for the refusals above: an index by integer rows, ``repeat_interleave`` with its
    ``output_size`` and a constant made before the capture are captured and replay."""
    t, rows, counts, const = torch.tensor([1.0, 2.0]), torch.tensor([1]), torch.tensor([1, 2]), torch.tensor([1.0, 2.0])
    graph = TapeGraph()
    out = graph.capture(lambda: [t[rows], torch.repeat_interleave(t, counts, output_size=3), t + const])
    t.copy_(torch.tensor([5.0, 6.0]))
    graph.replay()
    assert [o.tolist() for o in out] == [[6.0], [5.0, 6.0, 6.0], [6.0, 8.0]]


def test_triton_launches_replay_with_their_arguments(monkeypatch):
    """A Triton kernel (the interpreter's launcher) is recorded as one launch and launched again at
    replay with the same tensors: the gather reads the index buffer's new contents. The kernel's
    internal copies are not taped as ops of their own."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    src = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    dst = torch.zeros(2, 4)
    src_idx = torch.tensor([3, 5])
    dst_idx = torch.tensor([0, 1])

    def fn():
        copy_segments_triton(src, dst, src_idx, dst_idx)
        return [dst * 1]

    graph = TapeGraph()
    (out,) = graph.capture(fn)
    assert graph.kernels == 1
    src_idx.copy_(torch.tensor([0, 7]))
    graph.replay()
    assert torch.equal(out, src[[0, 7]])
    # control: a tape without the launch (the kernel lost) leaves the capture's rows
    graph.tape = [e for e in graph.tape if e[0] != "kernel"]
    src_idx.copy_(torch.tensor([1, 2]))
    graph.replay()
    assert not torch.equal(out, src[[1, 2]])


def test_in_place_ops_that_return_nothing_replay_too():
    """``torch._foreach_mul_`` returns nothing: still a kernel, recorded and run again at replay
    (control: a tape without it leaves the buffers as they were)."""
    a, b = torch.ones(2), torch.ones(3)

    def fn():
        torch._foreach_mul_([a, b], 2.0)
        return [a + 0]

    graph = TapeGraph()
    graph.capture(fn)
    a.fill_(1.0)
    b.fill_(1.0)
    graph.replay()
    assert a.tolist() == [2.0, 2.0] and b.tolist() == [2.0, 2.0, 2.0]
    graph.tape = [e for e in graph.tape if "foreach" not in str(e[1])]
    a.fill_(1.0)
    graph.replay()
    assert a.tolist() == [1.0, 1.0]


def test_one_capture_per_graph_and_no_replay_before_it():
    graph = TapeGraph()
    with pytest.raises(RuntimeError, match="nothing captured"):
        graph.replay()
    graph.capture(lambda: [torch.ones(1) + 1])
    with pytest.raises(RuntimeError, match="already captured"):
        graph.capture(lambda: [torch.ones(1)])
