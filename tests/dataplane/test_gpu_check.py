"""`kvplane gpu-check`: the CPU dry run end to end (same code path as on a GPU, labelled CPU),
the grading of figures against their targets, and negative controls."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from kvplane.cli import main
from sglang_ext.tools import gpu_check_attention, gpu_check_tests
from sglang_ext.tools.gpu_check_config import LLAMA3_8B, GpuCheckConfig
from sglang_ext.tools.gpu_check_report import (
    FAIL,
    NA,
    PASS,
    STATUSES,
    Figure,
    GpuCheckReport,
    grade,
)
from sglang_ext.tools.gpu_check_tests import GpuTestRun

EXTEND_KEYS = ["extend.max_abs_err", "extend.vs_torch_loop", "extend.vs_dense_sdpa", "extend.tflops"]
"""The prefill phase's figures, in report order (:mod:`sglang_ext.tools.gpu_check_extend`)."""
TURNOVER_KEYS = ["turnover.boundary_ms", "turnover.general_boundary_ms", "turnover.vs_general", "turnover.vs_steady",
                 "turnover.attention_max_abs_err"]
"""The batch-change phase's figures (:mod:`sglang_ext.tools.gpu_check_turnover`)."""
FIGURE_KEYS = {
    "attention_max_abs_err.flashinfer", "attention_max_abs_err.triton", "attention_max_abs_err.torch",
    "step_ms.resident", "step_ms.placed", "stall_rel_err", "h2d_vs_contiguous", "duplex_vs_one_direction",
    "host_syncs_per_step.kvplane", "host_syncs_per_step.attention", "kvplane_cpu_share", "kvplane_cpu_share_net",
    "recompute_step_rel_err", "recompute_attention_max_abs_err",
    "transfer_events.h2d_gbps", "transfer_events.d2h_gbps", "transfer_events.h2d_vs_wall_rel_err",
    "transfer_events.stall_ms_per_step", "transfer_events.stall_vs_wall_rel_err", "overlap.hidden_step_rel",
    "overlap.hidden_step_rel.dma", "duplex_vs_one_direction.dma", "overlap.fetch_launch_ms", "h2d_vs_contiguous.dma",
    "graph.replay_max_abs_diff", "graph.replayed_steps_attention_err", "graph.layers_ms.eager",
    "graph.layers_ms.replay", "graph.step_ms.eager", "graph.step_ms.replay", "graph.kvplane_cpu_share",
    "graph.buffers_vs_tables_err", "graph.identity.buffers_vs_tables_err",
    "graph.identity.replay_max_abs_diff", "graph.identity.replayed_steps_attention_err",
    "graph.runner.replay_max_abs_diff", "graph.runner.replay_vs_dense_err", "graph.runner.attention_err",
    "graph.staged.replay_vs_dense_err", "graph.staged.replay_max_abs_diff", "graph.staged.attention_err",
    "graph.staged.step_ms.eager", "graph.staged.step_ms.replay", "graph.staged.kvplane_cpu_share",
    "graph.staged.resident_step_ms.replay", *EXTEND_KEYS, *TURNOVER_KEYS,
}
TARGETS = {  # the targets, by figure
    "stall_rel_err": ("<=", 0.10), "h2d_vs_contiguous": (">=", 0.85), "duplex_vs_one_direction": (">=", 1.5),
    "host_syncs_per_step.kvplane": ("<=", 0.0), "host_syncs_per_step.attention": ("<=", 0.0),
    "kvplane_cpu_share": ("<=", 0.05), "recompute_step_rel_err": ("<=", 0.25),
    "transfer_events.h2d_gbps": (">=", 1.0), "transfer_events.d2h_gbps": (">=", 1.0),
    "transfer_events.h2d_vs_wall_rel_err": ("<=", 0.25), "transfer_events.stall_vs_wall_rel_err": ("<=", 0.25),
    "overlap.hidden_step_rel": ("<=", 0.10), "overlap.hidden_step_rel.dma": ("<=", 0.10),
    "duplex_vs_one_direction.dma": (">=", 1.5), "extend.max_abs_err": ("<=", 1e-4), "extend.vs_torch_loop": ("<=", 1.0),
    "turnover.vs_general": ("<=", 1.0), "graph.staged.kvplane_cpu_share": ("<=", 0.05),
}
CPU_NOT_MEANINGFUL = {"stall_rel_err", "h2d_vs_contiguous", "duplex_vs_one_direction", "kvplane_cpu_share",
                      "recompute_step_rel_err", "transfer_events.h2d_gbps", "transfer_events.d2h_gbps",
                      "transfer_events.h2d_vs_wall_rel_err", "transfer_events.stall_ms_per_step",
                      "overlap.hidden_step_rel", "overlap.fetch_launch_ms", "turnover.vs_general"}
