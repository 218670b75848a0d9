"""``--kv-overlap-schedule on``: the layered pool under SGLang's overlap loop, on real SGLang (CPU).

There step k+1 is scheduled and launched -- kvplane's boundary (plan install, pauses) and the
pool's step preparation included -- before step k's results are processed, so a request can be
parked while its last step is in flight, and a step's telemetry is paired with its launch by
order (``docs/overlap-schedule.md``). The setting of ``test_pause_server.py`` (a 96 token-layer
device budget, a quick starvation guard), with the overlap loop kept.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sglang_ext.hooks import ResidencyEventKind, read_jsonl_events
from sglang_ext.settings import POOL_STATS_FILE_ENV, RESIDENCY_EVENTS_FILE_ENV, STATS_FILE_ENV
from sglang_ext.testing.jsonl import read_jsonl, read_jsonl_settled
from sglang_ext.testing.server import SGLangServer
from tests.sglang.conftest import PROMPTS, assert_same_generation, greedy, running_server
from tests.sglang.test_pause_server import _same_as_vanilla, _sampled, pause_flags

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1800)]

MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def overlap_server(tiny_model_dir, launch_zygote, tmp_path_factory) -> Iterator[tuple[SGLangServer, Path, Path]]:
    root = tmp_path_factory.mktemp("overlap")
    stats, pool_stats = root / "stats.jsonl", root / "pool_stats.jsonl"
    flags = [*pause_flags(root), "--kv-overlap-schedule", "on"]
    env = {STATS_FILE_ENV: str(stats), POOL_STATS_FILE_ENV: str(pool_stats),
           RESIDENCY_EVENTS_FILE_ENV: str(root / "events.jsonl")}
    with running_server(tiny_model_dir, root, flags, env, zygote=launch_zygote) as server:
        yield server, stats, pool_stats


def test_the_server_runs_sglangs_overlap_loop_and_says_so(overlap_server):
    """``/server_info`` shows the overlap scheduler on (``test_pause_server.py``'s same setting
    without the flag shows it off: the negative control) and the launch line says why."""
    server, _, _ = overlap_server
    info = json.loads(urllib.request.urlopen(server.base_url + "/server_info", timeout=30).read())
    assert info["disable_overlap_schedule"] is False
    assert "overlap scheduler kept (--kv-overlap-schedule on)" in server.log_path.read_text()


def test_paused_and_offloaded_requests_match_vanilla_and_leave_nothing_behind(overlap_server, vanilla_server):
    """20 concurrent greedy prompts under a budget that offloads and pauses: vanilla's tokens and
    per-token logprobs (vanilla runs the overlap loop too, SGLang's default). Afterwards nobody is
    left parked or tracked: a lone request's steps show it as the pool's only live request (a
    request parked while its last step was in flight, then finished, would stay tracked and
    reported paused), and every decode step has a time of its own (paired with its launch). The
    stats lines carry every pause and resume the events file records: a boundary whose record no
    processed step took at once (the overlap loop processes step k after launching k+1, and none
    after the boundary that follows an idle iteration) is carried by the next line, not
    overwritten. This workload rarely meets that case: ``test_boundary_record.py`` holds the
    negative control (the differential fuzzer's stats lines missed 15-19% of its resumes before)."""
    server, stats_path, pool_path = overlap_server
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: greedy(server, p, MAX_NEW_TOKENS, logprobs=True), PROMPTS))
    for prompt, out in zip(PROMPTS, got, strict=True):
        assert_same_generation(out, greedy(vanilla_server, prompt, MAX_NEW_TOKENS, logprobs=True), prompt)
    lines = read_jsonl_settled(stats_path)
    paused_now = [rid for line in lines for rid in line.get("paused_now") or ()]
    assert len(paused_now) >= 5, f"expected pauses, stats show {len(paused_now)}"
    assert lines[-1]["paused"] == []
    # nobody finishing by length is parked within its last two tokens (the step in flight or the
    # next one ends it); before PauseManager's ``in_flight_steps``, one finished on its pause's
    # line. A request ended by EOS in the step in flight cannot be foreseen: left out.
    by_length = {out["meta_info"]["id"] for out in got if len(out["output_ids"]) == MAX_NEW_TOKENS}
    late = [(line["step"], rid) for n, line in enumerate(lines) for rid in line.get("paused_now") or ()
            if rid in by_length and any(rid in later["finished"] for later in lines[n:n + 2])]
    assert late == [], late
    decode = [line for line in lines if line["mode"] == "decode"]
    assert decode and all(line["step_ms"] is not None and line["step_ms"] > 0 for line in decode)
    kinds = [e.kind for e in read_jsonl_events(stats_path.parent / "events.jsonl")]
    resumed_now = [rid for line in lines for rid in line.get("resumed_now") or ()]
    assert (kinds.count(ResidencyEventKind.PAUSED), kinds.count(ResidencyEventKind.RESUMED)) == (
        len(paused_now), len(resumed_now))

    before = len(read_jsonl(pool_path))
    lone = greedy(server, PROMPTS[3], 4, logprobs=True)
    assert_same_generation(lone, greedy(vanilla_server, PROMPTS[3], 4, logprobs=True), "lone request")
    after = read_jsonl_settled(pool_path, before)
    assert after and after[-1]["live_requests"] == 1, [s["live_requests"] for s in after]
    assert read_jsonl_settled(stats_path)[-1]["paused"] == []


