"""kvplane's metrics on SGLang's own /metrics: a real layered server on CPU with --enable-metrics.

Scenario: one layered server (module-scoped) with the embedded control plane, SGLang's
``--enable-metrics``, a device KV budget of 96 token-layers (most KV on host) and a policy whose
starvation guard fires after 6 paused steps, so requests are offloaded, paused and resumed; its
per-step stats file, the pool's per-forward stats file and the residency events are on. /metrics
is scraped before and after 20 concurrent requests (half with a TBT SLO they cannot miss, half
with one they cannot meet); every counter must have moved by what the stats lines and the events
say. A second layered server without --enable-metrics must export nothing of kvplane's and write
no kvplane multiprocess file.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sglang_ext.hooks import ResidencyEventKind, read_jsonl_events
from sglang_ext.metric_spec import WORKER_METRICS
from sglang_ext.pause import PAUSE_SKIP_REASONS
from sglang_ext.settings import POOL_STATS_FILE_ENV, RESIDENCY_EVENTS_FILE_ENV, STATS_FILE_ENV
from sglang_ext.testing.jsonl import read_jsonl, wait_quiet
from sglang_ext.testing.server import SGLangServer
from tests.sglang.conftest import PROMPTS, running_servers
from tests.sglang.test_dashboard import DASHBOARD, dashboard_metrics, load_promql

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(2400)]  # two start-ups on a loaded host

BUDGET_TOKENS = 96
LAYERS = 4  # the tiny model's
MAX_NEW_TOKENS = 12
EASY_SLO_MS, HARD_SLO_MS = 1e6, 1.0
"""Per-request TBT SLOs: no CPU step takes 1000 s per token; every one takes more than 1 ms."""
SGLANG_LABELS = ("model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank")
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclass
class MetricsServer:
    server: SGLangServer
    root: Path
    prom_dir: Path

    @property
    def stats_path(self) -> Path:
        return self.root / "stats.jsonl"

    @property
    def pool_stats_path(self) -> Path:
        return self.root / "pool_stats.jsonl"

    @property
    def events_path(self) -> Path:
        return self.root / "events.jsonl"


def _lines(path: Path) -> list[dict]:
    return read_jsonl(path)


def _spec(root: Path, *, metrics: bool) -> tuple[Path, list[str], dict[str, str]]:
    policy = root / "policy.json"
    policy.write_text(json.dumps({"max_paused_steps": 6, "window_min": 2, "window_max": 4, "slo_ttft_ms": 1e7}))
    prom = root / "prom"
    prom.mkdir()
    flags = ["--enable-layered-kv", "--kv-policy", str(policy), "--kv-gpu-budget-tokens", str(BUDGET_TOKENS),
             "--mem-fraction-static", "0.3", *(["--enable-metrics"] if metrics else [])]
    env = {
        "PROMETHEUS_MULTIPROC_DIR": str(prom),
        STATS_FILE_ENV: str(root / "stats.jsonl"),
        POOL_STATS_FILE_ENV: str(root / "pool_stats.jsonl"),
        RESIDENCY_EVENTS_FILE_ENV: str(root / "events.jsonl"),
    }
    return root, flags, env


@pytest.fixture(scope="module")
def metrics_servers(tiny_model_dir, launch_zygote, tmp_path_factory) -> Iterator[tuple[MetricsServer, MetricsServer]]:
    """:func:`metrics_server` and :func:`quiet_server`, started side by side."""
    on, off = tmp_path_factory.mktemp("metrics-on"), tmp_path_factory.mktemp("metrics-off")
    with running_servers(tiny_model_dir, [_spec(on, metrics=True), _spec(off, metrics=False)], zygote=launch_zygote) as (a, b):
        yield MetricsServer(a, on, on / "prom"), MetricsServer(b, off, off / "prom")


@pytest.fixture(scope="module")
def metrics_server(metrics_servers) -> MetricsServer:
    """The layered server with --enable-metrics (see the module docstring)."""
    return metrics_servers[0]


@pytest.fixture(scope="module")
def quiet_server(metrics_servers) -> MetricsServer:
    """The same layered server without --enable-metrics."""
    return metrics_servers[1]


def scrape(server: SGLangServer) -> Samples:
    promql = load_promql()
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=60) as resp:
        return promql.parse_samples(resp.read().decode())


def total(samples: Samples, name: str, **match: str) -> float:
    """Sum of ``name``'s samples whose labels include ``match``."""
    return sum(v for (n, labels), v in samples.items()
               if n == name and all(dict(labels).get(k) == x for k, x in match.items()))


