"""A session survives absurd, finite telemetry (control-plane review, session 80): two reports of
a 1.7e308 ms step inflated the learned profile, the next true step sent the bandwidth to inf, and
every later plan of the session failed (``plan_failed`` with a traceback, no decision for the
worker again). The real embedded control plane, as the SGLang plugin runs it."""

from __future__ import annotations

import math

import pytest

from controlplane import api
from controlplane.embedded import EmbeddedControlPlane
from controlplane.model import Hardware, ModelSpec, Profile


def _play(absurd: float) -> tuple[float, list[api.Decision]]:
    cp = EmbeddedControlPlane()
    try:
        s = cp.open_session(api.WorkerInfo("w0", ModelSpec(8, 16, 65536), Hardware(300, 25.0), Profile((0.5,) * 8)))
        got: list[api.Decision] = []
        for step in range(30):
            running = [api.RequestState("r0", 500 + step), api.RequestState("r1", 900 + step)]
            if step >= 20:  # a new request: a batch change the controller must plan
                running.append(api.RequestState("r2", 700 + step))
            obs = None if step == 0 else (absurd if step in (2, 3) else 4.0)
            got += s.report(api.StepReport(step=step, now_ms=step * 10.0, observed_step_ms=obs, running=tuple(running)))
            s.flush(10)
        return s.status().h2d_gbps, got
    finally:
        cp.close()


def test_a_session_plans_on_after_two_absurd_step_times() -> None:
    gbps, got = _play(1.7e308)
    assert math.isfinite(gbps) and gbps > 0
    late = [d for d in got if d.apply_at_step > 20]
    assert late and all(math.isfinite(d.plan.predicted_step_ms) for d in late), late
    # control: the same history with a plausible slow step plans the batch change too
    gbps, got = _play(400.0)
    assert any(d.apply_at_step > 20 for d in got)


def test_an_absurd_clock_is_refused_and_the_session_plans_on() -> None:
    """Review of session 80: one report at ``now_ms`` 1.7e308 (finite) set the session's clock
    there, and every later report was refused as before it. Now that report is refused
    (``MAX_NOW_MS``) and the next ones plan the batch change. Control: a report before the last
    is still refused."""
    cp = EmbeddedControlPlane(synchronous=True)
    try:
        s = cp.open_session(api.WorkerInfo("w0", ModelSpec(8, 16, 65536), Hardware(300, 25.0), Profile((0.5,) * 8)))

        def report(step: int, now: float, n: int = 2) -> list[api.Decision]:
            running = tuple(api.RequestState(f"r{i}", 500 + step) for i in range(n))
            return s.report(api.StepReport(step=step, now_ms=now, running=running))

        report(0, 0.0)
        with pytest.raises(api.InvalidArgument, match=r"now_ms: 1.7e\+308 is out of range"):
            report(1, 1.7e308)
        assert report(1, 10.0, n=3)  # a batch change: planned
        with pytest.raises(api.InvalidArgument, match="before the previous report"):
            report(2, 5.0)
    finally:
        cp.close()
