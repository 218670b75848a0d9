"""Controller metrics hooks: a small observer interface and two implementations.

No global state: :class:`PrometheusObserver` registers its collectors on the registry it is
given (the service passes its own ``CollectorRegistry``), :class:`ControllerCounters` just counts
in memory (tests, the embedded mode, the simulator). :class:`FanOutObserver` combines several.
Observers are called from the planning thread and from ``report()``; they must be thread-safe
and must not raise (the controller logs and ignores observer errors).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import structlog

_log = structlog.get_logger(__name__)


class ControllerObserver(Protocol):
    """Receives the controller's events."""

    def on_trigger(self, worker_id: str, reason: str) -> None: ...

    def on_plan(self, worker_id: str, reason: str, solve_ms: float, feasible: bool) -> None: ...

    def on_pause(self, worker_id: str, request_id: str, reason: str) -> None: ...

    def on_resume(self, worker_id: str, request_id: str, reason: str) -> None: ...

    def on_error(self, worker_id: str, error: str) -> None: ...


class NullObserver:
    """Ignores everything."""

    def on_trigger(self, worker_id: str, reason: str) -> None:
        pass

    def on_plan(self, worker_id: str, reason: str, solve_ms: float, feasible: bool) -> None:
        pass

    def on_pause(self, worker_id: str, request_id: str, reason: str) -> None:
        pass

    def on_resume(self, worker_id: str, request_id: str, reason: str) -> None:
        pass

    def on_error(self, worker_id: str, error: str) -> None:
        pass


@dataclass(frozen=True)
class CounterSnapshot:
    """Totals since the counters were created."""

    triggers: dict[str, int]
    """Re-plan triggers by reason (batch-change, expiry, profile-mismatch, ...)."""
    plans: int
    """Decisions computed (each may call the planner several times)."""
    infeasible_plans: int
    """Decisions whose final plan was infeasible."""
    pauses: int
    """Requests paused by decisions."""
    resumes: int
    """Requests resumed by decisions."""
    errors: int
    """Planning failures."""
    solve_ms_total: float
    """Summed planning wall time in ms."""
    solve_ms_max: float
    """Longest planning wall time in ms."""


class ControllerCounters:
    """Thread-safe in-memory counters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._triggers: dict[str, int] = {}
        self._plans = self._infeasible = self._pauses = self._resumes = self._errors = 0
        self._solve_total = self._solve_max = 0.0

    def on_trigger(self, worker_id: str, reason: str) -> None:
        with self._lock:
            self._triggers[reason] = self._triggers.get(reason, 0) + 1

    def on_plan(self, worker_id: str, reason: str, solve_ms: float, feasible: bool) -> None:
        with self._lock:
            self._plans += 1
            self._infeasible += 0 if feasible else 1
            self._solve_total += solve_ms
            self._solve_max = max(self._solve_max, solve_ms)

    def on_pause(self, worker_id: str, request_id: str, reason: str) -> None:
        with self._lock:
            self._pauses += 1

    def on_resume(self, worker_id: str, request_id: str, reason: str) -> None:
        with self._lock:
            self._resumes += 1

    def on_error(self, worker_id: str, error: str) -> None:
        with self._lock:
            self._errors += 1

    def snapshot(self) -> CounterSnapshot:
        with self._lock:
            return CounterSnapshot(
                dict(self._triggers),
                self._plans,
                self._infeasible,
                self._pauses,
                self._resumes,
                self._errors,
                self._solve_total,
                self._solve_max,
            )


class PrometheusObserver:
    """Exports the controller's events as Prometheus metrics on the given registry.

    Metrics: ``kvplane_controller_triggers_total{reason}``, ``kvplane_plans_total{feasible}``,
    ``kvplane_plan_solve_seconds`` (histogram), ``kvplane_pauses_total``,
    ``kvplane_resumes_total``, ``kvplane_plan_errors_total``.
    """

    def __init__(self, registry: Any, *, buckets_s: Sequence[float] | None = None) -> None:
        from prometheus_client import Counter, Histogram

        self.triggers = Counter(
            "kvplane_controller_triggers_total", "Re-plan triggers", ["reason"], registry=registry
        )
        self.plans = Counter(
            "kvplane_plans_total", "Decisions computed", ["feasible"], registry=registry
        )
        self.solve_seconds = Histogram(
            "kvplane_plan_solve_seconds",
            "Planning wall time per decision",
            registry=registry,
            buckets=tuple(buckets_s)
            if buckets_s
            else (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0),
        )
        self.pauses = Counter("kvplane_pauses_total", "Requests paused", registry=registry)
        self.resumes = Counter("kvplane_resumes_total", "Requests resumed", registry=registry)
        self.errors = Counter("kvplane_plan_errors_total", "Planning failures", registry=registry)

    def on_trigger(self, worker_id: str, reason: str) -> None:
        self.triggers.labels(reason=reason).inc()

    def on_plan(self, worker_id: str, reason: str, solve_ms: float, feasible: bool) -> None:
        self.plans.labels(feasible=str(feasible).lower()).inc()
        self.solve_seconds.observe(solve_ms / 1e3)

    def on_pause(self, worker_id: str, request_id: str, reason: str) -> None:
        self.pauses.inc()

    def on_resume(self, worker_id: str, request_id: str, reason: str) -> None:
        self.resumes.inc()

    def on_error(self, worker_id: str, error: str) -> None:
        self.errors.inc()


class FanOutObserver:
    """Forwards every event to several observers."""

    def __init__(self, observers: Sequence[ControllerObserver]) -> None:
        self._observers = tuple(observers)

    def on_trigger(self, worker_id: str, reason: str) -> None:
        for o in self._observers:
            o.on_trigger(worker_id, reason)

    def on_plan(self, worker_id: str, reason: str, solve_ms: float, feasible: bool) -> None:
        for o in self._observers:
            o.on_plan(worker_id, reason, solve_ms, feasible)

    def on_pause(self, worker_id: str, request_id: str, reason: str) -> None:
        for o in self._observers:
            o.on_pause(worker_id, request_id, reason)

    def on_resume(self, worker_id: str, request_id: str, reason: str) -> None:
        for o in self._observers:
            o.on_resume(worker_id, request_id, reason)

    def on_error(self, worker_id: str, error: str) -> None:
        for o in self._observers:
            o.on_error(worker_id, error)


class SafeObserver:
    """Wraps an observer so that its failures are logged and never reach the controller."""

    def __init__(self, inner: ControllerObserver) -> None:
        self._inner = inner

    def _call(self, name: str, *args: Any) -> None:
        try:
            getattr(self._inner, name)(*args)
        except Exception:  # an exporter bug must not break planning
            _log.exception("observer_failed", hook=name)

    def on_trigger(self, worker_id: str, reason: str) -> None:
        self._call("on_trigger", worker_id, reason)

    def on_plan(self, worker_id: str, reason: str, solve_ms: float, feasible: bool) -> None:
        self._call("on_plan", worker_id, reason, solve_ms, feasible)

    def on_pause(self, worker_id: str, request_id: str, reason: str) -> None:
        self._call("on_pause", worker_id, request_id, reason)

    def on_resume(self, worker_id: str, request_id: str, reason: str) -> None:
        self._call("on_resume", worker_id, request_id, reason)

    def on_error(self, worker_id: str, error: str) -> None:
        self._call("on_error", worker_id, error)