def _request(server: SGLangServer, prompt: str, slo_ms: float) -> dict:
    payload: dict[str, Any] = {
        "text": prompt,
        "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.0,
                            "custom_params": {"kvplane_slo_tbt_ms": slo_ms}},
    }
    return server.post("/generate", payload)


@dataclass
class Workload:
    """Scrapes around one workload and what the files recorded during it."""

    before: Samples
    after: Samples
    stats: list[dict]
    """Stats lines ($KVPLANE_STATS_FILE, one per step on TP rank 0) written during the workload."""
    stats_before: dict | None
    """The last stats line before the workload."""
    pool_lines: list[dict]
    """The pool's per-forward lines written during the workload."""
    paused_events: int
    resumed_events: int
    requests: int


@pytest.fixture(scope="module")
def workload(metrics_server: MetricsServer) -> Workload:
    """20 concurrent greedy requests (even: an SLO they meet, odd: one they miss) between scrapes."""
    ms = metrics_server
    ms.server.post("/generate", {"text": "warm up", "sampling_params": {"max_new_tokens": 2, "temperature": 0.0}})
    _settle(ms)  # the warm-up's last step books its SLO verdicts, stall and stats line after its response
    stats0, pool0 = _lines(ms.stats_path), _lines(ms.pool_stats_path)
    events0 = read_jsonl_events(ms.events_path) if ms.events_path.exists() else []
    before = scrape(ms.server)
    slos = [EASY_SLO_MS if i % 2 == 0 else HARD_SLO_MS for i in range(len(PROMPTS))]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        outs = list(pool.map(lambda a: _request(ms.server, *a), zip(PROMPTS, slos, strict=True)))
    assert all(len(o["output_ids"]) == MAX_NEW_TOKENS for o in outs)
    _settle(ms)
    after = scrape(ms.server)
    events = read_jsonl_events(ms.events_path)[len(events0):]
    return Workload(
        before=before,
        after=after,
        stats=_lines(ms.stats_path)[len(stats0):],
        stats_before=stats0[-1] if stats0 else None,
        pool_lines=_lines(ms.pool_stats_path)[len(pool0):],
        paused_events=sum(1 for e in events if e.kind == ResidencyEventKind.PAUSED),
        resumed_events=sum(1 for e in events if e.kind == ResidencyEventKind.RESUMED),
        requests=len(PROMPTS),
    )


def _settle(ms: MetricsServer, quiet_s: float = 1.0, timeout_s: float = 60.0) -> None:
    """Wait until the scheduler has finished the workload's last step: a client gets its response
    when the step's result is sent, before kvplane's end-of-step hook updates the counters and
    writes the stats lines, so a scrape taken at once may miss that step's counts while the files
    read later have them. Quiet means the files did not grow for ``quiet_s``."""
    wait_quiet((ms.stats_path, ms.pool_stats_path, ms.events_path), quiet_s, timeout_s, poll_s=0.1)


