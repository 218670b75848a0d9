"""`kvplane gpu-check`'s CUDA-graph probe (``GraphProbe``) on the CPU: the orchestration around
the capture -- an all-resident step whose layers run again and again, then end as every step
does -- with an eager stand-in for the graph (there is no CUDA graph on the CPU); the capture
itself runs on a GPU only."""

from __future__ import annotations

import dataclasses

import pytest

from sglang_ext.tools.gpu_check_config import SMALL
from sglang_ext.tools.gpu_check_graph import STEPS, GraphProbe
from sglang_ext.tools.gpu_check_measure import CoreCheck
from sglang_ext.tools.gpu_check_report import FAIL, NA, PASS


class EagerGraph:
    """Stands in for ``CudaGraph``: ``capture`` runs the layers and keeps their outputs as the
    "static" tensors; ``replay`` runs them again into those tensors (``perturb``: adds it to the
    first output, a replay that reads something else)."""

    perturb = 0.0
    replays = 0

    def __init__(self, device: str) -> None:
        self.fn, self.static = None, None

    def capture(self, fn):  # noqa: ANN001, ANN201
        self.fn = fn
        self.static = [t.clone() for t in fn()]
        return self.static

    def replay(self) -> None:
        type(self).replays += 1
        for s, new in zip(self.static, self.fn(), strict=True):
            s.copy_(new)
        self.static[0].add_(self.perturb)


def _check() -> CoreCheck:
    config = dataclasses.replace(SMALL, repeat=2)
    return CoreCheck(config, "cpu", "torch")


def test_the_probe_replays_the_layers_and_ends_the_step():
    """An all-resident step's layers, run eagerly and "replayed", agree exactly (PASS); the step
    ends afterwards (no tables left), the batch gained the probe's tokens, and the next steps
    and the accuracy check run as before on the batch it leaves (every attention exact against
    the regenerated KV: the repeated layers wrote the same token into the same rows)."""
    check = _check()
    check.step()
    lens = list(check.batch.lens)
    EagerGraph.replays = 0
    figures = {f.key: f for f in GraphProbe(check, EagerGraph).run()}
    assert figures["graph.replay_max_abs_diff"].status == PASS and figures["graph.replay_max_abs_diff"].value == 0
    assert EagerGraph.replays == 1 + check.config.repeat + 2  # the agreement, then time_ms's warm-ups and repeats
    assert check.batch.core.tables is None  # the step ended at its last layer's exit
    assert check.batch.lens == [n + STEPS for n in lens]
    m = check.details["graph_probe"]
    assert m["layers_eager_ms"] > 0 and m["layers_replay_ms"] > 0 and m["boundary_cpu_ms"] >= 0
    for key in ("graph.layers_ms.eager", "graph.layers_ms.replay", "graph.kvplane_cpu_share"):
        assert figures[key].status == NA and figures[key].value is not None, key  # CPU: not meaningful
    check.step()
    errors = check.attention_errors()
    assert errors["torch"]["max_abs_err"] <= errors["torch"]["tolerance"]
    assert errors["torch"]["max_abs_err"] == pytest.approx(0.0, abs=1e-5)


def test_a_replay_that_reads_something_else_fails():
    """Negative control: a replay whose output moves (here by 1e-3 at layer 0) FAILs the graded
    figure, with the difference as its value."""
    check = _check()
    check.step()
    EagerGraph.perturb = 1e-3
    try:
        figures = {f.key: f for f in GraphProbe(check, EagerGraph).run()}
    finally:
        EagerGraph.perturb = 0.0
    f = figures["graph.replay_max_abs_diff"]
    assert f.status == FAIL and f.value == pytest.approx(1e-3, rel=1e-3)


def test_a_capture_that_raises_is_reported_not_failed(capsys):
    """Capture on hardware nobody ran it on may raise: the figures are N/A, the note names the
    exception, the traceback goes to stderr, and the step still ends (the batch stays usable)."""
    class Refusing(EagerGraph):
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
    errors = check.attention_errors()
    assert errors["torch"]["max_abs_err"] == pytest.approx(0.0, abs=1e-5)


def test_without_a_graph_on_the_cpu_the_probe_says_so():
    figures = GraphProbe(_check()).run()
    assert {f.status for f in figures} == {NA}
    assert all(f.note.startswith("CUDA only") for f in figures)
