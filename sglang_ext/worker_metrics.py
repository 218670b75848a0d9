"""``WorkerMetrics``: kvplane's scheduler-process metrics on SGLang's own ``/metrics``.

SGLang 0.5.23 with ``--enable-metrics`` serves ``/metrics`` from its main process in Prometheus
*multiprocess* mode: the launcher sets ``PROMETHEUS_MULTIPROC_DIR`` before it spawns the
schedulers, every process's ``prometheus_client`` values are memory-mapped files in that
directory, and the main process's ``MultiProcessCollector`` merges them at scrape time
(``sglang.srt.utils.common.add_prometheus_middleware``). A metric created in a scheduler process
therefore appears on ``/metrics`` whatever registry it is registered in: each
:class:`WorkerMetrics` registers in a private ``CollectorRegistry`` (nothing process-wide), and its
series carry the scheduler's own SGLang labels (``scheduler.metrics_collector.labels``:
``model_name``, ``engine_type``, ``tp_rank``, ...), so TP ranks are distinct series.

Built per scheduler by :meth:`WorkerMetrics.for_scheduler` only when SGLang's
``--enable-metrics`` is on (read through :mod:`sglang_ext.compat`); otherwise it returns None, the
scheduler hooks skip every call with one ``is None`` test, and no metric or multiprocess file is
created. What is exported is the table :data:`sglang_ext.metric_spec.WORKER_METRICS`.

Updates are O(1) per step: label-bound children are created once, a step reads the pool's
running totals (one ``residency_stats()``) and adds the differences, gauges are written only
when they change, and per-request work happens only for requests that finish or are reported.

* Counters in multiprocess mode are summed over processes; each series has one writer anyway.
* Gauges use ``multiprocess_mode="mostrecent"`` (as SGLang's own): every gauge series is written
  by exactly one process (the labels include ``tp_rank``), so the most recent write is that
  process's value; after a scheduler restart the new process's value wins, and a dead process's
  file keeps its last value (SGLang never calls ``mark_process_dead``, so ``live*`` modes would
  not drop it either).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final

import structlog

from controlplane.api import Decision, StepReport
from controlplane.controller.metrics import EMBEDDED_METRIC_NAMES, PrometheusObserver
from controlplane.policy import Policy
from sglang_ext.admission import request_slo
from sglang_ext.metric_spec import WORKER_METRICS, MetricSpec

log = structlog.get_logger(__name__)

GAUGE_MODE: Final = "mostrecent"
"""``multiprocess_mode`` of every gauge (see the module docstring)."""


class WorkerMetrics:
    """One scheduler's kvplane metrics (every TP rank: KV residency and transfers; TP rank 0
    also: plans, pauses, admission, SLO verdicts, control-plane fallbacks, deposits)."""

    def __init__(
        self,
        labels: Mapping[str, Any],
        *,
        layers: int,
        page_size: int,
        source: bool,
        registry: Any = None,
    ) -> None:
        if layers < 1 or page_size < 1:
            raise ValueError(f"WorkerMetrics: layers={layers}, page_size={page_size}; both must be >= 1")
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.labels = {str(k): str(v) for k, v in labels.items()}
        self.registry = registry if registry is not None else CollectorRegistry()
        self.layers = layers
        self.page_size = page_size
        self.source = source
        """TP rank 0: exports the ``source``-scoped metrics and the embedded controller's."""
        names = list(self.labels)
        self._one: dict[str, Any] = {}
        self._by: dict[str, dict[str, Any]] = {}
        for spec in WORKER_METRICS:
            if spec.scope == "controller" or (spec.scope == "source" and not source):
                continue
            keys = [*names, spec.label] if spec.label else names
            metric: Counter | Gauge | Histogram
            if spec.kind == "counter":
                metric = Counter(spec.name, spec.meaning, keys, registry=self.registry)
            elif spec.kind == "gauge":
                metric = Gauge(spec.name, spec.meaning, keys, registry=self.registry, multiprocess_mode=GAUGE_MODE)
            else:
                metric = Histogram(spec.name, spec.meaning, keys, registry=self.registry, buckets=spec.buckets)
            if spec.label:
                self._by[spec.key] = {v: metric.labels(**self.labels, **{spec.label: v}) for v in spec.label_values}
            else:
                self._one[spec.key] = metric.labels(**self.labels) if names else metric
        self._gauges: dict[str, float] = {}
        self._totals: dict[str, float] = {}
        if source:  # written once so /metrics shows it before any outage (an unset gauge is not scraped)
            self._set("control_plane_degraded", 0.0)
        self._pool: Any = None
        self._backend: Any = None
        self._seen_delta: Any = None
        self.transfers: Any = None
        """The layered core whose transfer account feeds the copy seconds and the stall histogram
        (``LayeredKVCore.close_transfer_step``, CPU and CUDA alike); None without a layered pool."""
        self._policy: Callable[[], Policy] = Policy
        self._session: Callable[[], Any] = lambda: None
        self.fallbacks = self._one.get("control_plane_fallback_steps_total")
        """The fallback-steps counter child (TP rank 0), for the control client."""

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def for_scheduler(
        cls, scheduler: Any, *, layers: int, page_size: int, source: bool, registry: Any = None
    ) -> WorkerMetrics | None:
        """The metrics of ``scheduler`` when SGLang runs with ``--enable-metrics``, else None.

        Labels: SGLang's scheduler collector's (``scheduler.metrics_collector.labels``)."""
        if not bool(getattr(scheduler.server_args, "enable_metrics", False)):
            return None
        collector = scheduler.metrics_collector
        labels = getattr(collector, "labels", None)
        if not isinstance(labels, Mapping):
            log.warning("kvplane_metrics_without_sglang_labels", reason="no SchedulerMetricsCollector")
            labels = {}
        return cls(labels, layers=layers, page_size=page_size, source=source, registry=registry)

    def attach_pool(self, pool: Any, backend: Any) -> None:
        """The layered pool (residency totals, its core's transfer account) and the attention
        backend (``last_delta``: the reconciliation of its last forward)."""
        self._pool = pool
        self._backend = backend
        core = getattr(pool, "core", None)
        self.transfers = core if callable(getattr(core, "close_transfer_step", None)) else None
        if self.transfers is not None:
            self.transfers.close_transfer_step()  # waits before the first step are no step's stall

    def controller_observer(self) -> PrometheusObserver:
        """The embedded controller's counters as ``kvplane:controller_*`` with SGLang's labels."""
        return PrometheusObserver(self.registry, names=EMBEDDED_METRIC_NAMES, labels=self.labels)

    def bind_control_plane(self, control_plane: Any, client: Any, policy_file: str | None) -> None:
        """Where SLO targets and deposits come from: the embedded control plane's live policy and
        session, else ``policy_file`` (``--kv-policy``) or the defaults, and no deposits."""
        store = getattr(control_plane, "store", None)
        if store is not None and callable(getattr(store, "get", None)):
            self._policy = store.get
        elif policy_file is not None:
            from controlplane.policy_store import load_policy_file

            policy = load_policy_file(policy_file)
            self._policy = lambda: policy
        self._session = lambda: getattr(client, "session", None)

    # ---- every TP rank ------------------------------------------------------------------
    def boundary(self, record: Mapping[str, Any]) -> None:
        """After a step boundary (``StepBoundary.record``): the install's moves; on TP rank 0 its
        pauses, resumes and skipped pauses."""
        delta = record.get("install_delta")
        if delta:
            self._add("offloaded_layer_pages_total", delta.get("offloaded_layer_pages", 0))
            self._add("loaded_layer_pages_total", delta.get("loaded_layer_pages", 0))
        if self.source:
            self._add("requests_paused_total", len(record.get("paused_now") or ()))
            self._add("requests_resumed_total", len(record.get("resumed_now") or ()))
            skipped = record.get("pauses_skipped")
            if skipped:  # by reason; one outside the metric's table is not exported
                children = self._by["pauses_skipped_total"]
                for reason, count in skipped.items():
                    if reason in children:
                        children[reason].inc(count)

    def end_step(self, *, paused: int = 0, held_total: int = 0, local_admits: int = 0) -> None:
        """After a forward (every rank): residency, moves, bytes, copy seconds, stall; TP rank 0
        also the paused requests and the admission gate's running totals."""
        if self.transfers is not None:  # first: books the completed timing events (no sync)
            stall = self._one["stall_seconds"]
            for seconds in self.transfers.close_transfer_step():
                stall.observe(seconds)
        pool = self._pool
        if pool is not None:
            stats = pool.residency_stats()
            weight = self.page_size / self.layers
            host = stats.host_layer_pages
            self._set("device_kv_tokens", (stats.live_layer_pages - host) * weight)
            self._set("host_kv_tokens", host * weight)
            self._set("device_kv_budget_tokens", stats.device_pages_total * weight)
            self._total("h2d_bytes_total", stats.h2d_bytes_total)
            self._total("d2h_bytes_total", stats.d2h_bytes_total)
            self._total("h2d_seconds_total", stats.h2d_seconds_total)
            self._total("d2h_seconds_total", stats.d2h_seconds_total)
            self._total("fetched_layer_pages_total", stats.fetched_layer_pages_total)
            self._total("overflow_steps_total", stats.overflow_steps_total)
            delta = getattr(self._backend, "last_delta", None)
            if delta is not None and delta is not self._seen_delta:
                self._seen_delta = delta
                self._add("offloaded_layer_pages_total", delta.offloaded_layer_pages)
                self._add("loaded_layer_pages_total", delta.loaded_layer_pages)
        if self.source:
            self._set("paused_requests", paused)
            self._total("admissions_held_total", held_total)
            self._total("local_admissions_total", local_admits)

    # ---- TP rank 0 ----------------------------------------------------------------------
    def decisions(self, decisions: Sequence[Decision]) -> None:
        """Plans received from the control plane (the control client calls this)."""
        plans, solve = self._one["plans_total"], self._one["plan_solve_seconds"]
        for d in decisions:
            plans.inc()
            solve.observe(max(0.0, d.plan.solve_ms) / 1e3)
            self._set("window_steps", d.plan.window_steps)

    def outage(self, down: bool) -> None:
        """A control-plane outage began (``down``) or ended (the control client calls this on
        both edges): the degraded gauge follows, the outages counter counts beginnings."""
        self._set("control_plane_degraded", 1.0 if down else 0.0)
        if down:
            self._add("control_plane_outages_total", 1)

    def resumed(self, count: int) -> None:
        """Paused requests resumed outside a boundary (an abort reaching a paused request)."""
        self._add("requests_resumed_total", count)

    def finished(self, reqs: Iterable[Any]) -> None:
        """SLO verdicts of requests that finished this step (O(finished)).

        TTFT: scheduler arrival -> first token against the policy's ``slo_ttft_ms``; TBT: mean
        time per output token after the first against the request's ``kvplane_slo_tbt_ms`` or
        the policy's ``slo_tbt_ms`` (a single token has no gap: met). A request that never got
        its first token (aborted while queued) is not judged, nor a request asking no tokens (the
        prefix warm-up SGLang sends ahead of an ``n > 1`` request, ``max_new_tokens == 0``)."""
        policy: Policy | None = None
        ttft, tbt = self._by["ttft_slo_requests_total"], self._by["tbt_slo_requests_total"]
        for req in reqs:
            if req.sampling_params.max_new_tokens == 0:
                continue
            stats = req.time_stats
            arrived, first, done = stats.scheduler_recv_time, stats.prefill_finished_time, stats.completion_time
            if arrived <= 0.0 or first <= 0.0:
                continue
            policy = policy or self._policy()
            ttft["met" if (first - arrived) * 1e3 <= policy.slo_ttft_ms else "missed"].inc()
            tokens = len(req.output_ids)
            slo = request_slo(req) or policy.slo_tbt_ms
            met = tokens < 2 or (done > first and (done - first) * 1e3 / (tokens - 1) <= slo)
            tbt["met" if met else "missed"].inc()

    def report_sent(self, report: StepReport) -> None:
        """A report reached the control plane: the embedded controller's deposit balance over the
        reported requests (O(reported requests), once per report; nothing with a remote one)."""
        deposit = getattr(self._session(), "deposit", None)
        if deposit is None:
            return
        total = 0
        for r in report.running:
            d = deposit(r.id)
            if d is not None:
                total += d.balance
        self._set("deposit_tokens", total)

    # ---- internals ----------------------------------------------------------------------
    def _add(self, key: str, amount: float) -> None:
        if amount:
            self._one[key].inc(amount)

    def _total(self, key: str, total: float) -> None:
        """Advance a counter to a running total kept elsewhere (never backwards)."""
        last = self._totals.get(key, 0.0)
        if total > last:
            self._one[key].inc(total - last)
            self._totals[key] = total

    def _set(self, key: str, value: float) -> None:
        if self._gauges.get(key) != value:
            self._gauges[key] = value
            self._one[key].set(value)


def exported_specs(*, source: bool) -> tuple[MetricSpec, ...]:
    """The specs a scheduler exports (``source``: TP rank 0 with the embedded controller)."""
    return tuple(s for s in WORKER_METRICS if s.scope == "rank" or source)
