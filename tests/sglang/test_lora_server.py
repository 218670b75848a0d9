"""LoRA serving (``--enable-lora``) with kvplane pausing requests and KV read from host.

Scenario (LoRA check, session 81): two adapters, ``--max-loras-per-batch 2``, a GPU budget that
makes the embedded control plane pause requests. SGLang admitted requests counting only the
running batch's adapters; a resume then merged more distinct adapters into one batch than the
LoRA memory pool holds, SGLang's LoRA manager asserted and the scheduler died (twice in two runs;
again in session 82 with the admission hook switched off). Now admission counts the parked
requests' adapters too (``parked_lifecycle.around_can_schedule_lora_req``;
``test_parked_lora.py`` runs SGLang's check with and without it).

Stock SGLang (``--disable-overlap-schedule``: the loop the layered server runs) and the layered
server start side by side with the same LoRA flags, and the test-only shim that lets SGLang's
LoRA layers allocate without CUDA (``lora_shim/``). A mixed batch -- base, A and B on short
prompts and on a ~450-token shared prefix -- is sent to each at once: the layered server pauses
and resumes requests, stays up, and every output matches stock's (greedy tokens and per-token
logprobs). SGLang's LoRA drainer is on (``--lora-drain-wait-threshold``) and sees the parked
requests (``parked_lifecycle.drainer_seeing_parked``). Control: each adapter changes the base model's output, so the comparison sees which
adapter served a request.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sglang_ext.testing.lora_adapter import write_lora_adapter
from sglang_ext.testing.server import SGLangServer
from tests.sglang.conftest import PROMPTS, assert_same_generation, running_servers
from tests.sglang.test_pause_server import pause_flags

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1800)]  # two server start-ups on a loaded host

SHIM_DIR = Path(__file__).parent / "lora_shim"
NEW_TOKENS = 48
ADAPTERS = {"A": (1, 8), "B": (2, 4)}
"""Adapter name -> (seed, rank)."""
LORA = ["--enable-lora", "--lora-backend", "torch_native", "--max-loras-per-batch", "2",
        "--max-total-tokens", "4096", "--disable-overlap-schedule", "--lora-drain-wait-threshold", "0.5"]


@pytest.fixture(scope="module")
def lora_servers(tiny_model_dir, launch_zygote, tmp_path_factory) -> Iterator[tuple[SGLangServer, SGLangServer]]:
    """(stock, layered), both serving adapters A and B with the LoRA shim."""
    root = tmp_path_factory.mktemp("lora")
    paths = [f"{name}={write_lora_adapter(tiny_model_dir, root / name, seed, rank)}"
             for name, (seed, rank) in ADAPTERS.items()]
    common = [*LORA, "--lora-paths", *paths]
    env = {"PYTHONPATH": os.pathsep.join([str(SHIM_DIR), *filter(None, [os.environ.get("PYTHONPATH")])])}
    (root / "stock").mkdir()
    (root / "layered").mkdir()
    # the pause server's forcing: a device budget of 96 token-layers, parked requests rotated
    # back after a few steps -- many pauses and resumes while the adapters' requests mix
    specs = [(root / "stock", common, env), (root / "layered", [*common, *pause_flags(root / "layered")], env)]
    with running_servers(tiny_model_dir, specs, zygote=launch_zygote) as servers:
        yield servers


def _generate(server: SGLangServer, prompt: str, lora: str | None, custom: dict | None = None) -> dict:
    payload: dict = {"text": prompt, "return_logprob": True,
                     "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}}
    if custom is not None:
        payload["sampling_params"]["custom_params"] = custom
    if lora is not None:
        payload["lora_path"] = lora
    return server.post("/generate", payload, timeout_s=600.0)


def _mixed_batch(server: SGLangServer, jobs: list[tuple[str, str | None]]) -> list[dict]:
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: _generate(server, *job), jobs))


def test_a_lora_server_pauses_and_resumes_within_max_loras_per_batch_and_matches_stock(lora_servers):
    stock, layered = lora_servers
    prefix = " ".join(PROMPTS) + " "
    prompts = [*PROMPTS[:4], prefix + "When the cache"]
    jobs = [(prompt, lora) for prompt in prompts for lora in (None, *ADAPTERS)]
    with ThreadPoolExecutor(2) as pool:
        want, got = pool.map(lambda server: _mixed_batch(server, jobs), (stock, layered))
    log = layered.log_path.read_text()
    assert "requests_paused" in log and "requests_resumed" in log, "no pause: the scenario did not happen"
    assert "kvplane_lora_drainer_counts_parked" in log  # SGLang's drainer (the threshold) sees them too
    assert "AssertionError" not in log and layered.post("/generate", {"text": "ok", "sampling_params": {
        "max_new_tokens": 1}})["meta_info"]["completion_tokens"] == 1  # the scheduler is up
    for (prompt, lora), g, w in zip(jobs, got, want, strict=True):
        assert_same_generation(g, w, f"{lora}: {prompt[:40]}")
    outputs = {(prompt, lora): w["output_ids"] for (prompt, lora), w in zip(jobs, want, strict=True)}
    for prompt in prompts:  # the control: each adapter serves its own weights
        for name in ADAPTERS:
            assert outputs[prompt, name] != outputs[prompt, None], (name, prompt[:40])


def test_a_requests_recompute_ratio_is_not_taken_with_lora_adapters(lora_servers):
    """eLLM's recompute rows are appended after SGLang mapped the batch's rows to their adapters:
    a request's ``kvplane_recompute_ratio`` on a LoRA server rebuilt its prefix's KV with the base
    weights, and adapter requests decoded wrong tokens (session 85's review: 6 of 6). With LoRA
    served the rows are not offered (``RecomputeForward.inputs_reason``): the ratio is not taken,
    the prefix is fetched, and every request -- base, A and B, one at a time on short prompts
    (their staging fits the budget: a batch that overflows it is read at rest, without recompute)
    -- matches stock's. Without the fix the adapters' requests differ (checked by hand in session
    85); the launch flag is refused at the parse (``test_offline_engine.py``)."""
    stock, layered = lora_servers
    jobs = [(prompt, lora) for prompt in (PROMPTS[0], PROMPTS[7]) for lora in (None, *ADAPTERS)]
    with ThreadPoolExecutor(1) as pool:
        want = pool.submit(lambda: [_generate(stock, prompt, lora) for prompt, lora in jobs])
        got = [_generate(layered, prompt, lora, {"kvplane_recompute_ratio": 0.5}) for prompt, lora in jobs]
    for (prompt, lora), g, w in zip(jobs, got, want.result(), strict=True):
        assert_same_generation(g, w, f"{lora}: {prompt} with kvplane_recompute_ratio 0.5")
