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

from sglang_ext.testing.server import SGLangServer
from tests.sglang.conftest import (
    PROMPTS,
    assert_matches_with_kv_on_host,
    fault_armed,
    offload_pair,
    undetected,
)

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1800)]  # two server start-ups on a loaded host

BF16 = ["--dtype", "bfloat16"]
NEW_TOKENS = 8
PROMPT_COUNT = 8


@pytest.fixture(scope="module")
def bf16_servers(tiny_model_dir, launch_zygote, tmp_path_factory) -> Iterator[tuple[SGLangServer, SGLangServer, Path, Path]]:
    """(vanilla, layered, the layered server's stats file, its fault flag file), all in bf16."""
    roots = (tmp_path_factory.mktemp("bf16-vanilla"), tmp_path_factory.mktemp("bf16-layered"))
    with offload_pair(tiny_model_dir, launch_zygote, roots, BF16) as servers:
        yield servers


def test_bf16_layered_generation_matches_vanilla_with_kv_on_host(bf16_servers):
    """Greedy tokens and per-token logprobs match vanilla's in bf16 while at least half of the
    live layer-KV sits on host, every step staged; the servers did run in bf16."""
    vanilla, layered, stats, _ = bf16_servers
    for server in (vanilla, layered):  # SGLang's own line about the KV pool it allocated
        assert "KV Cache is allocated. dtype: torch.bfloat16" in server.log_path.read_text(), server.log_path
    assert "layered_kv_pool_created" in layered.log_path.read_text()
    steps = assert_matches_with_kv_on_host(vanilla, layered, stats, PROMPTS[:PROMPT_COUNT], NEW_TOKENS)
    assert steps[-1]["overflow_steps_total"] == 0


def test_bf16_negative_control_a_corrupted_offloaded_page_fails_the_comparison(bf16_servers):
    """Negative control: one offloaded bf16 layer-page per step perturbed on its way through host
    memory moves the logprobs past the tolerance (on the layered server, the fault armed); once
    disarmed and the cache flushed, the same server matches again."""
    vanilla, layered, _, flag = bf16_servers
    with fault_armed(layered, flag):
        assert undetected(layered, vanilla, PROMPTS[:4], NEW_TOKENS) == 0
    assert undetected(layered, vanilla, PROMPTS[:1], NEW_TOKENS) == 1  # disarmed: the same server matches again
