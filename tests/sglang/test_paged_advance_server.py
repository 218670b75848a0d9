"""SGLang serves resident steady decode steps of the paged layout on advanced tables: with
``--page-size 4`` (as on CUDA, where kvplane picks 16), a device budget that holds the batch but
not every layer of every page (the paged layout, as on any offloading server), and the paged
decode backend (Triton, under the interpreter on this host), three of four decode steps open no
page and run on the last step's tables advanced by one token (no build, no upload:
``PagedDecodeStep.advance``); the fourth opens one and advances with it spliced in. Tokens
and logprobs equal vanilla's (page size 1).

Requests decoded two at a time with a prompt-length skew still match; the pool's stats show
both advanced and built steps, and nothing on host; the in-process meter counts the paged
decode's KV writes (one per layer and forward, decode forwards included). Negative control: the same server with a
stale advance armed (tests/sglang/fault_inject: the new tokens' rows not advanced) fails the
comparison.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from sglang_ext.overhead import WRITE_EVERY
from sglang_ext.settings import OVERHEAD_FILE_ENV, POOL_STATS_FILE_ENV
from sglang_ext.testing.jsonl import read_jsonl
from sglang_ext.testing.server import SGLangServer
from tests.sglang.conftest import (
    PROMPTS,
    batched,
    fault_armed,
    fault_inject_path,
    flag_file,
    greedy,
    running_server,
    token_logprobs,
)
from tests.sglang.test_triton_server import KERNEL_LOGPROB_ATOL

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1800)]

NEW_TOKENS = 10
LAYERS = 4
"""The tiny model's layers."""


@pytest.fixture(scope="module")
def advance_server(tiny_model_dir, launch_zygote, tmp_path_factory) -> Iterator[tuple[SGLangServer, object]]:
    """The layered server and its stats file; the test-only injector audits its layers and acts
    on the faults its flag files arm (stale turnover, stale advance), each in its own control."""
    root = tmp_path_factory.mktemp("layered-advance")
    stats = root / "pool_stats.jsonl"
    # 512 device pages of 4 tokens < 4 layers x 257 logical pages: the paged layout. The planner
    # provisions each request's growth over its decode window (64 steps: ~23 pages x 4 layers for
    # a ~25-token request), so two requests plan resident (a 512-token budget offloads half)
    flags = ["--enable-layered-kv", "--attention-backend", "triton", "--page-size", "4",
             "--max-total-tokens", "1024", "--kv-gpu-budget-tokens", "2048"]
    # the test-only injector only audits here (perturbs nothing): the served per-layer ops
    env = {"TRITON_INTERPRET": "1", POOL_STATS_FILE_ENV: str(stats), "PYTHONPATH": fault_inject_path(),
           "KVPLANE_TEST_AUDIT_FILE": str(root / "audit.json"), OVERHEAD_FILE_ENV: str(root / "overhead.json"),
           "KVPLANE_TEST_AUDIT_TORCH_EXTEND_FILE": str(root / "torch_extend"),
           "KVPLANE_TEST_STALE_TURNOVER_FILE": str(root / "stale_turnover"),
           "KVPLANE_TEST_STALE_ADVANCE_FILE": str(root / "stale_advance")}
    with running_server(tiny_model_dir, root, flags, env, zygote=launch_zygote) as server:
        yield server, stats


def _steps(path) -> list[dict]:  # noqa: ANN001
    return read_jsonl(path)


def _matches(got: dict, want: dict, context: str) -> None:
    assert got["output_ids"] == want["output_ids"], context
    worst = max(abs(a - b) for a, b in zip(token_logprobs(got), token_logprobs(want), strict=True))
    assert worst <= KERNEL_LOGPROB_ATOL, (context, worst)


