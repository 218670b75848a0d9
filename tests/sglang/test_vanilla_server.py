"""Real SGLang 0.5.23 on CPU with kvplane installed but --enable-layered-kv off.

The plugin is always loaded through its entry point; that this server starts at all on
a CPU-only host is the plugin's doing (it switches the rotary layer to its CPU path).
With the flag off nothing else of kvplane may be swapped in.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.sglang.conftest import greedy

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1800)]  # server start-ups on a loaded host

PROMPT = "The quick brown fox jumps over the lazy dog. A cache keeps"


def test_greedy_output_is_deterministic(vanilla_server):
    """The same greedy request twice yields the same tokens (second one hits the prefix cache)."""
    first = greedy(vanilla_server, PROMPT)
    second = greedy(vanilla_server, PROMPT)
    assert first["output_ids"] == second["output_ids"]
    assert len(first["output_ids"]) == 6
    assert second["meta_info"]["cached_tokens"] > 0


def test_flag_off_swaps_in_nothing(vanilla_server):
    """Flag off: default tree cache and backend, no radix backend, no kvplane env exported."""
    info = json.loads(urllib.request.urlopen(vanilla_server.base_url + "/server_info").read())
    assert info["radix_cache_backend"] is None
    assert info["attention_backend"] == "torch_native"
    log = vanilla_server.log_path.read_text()
    assert "Tree cache initialized: source=default impl=UnifiedRadixCache" in log
    assert "LayeredRadixCache" not in log


def test_completions_non_streaming(vanilla_server):
    """/v1/completions returns text and usage for a greedy request."""
    out = vanilla_server.post(
        "/v1/completions", {"model": "m", "prompt": PROMPT, "max_tokens": 5, "temperature": 0}
    )
    assert out["object"] == "text_completion"
    assert out["usage"]["completion_tokens"] == 5
    assert out["choices"][0]["finish_reason"] == "length"


def test_completions_streaming_matches_non_streaming(vanilla_server):
    """Streamed /v1/completions chunks concatenate to the non-streamed text."""
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 5, "temperature": 0}
    whole = vanilla_server.post("/v1/completions", body)["choices"][0]["text"]
    chunks = vanilla_server.stream("/v1/completions", body)
    assert len(chunks) >= 2
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole


def test_chat_completions_streaming_and_not(vanilla_server):
    """/v1/chat/completions works streamed and not, with the same greedy content."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 5,
        "temperature": 0,
    }
    whole = vanilla_server.post("/v1/chat/completions", body)
    assert whole["choices"][0]["message"]["role"] == "assistant"
    chunks = vanilla_server.stream("/v1/chat/completions", body)
    streamed = "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
    )
    assert streamed == whole["choices"][0]["message"]["content"]
