"""WorkerMetrics without a server: the metric table, the real layered pool at toy sizes, the real
embedded controller and control client, and Prometheus multiprocess mode across processes.

The served path (SGLang's ``/metrics`` with ``--enable-metrics``) is
``tests/sglang/test_metrics_server.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from controlplane.api import RequestState, StepReport, WorkerInfo
from controlplane.controller.metrics import EMBEDDED_METRIC_NAMES, ObserverMetricNames
from controlplane.embedded import EmbeddedControlPlane
from controlplane.model import Hardware, ModelSpec, Profile
from controlplane.policy import Policy
from controlplane.policy_store import PolicyStore
from sglang_ext.control_client import ControlClient
from sglang_ext.metric_spec import WORKER_METRICS, MetricSpec, markdown_table, spec_named
from sglang_ext.step_stats_writer import stats_dict
from sglang_ext.worker_metrics import WorkerMetrics

REPO = Path(__file__).resolve().parents[2]
LABELS = {"model_name": "tiny", "engine_type": "unified", "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}


def value(metrics: WorkerMetrics, name: str, **extra: str) -> float:
    """One sample of ``metrics``' registry (0.0 when absent)."""
    return metrics.registry.get_sample_value(name, {**metrics.labels, **extra}) or 0.0


def make_metrics(*, source: bool = True, layers: int = 3, page_size: int = 2) -> WorkerMetrics:
    return WorkerMetrics(LABELS, layers=layers, page_size=page_size, source=source, registry=CollectorRegistry())


# ---- the table ------------------------------------------------------------------------------


def test_metric_table_is_consistent_and_names_the_embedded_controller():
    """Names are unique and namespaced, every row validates, and the controller rows are exactly
    the embedded controller's names (one source of truth for the README table)."""
    names = [s.name for s in WORKER_METRICS]
    assert len(names) == len(set(names)) and all(n.startswith("kvplane:") for n in names)
    controller = {s.name for s in WORKER_METRICS if s.scope == "controller"}
    assert controller == {getattr(EMBEDDED_METRIC_NAMES, f.name) for f in dataclasses.fields(ObserverMetricNames)}
    assert spec_named("kvplane:stall_seconds_bucket").name == "kvplane:stall_seconds"
    table = markdown_table()
    assert all(f"| `{n}` |" in table for n in names)


def test_metric_spec_validation_names_the_field():
    """Negative controls: a counter without _total, an unknown kind, a histogram without buckets
    and a name outside the namespace are refused naming the field and the value."""
    with pytest.raises(ValueError, match="counters, and only counters, end in _total"):
        MetricSpec("kvplane:x", "counter", "u", "m")
    with pytest.raises(ValueError, match=r"MetricSpec.kind='summary'"):
        MetricSpec("kvplane:x", "summary", "u", "m")
    with pytest.raises(ValueError, match="MetricSpec.buckets"):
        MetricSpec("kvplane:x", "histogram", "u", "m")
    with pytest.raises(ValueError, match=r"MetricSpec.name='sglang:x'"):
        MetricSpec("sglang:x", "gauge", "u", "m")
    with pytest.raises(ValueError, match=r"ObserverMetricNames.plans='kvplane:plans'"):
        ObserverMetricNames(plans="kvplane:plans")


def test_each_scheduler_gets_its_own_registry_and_scope():
    """Two WorkerMetrics in one process do not collide (no process-wide registry); TP rank 0
    exports the scheduling metrics, other ranks only their pool's."""
    rank0, rank1 = make_metrics(), WorkerMetrics({**LABELS, "tp_rank": "1"}, layers=3, page_size=2, source=False)
    assert rank0.registry is not rank1.registry
    exported0 = {m.name for m in rank0.registry.collect()}
    exported1 = {m.name for m in rank1.registry.collect()}
    assert "kvplane:plans" in exported0 and "kvplane:plans" not in exported1  # counters drop _total
    assert "kvplane:h2d_bytes" in exported0 and "kvplane:h2d_bytes" in exported1
    assert rank1.fallbacks is None and rank0.fallbacks is not None


# ---- the real layered pool ------------------------------------------------------------------


