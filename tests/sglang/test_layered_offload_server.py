"""SGLang with --enable-layered-kv and a tiny GPU-KV budget: most layer-KV in host memory, same tokens.

Scenario: one module-scoped server runs the layered pool with ``--kv-gpu-budget-tokens 49`` and
``--max-total-tokens 48`` (49 layer-pages for a 4-layer model: one layer of the whole slot space,
so every batch can be staged and a 16-token request keeps at most half its layer-KV on the
device); the session's vanilla server is the reference. Every forward must run the staged
pipeline (no overflow step). The pool writes one
stats line per forward to ``$KVPLANE_POOL_STATS_FILE`` and its residency events (with the
radix cache's) to ``$KVPLANE_RESIDENCY_EVENTS_FILE``.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sglang_ext.hooks import ResidencyEventKind, read_jsonl_events
from sglang_ext.settings import POOL_STATS_FILE_ENV
from sglang_ext.settings import RESIDENCY_EVENTS_FILE_ENV as EVENTS_FILE_ENV
from sglang_ext.testing.jsonl import read_jsonl
from sglang_ext.testing.residency import check_block_lifecycle
from sglang_ext.testing.server import SGLangServer
from tests.sglang.conftest import (
    PROMPTS,
    assert_same_generation,
    batched,
    fault_armed,
    fault_inject_path,
    greedy,
    running_server,
    undetected,
    warmup_forward,
)

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1800)]  # server start-ups on a loaded host

MAX_TOTAL_TOKENS = 48
BUDGET_TOKENS = 49
"""One layer of SGLang's 48-token slot space plus its padding page: any batch can be staged, and a
16-token request keeps at most half its layer-KV on the device (the local fallback offloads)."""
NEW_TOKENS = 8


class OffloadServer:
    """The layered server plus its stats and event files."""

    def __init__(self, server: SGLangServer, stats: Path, events: Path) -> None:
        self.server, self.stats_path, self.events_path = server, stats, events

    def stats(self) -> list[dict]:
        return read_jsonl(self.stats_path)


@pytest.fixture(scope="module")
def offload(tiny_model_dir, launch_zygote, tmp_path_factory) -> Iterator[OffloadServer]:
    """A layered-KV server whose device KV budget is 49 token-layers, with the test-only fault
    injector loaded (it perturbs nothing until :func:`test_negative_control_a_corrupted_offloaded_page_fails_the_comparison`
    arms it)."""
    root = tmp_path_factory.mktemp("layered-offload")
    stats, events = root / "pool_stats.jsonl", root / "events.jsonl"
    flags = ["--enable-layered-kv", "--disable-overlap-schedule", "--kv-gpu-budget-tokens", str(BUDGET_TOKENS),
             "--max-total-tokens", str(MAX_TOTAL_TOKENS)]
    env = {POOL_STATS_FILE_ENV: str(stats), EVENTS_FILE_ENV: str(events), "PYTHONPATH": fault_inject_path(),
           "KVPLANE_TEST_CORRUPT_LAYER": str(CORRUPT_LAYER), "KVPLANE_TEST_CORRUPT_FILE": str(root / "corrupt"),
           "KVPLANE_TEST_WARMUP_DUMMY_FILE": str(root / "warmup.jsonl"),
           "KVPLANE_TEST_FORCE_OVERFLOW_FILE": str(root / "overflow")}
    with running_server(tiny_model_dir, root, flags, env, zygote=launch_zygote) as server:
        yield OffloadServer(server, stats, events)


def test_layered_pool_and_attention_are_active(offload):
    """The flag swaps in the layered pool (device pages = budget) and the layered torch_native backend."""
    log = offload.server.log_path.read_text()
    assert "layered_kv_pool_created" in log and f"device_pages={BUDGET_TOKENS}" in log
    # one layer of the slot space exactly: no warning (test_pause_server's 96 token-layers get it),
    # and not the identity layout (test_layered_server's pool is)
    assert "layered_kv_budget_below_one_layer" not in log and "layered_kv_slot_space_on_device" not in log
    before = len(offload.stats())
    greedy(offload.server, PROMPTS[0], 2)
    assert len(offload.stats()) > before, "the forward did not go through the layered attention backend"


def test_sglangs_warm_up_forward_ran_through_the_layered_pool_before_serving(offload):
    """SGLang's warm-up forward as its eager runner allocates it (``BaseRunner._dummy_run`` on
    ``_alloc_dummy_decode_buffers``: FlashInfer's autotune on CUDA sm90+ for FP8 / FP4 GEMMs or
    FlashInfer MoE; run here on the CPU by the test injector) asks the backend for its padded
    ``seq_len`` (``get_cuda_graph_seq_len_fill_value``, which SGLang's torch-native backend, and
    so kvplane's torch-native and FlashInfer ones before, did not answer: the start failed with
    ``NotImplementedError``), then runs anonymous one-token rows at the padding slot through the
    layered pool before any request; the server serves exactly (the tests below)."""
    forward = warmup_forward(offload.stats_path.parent / "warmup.jsonl")
    assert forward == {"backend": "LayeredTorchNativeAttnBackend", "rows": forward["rows"], "seq_lens": [1],
                       "rids": None}


def test_greedy_tokens_identical_with_most_kv_on_host(offload, vanilla_server):
    """20 greedy prompts match vanilla token for token and in per-token logprobs (fp32, within
    LOGPROB_ATOL) while >= 50% of live layer-KV sits on host."""
    before = len(offload.stats())
    for prompt in PROMPTS:
        got = greedy(offload.server, prompt, NEW_TOKENS, logprobs=True)
        want = greedy(vanilla_server, prompt, NEW_TOKENS, logprobs=True)
        assert_same_generation(got, want, prompt)
    steps = [s for s in offload.stats()[before:] if s["live_layer_pages"] > 0]
    assert len(steps) >= len(PROMPTS) * NEW_TOKENS // 2
    assert all(s["device_pages_used"] <= s["device_pages_total"] == BUDGET_TOKENS for s in steps)
    live = sum(s["live_layer_pages"] for s in steps)
    on_host = sum(s["host_layer_pages"] for s in steps)
    assert on_host / live >= 0.5, (on_host, live)
    big = [s for s in steps if s["live_layer_pages"] >= BUDGET_TOKENS + 15]
    assert big and min(s["host_fraction"] for s in big) >= 0.5
    assert steps[-1]["host_write_bytes_total"] > steps[0]["host_write_bytes_total"]
    # the mechanism served every step: staged pipeline, fetches into staging, no overflow
    assert steps[-1]["overflow_steps_total"] == 0
    assert steps[-1]["staged_steps_total"] - steps[0]["staged_steps_total"] >= len(steps) - 1
    assert steps[-1]["fetched_layer_pages_total"] > steps[0]["fetched_layer_pages_total"]


def test_prefix_cache_hits_read_offloaded_prefix(offload, vanilla_server):
    """A prefix cached by a finished request (its pages offloaded) is hit, read from host, and exact."""
    shared = "Large language models generate one token at a time and keep the keys"
    first = greedy(offload.server, shared + " and values", NEW_TOKENS, logprobs=True)
    again = greedy(offload.server, shared + " of every token", NEW_TOKENS, logprobs=True)
    assert again["meta_info"]["cached_tokens"] >= 10
    assert_same_generation(first, greedy(vanilla_server, shared + " and values", NEW_TOKENS, logprobs=True))
    assert_same_generation(again, greedy(vanilla_server, shared + " of every token", NEW_TOKENS, logprobs=True))
    kinds = {e.kind for e in read_jsonl_events(offload.events_path)}
    assert ResidencyEventKind.OFFLOADED in kinds


def test_streaming_and_non_streaming_openai_endpoints(offload, vanilla_server):
    """Streamed and non-streamed OpenAI completions give vanilla's text under forced offload."""
    payload = {"model": "m", "prompt": "Once upon a time there was", "max_tokens": NEW_TOKENS, "temperature": 0}
    plain = offload.server.post("/v1/completions", payload)
    reference = vanilla_server.post("/v1/completions", payload)
    assert plain["choices"][0]["text"] == reference["choices"][0]["text"]
    assert plain["usage"]["completion_tokens"] == NEW_TOKENS
    chunks = offload.server.stream("/v1/completions", payload)
    streamed = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
    assert streamed == reference["choices"][0]["text"]
    chat = offload.server.stream(
        "/v1/chat/completions",
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0},
    )
    assert any(c["choices"] and c["choices"][0]["delta"].get("content") for c in chat)


