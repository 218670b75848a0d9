"""SGLang on CPU with eLLM's recompute in the served path (issue 16, docs/recompute.md).

One module-scoped layered server with a device KV budget (the budgeted layout: transient pages
come out of the budget). Requests force an uncached ratio ``r`` with
``custom_params.kvplane_recompute_ratio`` (and optionally ``kvplane_recompute_layers``): their
first ``floor(r * prompt)`` tokens leave the device and are recomputed in every decode step's
forward. Greedy tokens must equal the session's vanilla server's and per-token logprobs stay
within ``LOGPROB_ATOL`` (both in fp32, :data:`FP32`); the pool's stats lines prove the forwards recomputed. The negative
control perturbs the recomputed K/V (test-only fault injector) and the same check fails.

The server also runs the embedded control plane's own recompute (:data:`POLICY`, :data:`PROFILE`):
a request without any override that overflows the device budget is planned an uncached prefix
and served with it.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sglang_ext.settings import POOL_STATS_FILE_ENV, STATS_FILE_ENV
from sglang_ext.testing.jsonl import read_jsonl
from sglang_ext.testing.server import ServerError, SGLangServer
from tests.sglang.conftest import (
    PROMPTS,
    assert_same_generation,
    batched,
    fault_inject_path,
    flag_file,
    greedy,
    running_servers,
)

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1800)]

MAX_TOTAL_TOKENS = 1024
BUDGET_TOKENS = 2304
"""Token-layers on the device: a bit over half of the 4-layer model's 1024-token slot space."""
NEW_TOKENS = 8
LONG = " ".join(PROMPTS[:5])
"""A prompt long enough for every ratio to leave whole pages uncached."""
HUGE = " ".join(PROMPTS * 3)
"""~660 tokens: with its window (64 steps) its 4 layers overflow the 2304 device layer-pages."""
POLICY = {"max_recompute_ratio": 0.5, "solve_budget_fraction": 10.0}
"""The control plane may leave up to half a request uncached; its planner gets 10x the predicted
step to plan (recompute is searched in the time the layout search leaves, docs/recompute.md)."""
PROFILE = {"device": "CPU: test profile", "layers": 4, "block_size": 1, "block_bytes": 256, "h2d_gbps": 1e-3,
           "d2h_gbps": 1e-3, "layer_compute_ms": {"fixed_ms": 1.0, "per_token_ms": 0.0}, "recompute_ms_per_token": 1e-4}
"""The worker's --kv-profile: a link so slow that fetching any layer loses to recomputing, so the
planner's answer to the overflow is recompute (stated, not measured: the figures only have to
make the choice stable on a loaded host; the controller scales the recompute cost with the
compute it learns, never the bandwidth of a plan without transfers)."""


class RecomputeServer:
    def __init__(self, server: SGLangServer, stats: Path, corrupt_flag: Path) -> None:
        self.server, self.stats_path, self.corrupt_flag = server, stats, corrupt_flag

    def stats(self) -> list[dict]:
        return read_jsonl(self.stats_path)


FP32 = ["--dtype", "float32"]
"""Both servers compute in fp32: a recomputed prefix runs through GEMMs of another shape than the
prefill that first wrote its KV, and in SGLang's default fp16 that alone moves logprobs by ~1e-3
(measured: r=0.5, same greedy tokens, 9.9e-4) -- in fp32 the two agree to LOGPROB_ATOL."""


