"""Simulated SGLang workers streaming step reports to a control-plane service (load generator).

Used by `kvplane bench service` and by the load test (``tests/service/test_load.py``). Each
worker is a :class:`~controlplane.service.client.GrpcControlPlane` session driven by its own
thread with a synthetic decode batch: ``requests_per_worker`` requests whose contexts grow by one
token per step; every ``change_every_steps`` steps the oldest request finishes and a new one
arrives (a batch change, so the controller re-plans).

Two modes:

* open loop (``rate_hz > 0``): report at a fixed rate like a real worker, never waiting;
* closed loop (``rate_hz == 0``): send a report, wait for its decision, repeat (throughput).

Latency is measured on the worker: from sending the report to receiving the decision the server
sent after processing it (``SessionReply.report_step``).
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass

from controlplane import api
from controlplane.model import Hardware, ModelSpec, Profile
from controlplane.service.client import GrpcControlPlane
from controlplane.service.worker_session import Backoff, GrpcWorkerSession


@dataclass(frozen=True)
class LoadSpec:
    """What load to generate."""

    workers: int
    """Concurrent worker sessions."""
    duration_s: float
    """Streaming time per worker."""
    rate_hz: float = 100.0
    """Reports per second per worker; 0 = closed loop (next report after the decision)."""
    change_every_steps: int = 20
    """A request finishes and another arrives every this many steps (forces a re-plan)."""
    requests_per_worker: int = 4
    """Decoding requests per worker."""
    layers: int = 32
    """Model layers."""
    budget_fraction: float = 0.8
    """GPU KV budget as a fraction of the batch's initial full residency (< 1 forces offload)."""

    def __post_init__(self) -> None:
        if not 1 <= self.workers <= 4096:
            raise ValueError(f"workers: {self.workers} is out of range (allowed [1, 4096])")
        if not 0 < self.duration_s <= 3600:
            raise ValueError(f"duration_s: {self.duration_s} is out of range (allowed (0, 3600])")
        if not 0 <= self.rate_hz <= 10_000:
            raise ValueError(f"rate_hz: {self.rate_hz} is out of range (allowed [0, 10000])")
        if self.change_every_steps < 1:
            raise ValueError(f"change_every_steps: {self.change_every_steps} must be >= 1")
        if not 1 <= self.requests_per_worker <= 1024:
            raise ValueError(f"requests_per_worker: {self.requests_per_worker} is out of range (allowed [1, 1024])")
        if not 0 < self.budget_fraction <= 2:
            raise ValueError(f"budget_fraction: {self.budget_fraction} is out of range (allowed (0, 2])")