def test_concurrent_requests_share_the_budget(offload):
    """Six concurrent requests (batched decode) all finish; the device never holds more than the budget."""
    before = len(offload.stats())
    # short requests (a few prompt tokens, 4 new): several fit the 48-token slot space at once
    results = batched(offload.server, PROMPTS[:6], {"max_new_tokens": 4, "temperature": 0.0})
    assert len(results) == 6 and all(len(r["output_ids"]) == 4 for r in results)
    steps = offload.stats()[before:]
    assert max(s["batch_size"] for s in steps) >= 2
    assert all(s["device_pages_used"] <= BUDGET_TOKENS for s in steps)


def test_residency_events_stay_consistent(offload):
    """After a flush every allocated block was freed exactly once; offloads were reported per layer."""
    offload.server.flush_cache()
    events = read_jsonl_events(offload.events_path)
    report = check_block_lifecycle(events)
    assert report.errors == ()
    assert report.live_blocks == frozenset()
    moves = [e for e in events if e.kind in (ResidencyEventKind.OFFLOADED, ResidencyEventKind.LOADED)]
    assert moves and all(e.layers is not None and len(e.layers) == 1 for e in moves)


CORRUPT_LAYER = 3
"""The tiny model's top layer: the local fallback offloads it first."""


def test_negative_control_a_corrupted_offloaded_page_fails_the_comparison(offload, vanilla_server):
    """Negative control: with one offloaded layer-page of layer 3 per step perturbed on its way
    through host memory (the test-only fault injector armed on this server), the comparison of the
    previous tests fails (logprobs move, tokens may not); disarmed, with the cache flushed, the same
    server matches again."""
    with fault_armed(offload.server, offload.server.log_path.parent / "corrupt"):
        assert undetected(offload.server, vanilla_server, PROMPTS[:4], NEW_TOKENS) == 0
    assert undetected(offload.server, vanilla_server, PROMPTS[:1], NEW_TOKENS) == 1


