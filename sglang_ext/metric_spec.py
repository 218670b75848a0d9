"""``MetricSpec`` and :data:`WORKER_METRICS`: every metric kvplane adds to SGLang's ``/metrics``.

One source of truth: :class:`~sglang_ext.worker_metrics.WorkerMetrics` builds its Prometheus
objects from this table, the embedded controller's names are
:data:`controlplane.controller.metrics.EMBEDDED_METRIC_NAMES` (checked against the rows with scope
``controller``), and the README's metric table is :func:`markdown_table` (a test compares them).

Every series carries SGLang's scheduler labels (``model_name``, ``engine_type``, ``tp_rank``,
``pp_rank``, ``moe_ep_rank``, and ``dp_rank`` / ``priority`` / ``--extra-metric-labels`` where
SGLang adds them), read off the scheduler's own ``SchedulerMetricsCollector``.

Pure Python (no prometheus_client, no torch): the README tool and the tests import it freely.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType

from controlplane.controller.metrics import EMBEDDED_METRIC_NAMES, SOLVE_BUCKETS_S
from sglang_ext.pause import PAUSE_SKIP_REASONS

NAMESPACE = "kvplane:"
"""Prefix of every kvplane metric on SGLang's ``/metrics`` (SGLang's own are ``sglang:``)."""

KINDS = ("counter", "gauge", "histogram")
SCOPES = ("rank", "source", "controller")
"""``rank``: every TP rank (its own KV pool); ``source``: TP rank 0 only (scheduling decisions,
identical on every rank, exported once); ``controller``: the embedded controller (TP rank 0)."""

_NAME = re.compile(r"kvplane:[a-z][a-z0-9_]*")

STEP_BUCKETS_S: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)
"""Buckets of per-step time histograms (seconds)."""


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric."""

    name: str
    """Name as queried in PromQL (``kvplane:...``; counters end in ``_total``; a histogram's
    series are ``name_bucket`` / ``name_sum`` / ``name_count``)."""
    kind: str
    """``counter``, ``gauge`` or ``histogram``."""
    unit: str
    """What one unit of the value is (``tokens``, ``bytes``, ``seconds``, ...)."""
    meaning: str
    """What it counts or measures."""
    scope: str = "rank"
    """Which processes export it (:data:`SCOPES`)."""
    label: str | None = None
    """A label of kvplane's own on top of SGLang's (e.g. ``result``), None for none."""
    label_values: tuple[str, ...] = ()
    """The values ``label`` takes (children are created once, up front), empty when open-ended."""
    caveat: str = ""
    """Where the value is not measured or means less (CPU / CUDA / control-plane mode)."""
    buckets: tuple[float, ...] = ()
    """Histogram buckets (seconds); empty for other kinds."""

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"MetricSpec.name={self.name!r}: must match {_NAME.pattern}")
        if self.kind not in KINDS:
            raise ValueError(f"MetricSpec.kind={self.kind!r} ({self.name}): allowed {KINDS}")
        if self.scope not in SCOPES:
            raise ValueError(f"MetricSpec.scope={self.scope!r} ({self.name}): allowed {SCOPES}")
        if (self.kind == "counter") != self.name.endswith("_total"):
            raise ValueError(f"MetricSpec.name={self.name!r}: counters, and only counters, end in _total")
        if (self.kind == "histogram") != bool(self.buckets) and self.scope != "controller":
            raise ValueError(f"MetricSpec.buckets ({self.name}): required for histograms, not allowed otherwise")
        if self.label_values and self.label is None:
            raise ValueError(f"MetricSpec.label_values ({self.name}): given without a label")
        if not self.meaning or not self.unit:
            raise ValueError(f"MetricSpec ({self.name}): meaning and unit must not be empty")

    @property
    def key(self) -> str:
        """The name without the namespace (``WorkerMetrics`` children are keyed by it)."""
        return self.name.removeprefix(NAMESPACE)

    @property
    def series(self) -> tuple[str, ...]:
        """The sample names a scrape shows for it."""
        if self.kind == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)


_CUDA_EVENTS = ("CUDA: a CUDA-event pair around each batched copy on its transfer stream, read without a sync "
                "once complete (at the end of its step or a later one; events still in flight are counted later), "
                "on about one step in --kv-timing-interval (default 8), each timed copy counted that many times: an estimate")

