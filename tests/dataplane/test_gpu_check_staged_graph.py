"""`kvplane gpu-check`'s staged CUDA-graph probe (``StagedGraphProbe``) on the CPU: the check's
batch placed with host-only layers, staged steps captured (their fetches and parked write-back
launches of the graph) and replayed on :class:`~sglang_ext.testing.tape_graph.TapeGraph`, graded
against the dense reference with the staging pages scrambled before the checked replay. Control:
fetch lists emptied after they load -- the replay reads the scramble and the figure fails."""

from __future__ import annotations

import dataclasses

import pytest

from sglang_ext.dataplane.graph_staging import GraphStaging
from sglang_ext.testing.tape_graph import TapeGraph
from sglang_ext.tools.gpu_check_config import SMALL
from sglang_ext.tools.gpu_check_measure import CoreCheck
from sglang_ext.tools.gpu_check_report import FAIL, NA, PASS
from sglang_ext.tools.gpu_check_staged_graph import PROFILED, StagedGraphProbe, steps


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _check() -> CoreCheck:
    ch = CoreCheck(dataclasses.replace(SMALL, layers=3, requests=2, repeat=1), "cpu", "torch")
    ch.step()
    return ch


def test_replayed_staged_steps_decode_what_the_reference_does():
    """The checked replay (staging scrambled first) is within tolerance of the dense reference and
    equal to its layers rerun eagerly; the eager step after the replays is within tolerance too;
    every replay staged; the probe used the steps it says; the timings are N/A on the CPU."""
    ch = _check()
    lens = list(ch.batch.lens)
    figures = {f.key: f for f in StagedGraphProbe(ch, TapeGraph).run()}
    for key in ("graph.staged.replay_vs_dense_err", "graph.staged.attention_err"):
        f = figures[key]
        assert f.status == PASS and f.value < f.threshold and f.threshold > 0, f
    f = figures["graph.staged.replay_max_abs_diff"]
    assert f.status == PASS and f.value == 0, f
    m = ch.details["graph_staged"]
    runs = ch.config.repeat + 2
    assert m["staged_replays"] == runs + 2 + PROFILED and m["replays"] == 2 * runs + 2 + PROFILED, m  # all-resident
    # ones between the checked replay and the profiled ones, then the layer-timed one
    assert m["replay_layer_ms"] is None  # the CPU's emulated graphs record no events
    assert m["offloaded_layers_per_request"] == [2, 2] and not m["eager_reasons"]
    profiled = {row["function"] for row in m["host_profile"]}  # the boundary's and the admission's calls
    assert any("paged_decode_step.py" in f for f in profiled) and any("graph_staging.py" in f for f in profiled), \
        sorted(profiled)
    assert m["host_replay_ms"] > 0 and m["host_resident_replay_ms"] > 0, m
    assert m["backend"] == "triton" and not m["backends_failed"]  # no FlashInfer on the CPU (its stand-in: below)
    assert ch.batch.lens == [n + steps(ch.config.repeat) // 2 for n in lens]  # one backend tried of two
    # the all-resident figure's comparison names the graph probe's decode (none ran on this check):
    # on a GPU it is FlashInfer's, another decode than this probe's Triton one (static review, session 77)
    assert m["resident_replay_plain_backend"] is None
    assert "(graph probe, None: another decode, not comparable)" in figures["graph.staged.resident_step_ms.replay"].note
    for key in ("graph.staged.step_ms.eager", "graph.staged.step_ms.replay", "graph.staged.kvplane_cpu_share",
                "graph.staged.resident_step_ms.replay"):
        assert figures[key].status == NA, key


def test_negative_control_a_replay_without_fetches_fails(monkeypatch):
    """Fetch lists emptied after each load: the checked replay reads the scrambled staging pages
    (the eager rerun over the same emptied lists agrees with it: only the reference catches it)."""
    real = GraphStaging.load

    def load(self, tables, size, host) -> None:  # noqa: ANN001
        real(self, tables, size, host)
        host["staging_ctl"][self._zero_from: self._zero_from + 4 * self.layers] = 0  # every list's length

    monkeypatch.setattr(GraphStaging, "load", load)
    ch = _check()
    figures = {f.key: f for f in StagedGraphProbe(ch, TapeGraph).run()}
    f = figures["graph.staged.replay_vs_dense_err"]
    assert f.status == FAIL and f.value > 100 * f.threshold, f
    assert figures["graph.staged.replay_max_abs_diff"].status == PASS


def test_on_the_cpu_without_a_graph_the_probe_says_why():
    ch = _check()
    figures = StagedGraphProbe(ch).run()
    assert figures and all(f.status == NA and "CUDA only" in f.note for f in figures)


def _flashinfer_stand_in(monkeypatch: pytest.MonkeyPatch, ch: CoreCheck) -> None:
    """FlashInfer's decode for the check, over the tests' stand-in of its wrapper (FlashInfer needs CUDA)."""
    from sglang_ext.dataplane.flashinfer_attention import FlashInferLayeredDecode
    from sglang_ext.testing.flashinfer_stand_in import FlashInferStandIn

    backends = ch.backends
    monkeypatch.setattr(backends, "fi", FlashInferLayeredDecode("cpu", backends.max_pages,
                                                                wrapper_class=FlashInferStandIn))
    monkeypatch.setattr(backends, "available", ("flashinfer", *backends.available))


@pytest.mark.parametrize("planned", [True, False], ids=["planned", "control-unplanned"])
def test_flashinfer_staged_replays_decode_what_the_reference_does(monkeypatch, planned):
    """Where FlashInfer is available (what serves on CUDA) the staged graphs capture its decode, its
    graph wrappers planned before each replay from the buffers' host CSR: the three agreements
    PASS, every replay staged. Control: the plans before the replays skipped -- each replay reads
    the lengths of the capture's padding-only plan, the replay vs dense reference FAILs (the eager
    rerun shares the replay's plan and still agrees)."""
    from sglang_ext.tools import gpu_check_graph

    ch = _check()
    _flashinfer_stand_in(monkeypatch, ch)
    if not planned:
        monkeypatch.setattr(gpu_check_graph, "plan_loaded_step", lambda ch, backend, buffers: None)
    figures = {f.key: f for f in StagedGraphProbe(ch, TapeGraph).run()}
    m = ch.details["graph_staged"]
    assert m["backend"] == "flashinfer" and not m["backends_failed"], m["backends_failed"]
    assert figures["graph.staged.replay_max_abs_diff"].status == PASS
    if planned:
        for key in ("graph.staged.replay_vs_dense_err", "graph.staged.attention_err"):
            assert figures[key].status == PASS, figures[key]
        runs = ch.config.repeat + 2
        assert m["staged_replays"] == runs + 2 + PROFILED and not m["eager_reasons"], m
        assert m["plan_replay_ms"] > 0 and ch.backends.fi.wrappers >= 1
    else:
        f = figures["graph.staged.replay_vs_dense_err"]
        assert f.status == FAIL and f.value > 10 * f.threshold, f


def test_a_flashinfer_capture_that_raises_falls_back_to_triton(monkeypatch):
    """FlashInfer's graph plan raising at the capture: the probe says so and measures Triton's
    staged replays (PASS), as the graph probe falls back."""
    ch = _check()
    _flashinfer_stand_in(monkeypatch, ch)
    real = ch.backends.plan_step

    def plan_step(view, graph=False):  # noqa: ANN001, ANN202
        if graph:
            raise RuntimeError("no graph plan here (test)")
        return real(view, graph=graph)

    monkeypatch.setattr(ch.backends, "plan_step", plan_step)
    figures = {f.key: f for f in StagedGraphProbe(ch, TapeGraph).run()}
    m = ch.details["graph_staged"]
    assert m["backend"] == "triton" and "no graph plan here" in m["backends_failed"]["flashinfer"], m["backends_failed"]
    assert figures["graph.staged.replay_vs_dense_err"].status == PASS
    assert "flashinfer's attempt raised RuntimeError" in figures["graph.staged.replay_vs_dense_err"].note


def test_a_flashinfer_attempt_that_raises_mid_step_falls_back_and_says_so(monkeypatch):
    """FlashInfer's eager run raising once inside a step's layers (after its boundary, before its
    last layer's exit): the probe still completes on Triton's staged replays and names the failed
    attempt (the unfinished step is closed by the next boundary; its token's KV is missing in the
    layers it never ran, so the accuracy figures are not graded here: ``first_that_captures``)."""
    ch = _check()
    _flashinfer_stand_in(monkeypatch, ch)
    real, faults = ch.backends.run, [1]

    def run(name, q, view):  # noqa: ANN001, ANN202
        if name == "flashinfer" and view.layer == 1 and faults[0]:  # once (the accuracy checks run every backend)
            faults[0] = 0
            raise RuntimeError("a kernel fault mid-step (test)")
        return real(name, q, view)

    monkeypatch.setattr(ch.backends, "run", run)
    figures = {f.key: f for f in StagedGraphProbe(ch, TapeGraph).run()}
    m = ch.details["graph_staged"]
    assert m["backend"] == "triton" and "kernel fault mid-step" in m["backends_failed"]["flashinfer"] and not faults[0]
    assert m["staged_replays"] > 0 and not m["eager_reasons"], m
    assert "flashinfer's attempt raised RuntimeError" in figures["graph.staged.replay_max_abs_diff"].note
    assert figures["graph.staged.replay_max_abs_diff"].status == PASS  # replay vs eager: the same buffers
