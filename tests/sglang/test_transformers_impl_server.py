"""SGLang's Transformers backend (``--model-impl transformers``) served with most layer-KV on host.

There SGLang runs the Hugging Face model's own decoder layers, called as Hugging Face calls them,
with SGLang's attention inside. Under ``--enable-layered-kv`` the server used to start, then die on
its first forward: eLLM's recompute cut wrapped every decoder layer for SGLang's layer call
(``RecomputeForward.wrap_layers``) and the Hugging Face call raised TypeError (flag audit, session
81). Such layers are no longer wrapped and recompute is not offered for them
(``RecomputeForward.layers_fit``). Two servers start side by side with ``--model-impl
transformers``: vanilla, and the layered pool at ``test_layered_offload_server``'s budget (at least
half of the live layer-KV on host) with the test-only fault injector loaded. Greedy tokens and
per-token logprobs must match vanilla's, and must not while the fault is armed. There
``--kv-recompute-ratio`` would do nothing, so a launch with it is refused, naming the flag.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sglang_ext.testing.server import ServerError, SGLangServer
from tests.sglang.conftest import (
    OFFLOAD_LAYERED,
    PROMPTS,
    assert_matches_with_kv_on_host,
    fault_armed,
    offload_pair,
    running_servers,
    undetected,
)

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1800)]  # two server start-ups on a loaded host

TRANSFORMERS = ["--model-impl", "transformers"]
NEW_TOKENS = 8
PROMPT_COUNT = 6


@pytest.fixture(scope="module")
def transformers_servers(tiny_model_dir, launch_zygote,
                         tmp_path_factory) -> Iterator[tuple[SGLangServer, SGLangServer, Path, Path]]:
    """(vanilla, layered, the layered server's stats file, its fault flag file), both on SGLang's
    Transformers backend."""
    roots = (tmp_path_factory.mktemp("hf-vanilla"), tmp_path_factory.mktemp("hf-layered"))
    with offload_pair(tiny_model_dir, launch_zygote, roots, TRANSFORMERS) as servers:
        yield servers


def test_transformers_backend_layered_generation_matches_vanilla_with_kv_on_host(transformers_servers):
    """Greedy tokens and per-token logprobs match vanilla's on the Transformers backend while at
    least half of the live layer-KV sits on host; both servers did run that backend."""
    vanilla, layered, stats, _ = transformers_servers
    for server in (vanilla, layered):  # SGLang's own line naming the backend it loaded
        assert "TransformersForCausalLM" in server.log_path.read_text(), server.log_path
    assert "layered_kv_pool_created" in layered.log_path.read_text()
    assert_matches_with_kv_on_host(vanilla, layered, stats, PROMPTS[:PROMPT_COUNT], NEW_TOKENS)


def test_transformers_backend_negative_control_a_corrupted_offloaded_page_fails_the_comparison(
        transformers_servers):
    """Negative control: one offloaded layer-page per step perturbed on its way through host
    memory moves the logprobs past the tolerance; once disarmed and the cache flushed, the same
    server matches again."""
    vanilla, layered, _, flag = transformers_servers
    with fault_armed(layered, flag):
        assert undetected(layered, vanilla, PROMPTS[:4], NEW_TOKENS) == 0
    assert undetected(layered, vanilla, PROMPTS[:1], NEW_TOKENS) == 1


def test_transformers_backend_refuses_the_recompute_flag_at_start(tiny_model_dir, launch_zygote, tmp_path):
    """``--kv-recompute-ratio`` on the Transformers backend would do nothing (no recompute rows
    can run through Hugging Face layers; accepted before and silently ignored): the server does
    not start, and its log names the flag, the reason and the way out. The same flag on SGLang's
    own Llama is served (``test_recompute_server.py``, the control)."""
    spec = (tmp_path, [*TRANSFORMERS, *OFFLOAD_LAYERED, "--kv-recompute-ratio", "0.5"], None)
    with pytest.raises(ServerError), running_servers(tiny_model_dir, [spec], zygote=launch_zygote):
        pass
    log = (tmp_path / "server.log").read_text()
    assert "--kv-recompute-ratio=0.5: eLLM's recompute cannot run in TransformersForCausalLM's forward" in log
    assert "--model-impl transformers" in log and "drop the flag" in log