def counter_problems(w: Workload, before: Samples, after: Samples) -> list[str]:
    """Every way the counters moved differently from what the stats lines and events recorded
    (empty: all agree). Takes the scrapes separately so a negative control can swap them."""

    def delta(name: str, **match: str) -> float:
        return total(after, name, **match) - total(before, name, **match)

    problems = []

    def expect(what: str, got: float, ok: bool) -> None:
        if not ok:
            problems.append(f"{what}: metric moved by {got}")

    paused, resumed = delta("kvplane:requests_paused_total"), delta("kvplane:requests_resumed_total")
    expect(f"pauses == {w.paused_events} PAUSED events", paused, paused == w.paused_events)
    expect(f"resumes == {w.resumed_events} RESUMED events", resumed, resumed == w.resumed_events)
    paused_lines = sum(len(line.get("paused_now") or ()) for line in w.stats)
    expect(f"pauses >= {paused_lines} in the stats lines' paused_now", paused, paused >= paused_lines)
    for reason in PAUSE_SKIP_REASONS:
        want = sum((line.get("pauses_skipped") or {}).get(reason, 0) for line in w.stats)
        got = delta("kvplane:pauses_skipped_total", reason=reason)
        # >=: a boundary whose record no line took yet (the last, before a step is processed) counts
        # in the metric only
        expect(f"pauses skipped ({reason}) >= {want} in the stats lines", got, got >= want)
    installs = sum((line.get("install_delta") or {}).get("offloaded_layer_pages", 0) for line in w.stats)
    forwards = sum(line["delta"]["offloaded_layer_pages"] for line in w.pool_lines)
    offloaded = delta("kvplane:offloaded_layer_pages_total")
    expect(f"offloaded layer-pages >= {installs} (installs) + {forwards} (forwards) of the stats lines",
           offloaded, offloaded >= installs + forwards and offloaded > 0)
    last, first = w.stats[-1]["pool"], (w.stats_before or {}).get("pool") or {}
    for metric, field in (("kvplane:h2d_bytes_total", "h2d_bytes_total"), ("kvplane:d2h_bytes_total", "d2h_bytes_total"),
                          ("kvplane:fetched_layer_pages_total", "fetched_layer_pages_total"),
                          ("kvplane:overflow_steps_total", "overflow_steps_total")):
        want = last[field] - first.get(field, 0)
        expect(f"{metric} == {want} (the pool's {field})", delta(metric), delta(metric) == want)
    expect("H2D bytes moved", delta("kvplane:h2d_bytes_total"), delta("kvplane:h2d_bytes_total") > 0)
    steps = delta("kvplane:stall_seconds_count")
    expect(f"stall observations == {len(w.stats)} steps", steps, steps == len(w.stats))
    copy_s = delta("kvplane:h2d_seconds_total") + delta("kvplane:d2h_seconds_total")
    expect(f"stall seconds == copy seconds {copy_s:.6f}", delta("kvplane:stall_seconds_sum"),
           abs(delta("kvplane:stall_seconds_sum") - copy_s) <= 1e-6 and copy_s > 0)
    n, half = w.requests, w.requests // 2
    for metric, result, want in (("kvplane:ttft_slo_requests_total", "met", n),
                                 ("kvplane:ttft_slo_requests_total", "missed", 0),
                                 ("kvplane:tbt_slo_requests_total", "met", half),
                                 ("kvplane:tbt_slo_requests_total", "missed", n - half)):
        got = delta(metric, result=result)
        expect(f"{metric}{{result={result}}} == {want}", got, got == want)
    plans, computed = delta("kvplane:plans_total"), delta("kvplane:controller_plans_total")
    expect(f"1 <= plans received <= {computed} computed", plans, 1 <= plans <= computed)
    expect("a solve time per plan", delta("kvplane:plan_solve_seconds_count"),
           delta("kvplane:plan_solve_seconds_count") == plans)
    fallbacks = w.stats[-1]["fallback_steps"] - (w.stats_before or {}).get("fallback_steps", 0)
    expect(f"fallback steps == {fallbacks}", delta("kvplane:control_plane_fallback_steps_total"),
           delta("kvplane:control_plane_fallback_steps_total") == fallbacks)
    return problems


def test_counters_move_by_what_the_stats_lines_and_events_record(workload):
    """After the workload: pauses and resumes equal the PAUSED / RESUMED events, offloaded
    layer-pages are at least what the stats lines' installs and forwards offloaded, bytes / fetches
    / overflows equal the pool's totals in the stats lines, one stall observation per step summing
    to the measured copy seconds, every request judged (TTFT all met, TBT as its SLO says), plans
    received with their solve times, fallback steps as in the stats lines."""
    w = workload
    assert w.paused_events >= 5, "the workload did not pause: the scenario is not exercised"
    assert counter_problems(w, w.before, w.after) == []