NOT_ON_CPU = {"overlap.hidden_step_rel.dma", "duplex_vs_one_direction.dma", "h2d_vs_contiguous.dma"}
"""Figures of the copy engines: CUDA only (N/A without a value, the note says why)."""
GRAPH_KEYS = {key for key in FIGURE_KEYS if key.startswith("graph.")} | {
    "extend.vs_torch_loop", "extend.vs_dense_sdpa", "extend.tflops"}
"""The CUDA-graph probe's figures (no graph to capture) and the extend kernel's timings: N/A
without a value on the CPU."""


def _result(tmp_path):
    [path] = tmp_path.glob("gpu-check-cpu-*.json")
    return path, json.loads(path.read_text())


def _failing_quick_run(tmp_path):
    """A quick CPU dry run (one repeat, no pytest) that must exit 1: (result, figures by key)."""
    argv = ["gpu-check", "--device", "cpu", "--skip-tests", "--repeat", "1", "--out-dir", str(tmp_path)]
    assert main(argv) == 1
    _, body = _result(tmp_path)
    return body, {f["key"]: f for f in body["figures"]}


def test_cpu_dry_run_end_to_end(tmp_path, capsys):
    """`--device cpu` runs the gpu tests (all skip), drives the served core with the planner's
    placement, and writes JSON + Markdown naming the CPU; every figure has its target and a
    status; transfer / timing figures are N/A (never PASS) on a CPU; kvplane makes no host sync
    inside a layer; the layered attentions match the dense reference."""
    assert main(["gpu-check", "--device", "cpu", "--out-dir", str(tmp_path)]) == 0
    path, body = _result(tmp_path)
    assert body["machine"].startswith("CPU: ") and body["device"] == "cpu" and body["label"].startswith("CPU")
    assert body["status"] == PASS and body["config"]["name"] == "small"
    tests = body["tests"]
    assert "tests/dataplane/test_gpu.py" in tests["files"]
    assert tests["skipped"] > 0 and tests["passed"] == tests["failed"] == tests["errors"] == 0
    figures = {f["key"]: f for f in body["figures"]}
    assert set(figures) == FIGURE_KEYS
    assert figures["extend.max_abs_err"]["status"] == PASS and body["details"]["extend"]["max_abs_err"] < 1e-4
    assert body["environment"]["kvplane_tree"] in ("clean", "modified")  # a stale head is flagged
    cpu = body["details"]["kvplane_cpu_ms_per_step"]
    assert cpu["vanilla_kv_write"] > 0 and 0 <= cpu["resident_steps_advanced"] <= cpu["resident_steps_timed"]
    # the planner's placement stages every timed step; its steady steps advance with their staging
    assert 2 * cpu["placed_steps_advanced"] >= cpu["resident_steps_timed"] >= cpu["placed_steps_advanced"]
    launches = cpu["placed_launches_per_step"]  # the placed steps fetch and write back (per-launch host cost)
    assert launches["h2d"] >= 1 and launches["d2h"] >= 1 and "launches a step" in figures["kvplane_cpu_share"]["note"]
    for kind in ("resident", "placed"):  # where the host time went, per call (medians of the same steps)
        calls = cpu[f"{kind}_layer_calls"]
        assert set(calls) == {"enter", "write", "exit"} and all(v > 0 for v in calls.values()), kind
        assert cpu[f"{kind}_boundary"] + sum(calls.values()) <= 2 * cpu[kind], kind
    assert "placed" in figures["kvplane_cpu_share"]["note"] and "boundary" in figures["kvplane_cpu_share"]["note"]
    hidden = cpu["hidden"]  # the hidden placement's host time, on the engine that serves (the CPU's here)
    assert hidden["profile"] and "sglang_ext/dataplane/" in " ".join(row["function"] for row in hidden["profile"])
    assert "hidden step's top own time" in figures["kvplane_cpu_share"]["note"]
    assert hidden["ms"] > 0 and set(hidden["layer_calls"]) == {"enter", "write", "exit"} and hidden["driver_ms"] == 0
    assert hidden["boundary"] + sum(hidden["layer_calls"].values()) <= 2 * hidden["ms"]
    assert body["details"]["overlap"]["kvplane_cpu"] == hidden and f"hidden {hidden['ms']:.3f}" in \
        figures["kvplane_cpu_share"]["note"]
    assert hidden["resident_step_ms"] > 0  # the hidden share's base: the overlap phase's own all-resident step
    assert figures["kvplane_cpu_share"]["value"] == pytest.approx(max(
        cpu["resident"] / figures["step_ms.resident"]["value"], hidden["ms"] / hidden["resident_step_ms"]))
    details = body["details"]  # the stall model at the link the placed steps' own copies measured
    assert details["model_link_gbps"] > 0 and details["predicted_step_ms_transfer_check"] > 0
    assert details["stall_predicted_ms"] == pytest.approx(details["predicted_step_ms"] - details["resident_step_ms"])
    profile = body["details"]["kvplane_host_profile"]  # by function, inside kvplane's scopes only
    for kind in ("resident", "placed"):
        names = " ".join(row["function"] for row in profile[kind])
        assert profile[kind] and all(row["calls_per_step"] > 0 for row in profile[kind]), kind
        assert "sglang_ext/dataplane/" in names, (kind, names)  # the core's own functions are in it
        assert "kernels/paged_decode.py" not in names, (kind, names)  # the attention's functions are not
    assert "top own time" in figures["kvplane_cpu_share"]["note"]
    for key, f in figures.items():
        assert f["status"] in STATUSES and f["target"] and f["method"], key
        assert f["status"] == NA or f["value"] is not None, key
    for key, (op, threshold) in TARGETS.items():
        assert (figures[key]["op"], figures[key]["threshold"]) == (op, threshold), key
    for key in NOT_ON_CPU:
        assert figures[key]["status"] == NA and figures[key]["value"] is None, key
        assert figures[key]["note"].startswith("not measured: not probed"), key
    assert body["details"]["transfer"]["dma_error"] and body["details"]["overlap"]["dma_error"]
    for key in GRAPH_KEYS:
        assert figures[key]["status"] == NA and figures[key]["value"] is None, key
        assert figures[key]["note"].startswith("CUDA only"), key
    for key in CPU_NOT_MEANINGFUL:
        assert figures[key]["status"] == NA and figures[key]["value"] is not None, key
    assert figures["host_syncs_per_step.kvplane"]["status"] == PASS
    assert figures["attention_max_abs_err.torch"]["status"] == PASS
    assert figures["attention_max_abs_err.triton"]["status"] == PASS  # Triton under the interpreter
    assert figures["attention_max_abs_err.flashinfer"]["status"] == NA
    assert figures["recompute_attention_max_abs_err"]["status"] == PASS  # the recomputed prefixes read exactly
    details = body["details"]
    assert details["recompute"]["recompute_tokens"] > 0 and details["recompute"]["predicted_step_ms"] > 0
    assert details["plan"]["solver"] and sum(details["plan"]["offloaded_layers_per_request"]) > 0
    assert details["resident_host_fraction"] == 0 and details["core_stats"]["host_fraction"] > 0
    assert details["core_stats"]["overflow_steps_total"] == 0
    assert details["core_stats"]["fetched_layer_pages_total"] > 0
    events = details["transfer_events"]  # the data plane's own timing account (wall-timed on CPU)
    assert len(events["placed_stall_ms"]) == events["steps"] and sum(events["placed_stall_ms"]) > 0
    assert events["h2d_gbps"] > 0 and events["d2h_gbps"] > 0
    assert details["core_stats"]["h2d_seconds_total"] > 0 and details["core_stats"]["stall_seconds_total"] > 0
    assert figures["transfer_events.stall_vs_wall_rel_err"]["status"] == NA  # a GPU's figure
    overlap = details["overlap"]  # the controller's launch-cost fit reproduces the hidden step
    assert overlap["launches"] >= 1
    model = overlap["model_step_ms"]
    if model["without_launches"] < overlap["step_ms"]:  # the usual case here: CPU copies do not overlap
        assert overlap["fetch_launch_ms"] > 0
        assert model["with_fitted_launches"] == pytest.approx(overlap["step_ms"], rel=1e-3)
    else:
        assert overlap["fetch_launch_ms"] == 0 and model["with_fitted_launches"] == model["without_launches"]
    assert figures["overlap.fetch_launch_ms"]["target"] == "none"
    layers = body["config"]["layers"]
    for kind, t in details["step_timeline"].items():  # one step of each kind laid out, layer by layer
        assert len(t["wait_ms"]) == len(t["layer_ms"]) == layers, kind
        assert math.isclose(t["boundary_ms"] + sum(t["layer_ms"]), t["step_ms"], rel_tol=1e-6), kind
        assert 0 <= t["wait_ms_total"] <= t["step_ms"] <= t["host_enqueue_ms"], kind  # CPU: synchronous
    assert "placed step" in figures["transfer_events.stall_vs_wall_rel_err"]["note"]
    overlap = details["overlap"]  # a placement the model hides: some KV out, the model's stall ~0
    assert overlap["offloaded_layer_pages"] > 0 and sum(overlap["offloaded_layers_per_request"]) > 0
    assert overlap["model_stall_ms"] <= 0.02 * overlap["resident_step_ms"]
    assert overlap["step_ms_by_programs"] == {"default": overlap["step_ms"]}  # the CPU engine has no cap
    assert details["transfer"]["by_programs"] is None
    assert len(overlap["timeline"]["layer_ms"]) == layers
    md = path.with_suffix(".md").read_text()
    assert body["machine"] in md and "CPU dry run" in md
    assert all(f["title"] in md for f in body["figures"])
    assert "kvplane gpu-check on CPU" in capsys.readouterr().out


