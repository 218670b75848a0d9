"""Controller metrics hooks: a small observer interface and two implementations.

No global state: :class:`PrometheusObserver` registers its collectors on the registry it is
given (the service passes its own ``CollectorRegistry`` with :data:`SERVICE_METRIC_NAMES`; the
SGLang scheduler process running the embedded controller passes one with
:data:`EMBEDDED_METRIC_NAMES` and SGLang's scheduler labels, so the controller's counters appear
on SGLang's ``/metrics``), :class:`ControllerCounters` just counts in memory (tests, the embedded
mode, the simulator). :class:`FanOutObserver` combines several.
Observers are called from the planning thread and from ``report()``; they must be thread-safe
and must not raise (the controller logs and ignores observer errors).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

import structlog

_log = structlog.get_logger(__name__)

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


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


@dataclass(frozen=True)
class ObserverMetricNames:
    """The metric names a :class:`PrometheusObserver` exports (counters with their ``_total``)."""

    triggers: str = "kvplane_controller_triggers_total"
    """Re-plan triggers, label ``reason``."""
    plans: str = "kvplane_plans_total"
    """Decisions computed, label ``feasible``."""
    solve_seconds: str = "kvplane_plan_solve_seconds"
    """Histogram of planning wall time per decision."""
    pauses: str = "kvplane_pauses_total"
    """Requests paused by decisions."""
    resumes: str = "kvplane_resumes_total"
    """Requests resumed by decisions."""
    errors: str = "kvplane_plan_errors_total"
    """Planning failures."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not _METRIC_NAME.fullmatch(value):
                raise ValueError(
                    f"ObserverMetricNames.{f.name}={value!r} is not a Prometheus metric name "
                    "(allowed: [a-zA-Z_:][a-zA-Z0-9_:]*)"
                )
            if f.name != "solve_seconds" and not value.endswith("_total"):
                raise ValueError(f"ObserverMetricNames.{f.name}={value!r}: a counter name must end in _total")


SERVICE_METRIC_NAMES = ObserverMetricNames()
"""``kvplane serve``'s names (its own registry, ``controlplane/service/metrics.py``)."""

EMBEDDED_METRIC_NAMES = ObserverMetricNames(
    triggers="kvplane:controller_triggers_total",
    plans="kvplane:controller_plans_total",
    solve_seconds="kvplane:controller_plan_solve_seconds",
    pauses="kvplane:controller_pauses_total",
    resumes="kvplane:controller_resumes_total",
    errors="kvplane:controller_plan_errors_total",
)
"""The embedded controller's names: in the SGLang scheduler process they join the worker's
``kvplane:*`` metrics on SGLang's ``/metrics`` (``sglang_ext/worker_metrics.py``)."""

SOLVE_BUCKETS_S: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
"""Default buckets of the solve-time histogram (seconds)."""


class PrometheusObserver:
    """Exports the controller's events as Prometheus metrics on the given registry.

    Metrics (``names``, :data:`SERVICE_METRIC_NAMES` by default): triggers ``{reason}``, plans
    ``{feasible}``, solve seconds (histogram), pauses, resumes, planning errors. ``labels`` are
    constant labels on every series (the embedded controller passes SGLang's scheduler labels,
    e.g. ``model_name``, ``tp_rank``); label-bound children are cached once.
    """

    def __init__(
        self,
        registry: Any,
        *,
        buckets_s: Sequence[float] | None = None,
        names: ObserverMetricNames = SERVICE_METRIC_NAMES,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        from prometheus_client import Counter, Histogram

        const = {str(k): str(v) for k, v in (labels or {}).items()}
        keys = list(const)
        self._const = const
        self.triggers = Counter(names.triggers, "Re-plan triggers", [*keys, "reason"], registry=registry)
        self.plans = Counter(names.plans, "Decisions computed", [*keys, "feasible"], registry=registry)
        self.solve_seconds = Histogram(
            names.solve_seconds,
            "Planning wall time per decision",
            keys,
            registry=registry,
            buckets=tuple(buckets_s) if buckets_s else SOLVE_BUCKETS_S,
        )
        self.pauses = Counter(names.pauses, "Requests paused", keys, registry=registry)
        self.resumes = Counter(names.resumes, "Requests resumed", keys, registry=registry)
        self.errors = Counter(names.errors, "Planning failures", keys, registry=registry)
        self._solve = self.solve_seconds.labels(**const) if keys else self.solve_seconds
        self._pauses = self.pauses.labels(**const) if keys else self.pauses
        self._resumes = self.resumes.labels(**const) if keys else self.resumes
        self._errors = self.errors.labels(**const) if keys else self.errors
        self._plans = {
            feasible: self.plans.labels(**const, feasible=str(feasible).lower()) for feasible in (True, False)
        }

    def on_trigger(self, worker_id: str, reason: str) -> None:
        self.triggers.labels(**self._const, reason=reason).inc()

    def on_plan(self, worker_id: str, reason: str, solve_ms: float, feasible: bool) -> None:
        self._plans[bool(feasible)].inc()
        self._solve.observe(solve_ms / 1e3)

    def on_pause(self, worker_id: str, request_id: str, reason: str) -> None:
        self._pauses.inc()

    def on_resume(self, worker_id: str, request_id: str, reason: str) -> None:
        self._resumes.inc()

    def on_error(self, worker_id: str, error: str) -> None:
        self._errors.inc()


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
