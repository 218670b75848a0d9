"""`kvplane gpu-check`'s CUDA-graph probe (``GraphProbe``) and the buffers it replays through
(``GraphStepBuffers``), on the CPU: the steps around the capture -- an all-resident step whose
layers read persistent buffers, run again and again, then successive steps as boundary + load +
replay -- with the capture and replays emulated (:class:`~sglang_ext.testing.tape_graph.TapeGraph`:
the recorded ops and launches run again on the recorded tensors, no Python; there is no CUDA
graph on the CPU), and the property a real replay needs: the layers' ops touch the same memory
every step."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sglang_ext.dataplane.graph_step_buffers import GraphStepBuffers
from sglang_ext.testing.tape_graph import TapeGraph
from sglang_ext.tools import gpu_check_graph
from sglang_ext.tools.gpu_check_config import SMALL
from sglang_ext.tools.gpu_check_graph import GraphProbe, steps
from sglang_ext.tools.gpu_check_measure import CoreCheck
from sglang_ext.tools.gpu_check_report import FAIL, NA, PASS


class Taped(TapeGraph):
    """The graph the probe captures on the CPU: :class:`TapeGraph` records the layers' ops and
    Triton launches and replays them on the recorded tensors, no Python -- a layer that read the
    step's own tables instead of the buffers would replay the captured step's (``perturb``:
    added to the first static output after each replay, a replay that reads something else)."""

    perturb = 0.0
    count = 0

    def capture(self, fn):  # noqa: ANN001, ANN201
        self.static = super().capture(fn)
        return self.static

    def replay(self) -> None:
        type(self).count += 1
        super().replay()
        self.static[0].add_(self.perturb)


def _check(repeat: int = 2) -> CoreCheck:
    """SMALL at 2 layers and 2 requests: the probe's attention is the Triton kernel under the
    interpreter here (~0.3 s a call), the batch and layer counts change nothing it checks."""
    return CoreCheck(dataclasses.replace(SMALL, repeat=repeat, layers=2, requests=2), "cpu", "torch")


def test_replayed_steps_decode_what_eager_steps_do():
    """The layers over the buffers agree exactly with the same layers over the step's own tables,
    once captured too (PASS); successive steps as boundary + load + replay then leave KV every
    layer's attention reads exactly against the dense reference (PASS); the probe adds the tokens
    it says, the step ends each time, the batch goes on."""
    check = _check()
    check.step()
    lens = list(check.batch.lens)
    Taped.count = 0
    figures = {f.key: f for f in GraphProbe(check, Taped).run()}
    f = figures["graph.replay_max_abs_diff"]
    assert f.status == PASS and f.value == 0, f
    f = figures["graph.replayed_steps_attention_err"]
    assert f.status == PASS and f.value < 1e-5 and f.threshold > 0, f
    f = figures["graph.buffers_vs_tables_err"]  # the padded buffers vs the step's own tables
    assert f.status == PASS and f.value == 0 and f.threshold > 0, f
    repeat = check.config.repeat
    assert Taped.count == 1 + (repeat + 2) + (repeat + 2) + 1  # the agreement, the layers' timing, the steps, the later
    m = check.details["graph_probe"]
    assert m["loads"] == 1 + repeat + 2 + 1 and m["step_replay_ms"] > 0 and m["host_replay_ms"] > 0
    one_backend = (repeat + 2) + (1 + (repeat + 2) + 1 + 1)  # eager steps; captured, replayed, later, accuracy
    assert check.batch.lens == [n + one_backend for n in lens] and one_backend < steps(repeat)  # the headroom: two
    assert check.batch.core.tables is None
    for key in ("graph.layers_ms.eager", "graph.layers_ms.replay", "graph.step_ms.eager", "graph.step_ms.replay",
                "graph.kvplane_cpu_share"):
        assert figures[key].status == NA and figures[key].value is not None, key  # CPU: not meaningful
    check.step()


def test_a_replay_that_reads_something_else_fails():
    """Negative control: a replay whose output moves (1e-3 at layer 0) FAILs the graded figure,
    with the difference as its value."""
    check = _check()
    check.step()
    Taped.perturb = 1e-3
    try:
        figures = {f.key: f for f in GraphProbe(check, Taped).run()}
    finally:
        Taped.perturb = 0.0
    f = figures["graph.replay_max_abs_diff"]
    assert f.status == FAIL and f.value == pytest.approx(1e-3, rel=1e-3)


class EagerRerun:
    """The stand-in these tests used before :class:`TapeGraph`: capture runs the layers, replay
    runs them again (Python and all) into the static outputs."""

    def __init__(self, device: str) -> None:
        self.fn, self.static = None, None

    def capture(self, fn):  # noqa: ANN001, ANN201
        self.fn = fn
        self.static = [t.clone() for t in fn()]
        return self.static

    def replay(self) -> None:
        for s, new in zip(self.static, self.fn(), strict=True):
            s.copy_(new)


@pytest.mark.parametrize("graph", [Taped, EagerRerun], ids=["tape", "eager-rerun"])
def test_layers_that_read_the_steps_own_tables_fail_only_when_replayed(monkeypatch, graph):
    """The bug a graph punishes: layers that read each step's freshly built tables (here every
    layer's page table and CSR from the step's ``StepTables``, the buffers only written) replay
    the captured step's tables at every later step. The tape shows it (the later step's replay
    FAILs the agreement); an eager re-run -- the control -- rebuilds the view each time and
    passes, which is why it could not stand in for a graph."""
    check = _check()
    check.step()
    monkeypatch.setattr(gpu_check_graph, "PADDED_ROWS", 0)  # the step's own tables have the batch's rows
    monkeypatch.setattr(GraphStepBuffers, "layer_view",
                        lambda self, store, layer, rids: check.batch.layer_view(layer))
    figures = {f.key: f for f in GraphProbe(check, graph).run()}
    f = figures["graph.replay_max_abs_diff"]
    m = check.details["graph_probe"]
    assert m["buffers_max_abs_diff"] == 0 and m["replay_max_abs_diff"] == 0  # the capture's own step agrees
    if graph is Taped:
        assert f.status == FAIL and m["late_replay_max_abs_diff"] > 0, f
    else:
        assert f.status == PASS, f


def test_replays_that_write_nowhere_fail_the_attention_check():
    """Negative control for the successive steps: replays that skip the new token's write (the
    buffers' rows never loaded after the capture) leave KV the dense reference does not find."""
    check = _check()
    check.step()
    load = GraphStepBuffers.load

    def first_only(self, tables, padded_to=None, slots=None, checked=False):  # noqa: ANN001, ANN202
        if self.loads == 0:
            load(self, tables, padded_to, slots, checked)
        else:  # later steps' rows point at the first step's slots: their tokens land there
            self.loads += 1

    GraphStepBuffers.load = first_only
    try:
        figures = {f.key: f for f in GraphProbe(check, Taped).run()}
    finally:
        GraphStepBuffers.load = load
    assert figures["graph.replayed_steps_attention_err"].status == FAIL