def test_pool_metrics_follow_the_real_pool_totals():
    """Scenario: a toy layered pool (3 layers, budget of 24 layer-pages) runs prefills and decodes
    while a plan moves two layers of a request to host. The byte / page / overflow counters equal
    the pool's running totals, the offloaded counter the sum of the installs' and forwards'
    deltas, the copy seconds equal the core's transfer account (CPU engine: wall-timed) and each
    step observes its stall."""
    pytest.importorskip("sglang")  # the pool adapter subclasses SGLang's MHATokenToKVPool
    from tests.sglang.test_layered_pool import LAYERS, Harness, make_pool, wants

    pool = make_pool(budget_tokens=24)
    backend = SimpleNamespace(last_delta=None)
    metrics = make_metrics(layers=LAYERS)
    metrics.attach_pool(pool, backend)
    assert metrics.transfers is pool.core, "the core's transfer account feeds the copy seconds"
    h = Harness(pool)
    offloaded = steps = 0
    prepare = pool.prepare_step

    def recording_prepare(*args, **kwargs):  # what the attention backend keeps as last_delta
        backend.last_delta = prepare(*args, **kwargs)
        return backend.last_delta

    pool.prepare_step = recording_prepare
    for rid, n in (("a", 7), ("b", 5), ("a", 1), ("b", 1)):
        h.step(rid, n)
        offloaded += backend.last_delta.offloaded_layer_pages
        metrics.end_step()
        steps += 1
    before = value(metrics, "kvplane:h2d_bytes_total")
    delta = pool.update_residency({"a": wants(pool, h, "a", (True, False, False))})
    metrics.boundary({"install_delta": stats_dict(delta), "paused_now": [], "resumed_now": []})
    offloaded += delta.offloaded_layer_pages
    for _ in range(3):
        h.step("a", 1)
        offloaded += backend.last_delta.offloaded_layer_pages
        metrics.end_step()
        steps += 1
    stats = pool.residency_stats()
    assert delta.offloaded_layer_pages > 0 and stats.fetched_layer_pages_total > 0
    assert value(metrics, "kvplane:h2d_bytes_total") == stats.h2d_bytes_total > before
    assert value(metrics, "kvplane:d2h_bytes_total") == stats.d2h_bytes_total > 0
    assert value(metrics, "kvplane:fetched_layer_pages_total") == stats.fetched_layer_pages_total
    assert value(metrics, "kvplane:overflow_steps_total") == stats.overflow_steps_total
    assert value(metrics, "kvplane:offloaded_layer_pages_total") == offloaded
    weight = 2 / LAYERS  # page size 2 over 3 layers
    assert value(metrics, "kvplane:host_kv_tokens") == pytest.approx(stats.host_layer_pages * weight)
    assert value(metrics, "kvplane:device_kv_tokens") == pytest.approx(
        (stats.live_layer_pages - stats.host_layer_pages) * weight
    )
    assert value(metrics, "kvplane:device_kv_budget_tokens") == pytest.approx(24 / LAYERS)  # token-layers / layers
    times = pool.core.transfer_times
    assert value(metrics, "kvplane:h2d_seconds_total") == stats.h2d_seconds_total == times.h2d_s > 0
    assert value(metrics, "kvplane:d2h_seconds_total") == stats.d2h_seconds_total == times.d2h_s > 0
    assert value(metrics, "kvplane:stall_seconds_count") == steps
    assert value(metrics, "kvplane:stall_seconds_sum") == pytest.approx(times.h2d_s + times.d2h_s)
    assert stats.stall_seconds_total == pytest.approx(times.h2d_s + times.d2h_s)  # CPU: copies block the step
    # negative control: one more step's copies are not in the counters until end_step
    h.step("a", 1)
    assert value(metrics, "kvplane:h2d_bytes_total") != pool.residency_stats().h2d_bytes_total


def test_without_a_layered_core_no_stall_is_observed():
    """Negative control for the pool test above: without a layered core (no transfer account)
    steps observe no stall and no copy seconds."""
    metrics = make_metrics()
    metrics.attach_pool(None, SimpleNamespace(last_delta=None))
    assert metrics.transfers is None
    metrics.end_step()
    assert value(metrics, "kvplane:stall_seconds_count") == 0
    assert value(metrics, "kvplane:h2d_seconds_total") == 0


# ---- the control plane ----------------------------------------------------------------------


def _worker(worker_id: str = "w0") -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id,
        model=ModelSpec(layers=4, block_size=1, block_bytes=256),
        hardware=Hardware(gpu_kv_budget_blocks=40, h2d_gbps=16.0),
        profile=Profile((1.0,) * 4),
    )


def _report(step: int, generated: int, rids: tuple[str, ...] = ("a", "b")) -> StepReport:
    running = tuple(
        RequestState(id=r, context_tokens=10 + step, generated_tokens=generated) for r in rids
    )
    return StepReport(step=step, now_ms=1.0 * step, running=running, observed_step_ms=1.0)