@pytest.fixture(scope="module")
def recompute_servers(tiny_model_dir, launch_zygote, tmp_path_factory) -> Iterator[tuple[RecomputeServer, tuple[SGLangServer, Path, Path]]]:
    """The module's two layered servers, started side by side (:func:`rec`, :func:`paused_rec`)."""
    root = tmp_path_factory.mktemp("layered-recompute")
    stats, flag = root / "pool_stats.jsonl", root / "corrupt-recompute"
    (root / "policy.json").write_text(json.dumps(POLICY))
    (root / "profile.json").write_text(json.dumps(PROFILE))
    flags = ["--enable-layered-kv", "--disable-overlap-schedule", "--kv-gpu-budget-tokens", str(BUDGET_TOKENS),
             "--max-total-tokens", str(MAX_TOTAL_TOKENS), "--kv-policy", str(root / "policy.json"),
             "--kv-profile", str(root / "profile.json"), *FP32]
    env = {POOL_STATS_FILE_ENV: str(stats), "PYTHONPATH": fault_inject_path(),
           "KVPLANE_TEST_CORRUPT_RECOMPUTE_FILE": str(flag)}
    proot = tmp_path_factory.mktemp("recompute-pause")
    (proot / "policy.json").write_text(json.dumps({"max_paused_steps": 6, "window_min": 2, "window_max": 4}))
    pstats, ppool_stats = proot / "stats.jsonl", proot / "pool_stats.jsonl"
    pflags = ["--enable-layered-kv", "--kv-policy", str(proot / "policy.json"), "--kv-gpu-budget-tokens", "96",
              "--kv-recompute-ratio", "0.5", "--mem-fraction-static", "0.3", *FP32]
    penv = {STATS_FILE_ENV: str(pstats), POOL_STATS_FILE_ENV: str(ppool_stats)}
    specs = [(root, flags, env), (proot, pflags, penv)]
    with running_servers(tiny_model_dir, specs, zygote=launch_zygote) as (layered, paused):
        yield RecomputeServer(layered, stats, flag), (paused, pstats, ppool_stats)


@pytest.fixture(scope="module")
def vanilla32(vanilla_server) -> SGLangServer:
    """Stock SGLang in fp32: the session's vanilla server (every test server serves float32,
    ``conftest.TEST_DTYPE_ARGS``, as this module's own vanilla server did)."""
    return vanilla_server


@pytest.fixture(scope="module")
def rec(recompute_servers) -> RecomputeServer:
    """The layered server whose planner answers an overflow with recompute (fp32)."""
    return recompute_servers[0]


@pytest.fixture(scope="module")
def paused_rec(recompute_servers) -> tuple[SGLangServer, Path, Path]:
    """Every request forced to recompute half its prompt (``--kv-recompute-ratio 0.5``) on a device
    budget about a fifth of what the batch needs, with a quick starvation guard: the planner
    pauses recomputing requests mid-generation and the guard rotates them back in
    (``tests/sglang/test_pause_server.py``'s setting, in fp32)."""
    return recompute_servers[1]


def _lines(path: Path) -> list[dict]:
    return read_jsonl(path)


def test_paused_recomputing_requests_resume_exactly(paused_rec, vanilla32):
    """20 concurrent requests, each recomputing half its prompt every decode step, paused and
    resumed mid-generation by the control plane: vanilla's greedy tokens and logprobs for every
    one; the stats show the pauses, the resumes and recompute on both sides of them."""
    server, stats_path, pool_path = paused_rec
    new_tokens = 12
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: generate(server, p, None, new_tokens=new_tokens), PROMPTS))
    for prompt, out in zip(PROMPTS, got, strict=True):
        assert_same_generation(out, greedy(vanilla32, prompt, new_tokens, logprobs=True), prompt)
    lines = _lines(stats_path)
    paused = [rid for line in lines for rid in line.get("paused_now") or ()]
    resumed = [rid for line in lines for rid in line.get("resumed_now") or ()]
    assert len(paused) >= 3, f"expected pauses, stats show {len(paused)}"
    assert set(paused) <= set(resumed), "a paused request was never resumed"
    rec = {s["step"]: s["recompute_tokens"] for s in _lines(pool_path)}  # same scheduler, same step numbers
    assert sum(1 for t in rec.values() if t) >= new_tokens, "the forced ratio did not reach the forward"
    decoding = [(line["step"], set(line["running"])) for line in lines if line["mode"] == "decode"]

    def recomputed(rid: str, after: int, before: float) -> bool:
        return any(after < step < before and rid in running and rec.get(step) for step, running in decoding)

    mid = {rid for line in lines for rid in line.get("paused_now") or ()
           if recomputed(rid, 0, line["step"])
           and any(later["step"] > line["step"] and rid in (later.get("resumed_now") or ())
                   and recomputed(rid, later["step"] - 1, float("inf")) for later in lines)}
    assert mid, "no request recomputed, was paused, resumed and recomputed again"
    assert lines[-1]["paused"] == []