@dataclass(frozen=True)
class LoadResult:
    """What the workers observed."""

    workers: int
    """Concurrent worker sessions."""
    mode: str
    """``open-loop@<rate>Hz`` or ``closed-loop``."""
    duration_s: float
    """Measured streaming wall time."""
    reports_sent: int
    """Reports handed to live streams, all workers."""
    reports_dropped: int
    """Reports not sent (stream down or send queue full)."""
    decisions_received: int
    """Decisions received, all workers."""
    decisions_announced: int
    """Decisions the server said it sent (``decisions_sent``), all workers; equal when none lost."""
    decisions_per_s: float
    """decisions_received / duration_s."""
    latency_p50_ms: float
    """Median report-to-decision latency."""
    latency_p99_ms: float
    """99th percentile report-to-decision latency."""
    latency_max_ms: float
    """Worst report-to-decision latency."""
    solve_p50_ms: float
    """Median planner solve time of the received decisions."""
    batched_reports: int
    """Reports that went out inside a ReportBatch (the worker was ahead of the server)."""
    reconnects: int
    """Streams re-established after a failure."""
    worker_errors: int
    """Exceptions seen by worker step loops (must be 0)."""


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def worker_info(worker_id: str, spec: LoadSpec) -> api.WorkerInfo:
    ctx0 = 2048
    blocks = spec.requests_per_worker * -(-ctx0 // 16) * spec.layers
    return api.WorkerInfo(
        worker_id=worker_id,
        model=ModelSpec(layers=spec.layers, block_size=16, block_bytes=65536),
        hardware=Hardware(gpu_kv_budget_blocks=int(blocks * spec.budget_fraction), h2d_gbps=25.0),
        profile=Profile(layer_compute_ms=(0.4,) * spec.layers),
    )


class _Worker:
    """One simulated worker's step loop."""

    def __init__(self, session: GrpcWorkerSession, spec: LoadSpec, index: int) -> None:
        self.session = session
        self.spec = spec
        self.index = index
        self.errors = 0
        self.solve_ms: list[float] = []
        self._contexts = {f"w{index}-r{i}": 2048 + 64 * i for i in range(spec.requests_per_worker)}
        self._next_id = spec.requests_per_worker

    def _report(self, step: int) -> api.StepReport:
        finished: tuple[str, ...] = ()
        if step and step % self.spec.change_every_steps == 0:
            oldest = next(iter(self._contexts))
            del self._contexts[oldest]
            finished = (oldest,)
            self._contexts[f"w{self.index}-r{self._next_id}"] = 1024
            self._next_id += 1
        for rid in self._contexts:
            self._contexts[rid] += 1
        return api.StepReport(
            step=step,
            now_ms=step * 10.0,
            running=tuple(
                api.RequestState(id=rid, context_tokens=ctx, slo_tbt_ms=200.0)
                for rid, ctx in self._contexts.items()
            ),
            observed_step_ms=14.0 if step else None,
            finished=finished,
        )

    def run(self, stop_at: float) -> None:
        step = 0
        period = 1.0 / self.spec.rate_hz if self.spec.rate_hz > 0 else 0.0
        next_at = time.perf_counter()
        try:
            while time.perf_counter() < stop_at:
                decisions = self.session.report(self._report(step))
                if period == 0.0:
                    decisions += self.session.wait_decisions(timeout_s=2.0)
                self.solve_ms.extend(d.plan.solve_ms for d in decisions)
                step += 1
                if period:
                    next_at += period
                    delay = next_at - time.perf_counter()
                    if delay > 0:
                        time.sleep(delay)
                    else:
                        next_at = time.perf_counter()  # behind: do not burst to catch up
        except Exception:
            self.errors += 1


CLOSE_DRAIN_S = 120.0
"""How long closing the sessions may wait for the server to read the reports still queued."""


def run_load(target: str, spec: LoadSpec, *, settle_s: float = 5.0, tls: object = None,
             connect_timeout_s: float = 30.0) -> LoadResult:
    """Run ``spec`` against the service at ``target``; close every session before returning
    (a session not connected within ``connect_timeout_s`` raises ``RuntimeError``)."""
    client = GrpcControlPlane(target, backoff=Backoff(initial_s=0.05, max_s=1.0), tls=tls)  # type: ignore[arg-type]
    try:
        sessions = [
            client.open_session(worker_info(f"load-{spec.workers}-{i}", spec))
            for i in range(spec.workers)
        ]
        for s in sessions:
            if not s.wait_connected(connect_timeout_s):
                raise RuntimeError(f"session {s.worker_id} did not connect to {target}: {s.last_error}")
        workers = [_Worker(s, spec, i) for i, s in enumerate(sessions)]
        start = time.perf_counter()
        stop_at = start + spec.duration_s
        threads = [threading.Thread(target=w.run, args=(stop_at,), daemon=True) for w in workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(spec.duration_s + 60)
        elapsed = time.perf_counter() - start
        # Let decisions still in flight (planned after the last report) arrive.
        deadline = time.perf_counter() + settle_s
        while time.perf_counter() < deadline:
            for w in workers:
                w.solve_ms.extend(d.plan.solve_ms for d in w.session.wait_decisions(0.05))
        # Graceful close: reports a slow server has not read yet are still delivered (and their
        # decisions received); all streams drain concurrently, so one deadline covers them all.
        close_by = time.perf_counter() + CLOSE_DRAIN_S
        for s in sessions:
            s.close(drain_s=max(0.5, close_by - time.perf_counter()))
        latencies = [x for s in sessions for x in s.stats.latencies_ms]
        received = sum(s.stats.decisions_received for s in sessions)
        return LoadResult(
            workers=spec.workers,
            mode="closed-loop" if spec.rate_hz == 0 else f"open-loop@{spec.rate_hz:g}Hz",
            duration_s=elapsed,
            reports_sent=sum(s.stats.reports_sent for s in sessions),
            reports_dropped=sum(s.stats.reports_dropped for s in sessions),
            decisions_received=received,
            decisions_announced=sum(s.stats.decisions_announced for s in sessions),
            decisions_per_s=received / elapsed,
            latency_p50_ms=percentile(latencies, 0.50),
            latency_p99_ms=percentile(latencies, 0.99),
            latency_max_ms=max(latencies) if latencies else float("nan"),
            solve_p50_ms=statistics.median(x for w in workers for x in w.solve_ms)
            if any(w.solve_ms for w in workers)
            else float("nan"),
            batched_reports=sum(s.stats.batched_reports for s in sessions),
            reconnects=sum(s.stats.reconnects for s in sessions),
            worker_errors=sum(w.errors for w in workers),
        )
    finally:
        client.close()