def test_plans_fallbacks_and_controller_counters_through_the_real_control_client():
    """Scenario: the embedded controller (synchronous) plans for a real ControlClient wired like
    the scheduler wires it. Every plan the client receives is counted with its solve time and
    window; the controller's own counters appear as kvplane:controller_* with SGLang's labels and
    equal its in-memory counters; after the session dies every report is a counted fallback step."""
    metrics = make_metrics()
    cp = EmbeddedControlPlane(PolicyStore(Policy()), synchronous=True, observer=metrics.controller_observer())
    client = ControlClient(
        cp, _worker(), fallbacks=metrics.fallbacks, on_decisions=metrics.decisions,
        reopen_initial_s=60.0, reopen_max_s=60.0,
    )
    received = []
    for step in range(1, 6):
        received += client.report(_report(step, step, ("a", "b") if step < 4 else ("a",)))
    assert received, "the controller planned nothing"
    assert value(metrics, "kvplane:plans_total") == len(received)
    assert value(metrics, "kvplane:plan_solve_seconds_count") == len(received)
    assert value(metrics, "kvplane:plan_solve_seconds_sum") == pytest.approx(sum(d.plan.solve_ms for d in received) / 1e3)
    assert value(metrics, "kvplane:window_steps") == received[-1].plan.window_steps
    snap = cp.counters.snapshot()
    plans = value(metrics, "kvplane:controller_plans_total", feasible="true") + value(
        metrics, "kvplane:controller_plans_total", feasible="false"
    )
    assert plans == snap.plans > 0
    assert value(metrics, "kvplane:controller_triggers_total", reason="initial") == snap.triggers["initial"]
    assert value(metrics, "kvplane:controller_plan_solve_seconds_count") == snap.plans
    assert value(metrics, "kvplane:control_plane_fallback_steps_total") == 0
    client.session.close()  # the controller is gone: reports fall back
    for step in range(6, 9):
        assert client.report(_report(step, step, ("a",))) == []
    assert value(metrics, "kvplane:control_plane_fallback_steps_total") == client.fallback_steps == 3
    # negative control: without metrics the client counts nothing anywhere (no prometheus object)
    bare = ControlClient(EmbeddedControlPlane(synchronous=True), _worker("w1"))
    assert type(bare._fallbacks).__name__ == "_Uncounted"


def test_outages_set_the_degraded_gauge_and_count_through_the_real_control_client():
    """Scenario: a real ControlClient on the embedded controller, wired like the scheduler wires
    it, loses its session twice and gets it back once (its reopen backoff on a test clock). The
    degraded gauge is 1 exactly while reports fall back, the outages counter counts beginnings;
    negative control: a client not wired to the metrics falls back the same and moves nothing."""
    metrics = make_metrics()
    now = [0.0]
    client = ControlClient(EmbeddedControlPlane(synchronous=True), _worker(), fallbacks=metrics.fallbacks,
                           on_outage=metrics.outage, reopen_initial_s=10.0, reopen_max_s=10.0, clock=lambda: now[0])
    seen = []
    for step in range(1, 10):
        if step in (3, 7):
            client.session.close()  # the controller is gone: the next report falls back
            client.report(_report(step, step))  # the session raises: dropped, reopened after 10 s
        elif step == 5:
            now[0] += 11.0  # past the backoff: the next report reopens and goes through
            client.report(_report(step, step))
        else:
            client.report(_report(step, step))
        seen.append((value(metrics, "kvplane:control_plane_degraded"),
                     value(metrics, "kvplane:control_plane_outages_total")))
    assert client.outages == 2 and client.in_fallback
    assert seen == [(0, 0), (0, 0), (1, 1), (1, 1), (0, 1), (0, 1), (1, 2), (1, 2), (1, 2)], seen
    # negative control: the same outage without on_outage leaves both at their start
    quiet = make_metrics()
    bare = ControlClient(EmbeddedControlPlane(synchronous=True), _worker("w1"), fallbacks=quiet.fallbacks)
    bare.session.close()
    bare.report(_report(1, 1))
    assert bare.in_fallback and value(quiet, "kvplane:control_plane_fallback_steps_total") == 1
    assert value(quiet, "kvplane:control_plane_degraded") == 0 and value(quiet, "kvplane:control_plane_outages_total") == 0


def test_a_failing_outage_hook_never_fails_a_report():
    """The outage hook is telemetry: one that raises is logged and the report still falls back."""
    def broken(down: bool) -> None:
        raise RuntimeError("metrics down")

    client = ControlClient(EmbeddedControlPlane(synchronous=True), _worker(), on_outage=broken)
    client.session.close()
    assert client.report(_report(1, 1)) == [] and client.in_fallback and client.outages == 1


