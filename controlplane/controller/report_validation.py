"""Checks on a worker's :class:`~controlplane.api.StepReport` before the controller uses it
(``InvalidArgument`` naming the field, the value and the allowed range)."""

from __future__ import annotations

import math

from controlplane.api import InvalidArgument, StepReport

MAX_PLANNED_CELLS = 1 << 24
"""Most request-layer cells a session's report may bring to plan (running requests x layers: the
planner's memory grows with them, ~10 bytes a cell at the least; 65,536 requests of a 4,096-layer
model asked for gigabytes, control-plane review, session 80). A real batch is far below: 1,024
requests of a 128-layer model are 131,072."""


MAX_NOW_MS = 1e13
"""Latest worker clock accepted (ms; ~317 years past its origin, the epoch or a boot): one report
at 1.7e308 ms set the session's clock there, and every later report was refused as before it
(review, session 80)."""


def validate_report(report: StepReport, last: StepReport | None, layers: int) -> None:
    """Raise ``InvalidArgument`` when ``report`` cannot follow ``last`` on a ``layers``-layer
    model; the controller's state is untouched either way."""
    if last is not None and report.step <= last.step:
        raise InvalidArgument(f"step: {report.step} must exceed the previous step {last.step}")
    if not 0 <= report.now_ms <= MAX_NOW_MS:  # NaN fails too
        raise InvalidArgument(f"now_ms: {report.now_ms} is out of range (allowed [0, {MAX_NOW_MS:g}])")
    if last is not None and report.now_ms < last.now_ms:
        raise InvalidArgument(f"now_ms: {report.now_ms} is before the previous report's {last.now_ms}")
    # finite, as the gRPC converter checks them: the embedded plane and the simulator take reports
    # as they are, and an inf here poisoned the profile or failed every later report (control-plane
    # review, session 77)
    if report.observed_step_ms is not None and not 0 <= report.observed_step_ms < math.inf:
        raise InvalidArgument(
            f"observed_step_ms: {report.observed_step_ms} is out of range (allowed finite >= 0)"
        )
    if len(report.running) * layers > MAX_PLANNED_CELLS:
        raise InvalidArgument(
            f"running: {len(report.running)} requests x {layers} layers is more than the "
            f"{MAX_PLANNED_CELLS} request-layers a session plans"
        )
    if report.layer_compute_ms is not None and len(report.layer_compute_ms) != layers:
        raise InvalidArgument(
            f"layer_compute_ms: has {len(report.layer_compute_ms)} entries, "
            f"expected model.layers = {layers}"
        )
    for i, ms in enumerate(report.layer_compute_ms or ()):
        if not 0 <= ms < math.inf:
            raise InvalidArgument(f"layer_compute_ms[{i}]: {ms} is out of range (allowed finite >= 0)")
    if report.h2d_gbps is not None and not 0 < report.h2d_gbps < math.inf:
        raise InvalidArgument(f"h2d_gbps: {report.h2d_gbps} is out of range (allowed finite > 0)")
    running = set()
    for i, r in enumerate(report.running):
        if r.slo_tbt_ms is not None and not 0 < r.slo_tbt_ms < math.inf:
            raise InvalidArgument(
                f"running[{i}].slo_tbt_ms: {r.slo_tbt_ms} is out of range (allowed finite > 0)"
            )
        if r.gpu_layers is not None and r.gpu_layers > layers:
            raise InvalidArgument(
                f"running[{i}].gpu_layers: {r.gpu_layers} is out of range (allowed 0..model.layers = {layers})"
            )
        running.add(r.id)
    for i, q in enumerate(report.queued):
        if q.id in running:
            raise InvalidArgument(f"queued[{i}].id: {q.id!r} is also running (a request is one or the other)")
