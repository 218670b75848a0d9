"""SGLang with --kv-scheduler layerkv: queued prefills start only when the control plane admits them.

Scenario: one layered server with the LayerKV admission scheduler and a per-step stats file
(``$KVPLANE_STATS_FILE``); a burst of 8 concurrent greedy requests, two carrying their own TBT
SLO (``custom_params.kvplane_slo_tbt_ms``). The session's vanilla server is the reference.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sglang_ext.testing.jsonl import read_jsonl
from sglang_ext.testing.server import SGLangServer
from tests.sglang.conftest import PROMPTS, assert_same_generation, greedy, running_server

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1800)]  # server start-ups on a loaded host

BURST = 8
NEW_TOKENS = 24
"""Long enough that the burst overlaps even when a loaded host spreads the arrivals."""


@pytest.fixture(scope="module")
def gated(tiny_model_dir, launch_zygote, tmp_path_factory) -> Iterator[tuple[SGLangServer, Path]]:
    root = tmp_path_factory.mktemp("admission")
    stats = root / "stats.jsonl"
    flags = ["--enable-layered-kv", "--disable-overlap-schedule", "--kv-scheduler", "layerkv"]
    with running_server(tiny_model_dir, root, flags, {"KVPLANE_STATS_FILE": str(stats)}, zygote=launch_zygote) as server:
        yield server, stats


def _burst(server: SGLangServer) -> dict[int, dict]:
    results: dict[int, dict] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            payload = {"text": PROMPTS[i], "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0},
                       "return_logprob": True}
            if i < 2:
                payload["sampling_params"]["custom_params"] = {"kvplane_slo_tbt_ms": 500.0}
            results[i] = server.post("/generate", payload)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(BURST)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    return results


def test_burst_is_admitted_by_the_control_plane_and_tokens_match_vanilla(gated, vanilla_server):
    """Every request of the burst completes with vanilla's greedy tokens; the control plane's
    ``admit`` decisions let queued requests in (not only the local work-conserving rule)."""
    server, stats_path = gated
    results = _burst(server)
    assert sorted(results) == list(range(BURST))
    for i, out in results.items():
        assert_same_generation(out, greedy(vanilla_server, PROMPTS[i], NEW_TOKENS, logprobs=True), str(i))
    steps = read_jsonl(stats_path)
    admitted = [rid for s in steps for rid in s.get("admitted_now") or ()]
    assert admitted, "the control plane never admitted a queued request"
    assert max(s["queued"] for s in steps) >= 1, "nothing was ever held in the queue"
    assert not any(s["fallback"] for s in steps)


def test_request_slo_reaches_the_control_plane(gated):
    """A request's own TBT SLO is reported as RequestState.slo_tbt_ms (seen in the step lines)."""
    server, stats_path = gated
    server.post(
        "/generate",
        {"text": PROMPTS[3], "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                  "custom_params": {"kvplane_slo_tbt_ms": 250.0}}},
    )
    steps = read_jsonl(stats_path)
    slos = {v for s in steps for v in (s.get("slo_tbt_ms") or {}).values()}
    assert 250.0 in slos


def test_sampled_per_layer_timings_are_reported(gated):
    """Some decode steps carry per-layer compute times, one positive value per layer."""
    server, stats_path = gated
    greedy(server, PROMPTS[5], max_new_tokens=40)
    steps = read_jsonl(stats_path)
    sampled = [s["layer_compute_ms"] for s in steps if s.get("layer_compute_ms")]
    assert sampled, "no step reported per-layer timings"
    assert all(len(ms) == s_layers and all(x > 0 for x in ms) for ms, s_layers in
               ((ms, steps[0]["layers"]) for ms in sampled))


def test_steady_decode_steps_are_coalesced_and_changes_reported_at_once(gated):
    """--kv-report-interval (default 8): a steady decode step may wait for the next report; a
    step that finishes a request, holds a queue, pauses or prefills is reported the step it
    happens. Nothing is offloaded here, so a stretch whose step time holds steady turns quiet
    (--kv-report-quiet-interval, 32 by default): a step waits past 7 in a row only then (the
    stats line says so), never past 31. Quiet needs the step time within 10% over a few
    reports; when this host held it that steady (8-step means within 4% of their median), the
    long stretch must have turned quiet."""
    server, stats_path = gated
    start = len(stats_path.read_text().splitlines())
    _burst(server)
    greedy(server, PROMPTS[6], max_new_tokens=160)  # a long steady stretch of one request
    steps = read_jsonl(stats_path, start)
    assert any(not s["reported"] for s in steps), "no steady step was coalesced"
    for s in steps:
        if s["finished"] or s["queued"] or s["paused"] or s["mode"] == "extend":
            assert s["reported"], s
    run = longest = 0
    for s in steps:
        run = 0 if s["reported"] else run + 1
        longest = max(longest, run)
        assert run <= 7 or s["report_quiet"], s  # past the base interval only when quiet
        assert not (s["report_quiet"] and s["reported"]), s
    assert longest <= 31, longest
    ready = [line for line in server.log_path.read_text().splitlines() if "kvplane_scheduler_ready" in line]
    assert ready and "report_interval=8" in ready[-1] and "report_quiet_interval=32" in ready[-1], ready
    alone = [s["step_ms"] for s in steps if s["mode"] == "decode" and len(s["running"]) == 1 and s["step_ms"]]
    means = sorted(sum(alone[i:i + 8]) / 8 for i in range(0, len(alone) - 7, 8))
    if means and all(abs(m / means[len(means) // 2] - 1) <= 0.04 for m in means):
        assert any(s["report_quiet"] for s in steps), means


def test_the_served_pool_journals_steady_decode_and_batches_request_ends(gated):
    """The served path runs the decode journal and the batched ends: the layered pool's counters
    in the stats lines of this server (a burst of 8 requests, then one long one) move. Both
    start at 0 in a fresh pool, so the check fails when either mechanism is bypassed."""
    server, stats_path = gated
    _burst(server)
    greedy(server, PROMPTS[6], max_new_tokens=40)
    pools = [step["pool"] for step in read_jsonl(stats_path)]
    last = pools[-1]
    assert last["journalled_decode_steps_total"] > 0
    assert last["ended_batches_total"] > 0
    assert pools[0]["journalled_decode_steps_total"] == 0  # the counters started at 0


def test_an_slo_no_step_can_meet_holds_no_prompt_back(gated):
    """Scenario: request ``tight`` decodes with a 1 us TBT SLO (below any step this server runs
    with every layer resident: late whatever is admitted) when prompt ``late`` arrives. LayerKV's
    Eq. 1 over the raw target left ``tight`` no slack, so the gate held ``late`` until it had
    aged (half its 5 s TTFT SLO: hundreds of steps here); the target counts from the
    all-resident step, where it bounds nothing, so ``late`` is admitted within a few steps.
    Control, run by hand: with Eq. 2 over the raw targets, ``late`` waited 332 steps (aged)."""
    server, stats_path = gated
    start = len(stats_path.read_text().splitlines())
    errors: list[BaseException] = []

    def tight() -> None:
        try:
            server.post("/generate", {"rid": "tight-slo", "text": PROMPTS[1], "sampling_params": {
                "max_new_tokens": 400, "temperature": 0, "ignore_eos": True,
                "custom_params": {"kvplane_slo_tbt_ms": 1e-3}}})
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=tight)
    thread.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any(
            s["mode"] == "decode" and "tight-slo" in s["running"] for s in read_jsonl(stats_path, start)):
        time.sleep(0.02)
    arrived = len(stats_path.read_text().splitlines())
    out = server.post("/generate", {"rid": "late-prompt", "text": PROMPTS[2],
                                    "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    thread.join(timeout=300)
    assert not errors, errors
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    steps = read_jsonl(stats_path, arrived)
    admitted_at = next(i for i, s in enumerate(steps) if "late-prompt" in (s.get("admitted_now") or ()))
    assert all("tight-slo" in s["running"] for s in steps[:admitted_at]), "tight was not decoding throughout"
    assert admitted_at <= 16, f"the prompt waited {admitted_at} steps behind an SLO no step meets"
