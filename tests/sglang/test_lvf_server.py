"""SGLang with --kv-scheduler lvf: SuperInfer's Largest-VLT-First rotation drives admission and
keep-KV pause/resume in a real server.

Scenario: one layered server with the LVF scheduler, a device KV budget of 96 token-layers (a
small fraction of what the burst needs, so requests contend for the GPU and are rotated) and a
per-step stats file. A burst of concurrent greedy requests must come back token-identical to the
session's vanilla server, with queued prefills admitted by the control plane and paused requests
rotated back in (every pause followed by a resume).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sglang_ext.settings import STATS_FILE_ENV
from sglang_ext.testing.jsonl import read_jsonl
from sglang_ext.testing.server import SGLangServer
from tests.sglang.conftest import PROMPTS, assert_same_generation, greedy, running_server

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1800)]  # server start-ups on a loaded host

BURST = 10
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def lvf_server(tiny_model_dir, launch_zygote, tmp_path_factory) -> Iterator[tuple[SGLangServer, Path]]:
    root = tmp_path_factory.mktemp("lvf")
    stats = root / "stats.jsonl"
    flags = ["--enable-layered-kv", "--kv-scheduler", "lvf", "--kv-gpu-budget-tokens", "96",
             "--mem-fraction-static", "0.3"]
    with running_server(tiny_model_dir, root, flags, {STATS_FILE_ENV: str(stats)}, zygote=launch_zygote) as server:
        yield server, stats


def test_lvf_rotation_keeps_outputs_token_identical_to_vanilla(lvf_server, vanilla_server):
    """Under GPU contention LVF admits queued prefills and rotates paused requests back in; every
    request finishes with vanilla's greedy tokens and nothing is left paused."""
    server, stats_path = lvf_server
    prompts = PROMPTS[:BURST]
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: greedy(server, p, NEW_TOKENS, logprobs=True), prompts))
    for prompt, out in zip(prompts, got, strict=True):
        assert_same_generation(out, greedy(vanilla_server, prompt, NEW_TOKENS, logprobs=True), prompt)

    lines = read_jsonl(stats_path)
    admitted = [rid for line in lines for rid in line.get("admitted_now") or ()]
    paused = [rid for line in lines for rid in line.get("paused_now") or ()]
    resumed = {rid for line in lines for rid in line.get("resumed_now") or ()}
    assert admitted, "LVF never admitted a queued prefill"
    assert paused, "no request was rotated out under a 96 token-layer budget"
    assert set(paused) <= resumed, "a paused request was never rotated back in"
    assert lines[-1]["paused"] == []
    assert not any(line["fallback"] for line in lines)
