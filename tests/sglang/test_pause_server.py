"""Keep-KV pause/resume in a real SGLang server, driven by the real control plane.

Scenario: one layered server (module-scoped) with the embedded control plane, a device KV budget
of 96 token-layers (``--kv-gpu-budget-tokens``; about a fifth of what the batch needs) and a
policy whose starvation guard fires after 3 paused steps. The planner then pauses requests that
do not fit (memory lower bound) and the guard rotates paused ones back in, so requests are paused
and resumed many times mid-generation. Their greedy outputs must still be token-identical to
vanilla SGLang's (the session's vanilla server), and the per-step stats file must show the pauses.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sglang_ext.hooks import ResidencyEventKind, read_jsonl_events
from sglang_ext.settings import RESIDENCY_EVENTS_FILE_ENV as EVENTS_FILE_ENV
from sglang_ext.settings import STATS_FILE_ENV
from sglang_ext.testing.jsonl import read_jsonl, read_jsonl_settled
from sglang_ext.testing.server import SGLangServer
from tests.sglang.conftest import (
    PROMPTS,
    assert_same_generation,
    concurrent_as_vanilla,
    greedy,
    running_server,
)

# Two SGLang start-ups (30-600 s each on the shared 2-core host) happen inside the first test.
pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1800)]

MAX_NEW_TOKENS = 12


def pause_flags(root: Path) -> list[str]:
    """A layered server forced to pause: small KV budget + quick starvation guard (its policy
    file written under ``root``)."""
    policy = root / "policy.json"
    policy.write_text(json.dumps({"max_paused_steps": 6, "window_min": 2, "window_max": 4}))
    return [
        "--enable-layered-kv", "--kv-policy", str(policy), "--kv-gpu-budget-tokens", "96",
        # SGLang sizes CPU memory off what is free now; the shared host is often busy.
        "--mem-fraction-static", "0.3",
    ]


@pytest.fixture(scope="module")
def paused_server(tiny_model_dir, launch_zygote, tmp_path_factory) -> Iterator[tuple[SGLangServer, Path, Path]]:
    """Layered server forced to pause (:func:`pause_flags`)."""
    root = tmp_path_factory.mktemp("pause")
    stats, events = root / "stats.jsonl", root / "events.jsonl"
    flags = pause_flags(root)
    env = {STATS_FILE_ENV: str(stats), EVENTS_FILE_ENV: str(events)}
    with running_server(tiny_model_dir, root, flags, env, zygote=launch_zygote) as server:
        yield server, stats, events


def _stats(path: Path) -> list[dict]:
    return read_jsonl(path)


def test_paused_requests_finish_token_identical_to_vanilla(paused_server, vanilla_server):
    """20 concurrent greedy prompts, paused and resumed mid-generation, match vanilla token for token."""
    server, stats_path, events_path = paused_server
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: greedy(server, p, MAX_NEW_TOKENS, logprobs=True), PROMPTS))
    for prompt, out in zip(PROMPTS, got, strict=True):
        want = greedy(vanilla_server, prompt, MAX_NEW_TOKENS, logprobs=True)
        assert_same_generation(out, want, prompt)
        assert out["meta_info"]["finish_reason"]["type"] == want["meta_info"]["finish_reason"]["type"]

    lines = _stats(stats_path)
    paused_now = [rid for line in lines for rid in line.get("paused_now") or ()]
    resumed_now = [rid for line in lines for rid in line.get("resumed_now") or ()]
    assert len(paused_now) >= 5, f"expected pauses, stats show {len(paused_now)}"
    assert set(paused_now) <= set(resumed_now), "a paused request was never resumed"
    # Mid-generation: a request that was running with tokens out, then paused, then resumed.
    finished = {rid for line in lines for rid in line["finished"]}
    assert set(paused_now) <= finished
    assert lines[-1]["paused"] == []
    assert any(line["decision"] for line in lines), "no control-plane decision was installed"
    assert not any(line["fallback"] for line in lines)

    events = read_jsonl_events(events_path)
    kinds = [e.kind for e in events]
    assert kinds.count(ResidencyEventKind.PAUSED) == len(paused_now)
    assert kinds.count(ResidencyEventKind.RESUMED) == len(resumed_now)


def _sampled(server: SGLangServer, prompt: str, **sampling: object) -> dict:
    """One greedy /generate call with logprobs and extra sampling parameters."""
    payload = {"text": prompt, "return_logprob": True,
               "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.0, **sampling}}
    return server.post("/generate", payload)


def _same_as_vanilla(paused_server, vanilla_server, **sampling: object) -> tuple[list[dict], list[dict]]:
    """Every prompt at once with ``sampling`` on the pausing server, each checked against
    vanilla's; returns the outputs and the stats lines of those steps."""
    server, stats_path, _ = paused_server
    start = len(read_jsonl(stats_path))
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: _sampled(server, p, **sampling), PROMPTS))
    for prompt, out in zip(PROMPTS, got, strict=True):
        assert_same_generation(out, _sampled(vanilla_server, prompt, **sampling), prompt)
    return got, read_jsonl_settled(stats_path, start)