def test_a_capture_that_raises_is_reported_not_failed(capsys):
    """Capture on hardware nobody ran it on may raise: every figure is N/A, the note names the
    exception, the traceback goes to stderr, and the step still ends (the batch stays usable)."""
    class Refusing(Taped):
        def capture(self, fn):  # noqa: ANN001, ANN201
            raise RuntimeError("operation not permitted when stream is capturing (test)")

    check = _check()
    check.step()
    figures = GraphProbe(check, Refusing).run()
    assert {f.status for f in figures} == {NA} and all(f.value is None for f in figures)
    assert all("RuntimeError: operation not permitted" in f.note for f in figures)
    assert "operation not permitted" in capsys.readouterr().err
    assert check.batch.core.tables is None
    check.step()  # the batch goes on, its KV what the reference regenerates
    assert check.attention_errors()["torch"]["max_abs_err"] == pytest.approx(0.0, abs=1e-5)


def test_without_a_graph_on_the_cpu_the_probe_says_so():
    figures = GraphProbe(_check()).run()
    assert {f.status for f in figures} == {NA}
    assert all(f.note.startswith("CUDA only") for f in figures)


class _Touches(TorchDispatchMode):
    """Each op's name and the storage addresses of its tensor arguments and results, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.seq: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        flat = [*args, *(kwargs or {}).values(), *(out if isinstance(out, tuple | list) else [out])]
        ptrs = tuple(t.data_ptr() for t in flat if isinstance(t, torch.Tensor))
        self.seq.append((func.overloadpacket.__name__, ptrs))
        return out


def _touches_over_steps(check: CoreCheck, use_buffers: bool) -> list[list[tuple]]:
    """What two successive all-resident steps' layers touch (the boundary and load outside)."""
    b, core, c = check.batch, check.batch.core, check.config
    buffers = GraphStepBuffers(c.layers, len(b.rids), b.batch_pages, check.device)
    seen = []
    for _ in range(2):
        loc = b.begin_decode()
        buffers.load(core.tables)
        touches = _Touches()
        with touches:
            check.layers(loc, backend="torch", plan=False, end_step=False, graph=buffers if use_buffers else None)
        core.exit_layer(c.layers - 1)
        seen.append([(op, ptrs) for op, ptrs in touches.seq if op not in _ALLOCATING])
    return seen


