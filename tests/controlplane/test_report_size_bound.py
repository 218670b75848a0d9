"""A session's report may bring at most ``MAX_PLANNED_CELLS`` request-layers to plan (control-plane
review, session 80: 65,536 requests of a 4,096-layer model would have taken gigabytes of planner
memory). Refused as InvalidArgument naming the sizes; the session is untouched and plans on.
The bound is made small here (64) so the control plans quickly."""

from __future__ import annotations

import pytest

from controlplane import api
from controlplane.controller import report_validation
from controlplane.embedded import EmbeddedControlPlane
from controlplane.model import Hardware, ModelSpec, Profile


def test_a_report_past_the_planned_cells_is_refused_and_loses_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(report_validation, "MAX_PLANNED_CELLS", 64)
    cp = EmbeddedControlPlane(synchronous=True)
    try:
        s = cp.open_session(api.WorkerInfo("w0", ModelSpec(8, 16, 65536), Hardware(4000, 25.0), Profile((0.5,) * 8)))

        def report(step: int, n: int) -> list[api.Decision]:
            running = tuple(api.RequestState(f"r{i}", 100 + step) for i in range(n))
            return s.report(api.StepReport(step=step, now_ms=step * 10.0, running=running))

        report(0, 2)
        with pytest.raises(api.InvalidArgument, match=r"running: 9 requests x 8 layers is more than the 64"):
            report(1, 9)
        assert {r for r in s.status().running} == {"r0", "r1"}  # the refused report changed nothing
        assert report(1, 8)  # control: 8 x 8 = 64 is planned (a batch change: a decision)
        assert len(s.status().running) == 8
    finally:
        cp.close()
