"""Load: 32 simulated workers streaming reports at 100 Hz for 30 s to one `kvplane serve`.

Checks that every decision the controller made was delivered (controller plans = decisions the
server sent = decisions workers received, no gaps per stream), that no report was lost, that no
worker saw an exception, and that the server's RSS does not grow after warm-up. Prints p50/p99
decision latency (the figure; not asserted beyond a sanity bound, it depends on machine load).
"""

from __future__ import annotations

import threading
import time

import pytest

from controlplane.bench.service_load import LoadSpec, run_load
from controlplane.service.ports import free_ports

from .conftest import ServeProcess

WORKERS = 32
RATE_HZ = 100.0
DURATION_S = 30.0
WARMUP_S = 10.0
MAX_RSS_GROWTH_BYTES = 24 * 1024 * 1024


@pytest.mark.slow
def test_32_workers_at_100hz_for_30s(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Every decision is delivered, no report is lost, no worker errors, server RSS flat after warm-up."""
    server = ServeProcess(
        *free_ports(2), tmp_path / "serve.log", "--log-level", "warning", "--max-sessions", "64"
    )
    server.start()
    samples: list[tuple[float, int]] = []
    stop = threading.Event()

    def sample_rss() -> None:
        t0 = time.monotonic()
        while not stop.wait(0.5):
            samples.append((time.monotonic() - t0, server.rss_bytes()))

    sampler = threading.Thread(target=sample_rss, daemon=True)
    try:
        sampler.start()
        result = run_load(
            server.target,
            LoadSpec(workers=WORKERS, duration_s=DURATION_S, rate_hz=RATE_HZ, change_every_steps=20),
            settle_s=5.0,
        )
        stop.set()
        sampler.join(5)
        sent = server.metric_sum("kvplane_decisions_total")
        plans = server.metric_sum("kvplane_plans_total")
        reports = server.metric_sum("kvplane_reports_total")
    finally:
        stop.set()
        server.kill()
    after_warmup = [rss for t, rss in samples if t >= WARMUP_S]
    growth = max(after_warmup) - after_warmup[0]
    print(
        f"\nload: {WORKERS} workers x {RATE_HZ:g} Hz x {result.duration_s:.1f} s: "
        f"reports={result.reports_sent} (batched {result.batched_reports}), "
        f"decisions={result.decisions_received} ({result.decisions_per_s:.0f}/s), "
        f"latency p50={result.latency_p50_ms:.1f} ms p99={result.latency_p99_ms:.1f} ms "
        f"max={result.latency_max_ms:.1f} ms, server RSS {after_warmup[0] / 2**20:.1f} MiB -> "
        f"max {max(after_warmup) / 2**20:.1f} MiB after warm-up"
    )
    assert result.worker_errors == 0
    assert result.reports_dropped == 0
    # This test is about loss and duplication under load, not speed (`kvplane bench service`
    # measures rates): on 2 shared cores the 32 client threads alone cannot always keep 100 Hz,
    # so only check that the load was really applied.
    assert result.reports_sent >= WORKERS * RATE_HZ * DURATION_S * 0.5, "load generator stalled"
    assert reports == result.reports_sent, "reports lost between worker and controller"
    assert result.decisions_received > 0
    assert result.decisions_received == result.decisions_announced, "a stream skipped decisions"
    assert sent == result.decisions_received, "decisions sent but not received"
    assert plans == sent, "decisions made by the controller but never delivered"
    assert result.latency_p99_ms < DURATION_S * 1000
    assert growth < MAX_RSS_GROWTH_BYTES, f"server RSS grew {growth / 2**20:.1f} MiB after warm-up"