def test_deposits_come_from_the_embedded_session():
    """The deposit gauge is the embedded controller's deposit balance summed over the reported
    requests (tokens generated faster than one per SLO interval are banked); with no session
    (a remote control plane) it stays 0."""
    metrics = make_metrics()
    cp = EmbeddedControlPlane(PolicyStore(Policy(slo_tbt_ms=100.0)), synchronous=True)
    client = ControlClient(cp, _worker())
    metrics.bind_control_plane(cp, client, None)
    report = None
    for step in range(1, 8):  # 1 ms steps, 100 ms SLO: nearly every token is banked
        report = _report(step, step)
        client.report(report)
    assert report is not None
    metrics.report_sent(report)
    session = client.session
    want = sum(session.deposit(r.id).balance for r in report.running)
    assert want > 0 and value(metrics, "kvplane:deposit_tokens") == want
    remote = make_metrics()
    remote.bind_control_plane(object(), SimpleNamespace(session=object()), None)
    remote.report_sent(report)
    assert value(remote, "kvplane:deposit_tokens") == 0.0


def _req(rid: str, arrived: float, first: float, done: float, tokens: int, slo_tbt_ms: float | None = None,
         max_new_tokens: int = 16):
    """What WorkerMetrics.finished reads of an SGLang Req: time_stats stamps, output ids, params."""
    custom = None if slo_tbt_ms is None else {"kvplane_slo_tbt_ms": slo_tbt_ms}
    return SimpleNamespace(
        rid=rid,
        time_stats=SimpleNamespace(scheduler_recv_time=arrived, prefill_finished_time=first, completion_time=done),
        output_ids=list(range(tokens)),
        sampling_params=SimpleNamespace(custom_params=custom, max_new_tokens=max_new_tokens),
    )


def test_slo_verdicts_use_the_live_embedded_policy_and_per_request_slos():
    """TTFT (arrival -> first token) against the policy's slo_ttft_ms, TBT (mean time per token
    after the first) against the request's own SLO or the policy's; a policy update through the
    embedded store changes the next verdicts; a request without a first token is not judged."""
    metrics = make_metrics()
    cp = EmbeddedControlPlane(PolicyStore(Policy(slo_ttft_ms=100.0, slo_tbt_ms=50.0)), synchronous=True)
    metrics.bind_control_plane(cp, SimpleNamespace(session=None), None)
    reqs = [
        _req("fast", 1.0, 1.05, 1.25, 5),  # ttft 50 ms, tbt 50 ms: both met
        _req("slow", 1.0, 1.2, 2.2, 5),  # ttft 200 ms, tbt 250 ms: both missed
        _req("own", 1.0, 1.05, 2.05, 11, slo_tbt_ms=150.0),  # tbt 100 ms under its own 150 ms SLO
        _req("one", 1.0, 1.05, 1.05, 1),  # a single token: no gap, met
        _req("queued", 1.0, 0.0, 0.0, 0),  # aborted before its first token: not judged
    ]
    metrics.finished(reqs)
    assert value(metrics, "kvplane:ttft_slo_requests_total", result="met") == 3
    assert value(metrics, "kvplane:ttft_slo_requests_total", result="missed") == 1
    assert value(metrics, "kvplane:tbt_slo_requests_total", result="met") == 3
    assert value(metrics, "kvplane:tbt_slo_requests_total", result="missed") == 1
    cp.update_policy({"slo_ttft_ms": 10.0})
    metrics.finished(reqs[:1])
    assert value(metrics, "kvplane:ttft_slo_requests_total", result="missed") == 2


def test_the_prefix_warm_up_of_an_n_request_is_not_judged():
    """SGLang sends an ``n > 1`` request's prompt ahead as a request of ``max_new_tokens`` 0 (to
    cache the prefix); it finishes like any other and was counted as one more met request (one
    client request with n=4 made 5 verdicts). Control: the same request asking one token is judged."""
    metrics = make_metrics()
    cp = EmbeddedControlPlane(PolicyStore(Policy(slo_ttft_ms=100.0, slo_tbt_ms=50.0)), synchronous=True)
    metrics.bind_control_plane(cp, SimpleNamespace(session=None), None)
    metrics.finished([_req("warm", 1.0, 1.05, 1.05, 0, max_new_tokens=0)])
    for name in ("kvplane:ttft_slo_requests_total", "kvplane:tbt_slo_requests_total"):
        assert value(metrics, name, result="met") == 0 and value(metrics, name, result="missed") == 0
    metrics.finished([_req("one", 1.0, 1.05, 1.05, 1, max_new_tokens=1)])
    assert value(metrics, "kvplane:ttft_slo_requests_total", result="met") == 1