WORKER_METRICS: tuple[MetricSpec, ...] = (
    # ---- KV residency, per TP rank (each rank's layered pool) -----------------------------
    MetricSpec("kvplane:device_kv_tokens", "gauge", "tokens",
               "Live requests' KV on the device, layer-weighted: device layer-pages x page size / layers"),
    MetricSpec("kvplane:host_kv_tokens", "gauge", "tokens",
               "Live requests' KV whose only copy is in host memory, layer-weighted like device_kv_tokens"),
    MetricSpec("kvplane:device_kv_budget_tokens", "gauge", "tokens",
               "The device KV budget (--kv-gpu-budget-tokens or the pool), layer-weighted"),
    MetricSpec("kvplane:offloaded_layer_pages_total", "counter", "layer-pages",
               "Layer-pages whose device copy was dropped (host copy made current first), at plan installs "
               "and per-forward reconciliations"),
    MetricSpec("kvplane:loaded_layer_pages_total", "counter", "layer-pages",
               "Layer-pages copied host -> device at step boundaries (onloads)"),
    MetricSpec("kvplane:fetched_layer_pages_total", "counter", "layer-pages",
               "Layer-pages fetched host -> staging by the per-layer pipeline inside forwards"),
    MetricSpec("kvplane:h2d_bytes_total", "counter", "bytes", "Bytes copied host -> device (onloads and fetches)"),
    MetricSpec("kvplane:d2h_bytes_total", "counter", "bytes",
               "Bytes copied device -> host (write-back of dirty and staged layer-pages)"),
    MetricSpec("kvplane:h2d_seconds_total", "counter", "seconds",
               "Time host -> device copies took", caveat=f"CPU: the synchronous copies, wall-timed. {_CUDA_EVENTS}"),
    MetricSpec("kvplane:d2h_seconds_total", "counter", "seconds",
               "Time device -> host copies took", caveat=f"CPU: the synchronous copies, wall-timed. {_CUDA_EVENTS}"),
    MetricSpec("kvplane:stall_seconds", "histogram", "seconds",
               "Per forward step: time the step waited on KV transfers",
               caveat="CPU: the step's copy seconds (copies block the scheduler thread). CUDA: the compute "
                      "stream's waits on the layers' fetch events and on the step start's fence, timed by "
                      "CUDA-event pairs; a step is observed once all its pairs completed (normally at its "
                      "own end, otherwise at a later step); only the steps timed (about one in --kv-timing-interval) "
                      "are observed. Known gap (gpu-check run 13, H200): these waits saw "
                      "~1 ms of a half-offloaded step's ~217 ms transfer stall; see README \"GPU check\"",
               buckets=STEP_BUCKETS_S),
    MetricSpec("kvplane:overflow_steps_total", "counter", "steps",
               "Forwards whose batch could not be staged inside the budget (served at rest, with host syncs)"),
    # ---- scheduling, TP rank 0 (identical on every rank, exported once) -------------------
    MetricSpec("kvplane:plans_total", "counter", "plans",
               "Plans (decisions) the worker received from the control plane", scope="source"),
    MetricSpec("kvplane:plan_solve_seconds", "histogram", "seconds",
               "Planning wall time of each received plan", scope="source", buckets=SOLVE_BUCKETS_S),
    MetricSpec("kvplane:window_steps", "gauge", "steps", "Decode window (steps a plan holds) of the newest plan",
               scope="source"),
    MetricSpec("kvplane:requests_paused_total", "counter", "requests",
               "Requests paused (KV kept) at step boundaries", scope="source"),
    MetricSpec("kvplane:requests_resumed_total", "counter", "requests",
               "Paused requests resumed (at step boundaries, or to be aborted)", scope="source"),
    MetricSpec("kvplane:paused_requests", "gauge", "requests", "Requests paused now", scope="source",
               caveat="SGLang's sglang:num_running_reqs and its #running-req log line leave them out (a paused "
                       "request is parked outside the running batch, its KV and slots kept): in flight = running + paused"),
    MetricSpec("kvplane:pauses_skipped_total", "counter", "pause attempts",
               "Pauses of decoding requests the plan asked for and a step boundary did not apply, by reason: finishing (the "
               "request's last token comes in the next step, or the step in flight under the overlap loop: "
               "finishing frees its KV sooner), a batch feature whose per-request state cannot be split "
               "off (custom logit processor, speculative decoding, encoder-decoder; penalties split with the row), "
               "or would_idle (it would take the last running request not ending by the next step, and the "
               "boundary would resume it at once rather than idle; that pause is dropped), or "
               "penalties_in_flight (under the overlap loop, a request with a frequency, presence or "
               "repetition penalty, whose token counts a pause would shift; dropped too). "
               "The others stay deferred and are retried at each boundary while the request runs",
               scope="source", label="reason", label_values=PAUSE_SKIP_REASONS),
    MetricSpec("kvplane:deposit_tokens", "gauge", "tokens",
               "Tokens generated but not yet due under the token-deposit rule, summed over the controller's "
               "live requests (the reserve that hides stalls), as of the last report",
               scope="source", caveat="Embedded control plane only (a remote one keeps its deposits)"),
    MetricSpec("kvplane:admissions_held_total", "counter", "request-steps",
               "Queued requests held back by the admission gate, summed over steps (--kv-scheduler layerkv|lvf)",
               scope="source"),
    MetricSpec("kvplane:local_admissions_total", "counter", "requests",
               "Queued requests let in by the gate's work-conserving rule (nothing else running)", scope="source"),
    MetricSpec("kvplane:ttft_slo_requests_total", "counter", "requests",
               "Finished requests by TTFT SLO verdict (scheduler arrival -> first token vs the policy's "
               "slo_ttft_ms; not the `max_new_tokens` 0 prefix warm-up SGLang sends ahead of an `n > 1` "
               "request)", scope="source", label="result", label_values=("met", "missed"),
               caveat="Scheduler-side times (tokenizer and HTTP time not included); remote control plane: "
                      "judged against --kv-policy or the defaults"),
    MetricSpec("kvplane:tbt_slo_requests_total", "counter", "requests",
               "Finished requests by TBT SLO verdict (mean time per output token after the first vs the "
               "request's kvplane_slo_tbt_ms or the policy's slo_tbt_ms; one token: met; not the "
               "`max_new_tokens` 0 prefix warm-up of an `n > 1` request)",
               scope="source", label="result", label_values=("met", "missed"),
               caveat="Generation times, before token-deposit pacing"),
    MetricSpec("kvplane:control_plane_fallback_steps_total", "counter", "steps",
               "Steps reported without a live control plane (last plan or local heuristic)", scope="source"),
    MetricSpec("kvplane:control_plane_degraded", "gauge", "0/1",
               "1 from a report that could not reach a live control plane until one that does (the worker "
               "runs on its last plan meanwhile, its paused requests resumed); a connected control plane "
               "that leaves a report unanswered for 5 s (silent, or answering ever further behind) counts as not live (it acks answered reports at "
               "least once a second)", scope="source"),
    MetricSpec("kvplane:control_plane_outages_total", "counter", "outages",
               "Control-plane outages seen by the worker (each begins with a report that could not reach it)",
               scope="source"),
    # ---- the embedded controller (TP rank 0's process) ------------------------------------
    MetricSpec(EMBEDDED_METRIC_NAMES.triggers, "counter", "triggers", "Re-plan triggers by reason",
               scope="controller", label="reason", caveat="Embedded control plane only"),
    MetricSpec(EMBEDDED_METRIC_NAMES.plans, "counter", "plans", "Decisions computed (feasible true/false)",
               scope="controller", label="feasible", label_values=("true", "false"),
               caveat="Embedded control plane only"),
    MetricSpec(EMBEDDED_METRIC_NAMES.solve_seconds, "histogram", "seconds", "Planning wall time per decision",
               scope="controller", caveat="Embedded control plane only"),
    MetricSpec(EMBEDDED_METRIC_NAMES.pauses, "counter", "requests", "Requests paused by decisions",
               scope="controller", caveat="Embedded control plane only"),
    MetricSpec(EMBEDDED_METRIC_NAMES.resumes, "counter", "requests", "Requests resumed by decisions",
               scope="controller", caveat="Embedded control plane only"),
    MetricSpec(EMBEDDED_METRIC_NAMES.errors, "counter", "errors", "Planning failures",
               scope="controller", caveat="Embedded control plane only"),
)
"""Every kvplane metric on SGLang's ``/metrics``, in README order."""

_SCOPE_TEXT = MappingProxyType({"rank": "every TP rank", "source": "TP rank 0", "controller": "TP rank 0"})


def spec_named(name: str) -> MetricSpec:
    """The spec of ``name`` (a metric name or one of its histogram series)."""
    for spec in WORKER_METRICS:
        if name == spec.name or name in spec.series:
            return spec
    raise KeyError(f"{name!r} is not a kvplane metric")


def markdown_table(specs: tuple[MetricSpec, ...] = WORKER_METRICS) -> str:
    """The README's metric table (name, type, labels, unit, meaning, caveats)."""
    rows = [
        "| metric | type | labels (besides SGLang's) | unit | exported by | meaning | caveats |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in specs:
        label = "—" if s.label is None else f"`{s.label}`" + (
            f" ({', '.join(s.label_values)})" if s.label_values else ""
        )
        rows.append(
            f"| `{s.name}` | {s.kind} | {label} | {s.unit} | {_SCOPE_TEXT[s.scope]} | {s.meaning} | "
            f"{s.caveat or '—'} |"
        )
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # the README's table: python -m sglang_ext.metric_spec
    print(markdown_table(), end="")
