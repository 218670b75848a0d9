"""SGLang serving in bfloat16 (the dtype GPU deployments serve in) with most layer-KV on host.

The other server tests serve the tiny fp32 checkpoint in float32 (``conftest.TEST_DTYPE_ARGS``).
Here two servers start side by side with ``--dtype bfloat16``: vanilla, and the layered pool at
``test_layered_offload_server``'s budget (49 token-layers: at least half of a 16-token request's
layer-KV on host) with the test-only fault injector loaded, which perturbs one written-back page
of layer 3 after every step while the negative control arms it. The KV pool, the pinned host pool
and every copy between them then hold bf16; greedy tokens and per-token logprobs must match
vanilla's, and must not while the fault is armed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sglang_ext.settings import POOL_STATS_FILE_ENV
from sglang_ext.testing.jsonl import read_jsonl
from sglang_ext.testing.server import SGLangServer
from tests.sglang.conftest import (
    PROMPTS,
    assert_same_generation,
    fault_armed,
    fault_inject_path,
    greedy,
    running_servers,
    undetected,
)

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1800)]  # two server start-ups on a loaded host

BF16 = ["--dtype", "bfloat16"]
LAYERED = ["--enable-layered-kv", "--disable-overlap-schedule", "--kv-gpu-budget-tokens", "49",
           "--max-total-tokens", "48"]
"""As ``test_layered_offload_server``: one layer of the 48-token slot space plus the padding page."""
NEW_TOKENS = 8
PROMPT_COUNT = 8


@pytest.fixture(scope="module")
def bf16_servers(tiny_model_dir, launch_zygote, tmp_path_factory) -> Iterator[tuple[SGLangServer, SGLangServer, Path, Path]]:
    """(vanilla, layered, the layered server's stats file, its fault flag file), all in bf16."""
    roots = [tmp_path_factory.mktemp(name) for name in ("bf16-vanilla", "bf16-layered")]
    stats, flag = roots[1] / "pool_stats.jsonl", roots[1] / "corrupt"
    env = {POOL_STATS_FILE_ENV: str(stats), "PYTHONPATH": fault_inject_path(),
           "KVPLANE_TEST_CORRUPT_LAYER": "3", "KVPLANE_TEST_CORRUPT_FILE": str(flag)}
    specs = [(roots[0], BF16, None), (roots[1], BF16 + LAYERED, env)]
    with running_servers(tiny_model_dir, specs, zygote=launch_zygote) as (vanilla, layered):
        yield vanilla, layered, stats, flag


def test_bf16_layered_generation_matches_vanilla_with_kv_on_host(bf16_servers):
    """Greedy tokens and per-token logprobs match vanilla's in bf16 while at least half of the
    live layer-KV sits on host, every step staged; the servers did run in bf16."""
    vanilla, layered, stats, _ = bf16_servers
    for server in (vanilla, layered):  # SGLang's own line about the KV pool it allocated
        assert "KV Cache is allocated. dtype: torch.bfloat16" in server.log_path.read_text(), server.log_path
    assert "layered_kv_pool_created" in layered.log_path.read_text()
    before = len(read_jsonl(stats)) if stats.exists() else 0
    for prompt in PROMPTS[:PROMPT_COUNT]:
        got = greedy(layered, prompt, NEW_TOKENS, logprobs=True)
        want = greedy(vanilla, prompt, NEW_TOKENS, logprobs=True)
        assert_same_generation(got, want, prompt)
    steps = [s for s in read_jsonl(stats)[before:] if s["live_layer_pages"] > 0]
    assert len(steps) >= PROMPT_COUNT * NEW_TOKENS // 2
    live = sum(s["live_layer_pages"] for s in steps)
    assert sum(s["host_layer_pages"] for s in steps) / live >= 0.5
    assert steps[-1]["overflow_steps_total"] == 0
    assert steps[-1]["fetched_layer_pages_total"] > steps[0]["fetched_layer_pages_total"]


def test_bf16_negative_control_a_corrupted_offloaded_page_fails_the_comparison(bf16_servers):
    """Negative control: one offloaded bf16 layer-page per step perturbed on its way through host
    memory moves the logprobs past the tolerance (on the layered server, the fault armed); once
    disarmed and the cache flushed, the same server matches again."""
    vanilla, layered, _, flag = bf16_servers
    with fault_armed(layered, flag):
        assert undetected(layered, vanilla, PROMPTS[:4], NEW_TOKENS) == 0
    assert undetected(layered, vanilla, PROMPTS[:1], NEW_TOKENS) == 1  # disarmed: the same server matches again