def test_requests_with_a_penalizer_are_paused_and_resumed_like_vanilla(paused_server, vanilla_server):
    """Requests with a penalizer (``min_new_tokens=6``: EOS masked for the first six tokens, by
    an output-length count the penalizer keeps per row) under the pausing budget: they are paused
    and resumed (the paused row takes its own copy of the penalizer state, merged back at resume:
    ``split_sampling_info``), no pause is skipped for a batch feature, and every output is
    vanilla's, tokens and logprobs. Negative controls: pausing them with one shared orchestrator
    killed the server on the first split batch (session 22); resuming them with a fresh one (the
    count restarted) fails the comparison ("The quick brown fox jumps": logprobs 3.0e-3 apart,
    session 23). ``min_new_tokens`` rather than a
    frequency penalty: with ``frequency_penalty`` vanilla SGLang 0.5.23's own outputs depend on
    the batch (7 of these 20 prompts differ sent one by one vs together)."""
    got, lines = _same_as_vanilla(paused_server, vanilla_server, min_new_tokens=6)
    paused = {rid for line in lines for rid in line.get("paused_now") or ()}
    assert paused & {out["meta_info"]["id"] for out in got}, "expected requests with a penalizer to be paused"
    assert all(set(line.get("pauses_skipped") or {}) <= {"finishing"} for line in lines)  # no batch-feature skip
    assert lines[-1]["paused"] == []


GRAMMAR = "[a-z ]+"
"""The constrained requests' regex."""


def test_grammar_constrained_requests_are_paused_and_resumed_like_any_other(paused_server, vanilla_server):
    """Regex-constrained requests under the pausing budget: they are paused and resumed (a
    request's grammar lives on the request; SGLang rebuilds a batch's grammars from its requests),
    and every output is vanilla's, tokens and logprobs, and matches the regex. The regex check can
    fail: unconstrained, the first prompt's output does not match it."""
    got, lines = _same_as_vanilla(paused_server, vanilla_server, regex=GRAMMAR)
    assert all(re.fullmatch(GRAMMAR, out["text"]) for out in got), [out["text"] for out in got]  # constrained
    assert not re.fullmatch(GRAMMAR, greedy(paused_server[0], PROMPTS[0], MAX_NEW_TOKENS)["text"])
    paused = {rid for line in lines for rid in line.get("paused_now") or ()}
    assert paused & {out["meta_info"]["id"] for out in got}, "expected constrained requests to be paused"
    assert all(set(line.get("pauses_skipped") or {}) <= {"finishing"} for line in lines)  # no batch-feature skip
    assert lines[-1]["paused"] == []


def test_a_budget_below_one_layer_of_the_slot_space_is_warned_at_start(paused_server):
    """96 token-layers against 4,097 pages a layer (``--kv-gpu-budget-tokens`` counts token-layers):
    the start warns (the control, exactly one layer: ``test_layered_offload_server.py``)."""
    log = paused_server[0].log_path.read_text()
    assert "layered_kv_budget_below_one_layer" in log and "device_pages=96" in log


def test_the_load_snapshot_and_prefill_admission_go_through_kvplanes_hooks(paused_server):
    """``/v1/loads`` answers from the load inquirer kvplane rebuilt (its running batch lists parked
    requests: ``test_parked_lifecycle.py`` checks the count against SGLang's own inquirer); after
    the module's runs nothing is running or parked."""
    import urllib.request

    server = paused_server[0]
    greedy(server, PROMPTS[0], 4)
    body = json.loads(urllib.request.urlopen(server.base_url + "/v1/loads", timeout=30).read())
    (load,) = body["loads"]
    assert load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0, load
    log = server.log_path.read_text()
    assert "kvplane_parked_load_inquirer" in log
    # the prefills of this module went through kvplane's PrefillAdder subclass (the reservation
    # of parked requests' tokens: test_parked_lifecycle.py checks it against SGLang's own class)
    assert "kvplane_prefill_adder_reserves_parked" in log and "base=PrefillAdder" in log


def test_flag_implies_disable_overlap_schedule(paused_server):
    """By default --enable-layered-kv runs SGLang's normal (non-overlap) loop (the negative control of
    test_overlap_server.py, where --kv-overlap-schedule on keeps the overlap loop)."""
    import urllib.request

    server, _, _ = paused_server
    info = json.loads(urllib.request.urlopen(server.base_url + "/server_info", timeout=30).read())
    assert info["disable_overlap_schedule"] is True