# ---- multiprocess mode ----------------------------------------------------------------------

_WRITER = textwrap.dedent(
    """
    import json, sys
    from prometheus_client import CollectorRegistry
    from sglang_ext.worker_metrics import WorkerMetrics
    labels, source, gauge = json.loads(sys.argv[1]), sys.argv[2] == "1", float(sys.argv[3])
    m = WorkerMetrics(labels, layers=4, page_size=1, source=source)
    m._one["h2d_bytes_total"].inc(100 + int(labels.get("tp_rank", "0")))
    m._set("host_kv_tokens", gauge)
    if source:
        m._one["plans_total"].inc(3)
    """
)
_COLLECTOR = textwrap.dedent(
    """
    import json, sys
    from prometheus_client import CollectorRegistry, multiprocess
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=sys.argv[1])
    out = [[s.name, s.labels, s.value] for m in registry.collect() for s in m.samples]
    print(json.dumps(out))
    """
)


def _run(code: str, env: dict[str, str], *args: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code, *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _collect(tmp_path: Path, writers: list[tuple[dict[str, str], bool, float]]) -> list[list]:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for labels, source, gauge in writers:
        _run(_WRITER, env, json.dumps(labels), "1" if source else "0", str(gauge))
    return json.loads(_run(_COLLECTOR, env, str(tmp_path)))


def test_tp_ranks_are_distinct_series_in_multiprocess_mode(tmp_path: Path):
    """Scenario: two scheduler processes (TP ranks 0 and 1) write into one PROMETHEUS_MULTIPROC_DIR
    as SGLang's do; the main process's MultiProcessCollector shows one series per rank with SGLang's
    labels, the gauges (mostrecent) keep each rank's value, the rank-0 metrics appear once."""
    samples = _collect(tmp_path, [(LABELS, True, 7.0), ({**LABELS, "tp_rank": "1"}, False, 9.0)])
    h2d = {s[1]["tp_rank"]: s[2] for s in samples if s[0] == "kvplane:h2d_bytes_total"}
    host = {s[1]["tp_rank"]: s[2] for s in samples if s[0] == "kvplane:host_kv_tokens"}
    plans = [s for s in samples if s[0] == "kvplane:plans_total"]
    assert h2d == {"0": 100.0, "1": 101.0}
    assert host == {"0": 7.0, "1": 9.0}
    assert [p[1]["tp_rank"] for p in plans] == ["0"] and plans[0][2] == 3.0
    assert all(s[1]["model_name"] == "tiny" for s in samples if s[0].startswith("kvplane:"))


def test_negative_control_ranks_without_their_label_merge(tmp_path: Path):
    """Negative control: two processes writing the same labels (no tp_rank to tell them apart) are
    merged into one series, so the per-rank check above would fail without SGLang's labels."""
    same = {k: v for k, v in LABELS.items() if k != "tp_rank"}
    samples = _collect(tmp_path, [(same, True, 7.0), (same, False, 9.0)])
    h2d = [s for s in samples if s[0] == "kvplane:h2d_bytes_total"]
    assert len(h2d) == 1 and h2d[0][2] == 200.0


def test_pauses_skipped_are_counted_by_reason_from_the_boundary_record():
    """``kvplane:pauses_skipped_total{reason}`` adds each boundary's skips by reason; a reason
    outside the table is not exported; TP ranks other than 0 export none."""
    metrics = make_metrics()
    metrics.boundary({"pauses_skipped": {"finishing": 2}})
    metrics.boundary({"pauses_skipped": {"finishing": 1, "custom_logit_processor": 1, "made_up": 5}})
    metrics.boundary({"pauses_skipped": {}})
    assert value(metrics, "kvplane:pauses_skipped_total", reason="finishing") == 3
    assert value(metrics, "kvplane:pauses_skipped_total", reason="custom_logit_processor") == 1
    assert value(metrics, "kvplane:pauses_skipped_total", reason="encoder_decoder") == 0
    assert metrics.registry.get_sample_value("kvplane:pauses_skipped_total",
                                             {**metrics.labels, "reason": "made_up"}) is None
    rank1 = make_metrics(source=False)
    rank1.boundary({"pauses_skipped": {"finishing": 2}})
    assert rank1.registry.get_sample_value("kvplane:pauses_skipped_total",
                                           {**rank1.labels, "reason": "finishing"}) is None
