"""StagedGraphProbe: `kvplane gpu-check`'s staged decode steps replayed as one CUDA graph.

Why: kvplane's host time on a placed step is most of what keeps issue 14's last target out of
reach (``benchmarks/results/gpu/session67-h200-runs.md``: 0.64-0.70 of the all-resident step on
the H200, against 0.05; the hidden placement's step 0.48-0.49 over all-resident where the copies
are hidden). A profile of that step has no large single item: it is the per-layer host calls --
fetch launches, events, index views, the KV write. A graph replays them with no host work, so
:class:`~sglang_ext.dataplane.graph_staging.GraphStaging` puts a staged decode step's fetches and
parked write-back into fixed launches over device lists. This probe measures what that buys on
the check's batch, and grades that it decodes right:

1. the batch takes the overlap phase's hidden placement (its ``rows``; a fixed one where that
   phase did not run) and decodes eager staged steps (timed: the eager step, and kvplane's host
   time in it) on the decode that serves: FlashInfer's where it is available, else -- or where its
   capture raises, which the result names -- Triton's (:data:`BACKENDS`);
2. graphs are captured over a padding-only step (SGLang's start-up capture,
   :class:`~sglang_ext.dataplane.decode_graphs.DecodeGraphs` with ``staged=True``; FlashInfer's
   graph wrappers planned for it first); then steps run as boundary + admit (the tables and the
   fetch lists into the buffers) + plan (FlashInfer's, from the buffers' host CSR, as the served
   decode plans before a replay) + replay, timed, with kvplane's host time (the boundary, the
   admission and the step's end after the replay, thread CPU; the plan's apart);
3. one more step is admitted, its staging pages filled with :data:`SCRAMBLE`, replayed: every
   layer's attention vs the dense reference over the regenerated KV (a replay whose fetches
   missed a page reads the scramble); then its layers run eagerly over the same buffers -- the
   fetch launches again, eagerly -- and must agree with the replay exactly; an eager step after
   them compares every layer's attention with the dense reference too (the replays' parked tokens
   reached the host pool: the staged layers fetch them from there).

Then the batch goes all-resident and steps replay through the same graph (its staging launches
empty): what staging in the graph costs where nothing is offloaded, beside the graph probe's
all-resident replay without it.

Figures ``graph.staged.*``: the three agreements (graded), the step eager vs replayed, and kvplane's
host time per replayed step over the all-resident eager step -- the issue's measure, graded with
its target (0.05) as the figure where graphs serve. On the CPU there is no graph (N/A); the tests
capture and replay the same steps on :class:`~sglang_ext.testing.tape_graph.TapeGraph`.
"""

from __future__ import annotations

import statistics
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from sglang_ext.dataplane.bench_env import sync, time_ms
from sglang_ext.layer_timing import LayerTimer
from sglang_ext.tools.gpu_check_report import Figure
from sglang_ext.tools.host_profile_probe import HostProfileProbe

HOST_SHARE_TARGET = 0.05
"""Issue 14's target for kvplane's host time per step, as a share of the all-resident GPU step."""
SCRAMBLE = 1e4
"""What the checked replay's staging pages hold before it: its fetches must overwrite every one read."""
BACKENDS = ("flashinfer", "triton")
"""The decodes the staged graphs capture, in order (as the graph probe's): FlashInfer's where it is
available -- what ``--kv-cuda-graphs on`` serves on CUDA when no ``--attention-backend`` is given,
its graph wrappers planned before each replay (``FlashInferLayeredDecode.plan_graph``) -- else, or
where its capture raises (the result names why), Triton's (``--attention-backend triton``)."""


PROFILED = 3
"""Replayed staged steps whose host work (boundary + admission) is profiled by function."""


def _total(layer_ms: list[float] | None) -> str:
    return "none recorded" if layer_ms is None else f"{sum(layer_ms):.3f}"


def steps(repeat: int) -> int:
    """Decode steps the probe adds to the batch (``GpuCheckConfig.decode_steps``), per backend tried
    (two at most): the timed eager steps (2 warm-ups + ``repeat``), the timed replayed ones (as
    many), the later one, the timed all-resident replays (as many), the profiled replays, the
    layer-timed one and the accuracy step."""
    return 2 * (3 * (repeat + 2) + 3 + PROFILED)