def _stopped(server: SGLangServer, prompt: str, stop_token: int) -> dict:
    payload = {"text": prompt, "return_logprob": True,
               "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.0, "stop_token_ids": [stop_token]}}
    return server.post("/generate", payload)


def test_requests_ended_by_a_stop_token_end_once(overlap_server, vanilla_server):
    """A request ended by a stop token in step k is still in step k+1, which the overlap loop
    launched before processing step k: the stats lines list it finished once (before the fix:
    twice, so it was released, reported and counted in the SLO metrics twice), and its output is
    vanilla's."""
    server, stats_path, _ = overlap_server
    prompts = PROMPTS[4:10]
    stops = [greedy(vanilla_server, p, MAX_NEW_TOKENS)["output_ids"][2] for p in prompts]
    start = len(read_jsonl(stats_path))
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda ps: _stopped(server, *ps), zip(prompts, stops, strict=True)))
    for prompt, stop, out in zip(prompts, stops, got, strict=True):
        assert_same_generation(out, _stopped(vanilla_server, prompt, stop), prompt)
        assert out["meta_info"]["finish_reason"]["type"] == "stop" and len(out["output_ids"]) < MAX_NEW_TOKENS
    finished = [rid for line in read_jsonl_settled(stats_path, start) for rid in line["finished"]]
    ids = [out["meta_info"]["id"] for out in got]
    assert {rid: finished.count(rid) for rid in ids} == dict.fromkeys(ids, 1)


def test_requests_with_a_penalizer_paused_under_the_overlap_loop_match_vanilla(overlap_server, vanilla_server):
    """Penalty state across a pause under the overlap loop, where a boundary runs while the step
    before it is in flight (and SGLang adds a step's token to the penalizers late, in
    ``prepare_for_decode``): requests with ``min_new_tokens=6`` (EOS masked by an output-length
    count) are paused and resumed, tokens and logprobs vanilla's (vanilla runs the overlap loop
    too). Negative control (session 23): counting the in-flight token into the paused row when
    it is split off -- a count one off -- moves a logprob by 2.7e-3."""
    got, lines = _same_as_vanilla(overlap_server, vanilla_server, min_new_tokens=6)
    paused = {rid for line in lines for rid in line.get("paused_now") or ()}
    assert paused & {out["meta_info"]["id"] for out in got}, "expected requests with a penalizer to be paused"
    assert lines[-1]["paused"] == []



def test_requests_with_a_frequency_penalty_are_not_paused_under_the_overlap_loop(overlap_server):
    """A frequency penalty counts each output token, and under the overlap loop SGLang's
    ``prepare_for_decode`` counts the token of the step before the one in flight: a row parked
    there would miss one count and count another twice at its resume. So the planner's pauses of
    such requests are skipped (``penalties_in_flight``, in the stats lines' ``pauses_skipped``)
    and none of them is parked, under the budget that pauses the other tests' requests; each
    request still decodes all its tokens. (Not compared with vanilla: vanilla SGLang's own outputs
    with a frequency penalty differ between two identical concurrent runs on this CPU -- 8 of 20
    prompts, session 64 -- while without one they are equal to the bit.) Negative control, by
    hand: with ``pause.penalized`` returning False the requests are paused.

    Each dropped pause is named in the step's report (``pauses_dropped``), and the control plane
    holds the request running: it is not asked to pause again within its generation (before
    session 79 it was re-planned as the victim and its pause dropped every third step)."""
    server, stats_path, _ = overlap_server
    start = len(read_jsonl(stats_path))
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: _sampled(server, p, frequency_penalty=0.5), PROMPTS))
    lines = read_jsonl_settled(stats_path, start)
    ids = {out["meta_info"]["id"] for out in got}
    paused = {rid for line in lines for rid in line.get("paused_now") or ()}
    skipped = sum((line.get("pauses_skipped") or {}).get("penalties_in_flight", 0) for line in lines)
    assert not paused & ids, f"requests with a frequency penalty were paused: {sorted(paused & ids)}"
    assert skipped > 0, "the budget asked for no pause of them: the test shows nothing"
    dropped = [rid for line in lines for rid in line.get("pauses_dropped") or () if rid in ids]
    assert dropped, "no dropped pause was reported"
    # once each; twice when a plan already in flight when the drop was reported paused it again
    assert all(dropped.count(rid) <= 2 for rid in dropped), f"pauses dropped again and again: {sorted(dropped)}"
    assert all(len(out["output_ids"]) == MAX_NEW_TOKENS or out["meta_info"]["finish_reason"]["type"] == "stop"
               for out in got)
    assert lines[-1]["paused"] == []


def test_steady_decode_boundaries_take_the_allocation_hooks_slots_under_the_overlap_loop(overlap_server):
    """Under the overlap loop step k+1 is allocated after step k launched: each steady decode
    boundary still finds its own step's slots published (``HostSlots``, keyed by requests and
    lengths) and reads none back from the forward's tensor (on a GPU a sync of the forward
    stream, which here still runs step k). Requests decode one at a time, so steps stay steady."""
    server, _, pool_path = overlap_server
    before = read_jsonl(pool_path)[-1] if pool_path.exists() and read_jsonl(pool_path) else {}
    for prompt in PROMPTS[:2]:
        greedy(server, prompt, MAX_NEW_TOKENS)
    last = read_jsonl(pool_path)[-1]
    taken = last["slot_handoffs_total"] - before.get("slot_handoffs_total", 0)
    assert taken >= MAX_NEW_TOKENS, last  # two requests' decode steps, most of them steady
    assert last["slot_readbacks_total"] == before.get("slot_readbacks_total", 0), last