def test_resident_paged_decode_runs_on_advanced_tables(advance_server, vanilla_server):
    server, stats_path = advance_server
    for prompt in PROMPTS[:2]:
        _matches(greedy(server, prompt, NEW_TOKENS, logprobs=True),
                 greedy(vanilla_server, prompt, NEW_TOKENS, logprobs=True), prompt)
    steps = _steps(stats_path)
    last = steps[-1]
    assert last["overflow_steps_total"] == 0 and max(s["host_fraction"] for s in steps) == 0.0
    # 2 requests x 10 tokens: 9 decode steps each, at most 3 of them open a page, the first builds
    assert last["advanced_decode_steps_total"] >= 2 * (NEW_TOKENS - 1 - 3 - 1)
    assert last["advanced_decode_steps_total"] < last["staged_steps_total"]  # prefills and page opens build
    assert last["resident_builds_total"] > 0  # the first decode step builds knowing the batch resident
    assert last["opened_advances_total"] > 0  # page-opening steps advance too, in the served path
    assert last["opened_one_pass_total"] > 0  # and their opened pages are placed in one pass (OpenedPages)
    # every steady boundary took its new slots from the allocation hook's host list (HostSlots):
    # none read them back from the device (on a GPU, a sync of the forward stream)
    assert last["slot_readbacks_total"] == 0, last
    assert last["slot_handoffs_total"] >= 2 * (NEW_TOKENS - 1) - 2, last
    log = server.log_path.read_text()
    assert "layered_triton_decode_active" in log and "impl=triton" in log


def test_a_batch_of_two_with_skewed_pages_still_matches(advance_server, vanilla_server):
    """Two requests decoding together open pages at different steps: a step advances only when
    neither opens one, and every step's reads stay exact."""
    server, stats_path = advance_server
    before = _steps(stats_path)[-1]["advanced_decode_steps_total"]
    prompts = (PROMPTS[2], PROMPTS[3] + " and then")
    got = batched(server, prompts, {"max_new_tokens": NEW_TOKENS, "temperature": 0.0}, logprobs=True)
    for prompt, response in zip(prompts, got, strict=True):
        _matches(response, greedy(vanilla_server, prompt, NEW_TOKENS, logprobs=True), prompt)
    steps = _steps(stats_path)
    assert steps[-1]["advanced_decode_steps_total"] > before
    assert max(s["batch_size"] for s in steps) == 2 and max(s["host_fraction"] for s in steps) == 0.0


def _staggered(server, prompts: tuple[str, ...], lengths: tuple[int, ...]) -> list[dict]:  # noqa: ANN001
    """``prompts[i]`` generating ``lengths[i]`` tokens, sent a short while apart: requests join a
    running batch after their prefill and leave it as they finish."""
    import time

    def one(i: int) -> dict:
        time.sleep(0.4 * i)
        return server.post("/generate", {"text": prompts[i], "return_logprob": True, "sampling_params": {
            "max_new_tokens": lengths[i], "temperature": 0.0, "ignore_eos": True}})

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, range(len(prompts))))


TURNOVER_PROMPTS = (PROMPTS[11], PROMPTS[12] + " then", PROMPTS[13] + " one two three")
TURNOVER_LENGTHS = (14, 6, 10)