class StagedGraphProbe:
    """The probe (module docstring) on a :class:`~sglang_ext.tools.gpu_check_measure.CoreCheck`;
    ``graph`` builds the graph object from the device (default ``CudaGraph``, CUDA only)."""

    def __init__(self, check: Any, graph: Callable[[str], Any] | None = None) -> None:
        self.check = check
        self.graph = graph

    def run(self) -> list[Figure]:
        """The probe's figures (N/A with the reason where nothing could be captured)."""
        ch = self.check
        if self.graph is None and not ch.device.startswith("cuda"):
            return self.figures(None, "CUDA only: there is no graph to capture on the CPU (the tests replay these "
                                      "steps on TapeGraph: tests/dataplane/test_gpu_check_staged_graph.py)")
        try:
            m = self.measure()
        except Exception as exc:  # noqa: BLE001 - a probe on hardware nobody ran it on: reported, not failed
            traceback.print_exc()
            return self.figures(None, f"the capture or replay raised {type(exc).__name__}: {exc}")
        ch.details["graph_staged"] = m
        return self.figures(m, "")

    def _rows(self) -> list[list[int]]:
        """The overlap phase's hidden placement, else every request's later half of layers on host."""
        ch = self.check
        rows = ch.details.get("overlap", {}).get("rows")
        if rows:
            return [list(r) for r in rows]
        layers = ch.config.layers
        return [[1] * (layers // 2) + [0] * (layers - layers // 2) for _ in ch.batch.rids]

    def measure(self) -> dict[str, Any]:
        """The probe on FlashInfer's decode where it is available, else -- or where it raises,
        which the result then names -- on Triton's (:data:`BACKENDS`)."""
        from sglang_ext.tools.gpu_check_graph import first_that_captures

        return first_that_captures([name for name in BACKENDS if name in self.check.backends.available],
                                   self._attempt)

    def _attempt(self, backend: str) -> dict[str, Any]:
        from sglang_ext.dataplane.decode_graphs import DecodeGraphs
        from sglang_ext.tools.gpu_check_graph import CudaGraph, plan_loaded_step, plan_padding_step

        ch = self.check
        b, c, device = ch.batch, ch.config, ch.device
        core, last = b.core, c.layers - 1
        rows = self._rows()
        b.place(rows)
        core.store.engine.quiesce()
        sync(device)
        eager_ms = time_ms(lambda: ch.layers(b.begin_decode(), backend=backend), device, c.repeat)
        real = len(b.rids)
        graphs = DecodeGraphs(core, (real,), b.batch_pages + real, staged=True)
        staging, buffers = graphs.buffers.staging, graphs.buffers

        def layers(bs: int) -> list[torch.Tensor]:
            return ch.layers(None, backend=backend, plan=False, graph=buffers)

        plan_ms: list[float] = []

        def replay(size: int) -> Any:  # the attention's plan for the loaded step (FlashInfer's), then the graph
            t0 = time.thread_time()
            plan_loaded_step(ch, backend, buffers)
            plan_ms.append((time.thread_time() - t0) * 1e3)
            return graphs.replay(size)

        graphs.capture(layers, lambda: (self.graph or CudaGraph)(device),
                       lambda bs: plan_padding_step(ch, backend, buffers))
        host_replay: list[float] = []
        staged_steps = [0]
        profile = HostProfileProbe()
        profiling = [False]

        def admit() -> int:
            loc = b.begin_decode()
            t0 = time.thread_time()
            with profile.boundary() if profiling[0] else nullcontext():
                size = graphs.admit(slots=loc)
            host_replay.append(b.prepare_cpu_s * 1e3 + (time.thread_time() - t0) * 1e3)
            if size is None:
                core.exit_layer(last)
                raise RuntimeError(f"a staged step was not admitted: {dict(graphs.eager_reasons)}")
            staged_steps[0] += staging.loaded_fetches > 0
            return size

        def replayed_step() -> None:
            size = admit()
            try:
                replay(size)
            finally:  # the step's end is kvplane's host work too (served: end_graph_step after the replay)
                t0 = time.thread_time()
                core.exit_layer(last)
                host_replay[-1] += (time.thread_time() - t0) * 1e3

        replay_ms = time_ms(replayed_step, device, c.repeat)
        size = admit()  # a later step, its staging pages scrambled first: replayed, then its layers
        try:  # eagerly over the same buffers (fetching again)
            tables = core.tables
            core.store.dev[:, torch.as_tensor(tables.staging_ids, device=core.store.dev.device)] = SCRAMBLE
            static = replay(size)
            sync(device)
            replayed = [out[:real].clone() for out in static]
            again = [out[:real] for out in layers(size)]
            diff = max(float((x.float() - y.float()).abs().max()) for x, y in zip(replayed, again, strict=True))
        finally:
            core.exit_layer(last)
        dense = ch.dense_errors({"replay": replayed})["replay"]
        b.place([[1] * c.layers for _ in b.rids])  # all-resident steps through the same graph: what its
        core.store.engine.quiesce()  # empty staging launches cost where nothing is offloaded
        sync(device)
        resident_replay_ms = time_ms(replayed_step, device, c.repeat)
        host_resident = statistics.median(host_replay[-c.repeat:])
        b.place(rows)
        core.store.engine.quiesce()
        profiling[0], b.boundary_scope = True, profile.boundary  # where a replayed step's host time goes
        try:
            for _ in range(PROFILED):
                replayed_step()
                profile.steps += 1
        finally:
            profiling[0], b.boundary_scope = False, nullcontext
        timer = LayerTimer(c.layers, device, every=1)  # a sampled replay, timed by its graph's events
        timer.begin(True)
        size = admit()
        marks = graphs.buffers.marks
        timer.replayed(None if marks is None else marks.of(size))
        try:
            replay(size)
        finally:
            core.exit_layer(last)
        timer.end()
        layer_ms = timer.take()
        sync(device)
        errors = ch.attention_errors()[backend]  # one eager staged step over every replayed token
        resident_ms = ch.details.get("overlap", {}).get("resident_step_ms") or ch.details.get("resident_step_ms")
        return {"backend": backend, "layers": c.layers, "requests": real, "offloaded_layers_per_request": [r.count(0) for r in rows],
                "step_eager_ms": eager_ms, "step_replay_ms": replay_ms, "resident_step_ms": resident_ms,
                "resident_replay_ms": resident_replay_ms,
                "resident_replay_ms_plain": ch.details.get("graph_probe", {}).get("step_replay_ms"),
                "resident_replay_plain_backend": ch.details.get("graph_probe", {}).get("backend"),
                "host_replay_ms": statistics.median(host_replay[2: c.repeat + 2]),  # the timed ones
                "host_resident_replay_ms": host_resident, "host_profile": profile.top(),
                "plan_replay_ms": statistics.median(plan_ms[2: c.repeat + 2]),
                "replay_layer_ms": None if layer_ms is None else list(layer_ms),
                "replay_layer_stall_ms": None if layer_ms is None else list(timer.last_stall_ms),
                "hidden_eager_kvplane_cpu": ch.details.get("overlap", {}).get("kvplane_cpu"),
                "staged_replays": staged_steps[0], "replays": graphs.replays, "replay_max_abs_diff": diff,
                "replay_vs_dense": dense,
                "attention": errors, "eager_reasons": dict(graphs.eager_reasons)}

    def figures(self, m: dict[str, Any] | None, why: str) -> list[Figure]:
        """Two graded agreements, the step eager and replayed, kvplane's host share (graded on CUDA)."""
        got, cuda = m is not None, self.check.device.startswith("cuda")
        timed = got and cuda
        note = why if m is None else (f"{m['backend']} decode, {m['layers']} layers, batch {m['requests']}, offloaded "
                                      f"layers per request {m['offloaded_layers_per_request']}; {m['staged_replays']}"
                                      f" of {m['replays']} replays staged" + "".join(
                                          f"; {name}'s attempt raised {err}" for name, err in m["backends_failed"].items()))
        err = None if m is None else m["attention"]
        resident = None if m is None else m["resident_step_ms"]
        share = None if m is None or not resident else m["host_replay_ms"] / resident

        def v(key: str) -> float | None:
            return None if m is None else m[key]

        dense = None if m is None else m["replay_vs_dense"]
        return [
            Figure.graded("graph.staged.replay_vs_dense_err", "CUDA-graph replay of a staged step vs dense "
                          "reference", None if dense is None else dense["max_abs_err"], "abs",
                          None if dense is None else "<=", None if dense is None else dense["tolerance"],
                          "a staged step (hidden placement) admitted, its staging pages filled with "
                          f"{SCRAMBLE:g}, replayed -- its fetches and parked write-back launches of the graph: "
                          "every layer's attention vs dense_attention over the regenerated K/V (bf16 tolerance)",
                          meaningful=got, note=note),
            Figure.graded("graph.staged.replay_max_abs_diff", "CUDA-graph replay of a staged step vs its layers run "
                          "eagerly over the same buffers", v("replay_max_abs_diff"), "abs", "<=", 0.0,
                          "a staged step (hidden placement) admitted and replayed -- its fetches and parked "
                          "write-back launches of the graph -- then its layers eagerly over the same buffers, "
                          "fetching again: every layer's attention output", meaningful=got, note=note),
            Figure.graded("graph.staged.attention_err", "attention after replayed staged steps vs dense reference",
                          None if err is None else err["max_abs_err"], "abs", None if err is None else "<=",
                          None if err is None else err["tolerance"], "one eager staged step after the replayed "
                          "ones: every layer's attention vs dense_attention over the regenerated K/V (the replays' "
                          "parked tokens fetched back from the host pool)", meaningful=got, note=note),
            Figure.graded("graph.staged.step_ms.eager", "staged decode step (hidden placement), eager",
                          v("step_eager_ms"), "ms", None, None, "median wall time, device-synchronised; the "
                          "decode the note names", meaningful=timed, note=note),
            Figure.graded("graph.staged.step_ms.replay", "staged decode step: boundary + admit + plan + replay",
                          v("step_replay_ms"), "ms", None, None, "median wall time, device-synchronised",
                          meaningful=timed, note=note if m is None else f"a sampled replay's layers by the "
                          f"events its graph records (the controller's layer timings): "
                          f"{_total(m['replay_layer_ms'])} ms in all; {note}"),
            Figure.graded("graph.staged.resident_step_ms.replay", "all-resident decode step through the staged "
                          "graph: boundary + admit + plan + replay", v("resident_replay_ms"), "ms", None, None,
                          "median wall time, device-synchronised: the staging launches (empty lists) and the "
                          "parks are the cost where nothing is offloaded; graph.step_ms.replay is the batch "
                          "through the graph probe's graph without them (its backend, one padded row, its plan "
                          "per step: the staging's cost only where that backend is this one's too)", meaningful=timed,
                          note=note if m is None else f"without staging (graph probe, "
                          f"{m['resident_replay_plain_backend']}"
                          f"{'' if m['resident_replay_plain_backend'] == m['backend'] else ': another decode, not comparable'}"
                          f"): {m['resident_replay_ms_plain']} ms; {note}"),
            Figure.graded("graph.staged.kvplane_cpu_share", "kvplane CPU time per replayed staged step / the "
                          "all-resident eager step", share, "ratio", "<=", HOST_SHARE_TARGET,
                          "thread CPU time of the boundary, the admission (tables and fetch lists into the "
                          "buffers) and the step's end after the replay, median, over the all-resident eager step "
                          "of the overlap phase (issue 14's measure, where --kv-cuda-graphs on serves); the "
                          "attention's plan apart (SGLang's own FlashInfer backend plans before a replay too)",
                          meaningful=timed and share is not None,
                          note=note if m is None else f"{m['host_replay_ms']:.3f} ms a replayed step, plan "
                          f"{m['plan_replay_ms']:.3f} ms, over "
                          f"{resident} ms (the eager hidden step's kvplane host time: details.overlap.kvplane_cpu; an all-resident "
                          f"step replayed through the same graph: {m['host_resident_replay_ms']:.3f} ms; by function: "
                          "details.graph_staged.host_profile); "
                          f"{note}"),
        ]