def test_stats_lines_describe_each_step(paused_server):
    """Every stats line carries the step, its time, per-request GPU layer counts and pool occupancy."""
    server, stats_path, _ = paused_server
    greedy(server, "One more request after the batch", 4)
    lines = _stats(stats_path)
    steps = [line["step"] for line in lines]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    decode = [line for line in lines if line["mode"] == "decode"]
    assert decode and all(line["step_ms"] > 0 for line in decode)
    for line in decode:
        assert set(line["gpu_layers"]) <= set(line["running"]) | set(line["paused"]) | set(line["finished"])
        assert all(0 <= n <= line["layers"] for n in line["gpu_layers"].values())
        if line["layered_pool"]:
            assert 0 <= line["device_pages_used"] <= line["device_pages_total"]
            assert 0.0 <= line["host_fraction"] <= 1.0



def _last_paused(path: Path, after: int) -> list[str]:
    """The paused rids of the newest step line past byte ``after`` (only the file's tail is read:
    polled every 10 ms, the whole file would take longer to parse than a pause lasts)."""
    with path.open("rb") as f:
        f.seek(0, 2)
        size = f.tell()
        f.seek(max(after, size - 65536))
        lines = [line for line in f.read().splitlines() if line.strip()]
    for line in reversed(lines):
        try:
            return list(json.loads(line)["paused"])
        except (ValueError, KeyError):
            continue  # a line cut by the tail read or being written
    return []


def test_aborting_a_paused_request_frees_it_and_the_server_keeps_serving(paused_server):
    """A request aborted while paused is resumed into SGLang's own abort path (KV freed there): it
    ends as aborted, the others complete, and the server keeps serving (no leaked KV). The abort
    races the starvation guard, which resumes a paused request within a few steps; an abort that
    lands after the resume (the request then aborts while running, which proves nothing here) is
    retried with a new request, up to three times."""
    import urllib.request

    from tests.service.conftest import wait_until

    server, stats_path, _ = paused_server
    landed = None
    for attempt in range(3):
        rid = f"kvplane-abort-me-{attempt}"
        start = stats_path.stat().st_size
        long_req = {
            "text": "A very long story begins",
            "rid": rid,
            "sampling_params": {"max_new_tokens": 1500, "temperature": 0.0, "ignore_eos": True},
        }
        with ThreadPoolExecutor(8) as pool:
            victim = pool.submit(server.post, "/generate", long_req, 900.0)
            others = [pool.submit(greedy, server, p, 64) for p in PROMPTS[:6]]
            # The abort must land while the request is paused: wait for the newest step line to
            # show it paused, polling faster than a step.
            abort = urllib.request.Request(
                server.base_url + "/abort_request",
                data=json.dumps({"rid": rid}).encode(),
                headers={"Content-Type": "application/json"},
            )
            try:
                paused = wait_until(lambda rid=rid, start=start: rid in _last_paused(stats_path, start), 400.0, 0.01)
            finally:  # aborted whatever happens: the 1500-token victim must not outlive this block
                with urllib.request.urlopen(abort, timeout=30) as resp:
                    assert resp.status == 200
            assert paused, "the long request was never paused"
            out = victim.result(timeout=600)
            assert out["meta_info"]["finish_reason"]["type"] == "abort"
            assert out["meta_info"]["completion_tokens"] < 1500
            for f in others:
                assert f.result(timeout=600)["meta_info"]["completion_tokens"] >= 1
        aborted = [line for line in server.log_path.read_text().splitlines() if "paused_requests_aborted" in line]
        if any(rid in line for line in aborted):
            landed = rid
            break
    assert landed is not None, "no abort landed while its request was paused in three tries"
    assert greedy(server, "Still serving after the abort", 4)["meta_info"]["completion_tokens"] == 4
    last = _stats(stats_path)[-1]
    assert last["paused"] == [] and not any(r.startswith("kvplane-abort-me") for r in last["running"])