def test_requests_sharing_a_cached_prefix_stage_it_once(offload, vanilla_server):
    """Two requests that hit one cached prefix decode together with most of their KV on host.
    Staged per request, their pages would ask more staging than the budget (the prefix twice:
    more than one layer of the slot space), and every such step would run at rest. One staging
    page per distinct page (``staging_columns.py``) fits: the steps stay staged, and the tokens
    match vanilla's."""
    prefix = PROMPTS[0] + " " + PROMPTS[2]
    greedy(offload.server, prefix, 2)  # the prefix, cached
    seen = len(offload.stats())
    before = offload.stats()[-1]
    prompts = (prefix + " dawn", prefix + " night")  # ~20 prefix tokens (the tiny BPE) + a few
    new = 6
    # both reach the scheduler at once (two concurrent calls, then a batch of texts, once reached a
    # loaded CI host's a whole generation apart and never decoded together)
    got = batched(offload.server, prompts, {"max_new_tokens": new, "temperature": 0.0}, logprobs=True)
    for prompt, out in zip(prompts, got, strict=True):
        assert_same_generation(out, greedy(vanilla_server, prompt, new, logprobs=True), prompt)
    cached = min(o["meta_info"]["cached_tokens"] for o in got)
    per_request = sum(o["meta_info"]["prompt_tokens"] + new - 1 for o in got)  # the last decode step's pages
    # staged per request, the last decode step of the two asks more than the budget; distinct, it fits
    assert cached > 2 * new and per_request > BUDGET_TOKENS >= per_request - cached, (cached, per_request)
    steps = offload.stats()[seen:]  # one line per forward, written once its staging is reserved
    together = [s for s in steps if s["batch_size"] == 2 and s["new_tokens"] == 2 and s["staging_pages"]]
    assert together, ("the two never decoded together staged",
                      [(s["batch_size"], s["new_tokens"], s["staging_pages"]) for s in steps])
    # page size 1: staged per request, a step of the two takes at least their prompts' tokens
    prompts_total = sum(o["meta_info"]["prompt_tokens"] for o in got)
    assert max(s["staging_pages"] for s in together) <= prompts_total + 2 * new - cached < prompts_total, together
    assert steps[-1]["overflow_steps_total"] == before["overflow_steps_total"]
    assert steps[-1]["staged_steps_total"] > before["staged_steps_total"]


def test_steps_served_at_rest_with_a_shared_prefix_match_vanilla(offload, vanilla_server):
    """The overflow path as SGLang serves it (kept last: the module's other tests assert no
    overflow). With the staging room forced empty (the injector) every step that stages is served
    at rest: each layer's K/V of the batch read from where it lies, each distinct slot once
    (``at_rest_batch``), and the attention reads it through the compact table. Two requests
    sharing a prompt prefix decode together (the prefix read once for both) and match vanilla;
    the stats count the overflow steps."""
    before = offload.stats()[-1]["overflow_steps_total"] if offload.stats() else 0
    prompts = (PROMPTS[1], PROMPTS[1] + " and so on")
    with fault_armed(offload.server, offload.stats_path.parent / "overflow"):
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda p: greedy(offload.server, p, NEW_TOKENS, logprobs=True), prompts))
    for prompt, out in zip(prompts, got, strict=True):
        assert_same_generation(out, greedy(vanilla_server, prompt, NEW_TOKENS, logprobs=True), prompt)
    assert offload.stats()[-1]["overflow_steps_total"] - before >= NEW_TOKENS
