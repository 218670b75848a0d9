"""Per-report cost of ``SessionController.report()`` (the reader thread in ``kvplane serve``, the
scheduler thread in the embedded mode), R requests x L layers of the load generator's workload
(``controlplane/bench/service_load.py``); planning is flushed between reports, so only the
report's own work is timed. Prints the p50 / mean / max over steps 20.. and cProfile's top entries.

    .venv/bin/python benchmarks/results/service/session88-scale-review/report_cost.py R L [steps]
"""

from __future__ import annotations

import cProfile
import logging
import pstats
import statistics
import sys
import time

import structlog

from controlplane.bench.service_load import LoadSpec, _Worker, worker_info
from controlplane.embedded import EmbeddedControlPlane


def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    reqs, layers = int(sys.argv[1]), int(sys.argv[2])
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 100
    spec = LoadSpec(workers=1, duration_s=1, requests_per_worker=reqs, layers=layers)
    cp = EmbeddedControlPlane()
    session = cp.open_session(worker_info("w", spec))
    worker = _Worker(session, spec, 0)
    times, prof = [], cProfile.Profile()
    for step in range(steps):
        report = worker._report(step)
        timed = step >= 20
        t0 = time.perf_counter()
        if timed:
            prof.enable()
        session.report(report)
        if timed:
            prof.disable()
            times.append((time.perf_counter() - t0) * 1e3)
        session.flush(60)
    print(f"{reqs}x{layers}: report() ms p50 {statistics.median(times):.2f} mean {statistics.mean(times):.2f} "
          f"max {max(times):.2f}; installed all-GPU: {session._installed_all_gpu()}")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(8)
    cp.close()


if __name__ == "__main__":
    main()