def generate(server: SGLangServer, prompt: str, ratio: float | None, layers: int | None = None,
             new_tokens: int = NEW_TOKENS, rid: str | None = None, timeout_s: float = 600.0) -> dict:
    custom: dict = {}
    if ratio is not None:
        custom["kvplane_recompute_ratio"] = ratio
    if layers is not None:
        custom["kvplane_recompute_layers"] = layers
    payload: dict = {"text": prompt, "return_logprob": True,
                     "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0, "custom_params": custom}}
    if rid is not None:
        payload["rid"] = rid
    return server.post("/generate", payload, timeout_s=timeout_s)


@pytest.mark.parametrize("layers", [None, 2])
@pytest.mark.parametrize("ratio", [0.2, 0.5, 0.9])
def test_recomputed_prefix_serves_vanilla_tokens(rec, vanilla32, ratio, layers):
    """r = 0.2 / 0.5 / 0.9, all 4 layers recomputed or the lowest 2 (the prefix fetched above):
    vanilla's greedy tokens and logprobs; every decode step recomputed the whole prefix."""
    before = len(rec.stats())
    got = generate(rec.server, LONG, ratio, layers)
    want = greedy(vanilla32, LONG, NEW_TOKENS, logprobs=True)
    assert_same_generation(got, want, f"r={ratio} k={layers}")
    prompt = got["meta_info"]["prompt_tokens"]
    recomputed = [s["recompute_tokens"] for s in rec.stats()[before:] if s["recompute_tokens"]]
    assert len(recomputed) >= NEW_TOKENS - 1, recomputed  # every decode step (the first follows the prefill)
    assert set(recomputed) == {int(ratio * prompt)}, (recomputed, prompt)
    assert all(s["overflow_steps_total"] == 0 for s in rec.stats()[before:])
    # eLLM §4.3.1: the prefix runs through its k layers only. A stats line is written as its
    # forward starts, so the totals after this request's last forward are in the next line.
    generate(rec.server, PROMPTS[1], None, new_tokens=1)
    lines = rec.stats()[before:]
    rows = lines[-1]["recompute_layer_rows_total"] - lines[0]["recompute_layer_rows_total"]
    assert rows == (layers or 4) * sum(recomputed), (rows, layers, sum(recomputed))  # uncut: 4 * sum


def test_batched_requests_with_mixed_ratios(rec, vanilla32):
    """Four concurrent requests, three ratios and one without: one batched decode, each exact."""
    ratios = [0.5, None, 0.9, 0.2]
    prompts = [LONG, PROMPTS[6] * 3, " ".join(PROMPTS[7:11]), " ".join(PROMPTS[11:15])]
    before = len(rec.stats())
    params = [{"max_new_tokens": NEW_TOKENS, "temperature": 0.0,
               "custom_params": {} if r is None else {"kvplane_recompute_ratio": r}} for r in ratios]
    results = batched(rec.server, prompts, params, logprobs=True)
    for i, prompt in enumerate(prompts):
        assert_same_generation(results[i], greedy(vanilla32, prompt, NEW_TOKENS, logprobs=True), f"request {i}")
    steps = rec.stats()[before:]
    assert max(s["batch_size"] for s in steps if s["recompute_tokens"]) >= 2


def test_prefix_cache_hit_then_recompute(rec, vanilla32):
    """The second request hits the first one's cached prefix, then recomputes part of it."""
    first = generate(rec.server, LONG + " and then", None)
    again = generate(rec.server, LONG + " and so", 0.5)
    assert again["meta_info"]["cached_tokens"] >= 20
    assert_same_generation(first, greedy(vanilla32, LONG + " and then", NEW_TOKENS, logprobs=True))
    assert_same_generation(again, greedy(vanilla32, LONG + " and so", NEW_TOKENS, logprobs=True))


def test_abort_mid_recompute_loses_nothing(rec, vanilla32):
    """A long recomputing request aborted after a few steps: the server goes on serving exactly and
    its device pages come back."""
    box: dict = {}
    before = len(rec.stats())
    t = threading.Thread(target=lambda: box.setdefault("r", generate(rec.server, LONG, 0.5, new_tokens=400,
                                                                    rid="kvplane-abort-recompute")))
    t.start()
    deadline = time.monotonic() + 120
    abort = urllib.request.Request(rec.server.base_url + "/abort_request",
                                   data=json.dumps({"rid": "kvplane-abort-recompute"}).encode(),
                                   headers={"Content-Type": "application/json"})
    try:
        while time.monotonic() < deadline and sum(1 for s in rec.stats()[before:] if s["recompute_tokens"]) < 3:
            time.sleep(0.1)  # a few of its decode steps have recomputed
    finally:  # aborted whatever happens here, so a failure cannot leave it running into the next test
        try:
            with urllib.request.urlopen(abort, timeout=30) as resp:  # an empty 200
                assert resp.status == 200
        finally:
            t.join(timeout=300)
    assert not t.is_alive(), "the aborted request is still running"
    assert box["r"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(box["r"]["output_ids"]) < 400
    got = generate(rec.server, LONG, 0.9)
    assert_same_generation(got, greedy(vanilla32, LONG, NEW_TOKENS, logprobs=True), "after the abort")
    rec.server.flush_cache()
    generate(rec.server, PROMPTS[1], None, new_tokens=1)
    assert rec.stats()[-1]["device_pages_used"] <= 4 * 32  # only the last short request's pages


def test_negative_control_corrupted_recompute_fails_the_comparison(rec, vanilla32):
    """With the recomputed K/V perturbed on the way into the transient pages, the comparison of
    the tests above fails (and passes again once the perturbation is off)."""
    want = greedy(vanilla32, LONG, NEW_TOKENS, logprobs=True)
    with flag_file(rec.corrupt_flag):
        got = generate(rec.server, LONG, 0.5)
    with pytest.raises(AssertionError):
        assert_same_generation(got, want, "corrupted recompute")
    assert_same_generation(generate(rec.server, LONG, 0.5), want, "perturbation off")


def test_bad_recompute_params_are_refused(rec):
    """A ratio outside [0, 1) or negative layers: HTTP 400 naming the field, before anything runs."""
    for custom, field in (({"kvplane_recompute_ratio": 1.5}, "kvplane_recompute_ratio=1.5"),
                          ({"kvplane_recompute_ratio": 0.5, "kvplane_recompute_layers": -1}, "kvplane_recompute_layers=-1")):
        payload = {"text": "hi", "sampling_params": {"max_new_tokens": 2, "custom_params": custom}}
        with pytest.raises(ServerError, match=f"-> 400: .*{field}"):
            rec.server.post("/generate", payload)


def test_planned_recompute_serves_an_overflowing_request_exactly(rec, vanilla32):
    """No custom_params: a short request fits and recomputes nothing; a ~660-token one overflows
    the device budget, the control plane plans an uncached prefix, and its decode steps recompute
    it -- with vanilla's greedy tokens and logprobs."""
    new_tokens = 12
    before = len(rec.stats())
    short = generate(rec.server, LONG, None, new_tokens=new_tokens)
    assert all(s["recompute_tokens"] == 0 for s in rec.stats()[before:])  # negative control: nothing planned
    assert_same_generation(short, greedy(vanilla32, LONG, new_tokens, logprobs=True), "short")
    before = len(rec.stats())
    got = generate(rec.server, HUGE, None, new_tokens=new_tokens)
    prompt = got["meta_info"]["prompt_tokens"]
    assert prompt * 4 > BUDGET_TOKENS  # it does not fit without offloading something
    recomputed = [s["recompute_tokens"] for s in rec.stats()[before:] if s["recompute_tokens"]]
    assert recomputed, "no decode step recomputed: the plan's recompute did not reach the forward"
    assert all(0 < t < prompt for t in recomputed), recomputed
    assert_same_generation(got, greedy(vanilla32, HUGE, new_tokens, logprobs=True), "planned recompute")
    rec.server.flush_cache()
