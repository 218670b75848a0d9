"""`kvplane gpu-check`'s batch-change phase (``TurnoverCheck``) on the CPU, where the GPU host runs
it: after the whole core check -- its CUDA-graph probe included, here with the eager stand-in for
the graph, so the batch arrives as it does on a GPU (the probe's replayed tokens added) -- then
rounds of a request finishing and one joining, and the step after one more change checked
against the dense reference over the KV each request holds."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sglang_ext.tools import gpu_check_graph
from sglang_ext.tools.gpu_check_config import SMALL
from sglang_ext.tools.gpu_check_measure import CoreCheck
from sglang_ext.tools.gpu_check_report import FAIL, PASS
from sglang_ext.tools.gpu_check_turnover import ROUNDS, TurnoverCheck
from tests.dataplane.test_gpu_check_graph import Taped


@pytest.fixture(scope="module")
def checked():
    """A core check run through on SMALL at 2 layers, the graph probe replaying on the tape (TapeGraph)."""
    with pytest.MonkeyPatch.context() as mp:
        real_init = gpu_check_graph.GraphProbe.__init__
        mp.setattr(gpu_check_graph.GraphProbe, "__init__",
                   lambda self, check, graph=None, identity=False, runner=False: real_init(self, check, Taped))
        check = CoreCheck(dataclasses.replace(SMALL, repeat=2, layers=2), "cpu", "torch")
        figures = {f.key: f for f in check.run()}
    assert figures["graph.replay_max_abs_diff"].status == PASS, figures["graph.replay_max_abs_diff"]
    return check


def test_the_phase_after_the_graph_probe_reads_what_the_pool_holds(checked):
    """The phase runs on the batch the graph probe left (within the headroom the config counts),
    every change is a turnover the continued boundary takes, and the step after one more change
    reads, at every layer, what each request holds -- the joiners' prefills and the survivors'
    decoded tokens -- within the bf16 tolerance (PASS)."""
    check = checked
    rids_before = list(check.batch.rids)
    figures = {f.key: f for f in TurnoverCheck(check).run()}
    f = figures["turnover.attention_max_abs_err"]
    assert f.status == PASS and f.value < 1e-5 and f.threshold > 0, f
    b = check.batch
    assert b.rids[-1] == f"join{ROUNDS}" and not set(rids_before) & set(b.rids)  # every first request left
    assert all(n < len(s) for n, s in zip(b.lens, b.slots, strict=True))  # the headroom held
    assert len(set(b.seeds)) == len(b.seeds) and b.core.tables is None
    assert figures["turnover.boundary_ms"].value > 0 and figures["turnover.general_boundary_ms"].value > 0


def _fresh() -> CoreCheck:
    check = CoreCheck(dataclasses.replace(SMALL, repeat=1, layers=2), "cpu", "torch")
    check.step()
    return check


def test_negative_control_a_joiners_corrupted_page_fails(monkeypatch):
    """The last joiner's first page at one layer rewritten with other values (at rest, after its
    prefill) FAILs the figure: the check reads what the pool holds."""
    check = _fresh()
    real = TurnoverCheck._finish_and_join

    def corrupting(self, r):  # noqa: ANN001, ANN202
        real(self, r)
        if r == ROUNDS:
            b, c = self.check.batch, self.check.config
            loc = torch.from_numpy(b.slots[-1][: c.page_size].copy())
            k = torch.full((c.page_size, c.kv_heads, c.head_dim), 3.0, dtype=c.torch_dtype)
            b.core.write(1, loc, k, k)

    monkeypatch.setattr(TurnoverCheck, "_finish_and_join", corrupting)
    figures = {f.key: f for f in TurnoverCheck(check).run()}
    f = figures["turnover.attention_max_abs_err"]
    assert f.status == FAIL and f.value > f.threshold, f


def test_negative_control_a_checked_step_off_the_continued_path_fails(monkeypatch):
    """The checked step declined by the decode path (the general boundary serves it, correctly)
    FAILs: the figure is about the continued boundary's tables."""
    check = _fresh()
    turn = TurnoverCheck(check)
    real_run = check.attention_errors

    def general_step():  # noqa: ANN202
        monkeypatch.setattr(check.batch.core, "prepare_decode_step", lambda *a, **k: False)
        return real_run()

    monkeypatch.setattr(check, "attention_errors", general_step)
    figures = {f.key: f for f in turn.run()}
    f = figures["turnover.attention_max_abs_err"]
    assert f.status == FAIL and "did not take the continued boundary" in f.note, f
    assert turn.details["attention_errors"]["torch"]["max_abs_err"] < 1e-5  # the general path read right


def test_the_phase_times_the_eager_boundary_whatever_the_graph_probes_left(monkeypatch):
    """Scenario (static review, session 77): on a GPU the graph probes leave the core deferring its
    tables' device half and its step-start fetches (the CPU dry run builds no graphs), so the
    phase's boundaries would not pay what an eager one does. Each timed boundary runs with both
    off, and the phase restores them. Control: the flags as the probes leave them are on before."""
    check = _fresh()
    core = check.batch.core
    core.defer_tables = core.pipeline.defer_start = True  # as DecodeGraphs / GraphStaging leave them
    seen: list[tuple[bool, bool]] = []
    real = TurnoverCheck._timed_boundary

    def timed(self, general):  # noqa: ANN001, ANN202
        seen.append((core.defer_tables, core.pipeline.defer_start))
        return real(self, general)

    monkeypatch.setattr(TurnoverCheck, "_timed_boundary", timed)
    TurnoverCheck(check).run()
    assert seen and set(seen) == {(False, False)}
    assert (core.defer_tables, core.pipeline.defer_start) == (True, True)
