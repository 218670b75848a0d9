"""The starvation guard at scale: one long request paused among R short ones, starving after
``max_paused_steps``; the guard forces it in and pauses others. Prints each decision's reason,
wall time and planner calls.

    .venv/bin/python benchmarks/results/service/session88-scale-review/starve_walk.py R [LONG SLO_MS FRAC LAYER_MS]
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import structlog

from controlplane import api
from controlplane.controller import NullObserver
from controlplane.embedded import EmbeddedControlPlane
from controlplane.model import Hardware, ModelSpec, Profile
from controlplane.planner import Planner
from controlplane.policy_store import PolicyStore

LAYERS = 80


def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    args = sys.argv[1:] + [None] * 5
    reqs = int(args[0])
    long_ctx = int(args[1] or 65536)
    slo = float(args[2] or 200.0)
    frac = float(args[3] or 1.0)
    layer_ms = float(args[4] or 0.4)
    calls: list[float] = []
    decisions: list[tuple[int, int, str]] = []

    class Counting(Planner):
        def plan(self, batch: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            plan = super().plan(batch, **kw)
            calls.append((time.perf_counter() - t0) * 1e3)
            return plan

    class Decisions(NullObserver):
        def on_plan(self, worker: str, reason: str, ms: float, feasible: bool) -> None:
            decisions.append((round(ms), len(calls), reason))

    ctx = {f"r{i}": 2048 for i in range(reqs)}
    ctx["big"] = long_ctx
    info = api.WorkerInfo("w0", ModelSpec(LAYERS, 16, 65536), Hardware(int(reqs * 128 * LAYERS * frac), 200.0),
                          Profile((layer_ms,) * LAYERS))
    store = PolicyStore()
    store.update({"max_paused_steps": 3}, actor="t")
    cp = EmbeddedControlPlane(store, planner_factory=Counting, observer=Decisions())
    session = cp.open_session(info)
    paused: set[str] = set()
    for step in range(12):
        for rid in ctx:
            if rid not in paused:
                ctx[rid] += 1
        running = tuple(api.RequestState(rid, c, slo_tbt_ms=slo, paused=rid in paused) for rid, c in ctx.items())
        report = api.StepReport(step=step, now_ms=step * 50.0, running=running,
                                observed_step_ms=None if step == 0 else layer_ms * LAYERS)
        for d in session.report(report):
            paused |= set(d.pause)
            paused -= set(d.resume)
        session.flush(600)
    before = 0
    for ms, n, reason in decisions:
        print(f"decision {reason}: {ms} ms wall, {n - before} planner calls")
        before = n
    cp.close()


if __name__ == "__main__":
    main()