def test_batch_changes_continue_without_reading_slots(advance_server, vanilla_server):
    """Requests joining a running batch after their prefill and leaving it as they finish: the
    decode steps after each change continue what each request held (``DecodeContinuity``: no
    request's slots read back, the tables built from the kept page lists), counted by the pool's
    ``decode_turnovers_total``; tokens and logprobs still equal vanilla's, request by request."""
    server, stats_path = advance_server
    before = _steps(stats_path)[-1]["decode_turnovers_total"]
    got = _staggered(server, TURNOVER_PROMPTS, TURNOVER_LENGTHS)
    for prompt, n, response in zip(TURNOVER_PROMPTS, TURNOVER_LENGTHS, got, strict=True):
        want = vanilla_server.post("/generate", {"text": prompt, "return_logprob": True, "sampling_params": {
            "max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}})
        _matches(response, want, prompt)
    steps = _steps(stats_path)
    assert steps[-1]["decode_turnovers_total"] >= before + 2, (before, steps[-1]["decode_turnovers_total"])
    assert max(s["batch_size"] for s in steps[-40:]) >= 2


def test_negative_control_a_stale_turnover_fails_the_comparison(advance_server, vanilla_server):
    """Control: turnover steps that continue a wrong page list (a request's first page read as
    its second, tests/sglang/fault_inject) are caught by the same comparison."""
    server, stats_path = advance_server
    with flag_file(stats_path.parent / "stale_turnover"):
        got = _staggered(server, TURNOVER_PROMPTS, TURNOVER_LENGTHS)
    failures = 0
    for prompt, n, response in zip(TURNOVER_PROMPTS, TURNOVER_LENGTHS, got, strict=True):
        want = vanilla_server.post("/generate", {"text": prompt, "return_logprob": True, "sampling_params": {
            "max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}})
        try:
            _matches(response, want, prompt)
        except AssertionError:
            failures += 1
    assert failures >= 1, "no stale turnover was detected"


def test_negative_control_a_stale_advance_fails_the_comparison(advance_server, vanilla_server):
    """Control: advanced steps that keep the last step's rows (each new token's K/V overwrite the
    previous token's) are caught by the same comparison, for every prompt (the fault armed on
    this server; disarmed, it matches again)."""
    server, stats_path = advance_server
    failures = 0
    with fault_armed(server, stats_path.parent / "stale_advance"):
        for prompt in PROMPTS[:2]:
            try:
                _matches(greedy(server, prompt, NEW_TOKENS, logprobs=True),
                         greedy(vanilla_server, prompt, NEW_TOKENS, logprobs=True), prompt)
            except AssertionError:
                failures += 1
    assert failures == 2, f"only {failures} of 2 stale-advance generations were detected"
    _matches(greedy(server, PROMPTS[0], NEW_TOKENS, logprobs=True),
             greedy(vanilla_server, PROMPTS[0], NEW_TOKENS, logprobs=True), PROMPTS[0])


def test_served_decode_layers_make_no_host_sync_and_the_same_ops(advance_server):
    """GPU discipline in the process SGLang serves from (issue 13, item 5): every layer of every
    paged decode step the previous tests served -- advanced and built, batch 1 and 2 -- ran
    kvplane's per-layer work (layer begin, KV write through the pool, layer end) with no op that
    would make a CUDA host wait (aten sync ops, and a tensor's tolist / numpy / cpu / item, which
    a CPU host never dispatches), and the same ops at every layer of every step."""
    server, stats_path = advance_server
    greedy(server, PROMPTS[4], NEW_TOKENS)  # batch 1, then 2 (also what the tests above served)
    batched(server, (PROMPTS[5], PROMPTS[6] + " again"), {"max_new_tokens": NEW_TOKENS, "temperature": 0.0})
    steps = [s for s in json.loads((stats_path.parent / "audit.json").read_text()) if not s["extend"]]
    paged = [s for s in steps if s["paged"]]
    assert len(paged) >= 10 and {s["batch"] for s in paged} >= {1, 2}
    assert all(not s.get("violations") for s in steps), [s["violations"] for s in steps if s.get("violations")]
    first = paged[0]["layers"]["0"]
    assert first and any("index_copy" in op or "index_put" in op for op in first)  # the KV write is in scope
    for s in paged:
        assert len(s["layers"]) == 4 and all(ops == first for ops in s["layers"].values()), s
    # both kinds of step were audited: advanced (the core's count moved at the step) and built
    moved = [b["advanced_total"] > a["advanced_total"] for a, b in zip(steps, steps[1:], strict=False) if b["paged"]]
    assert any(moved) and not all(moved)


def test_idle_decode_steps_skip_the_pools_per_layer_calls(advance_server):
    """An all-resident paged decode step fetches, writes back and parks nothing
    (``LayeredKVCore.layers_idle``): the served backend makes none of the pool's per-layer calls
    but the last layer's ``exit_layer``, which ends the step. Here nothing is ever on host, so
    every paged decode step the tests above served is idle; the audit recorded the pool's calls
    inside each of its layers. (The same skip is KV-exact over the stateful machine's idle steps,
    and fails the shadow checks when applied to staged steps: ``tests/dataplane/test_layers_idle.py``.)"""
    server, stats_path = advance_server
    greedy(server, PROMPTS[3], NEW_TOKENS)
    steps = [s for s in json.loads((stats_path.parent / "audit.json").read_text()) if s["paged"]]
    assert len(steps) >= 10 and all(s["idle"] for s in steps), [s["idle"] for s in steps]
    for s in steps:
        assert s.get("pool_calls") == [["exit_layer", LAYERS - 1]], s.get("pool_calls")


def test_the_meter_counts_the_paged_decode_kv_writes(advance_server):
    """Issue 13: the meter counts every kvplane path that runs per step. The paged decode writes
    K/V through the metered stand-in pool, so ``kv_write`` is measured exactly once per layer of
    every forward: extends and paged decodes. Were decode writes not metered, the count would be
    the extends' alone, ``LAYERS x`` a handful, far below ``LAYERS x`` the forwards (checked to be
    mostly decodes)."""
    server, stats_path = advance_server
    server.post("/generate", {"text": PROMPTS[7], "sampling_params": {
        "max_new_tokens": WRITE_EVERY + 8, "temperature": 0.0, "ignore_eos": True}})  # the meter writes every 64 steps
    out = json.loads((stats_path.parent / "overhead.json").read_text())
    forwards = out["counts"]["prepare_steady_decode"] + out["counts"].get("prepare_general", 0)
    assert out["counts"]["prepare_steady_decode"] > forwards // 2  # mostly paged decode steps
    assert out["calls"]["kv_write"] == LAYERS * forwards, (out["calls"], out["counts"])


def test_served_extend_layers_run_the_kernel_with_no_host_sync_and_the_same_ops(advance_server, vanilla_server):
    """GPU discipline for prefill, in the process SGLang serves from: every extend step the tests
    above served (and a batch of two prompts of different lengths) ran on the paged-extend kernel,
    and kvplane's per-layer work around it (layer begin, KV write, layer end) made no op that
    would make a CUDA host wait, with the same ops at every layer of every extend step, whatever
    the batch or prompt lengths. Negative control: extends served by SGLang's torch-native path
    (the kernel turned off for them by the test-only injector) show the audit its host reads
    (``_local_scalar_dense``: the per-request loop's device lengths, at every layer)."""
    server, stats_path = advance_server
    pair = (PROMPTS[8], PROMPTS[9] + " a b c d")
    got = batched(server, pair, {"max_new_tokens": 2, "temperature": 0.0}, logprobs=True)
    for prompt, response in zip(pair, got, strict=True):
        _matches(response, greedy(vanilla_server, prompt, 2, logprobs=True), prompt)
    audit_path = stats_path.parent / "audit.json"
    extends = [s for s in json.loads(audit_path.read_text()) if s["extend"]]
    assert len(extends) >= 8 and all(s["kernel"] for s in extends), [s["kernel"] for s in extends]
    assert all(not s.get("violations") for s in extends), [s["violations"] for s in extends if s.get("violations")]
    first = extends[0]["layers"]["0"]
    assert first and any("index_copy" in op or "index_put" in op for op in first)  # the KV write is in scope
    for s in extends:
        assert len(s["layers"]) == LAYERS and all(ops == first for ops in s["layers"].values()), s
    seen = len(json.loads(audit_path.read_text()))
    with flag_file(stats_path.parent / "torch_extend"):
        greedy(server, PROMPTS[10] + " control", 1)
    control = [s for s in json.loads(audit_path.read_text())[seen:] if s["extend"]]
    assert control and not any(s["kernel"] for s in control)
    assert all(any("_local_scalar_dense" in str(v) for v in s.get("violations", [])) for s in control), control


def test_a_one_token_extend_hands_its_tables_to_the_next_decode_step(advance_server, vanilla_server):
    """Extends on the paged-extend kernel build no token tables, so an extend of one token per
    request (a prompt served again: SGLang recomputes its last token past the cached, page-aligned
    prefix) builds tables a steady decode step can advance from (``PagedStepTables.advanced``):
    the decode step right after it advances, and the generation equals vanilla's."""
    server, stats_path = advance_server
    lengths = {}
    for words in range(1, 9):  # " x" is one token of the test tokenizer: four in a row cover every length mod 4
        text = PROMPTS[12] + " x" * words
        lengths[text] = len(server.post("/generate", {"text": text, "return_logprob": True, "logprob_start_len": 0,
                                                      "sampling_params": {"max_new_tokens": 1}})
                            ["meta_info"]["input_token_logprobs"])
    prompt = next((p for p, n in lengths.items() if n % 4 == 1), None)  # page 4: one token past the prefix
    assert prompt is not None, lengths
    audit_path = stats_path.parent / "audit.json"
    seen = len(json.loads(audit_path.read_text()))
    _matches(greedy(server, prompt, 4, logprobs=True), greedy(vanilla_server, prompt, 4, logprobs=True), prompt)
    steps = json.loads(audit_path.read_text())[seen:]
    assert steps[0]["extend"] and steps[0]["kernel"] and not steps[1]["extend"], steps[:2]
    assert steps[1]["advanced_total"] > steps[0]["advanced_total"], steps[:2]