_ALLOCATING = {"empty", "empty_like", "new_empty", "zeros", "zeros_like", "full", "ones_like"}
"""Ops that make their own outputs (a graph's private pool gives them the same addresses)."""


def test_the_layers_over_the_buffers_touch_the_same_memory_every_step():
    """What a replay needs: the captured layers' ops, in order, read and write the same addresses
    at every step (the buffers take each step's tables; the pool, the weights and the inputs stay
    put). Negative control: the same layers over each step's own tables touch new memory."""
    check = _check()
    check.batch.place([[1] * check.config.layers for _ in check.batch.rids])
    check.step()
    check.step()
    first, second = _touches_over_steps(check, use_buffers=True)
    assert first and Counter(op for op, _ in first)["index_copy_"] == 2 * check.config.layers
    fresh = [(i, a) for i, (a, b) in enumerate(zip(first, second, strict=True)) if a != b]
    # the torch reference attention allocates as it goes; the kvplane ops and the inputs must not move
    moved = {a[0] for _, a in fresh}
    assert "index_copy_" not in moved, fresh[:5]
    own_first, own_second = _touches_over_steps(check, use_buffers=False)
    own_moved = {a[0] for a, b in zip(own_first, own_second, strict=True) if a != b}
    assert "index_copy_" in own_moved  # the control: the tables' rows are new memory each step


def test_a_flashinfer_capture_that_raises_falls_back_to_triton(monkeypatch, capsys):
    """FlashInfer's decode is captured first where it is available (what serves on CUDA); a
    capture that raises there is named in the notes and the probe measures Triton's. Control:
    without Triton to fall back on, the failure is the probe's (every figure N/A, named). The
    CPU has no FlashInfer: here it is Triton's kernel under that name."""
    check = _check()
    check.step()
    backends = check.backends
    run = backends.run
    monkeypatch.setattr(backends, "available", ("flashinfer", *backends.available))
    monkeypatch.setattr(backends, "run", lambda name, q, view: run("triton" if name == "flashinfer" else name, q, view))
    monkeypatch.setattr(backends, "plan_step", lambda view, graph=False: None)

    class FirstRefuses(Taped):
        made = 0

        def __init__(self, device: str) -> None:
            super().__init__(device)
            type(self).made += 1
            self.n = type(self).made

        def capture(self, fn):  # noqa: ANN001, ANN201
            if self.n == 1:
                raise RuntimeError("flashinfer capture refused (test)")
            return super().capture(fn)

    figures = {f.key: f for f in GraphProbe(check, FirstRefuses).run()}
    f = figures["graph.replay_max_abs_diff"]
    assert f.status == PASS and "; triton attention" in f.note, f
    assert "flashinfer's capture raised RuntimeError: flashinfer capture refused (test)" in f.note
    assert figures["graph.replayed_steps_attention_err"].status == PASS
    assert check.details["graph_probe"]["backend"] == "triton"
    FirstRefuses.made = 0
    monkeypatch.setattr(backends, "available", ("flashinfer", "torch"))
    figures = GraphProbe(check, FirstRefuses).run()
    assert {f.status for f in figures} == {NA}
    assert all("flashinfer capture refused (test)" in f.note for f in figures)
    assert "flashinfer capture refused" in capsys.readouterr().err


