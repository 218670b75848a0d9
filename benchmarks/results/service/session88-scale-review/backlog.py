"""Overload: one worker (R requests x L layers, the load generator's workload) reporting every step
at HZ to a ``kvplane serve`` whose per-report work exceeds the report period. Prints how far behind
the worker's step the newest decision was planned, how many decisions arrived expired, and how
many steps the worker's session said degraded.

    .venv/bin/python benchmarks/results/service/session88-scale-review/backlog.py R L HZ SECONDS
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import structlog

from controlplane.bench import service_bench
from controlplane.bench.service_load import LoadSpec, _Worker, worker_info
from controlplane.service.client import GrpcControlPlane


def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    reqs, layers, hz, secs = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
    spec = LoadSpec(workers=1, duration_s=secs, rate_hz=hz, requests_per_worker=reqs, layers=layers)
    with service_bench.ServeSubprocess(Path(tempfile.gettempdir()) / "serve-backlog.log") as srv:
        os.system(f"renice -n 10 -p {srv.proc.pid} >/dev/null")
        client = GrpcControlPlane(srv.target)
        session = client.open_session(worker_info("bk", spec))
        assert session.wait_connected(60)
        worker = _Worker(session, spec, 0)
        rows, degraded, step = [], 0, 0
        end = time.perf_counter() + secs
        while time.perf_counter() < end:
            t0 = time.perf_counter()
            for d in session.report(worker._report(step)):
                rows.append((step, d.apply_at_step, d.expiry_step))
            degraded += session.degraded
            step += 1
            time.sleep(max(0.0, 1 / hz - (time.perf_counter() - t0)))
        print(f"{reqs}x{layers} @{hz}Hz {secs}s: steps={step} decisions={len(rows)} "
              f"stale_periods={session.stats.stale_periods} steps_seen_degraded={degraded} "
              f"batched={session.stats.batched_reports}")
        for frac in (0.1, 0.25, 0.5, 0.75, 1.0):
            sub = [r for r in rows if r[0] <= frac * step]
            if sub:
                at, apply, expiry = sub[-1]
                behind = at - (apply - 1)
                print(f"  at worker step {at}: newest decision planned for step {apply - 1} ({behind} steps = "
                      f"{behind / hz:.1f} s behind), expiry {expiry}{' ALREADY EXPIRED' if expiry <= at else ''}")
        expired = sum(1 for at, _, expiry in rows if expiry <= at)
        print(f"  decisions already expired on arrival: {expired}/{len(rows)}")
        session.close(drain_s=0.5)
        client.close()


if __name__ == "__main__":
    main()