def test_a_retract_pause_and_a_cache_flush_take_parked_requests_too(paused_server, vanilla_server):
    """The RL weight-update sequence -- ``/pause_generation`` (retract), ``/flush_cache``,
    ``/continue_generation`` -- while requests are parked. SGLang's retract takes the running batch
    only, and its flush then clears the request rows, the radix tree and the KV allocator: parked
    requests kept theirs through it and resumed on freed KV (scheduler review, session 54). Now
    they are resumed into the retract first: every request recomputes its KV after the flush and
    ends token-identical to vanilla SGLang; the server log says which were parked."""
    import urllib.request

    from tests.service.conftest import wait_until

    server, stats_path, _ = paused_server
    prompts, new_tokens = PROMPTS[:8], 40
    start = stats_path.stat().st_size
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(greedy, server, p, new_tokens, logprobs=True) for p in prompts]
        try:
            parked = wait_until(lambda: bool(_last_paused(stats_path, start)), 400.0, 0.01)
            server.post("/pause_generation", {"mode": "retract"})
            flush = urllib.request.Request(server.base_url + "/flush_cache", data=b"", method="POST")
            with urllib.request.urlopen(flush, timeout=60) as resp:
                flushed = resp.status == 200
        finally:
            server.post("/continue_generation", {})
        outs = [f.result(timeout=900) for f in futures]
    assert parked, "no request was parked"
    assert flushed, "the flush was refused"
    retracted = [line for line in server.log_path.read_text().splitlines() if "paused_requests_retracted" in line]
    assert retracted, "the retract found no parked request"
    for prompt, out in zip(prompts, outs, strict=True):
        assert_same_generation(out, greedy(vanilla_server, prompt, new_tokens, logprobs=True), prompt)
    assert greedy(server, "Still serving after the flush", 4)["meta_info"]["completion_tokens"] == 4


@pytest.fixture(scope="module")
def tight_paused_server(tiny_model_dir, launch_zygote, tmp_path_factory) -> Iterator[tuple[SGLangServer, Path]]:
    """:func:`pause_flags` on a KV pool of 512 tokens, admitting freely: eight 200-token generations
    do not fit, so SGLang retracts while kvplane has requests parked."""
    root = tmp_path_factory.mktemp("pause-tight")
    stats = root / "stats.jsonl"
    # SGLang admits as if each request will use a small share of its max_new_tokens: it then runs
    # out mid-decode and retracts
    flags = [*pause_flags(root), "--max-total-tokens", "512", "--schedule-conservativeness", "0.05"]
    with running_server(tiny_model_dir, root, flags, {STATS_FILE_ENV: str(stats)}, zygote=launch_zygote) as server:
        yield server, stats


def test_parked_requests_join_sglangs_retraction_when_the_pool_is_full(tight_paused_server, vanilla_server):
    """When the next decode step does not fit the KV pool SGLang retracts running requests,
    longest first, and aborts the last one left; parked requests held their slots out of its
    reach (scheduler review, session 54). Now they are merged back first and retracted like the
    rest: no request is aborted, every one ends token-identical to vanilla, and the log shows the
    parked ones joining a retraction. Negative control (run by hand, session 54): with the hook
    off, a request ends HTTP 500 with SGLang's "Out of memory even after retracting all other
    requests in the decode batch" abort."""
    server, stats_path = tight_paused_server
    concurrent_as_vanilla(server, vanilla_server, PROMPTS[:8], 200)
    log_text = server.log_path.read_text()
    assert "paused_requests_resumed_for_retraction" in log_text, "no retraction met a parked request"
    assert any(line.get("paused_now") for line in _stats(stats_path)), "nothing was parked"


def test_a_retracted_request_keeps_its_placement_record_to_the_end(tight_paused_server):
    """Eight 200-token generations asking for their placement info
    (``custom_params.kvplane_return_placement``) on the pool that does not hold them: SGLang
    retracts some (releases them unfinished, back to the queue). Each final response still carries
    the ``kvplane`` record. Negative control, by hand (session 64): with
    ``RequestPlacement.finishing`` dropping the record of a request released unfinished (before
    90aa3ff), the retracted requests' responses came back without it."""
    server, stats_path = tight_paused_server
    before = server.log_path.read_text().count("Retract requests")
    start = len(_stats(stats_path))

    def one(prompt: str) -> dict:
        return server.post("/generate", {"text": prompt, "sampling_params": {
            "max_new_tokens": 200, "temperature": 0.0, "custom_params": {"kvplane_return_placement": True}}})

    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(one, PROMPTS[:8]))
    assert server.log_path.read_text().count("Retract requests") > before, "SGLang retracted nothing"
    missing = [out["meta_info"]["id"] for out in outs if "kvplane" not in out["meta_info"]]
    assert missing == [], f"responses without their placement record: {missing}"
    assert all(out["meta_info"]["completion_tokens"] == 200 for out in outs)
    lines = read_jsonl_settled(stats_path, start)
    pauses = {out["meta_info"]["id"]: 0 for out in outs}
    for rid in (rid for line in lines for rid in line.get("paused_now") or ()):
        pauses[rid] += 1
    assert sum(pauses.values()) > 0, "nothing was paused"
    recorded = {out["meta_info"]["id"]: out["meta_info"]["kvplane"]["pauses"] for out in outs}
    assert recorded == pauses, "a record lost the pauses its request had before a retraction"