def test_the_probe_runs_on_the_cuda_engine_path(monkeypatch):
    """The same probe over the CUDA transfer engine (simulated streams and events on CPU pools, as
    the GPU runs it): the placement's moves, the fences, the steps' ends -- the replayed steps
    agree and leave exact KV."""
    from tests.dataplane import cuda_simulation

    cuda_simulation.install(monkeypatch)
    check = _check()
    assert type(check.batch.core.store.engine).__name__ == "CudaTransferEngine"
    check.batch.place([[1, 0] * (check.config.layers // 2) for _ in check.batch.rids])  # moves to undo
    check.step()
    figures = {f.key: f for f in GraphProbe(check, Taped).run()}
    assert figures["graph.replay_max_abs_diff"].status == PASS, figures["graph.replay_max_abs_diff"]
    assert figures["graph.replayed_steps_attention_err"].status == PASS
    assert check.batch.core.stats().host_fraction == 0  # all resident after the probe's placement


def test_the_runners_flow_replays_admitted_steps_exactly(monkeypatch):
    """The runner's flow (``runner=True``, as gpu-check runs it): graphs of two sizes captured over
    a padding-only step, three steps admitted at the smaller and replayed -- bit-exact against
    their layers run eagerly over the same buffers, KV exact after (PASS). Negative control: captures over buffers never
    loaded with the padding-only step write the padded inputs into device row 0, a request's
    KV -- the attention check FAILs."""
    check = _check()
    check.step()
    figures = {f.key: f for f in GraphProbe(check, Taped, runner=True).run()}
    for key in ("graph.runner.replay_max_abs_diff", "graph.runner.replay_vs_dense_err", "graph.runner.attention_err"):
        assert figures[key].status == PASS, figures[key]
    m = check.details["graph_runner"]
    assert m["sizes"] == [3, 6] and m["admitted"] == [3, 3, 3] and m["replays"] == 3

    control = _check()
    control.step()
    monkeypatch.setattr(GraphStepBuffers, "load_padding", lambda self, rows, in_place: setattr(self, "batch", rows))
    figures = {f.key: f for f in GraphProbe(control, Taped, runner=True).run()}
    assert figures["graph.runner.attention_err"].status == FAIL, figures["graph.runner.attention_err"]


def test_flashinfer_graphs_replay_on_a_stand_in_of_its_wrapper(monkeypatch):
    """The probe's FlashInfer path -- what gpu-check captures first on CUDA, its graph wrappers
    planned as the served decode plans them (``FlashInferLayeredDecode.plan_graph``: the CSR
    staged, no page ids) -- on the CPU over ``FlashInferStandIn`` (FlashInfer needs CUDA): the
    replays equal the eager layers and the KV after them the dense reference, in the probe's own
    flow and SGLang's runner's. Control: a replay that reads something else FAILs."""
    from sglang_ext.dataplane.flashinfer_attention import FlashInferLayeredDecode
    from sglang_ext.testing.flashinfer_stand_in import FlashInferStandIn

    def probe(perturb: float) -> tuple[dict, CoreCheck]:
        check = _check()
        check.step()
        backends = check.backends
        fi = FlashInferLayeredDecode("cpu", backends.max_pages, wrapper_class=FlashInferStandIn)
        monkeypatch.setattr(backends, "fi", fi)
        monkeypatch.setattr(backends, "available", ("flashinfer", *backends.available))
        monkeypatch.setattr(Taped, "perturb", perturb)
        return {f.key: f for f in GraphProbe(check, Taped, runner=True).run()}, check

    figures, check = probe(0.0)
    for key in ("graph.replay_max_abs_diff", "graph.replayed_steps_attention_err",
                "graph.runner.replay_max_abs_diff", "graph.runner.replay_vs_dense_err", "graph.runner.attention_err"):
        assert figures[key].status == PASS, figures[key]
    assert check.details["graph_probe"]["backend"] == check.details["graph_runner"]["backend"] == "flashinfer"
    assert check.backends.fi.wrappers >= 2  # graph wrappers of the probe's and the runner's sizes
    figures, _ = probe(1.0)
    assert figures["graph.replay_max_abs_diff"].status == FAIL, figures["graph.replay_max_abs_diff"]


def test_a_runner_replay_not_planned_for_its_step_fails_the_dense_check(monkeypatch):
    """FlashInfer's graph wrappers not planned before the runner flow's replays (the stand-in): each
    replay reads the lengths the capture's padding-only plan wrote. The replay vs eager check
    reruns the layers under that same plan and still PASSes -- the blind spot -- while the last
    replay vs the dense reference FAILs. (The first test of this pair is the PASS control.)"""
    from sglang_ext.dataplane.flashinfer_attention import FlashInferLayeredDecode
    from sglang_ext.testing.flashinfer_stand_in import FlashInferStandIn
    from sglang_ext.tools import gpu_check_graph

    check = _check()
    check.step()
    backends = check.backends
    monkeypatch.setattr(backends, "fi", FlashInferLayeredDecode("cpu", backends.max_pages, wrapper_class=FlashInferStandIn))
    monkeypatch.setattr(backends, "available", ("flashinfer", *backends.available))
    monkeypatch.setattr(gpu_check_graph, "plan_loaded_step", lambda ch, backend, buffers: None)
    probe = GraphProbe(check, Taped, runner=True)
    figures = {f.key: f for f in probe.runner_run("flashinfer")}
    assert figures["graph.runner.replay_max_abs_diff"].status == PASS, figures["graph.runner.replay_max_abs_diff"]
    assert figures["graph.runner.replay_vs_dense_err"].status == FAIL, figures["graph.runner.replay_vs_dense_err"]
