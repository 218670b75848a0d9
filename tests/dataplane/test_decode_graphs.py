"""DecodeGraphs on the CPU tape: graphs captured per batch size before any step is known (every
row padding, on the sink), then steps admitted after their boundary -- replayed at the smallest
size that holds them, or run eagerly (a staged step) -- as SGLang's decode graph runner would
drive the layered backend. Each replay's batch rows must equal the same layers run eagerly over
the step's own tables, and every request's KV must stay exact."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sglang_ext.dataplane.decode_graphs import DecodeGraphs
from sglang_ext.dataplane.graph_step_buffers import GraphStepBuffers
from sglang_ext.testing.tape_graph import TapeGraph
from sglang_ext.tools.gpu_check_config import SMALL
from sglang_ext.tools.gpu_check_measure import CoreCheck

BACKEND = "triton"  # the Triton paged decode under the interpreter: kernels the tape records as launches


def _check(requests: int, identity: bool = False) -> CoreCheck:
    return CoreCheck(dataclasses.replace(SMALL, repeat=1, layers=2, requests=requests), "cpu", "torch",
                     identity=identity)


class _Runner:
    """What SGLang's runner keeps: static inputs of the largest size (filled before a replay,
    padded rows left holding whatever they held), and the graphs."""

    def __init__(self, check: CoreCheck, sizes: tuple[int, ...]) -> None:
        self.check = check
        b = check.batch
        self.graphs = DecodeGraphs(b.core, sizes, b.batch_pages + max(sizes))
        top = max(sizes)
        gen = torch.Generator().manual_seed(3)

        def static(t: torch.Tensor) -> torch.Tensor:
            return torch.randn((top, *t.shape[1:]), generator=gen) * 100  # garbage where no request is

        self.inputs = [static(t) for t in (check.x, check.q, b.k1, b.v1)]
        self.graphs.capture(self._layers, TapeGraph)

    def _layers(self, bs: int) -> list[torch.Tensor]:
        buffers = self.graphs.buffers
        return self.check.layers(None, backend=BACKEND, plan=False, graph=buffers,
                                 padded=tuple(t[:bs] for t in self.inputs))

    def step(self) -> tuple[int | None, float]:
        """One decode step as the runner runs it: boundary, admit, replay (or eager); the replay's
        batch rows vs the eager layers over the step's own tables (max abs diff, 0 when eager)."""
        ch, b = self.check, self.check.batch
        loc = b.begin_decode()
        size = self.graphs.admit(slots=loc)
        diff = 0.0
        if size is not None:
            real = len(b.rids)
            for dst, src in zip(self.inputs, (ch.x, ch.q, b.k1, b.v1), strict=True):
                dst[:real].copy_(src)
            static = self.graphs.replay(size)
            eager = ch.layers(loc, backend=BACKEND, plan=False, end_step=False)  # the same token again
            diff = max(float((s[:real] - e).abs().max()) for s, e in zip(static, eager, strict=True))
            b.core.exit_layer(ch.config.layers - 1)
        else:
            ch.layers(loc, backend=BACKEND)
        return size, diff


@pytest.mark.parametrize("identity", [False, True], ids=["paged", "identity"])
def test_steps_replay_at_the_smallest_size_that_holds_them_or_run_eagerly(identity):
    """3 requests, graphs of 2 and 4: resident steps replay at 4 (one padded row) and agree
    exactly; a step that stages (one layer offloaded, paged layout) runs eagerly, its reason
    counted; resident again, it replays again; then every request's KV is exact."""
    check = _check(3, identity)
    runner = _Runner(check, (2, 4))
    assert set(runner.graphs.graphs) == {2, 4} and runner.graphs.size_for(3) == 4 and runner.graphs.size_for(5) is None
    for _ in range(2):
        assert runner.step() == (4, 0.0)
    if not identity:
        check.batch.place([[1, 0]] + [[1, 1]] * 2)  # request 0's layer 1 to host: the step stages
        assert runner.step() == (None, 0.0)
        assert any("stages pages" in why for why in runner.graphs.eager_reasons)
        check.batch.place([[1, 1]] * 3)
        assert runner.step() == (4, 0.0)
    assert runner.graphs.replays == (2 if identity else 3)
    err = check.attention_errors()["torch"]
    assert err["max_abs_err"] <= err["tolerance"], err


def test_a_batch_of_a_captured_size_replays_unpadded():
    check = _check(2)
    runner = _Runner(check, (2, 4))
    assert runner.step() == (2, 0.0) and runner.graphs.buffers.real == runner.graphs.buffers.batch == 2


def test_a_capture_over_unloaded_buffers_writes_into_a_requests_kv():
    """Why capture loads a padding-only step: buffers holding zeros point every row at device row
    0, which in the paged layout is some request's KV -- the capture's runs write the padded
    inputs there, and the KV check fails. (The control to the test above, whose captures touch
    only the sink.)"""
    check = _check(3)
    real = GraphStepBuffers.load_padding

    def unloaded(self, rows, in_place):  # noqa: ANN001, ANN202 - sized, nothing written
        self.batch, self.real, self.pages, self.in_place = rows, 0, rows, in_place

    GraphStepBuffers.load_padding = unloaded
    try:
        _Runner(check, (4,))
    finally:
        GraphStepBuffers.load_padding = real
    err = check.attention_errors()["torch"]
    assert err["max_abs_err"] > err["tolerance"], err


def test_without_a_sink_there_are_no_graphs():
    check = _check(2)
    check.batch.core.store.sink_page = None
    with pytest.raises(ValueError, match="sink page"):
        DecodeGraphs(check.batch.core, (2,), 64)
    with pytest.raises(ValueError, match="batch sizes"):
        DecodeGraphs(_check(2).batch.core, (0, 2), 64)


def test_a_batch_larger_than_every_graph_runs_eagerly():
    """3 requests, one graph of 2: the step is not admitted (named), runs eagerly, and the KV stays
    exact; the control is the captured size's own batch above, which replays."""
    check = _check(3)
    runner = _Runner(check, (2,))
    assert runner.step() == (None, 0.0)
    assert runner.graphs.eager_reasons == {"no graph holds a batch of 3": 1} and runner.graphs.replays == 0
    store = check.batch.core.store  # a paged step deferred for a graph, declined: made at the admission
    assert store.deferred_tables == store.materialized_tables > 0
    err = check.attention_errors()["torch"]
    assert err["max_abs_err"] <= err["tolerance"], err


def test_a_paged_steps_device_tables_are_made_only_when_it_runs_eagerly():
    """The boundary of a step a graph may take leaves its tables' device half unmade: admitted, it
    stays so (the graph is sent the host half); declined, the admission makes it before the eager
    forward (not the forward's first read). Control: the admitted step's tables are still pending."""
    for requests, admitted in ((2, True), (3, False)):
        check = _check(requests)
        runner = _Runner(check, (2,))
        b, core = check.batch, check.batch.core
        loc = b.begin_decode()
        assert core.tables.pending
        assert (runner.graphs.admit(slots=loc) is not None) == admitted
        assert core.tables.pending == admitted and core.store.materialized_tables == (0 if admitted else 1)
        if admitted:
            runner.graphs.replay(2)
            core.exit_layer(check.config.layers - 1)
        else:
            check.layers(loc, backend=BACKEND)
        assert core.store.materialized_tables == (0 if admitted else 1)