def test_negative_control_unmoved_counters_are_caught(workload):
    """Negative control: the same checks against a scrape taken before the workload (as if the
    counters had not moved) report the pauses, the offloads, the bytes and the SLO verdicts."""
    problems = "\n".join(counter_problems(workload, workload.before, workload.before))
    for needle in ("pauses ==", "offloaded layer-pages", "kvplane:h2d_bytes_total ==", "tbt_slo_requests_total"):
        assert needle in problems


def test_gauges_describe_the_server_after_the_workload(workload):
    """The budget gauge is the layer-weighted budget, nothing is paused, device KV within budget,
    the newest plan's window within the policy's [2, 4]."""
    after = workload.after
    assert total(after, "kvplane:device_kv_budget_tokens") == BUDGET_TOKENS / LAYERS
    assert total(after, "kvplane:paused_requests") == 0
    assert 0 <= total(after, "kvplane:device_kv_tokens") <= BUDGET_TOKENS / LAYERS
    assert 2 <= total(after, "kvplane:window_steps") <= 4


def label_problems(samples: Samples) -> list[str]:
    """kvplane samples whose labels do not include SGLang's scheduler labels (taken from SGLang's
    own ``sglang:num_running_reqs``) with the same values."""
    reference = [dict(labels) for (name, labels) in samples if name == "sglang:num_running_reqs"]
    if not reference:
        return ["no sglang:num_running_reqs sample to compare with"]
    want = {k: reference[0][k] for k in SGLANG_LABELS}
    return [f"{name} {dict(labels)}" for (name, labels) in samples
            if name.startswith("kvplane:") and any(dict(labels).get(k) != v for k, v in want.items())]


def test_every_kvplane_series_carries_sglangs_labels(workload):
    """Every kvplane sample has model_name, engine_type, tp_rank, pp_rank and moe_ep_rank equal to
    SGLang's own scheduler series; every metric of the table is exported."""
    after = workload.after
    assert label_problems(after) == []
    names = {name for name, _ in after}
    missing = [s.name for s in WORKER_METRICS if not set(s.series) & names]
    assert missing == []
    # negative control: a sample without tp_rank is reported
    stray = {("kvplane:h2d_bytes_total", (("model_name", "x"),)): 1.0}
    assert label_problems({**after, **stray}) != []


def test_every_dashboard_query_names_a_scraped_metric_and_resolves(workload):
    """Every query of the shipped dashboard (panels and template variable) parses in the supported
    PromQL subset, names only metrics present in the real scrape, and evaluates to a series over
    the two scrapes; a made-up metric name is caught (negative control)."""
    promql = load_promql()
    dashboard = json.loads(DASHBOARD.read_text())
    scraped = {name for name, _ in workload.after}
    used = dashboard_metrics(dashboard)
    assert used and used - scraped == set()
    scrapes = [(0.0, workload.before), (10.0, workload.after)]
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            query = promql.PromQLSubset(target["expr"], {"model_name": ".*"})
            assert query.series(scrapes), f"{panel['title']}: {target['expr']} resolves to no series"
    broken = json.loads(json.dumps(dashboard).replace("kvplane:h2d_bytes_total", "kvplane:h2d_bytez_total"))
    assert dashboard_metrics(broken) - scraped == {"kvplane:h2d_bytez_total"}


def test_without_enable_metrics_nothing_is_exported(quiet_server, metrics_server):
    """Without --enable-metrics a layered server serving requests creates no kvplane metric: no
    multiprocess file mentions kvplane and /metrics (if served at all) has no kvplane series.
    Negative control: the --enable-metrics server's directory does."""
    for prompt in PROMPTS[:4]:
        _request(quiet_server.server, prompt, EASY_SLO_MS)
    assert _lines(quiet_server.stats_path), "the layered scheduler hooks did not run"

    def mentions_kvplane(directory: Path) -> list[str]:
        return [p.name for p in directory.rglob("*") if p.is_file() and b"kvplane" in p.read_bytes()]

    assert mentions_kvplane(quiet_server.prom_dir) == []
    try:
        with urllib.request.urlopen(quiet_server.server.base_url + "/metrics", timeout=60) as resp:
            text = resp.read().decode()
    except urllib.error.HTTPError as exc:
        assert exc.code == 404
        text = ""
    assert "kvplane" not in text
    assert mentions_kvplane(metrics_server.prom_dir) != []
