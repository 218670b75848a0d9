"""A session survives absurd, finite telemetry (control-plane review, session 80): two reports of
a 1.7e308 ms step inflated the learned profile, the next true step sent the bandwidth to inf, and
every later plan of the session failed (``plan_failed`` with a traceback, no decision for the
worker again). The real embedded control plane, as the SGLang plugin runs it."""

from __future__ import annotations

import math

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