def test_a_wrong_attention_fails_the_check(tmp_path, monkeypatch):
    """Negative control, through the whole run: an attention that swaps two requests' outputs
    is graded FAIL against the dense reference, the report says FAIL and the exit status is 1."""
    reference = gpu_check_attention.paged_decode_ref

    def swapped(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        return reference(*args, **kwargs).roll(1, dims=0)

    monkeypatch.setattr(gpu_check_attention, "paged_decode_ref", swapped)
    body, figures = _failing_quick_run(tmp_path)
    assert figures["attention_max_abs_err.torch"]["status"] == FAIL
    assert figures["attention_max_abs_err.triton"]["status"] == PASS
    assert body["status"] == FAIL and body["tests"]["note"].startswith("not run")


def test_a_wrong_recompute_fails_the_check(tmp_path, monkeypatch):
    """Negative control: recomputed prefix K/V off by one make the recompute attention figure FAIL
    (and nothing else)."""
    from sglang_ext.dataplane.layered_kv_core import LayeredKVCore

    real = LayeredKVCore.write_recompute
    monkeypatch.setattr(LayeredKVCore, "write_recompute", lambda self, layer, k, v: real(self, layer, k + 1, v))
    _, figures = _failing_quick_run(tmp_path)
    assert figures["recompute_attention_max_abs_err"]["status"] == FAIL
    assert figures["attention_max_abs_err.torch"]["status"] == PASS


def test_overlap_sweeps_the_copy_program_caps(tmp_path, monkeypatch):
    """An engine with a copy-program cap (CUDA's) is timed at every cap of the sweep, and left at
    its default afterwards; the CPU engine stands in (it copies synchronously, whatever the cap).
    The check batch has slots for every step of every phase at the default repeat."""
    from sglang_ext.dataplane.transfer_engine import CpuTransferEngine
    from sglang_ext.tools import gpu_check_overlap

    seen = []
    real = gpu_check_overlap.time_ms

    def timed(fn, device, repeat):  # noqa: ANN001, ANN202
        seen.append(engines[-1].copy_programs)
        return real(fn, device, repeat)

    engines: list = []
    init = CpuTransferEngine.__init__

    def tracked(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        init(self, *a, **k)
        self.copy_programs = None
        engines.append(self)

    monkeypatch.setattr(CpuTransferEngine, "__init__", tracked)
    monkeypatch.setattr(gpu_check_overlap, "time_ms", timed)
    # the default repeat, as on a GPU: the batch's slots must last every phase's steps, the
    # sweep's included (before it was counted: out of slots in the recompute phase)
    assert main(["gpu-check", "--device", "cpu", "--skip-tests", "--out-dir", str(tmp_path)]) == 0
    _, body = _result(tmp_path)
    sweep = body["details"]["overlap"]["step_ms_by_programs"]
    assert list(sweep) == ["default", "256", "32", "16", "4"]
    assert seen == [None, *gpu_check_overlap.PROGRAM_CAPS]  # the all-resident step re-timed first, uncapped
    assert engines[-1].copy_programs is None
    link = body["details"]["transfer"]["by_programs"]  # the link at each cap, beside the step times
    assert list(link) == ["256", "32", "16", "4"] and all(v["h2d_gbps"] > 0 and v["duplex_gbps"] > 0
                                                          for v in link.values())
    note = {f["key"]: f for f in body["figures"]}["overlap.hidden_step_rel"]["note"]
    assert "H2D / duplex GB/s by cap" in note and "recommended: " in note
    assert body["details"]["overlap"]["recommended_programs"].startswith(("default", "--kv-copy-programs "))


def test_the_copy_engines_are_swept_where_the_engine_has_them(tmp_path, monkeypatch):
    """On a GPU the check also runs the copy engines (``set_copy_engine("dma")``): the transfer
    check's H2D / duplex, the hidden placement's step and timeline, two figures; the engine goes
    back to its kernels after each. The CPU engine stands in with a switch that only records
    (it copies synchronously either way), at the default repeat: the batch's slots last these
    steps too."""
    from sglang_ext.dataplane.transfer_engine import CpuTransferEngine
    from sglang_ext.tools.gpu_check_measure import CoreCheck

    switches: list[str] = []
    init = CpuTransferEngine.__init__

    def tracked(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        init(self, *a, **k)
        self.copy_programs, self.impl, self.dma_error = None, "triton", None
        # the driver's counters as a GPU run leaves them: 3 strided runs of 40 segments, 5 singles
        self._dma = SimpleNamespace(copies=5, calls=1, call_seconds=1e-5, driver_version=13000)
        self._pitched, self.pitched_error = SimpleNamespace(calls=3, rows=40, call_seconds=6e-6), None
        self.fetch_runs = SimpleNamespace(planned=4, reused=12)  # the CUDA engine's FetchRunCache counters

    def set_copy_engine(self, name):  # noqa: ANN001, ANN202
        switches.append(name)
        self.impl = name
        return True

    check_init = CoreCheck.__init__

    def probed(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        check_init(self, *a, **k)
        self.dma_error = None  # as on a GPU whose driver has the batched memcpy

    from sglang_ext.tools import gpu_check_transfer

    monkeypatch.setattr(CpuTransferEngine, "__init__", tracked)
    monkeypatch.setattr(CpuTransferEngine, "set_copy_engine", set_copy_engine, raising=False)
    monkeypatch.setattr(CoreCheck, "__init__", probed)
    # the small preset's segments are far under the copy engines' floor: first as they are...
    assert main(["gpu-check", "--device", "cpu", "--skip-tests", "--out-dir", str(tmp_path)]) == 0
    _, body = _result(tmp_path)
    assert switches == [] and body["details"]["overlap"]["dma_error"].startswith("segments of ")
    assert body["details"]["placed_engine"] == "triton"  # the copy engines refused: the kernels serve
    assert body["details"]["plan"]["h2d_gbps"] == pytest.approx(body["details"]["transfer"]["h2d_gbps"], rel=1e-6)
    assert {f["key"]: f for f in body["figures"]}["overlap.hidden_step_rel.dma"]["note"].startswith(
        "not measured: segments of ")
    # ...then with the floor at 0, as Llama-3-8B's 32 KiB segments pass it; the hidden placement's
    # host-time steps (timed and profiled after its copy-engine step) add driver calls of their
    # own, which the copy engines' per-copy figure must not average in
    monkeypatch.setattr(gpu_check_transfer, "DMA_MIN_BYTES", 0)
    from sglang_ext.tools.gpu_check_overlap import OverlapCheck

    host_time = OverlapCheck._host_time

    def busier(self, engine, resident_ms):  # noqa: ANN001, ANN202
        self.check.batch.core.store.engine._dma.copies += 1000
        return host_time(self, engine, resident_ms)

    monkeypatch.setattr(OverlapCheck, "_host_time", busier)
    assert main(["gpu-check", "--device", "cpu", "--skip-tests", "--out-dir", str(tmp_path)]) == 0
    _, body = _result(tmp_path)
    # the transfer check, the placed phase (on what serves: the copy engines), the half-offloaded
    # placement, then the hidden one; the model's bandwidth is the copy engines' H2D there
    assert switches == ["dma", "triton"] * 4
    assert body["details"]["placed_engine"] == "dma"
    t = body["details"]["transfer"]
    assert body["details"]["plan"]["h2d_gbps"] == pytest.approx(t["by_programs"]["dma"]["h2d_gbps"], rel=1e-6)
    placed = body["details"]["overlap"]["placed_on_copy_engines"]
    assert placed["step_ms"] > 0 and placed["timeline"]["step_ms"] > 0
    overlap, link = body["details"]["overlap"], body["details"]["transfer"]["by_programs"]
    assert overlap["step_ms_by_programs"]["dma"] > 0 and overlap["dma_error"] is None
    assert overlap["dma_timeline"]["step_ms"] > 0
    assert link["dma"]["h2d_gbps"] > 0 and link["dma"]["duplex_gbps"] > 0
    assert link["dma"]["h2d_interleaved_gbps"] > 0 and link["dma"]["interleaved_pitch_mib"] > 0
    assert "in a long decode's order" in {f["key"]: f for f in body["figures"]}["duplex_vs_one_direction.dma"]["note"]
    figures = {f["key"]: f for f in body["figures"]}
    for key in ("overlap.hidden_step_rel.dma", "duplex_vs_one_direction.dma", "h2d_vs_contiguous.dma"):
        assert figures[key]["value"] is not None and figures[key]["status"] == NA, key  # the CPU's: N/A
    assert figures["h2d_vs_contiguous.dma"]["value"] == pytest.approx(link["dma"]["h2d_gbps"] / t["contiguous_gbps"])
    assert "step " in figures["overlap.hidden_step_rel.dma"]["note"]
    assert "the half-offloaded placement on the copy engines" in figures["overlap.hidden_step_rel.dma"]["note"]
    assert ("driver 13000, 3 strided runs (2-D copies) of 40 segments at 2.00 us of host time each, 5 single "
            "segments at 2.00 us each in 1 batched calls, fetches planned 4, reusing a layer's plan 12") in \
        figures["overlap.hidden_step_rel.dma"]["note"]


def test_the_interleaved_h2d_is_one_free_step_run_per_residue():
    """The transfer check's interleaved H2D (a long decode's page order over the batch's pages)
    goes on the copy engines as ``2 x INTERLEAVE`` free-step runs (K and V of each residue), none
    single, at ``INTERLEAVE`` times the prompt pages' pitch; the batch's own order is ~2 runs
    (the control: the same pages, fixed-step runs)."""
    import numpy as np

    from kernels.pitched_memcpy import plan_runs
    from sglang_ext.tools.gpu_check_transfer import INTERLEAVE, interleaved

    layers, pages = LLAMA3_8B.layers, np.arange(1, 1 + 10_000)
    stage = np.arange(20_000, 30_000)
    for order, want_runs, want_step in ((interleaved(pages), 2 * INTERLEAVE, INTERLEAVE * 2 * layers),
                                        (pages, 2, 2 * layers)):
        k = (order * layers + 0) * 2
        src, dst = np.concatenate([k, k + 1]), np.concatenate([stage, stage + 100_000])
        groups, rest, _ = plan_runs(src, dst, 2 * layers, 1)
        steps = np.concatenate([np.broadcast_to(g[3], g[2].shape) for g in groups])
        assert sum(g[2].size for g in groups) == want_runs and rest.size == 0
        assert set(steps.tolist()) == {want_step}
    assert sorted(interleaved(pages).tolist()) == pages.tolist()


def test_grade_flags_figures_that_miss_their_target():
    """Negative control of the grading: a figure below / above its bound is FAIL, a missing or
    NaN value on a meaningful figure is FAIL, a not-meaningful or target-less one is N/A."""
    assert grade(0.90, ">=", 0.85) == PASS
    assert grade(0.60, ">=", 0.85) == FAIL
    assert grade(0.0, "<=", 0.0) == PASS
    assert grade(1.0, "<=", 0.0) == FAIL
    assert grade(math.nan, "<=", 0.1) == FAIL
    assert grade(None, ">=", 1.5) == FAIL
    assert grade(0.60, ">=", 0.85, meaningful=False) == NA
    assert grade(3.0, None, None) == NA
    with pytest.raises(ValueError, match="op"):
        grade(1.0, "<", 2.0)
    bad = Figure.graded("duplex_vs_one_direction", "duplex", 1.1, "ratio", ">=", 1.5, "test")
    assert bad.status == FAIL and bad.target == ">= 1.5"
    report = GpuCheckReport(machine="CPU: test", device="cpu", command="kvplane gpu-check", environment={},
                            config=vars(LLAMA3_8B), tests={"failed": 0, "errors": 0}, figures=[bad])
    assert report.status == FAIL and "| FAIL |" in report.to_markdown()
    report.figures = [Figure.graded("x", "x", 0.0, "syncs", "<=", 0.0, "test")]
    assert report.status == PASS
    report.tests = {"failed": 1, "errors": 0}
    assert report.status == FAIL  # a failing gpu test fails the check


def test_llama3_8b_preset_and_config_validation():
    """The GPU preset is the issue's shapes; invalid configs are refused by field name."""
    c = LLAMA3_8B
    assert (c.layers, c.kv_heads, c.head_dim, c.dtype, c.page_size, c.requests) == (32, 8, 128, "bfloat16", 16, 32)
    assert (min(c.contexts), max(c.contexts), len(c.contexts)) == (2048, 8192, 32)
    assert c.layer_page_bytes == 2 * 16 * 8 * 128 * 2
    for bad, field in (({"q_heads": 12}, "q_heads"), ({"context_max": 1}, "context_max"),
                       ({"offload_share": 1.0}, "offload_share"), ({"dtype": "int8"}, "dtype"),
                       ({"repeat": 0}, "repeat")):
        with pytest.raises(ValueError, match=field):
            GpuCheckConfig(**{**vars(c), **bad})


def test_gpu_test_files_are_found_by_marker(monkeypatch):
    """The test step runs every file that names the gpu marker (and only those); without SGLang
    (the GPU host) the files under tests/sglang/ are listed as excluded, not collected."""
    run = GpuTestRun()
    files = run.files()
    assert "tests/dataplane/test_gpu.py" in files and "tests/kernels/test_paged_decode.py" in files
    assert "tests/dataplane/test_gpu_check.py" not in files
    real_find_spec = gpu_check_tests.importlib.util.find_spec
    monkeypatch.setattr(gpu_check_tests.importlib.util, "find_spec",
                        lambda name, *a: None if name == "sglang" else real_find_spec(name, *a))
    runnable, excluded = run.runnable()
    assert excluded and all(f.startswith("tests/sglang/") for f in excluded)
    assert sorted(runnable + excluded) == sorted(files) and "tests/dataplane/test_gpu.py" in runnable


def test_failed_tests_are_reported_with_their_message(tmp_path):
    """A failing test's name and message reach the summary (a GPU run's report is all that comes
    back); a passing one is counted, not listed."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_marked.py").write_text(
        "import pytest\npytestmark = pytest.mark." + "gpu\n\n"  # split: this file is not a gpu test
        "def test_ok():\n    assert 1 + 1 == 2\n\n"
        "def test_bad():\n    assert 40 + 2 == 41, 'the planted message'\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs CUDA\n")
    summary = GpuTestRun(root=tmp_path, timeout_s=120).run()
    assert (summary.passed, summary.failed, summary.errors) == (1, 1, 0)
    assert len(summary.failures) == 1
    assert summary.failures[0].startswith("tests.test_marked::test_bad: ")
    assert "the planted message" in summary.failures[0] and "test_ok" not in summary.failures[0]


def test_sync_probe_records_where_a_sync_came_from():
    """A CUDA sync warning is counted with the Python frames that led to it (the GPU run's
    report says what to fix); other warnings are not counted."""
    from sglang_ext.tools.gpu_check_probes import SyncProbe

    probe = SyncProbe("cpu")

    def caller():
        probe._seen("kvplane", "called a synchronizing CUDA operation", UserWarning, "torch/cuda/x.py", 7)
        probe._seen("kvplane", "some other warning", UserWarning, "torch/cuda/x.py", 8)
        # what torch says once when the mode is first set (H100 run 3 counted it as a sync)
        probe._seen("kvplane", "Synchronization debug mode is a prototype feature and does not yet detect all "
                    "synchronizing operations", UserWarning, "torch/cuda/__init__.py", 1270)

    caller()
    assert probe.runtime["kvplane"] == 1
    (site, n), = probe.where("kvplane").items()
    assert n == 1 and site.startswith("torch/cuda/x.py:7 <- test_gpu_check.py:")


def test_extend_phase_grades_the_kernel_against_its_reference(monkeypatch):
    """The prefill phase's error figure is the kernel's distance from the fp32 reference (the
    interpreter here): PASS as served, FAIL when the reference it is held to moves by 1e-3
    (negative control: the figure reads the kernel's output, not a constant)."""
    from sglang_ext.tools import gpu_check_extend
    from sglang_ext.tools.gpu_check_config import SMALL

    check = gpu_check_extend.ExtendCheck(SMALL, "cpu")
    figures = {f.key: f for f in check.run()}
    assert figures["extend.max_abs_err"].status == PASS and figures["extend.max_abs_err"].value < 1e-4
    assert check.details["prompts"] == [list(p) for p in gpu_check_extend.CPU_PROMPTS]
    real = gpu_check_extend.paged_extend_ref
    monkeypatch.setattr(gpu_check_extend, "paged_extend_ref", lambda **t: real(**t) + 1e-3)
    moved = {f.key: f for f in gpu_check_extend.ExtendCheck(SMALL, "cpu").run()}["extend.max_abs_err"]
    assert moved.status == FAIL and moved.value >= 1e-3


def test_causal_flops_counts_the_keys_each_query_sees():
    """One query after a 3-token prefix sees 4 keys; 3 new tokens without prefix see 1 + 2 + 3."""
    from sglang_ext.tools.gpu_check_extend import causal_flops

    assert causal_flops(((3, 1),), 1, 1) == 4 * 4
    assert causal_flops(((0, 3), (3, 1)), 2, 8) == 4 * 2 * 8 * (6 + 4)
