"""SGLang's mixed chunked prefill (``--enable-mixed-chunk``) under --enable-layered-kv with KV on host.

With ``--enable-mixed-chunk`` SGLang runs a prefill chunk and the running requests' decode tokens
as one extend batch (``ScheduleBatch.mix_with_running``): the layered extend path then reads the
decoding requests' offloaded layers, staged, beside the new chunk's. Nothing else in the suite
mixes them (the other servers run without the flag or send one request at a time), so this
module sends concurrent requests to a server that chunks prefills at 32 tokens and holds a third
of its layer-KV on the device, and compares every request with the session's vanilla server
(which neither mixes nor chunks: greedy tokens and fp32 logprobs are batch-invariant to ~1e-6,
far inside :data:`~tests.sglang.conftest.LOGPROB_ATOL`). Its negative control arms the test-only
fault injector (one offloaded layer-page of layer 3 perturbed per step on its way through host
memory), and the same comparison fails.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sglang_ext.settings import POOL_STATS_FILE_ENV
from sglang_ext.testing.jsonl import read_jsonl
from sglang_ext.testing.server import SGLangServer
from tests.sglang.conftest import (
    FAULT_INJECT_DIR,
    PROMPTS,
    assert_same_generation,
    fault_armed,
    greedy,
    running_server,
)

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1800)]

NEW_TOKENS = 16
CHUNK = 32
CORRUPT_LAYER = 3
BUDGET_TOKENS = 1100
"""Device layer-pages (page 1 on the CPU): one layer of the 1,024-token slot space and some, so any
batch can be staged, while the eight requests' ~2,400 live layer-pages mostly sit on host."""
PROMPTS_MIXED = tuple(" ".join(PROMPTS[(i + j) % len(PROMPTS)] for j in range(6)) for i in range(0, 16, 2))
"""Eight prompts of six test prompts each (~40-60 tokens): two chunks each, so chunks and decodes meet."""

MIXED_PREFILL = re.compile(r"Prefill batch.*#running-req: ([1-9]\d*)")
"""SGLang's log line of a prefill batch built while requests were decoding: with
``--enable-mixed-chunk`` those requests ran in it (``mix_with_running``)."""


@pytest.fixture(scope="module")
def mixed(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangServer]:
    root = tmp_path_factory.mktemp("layered-mixed-chunk")
    flags = ["--enable-layered-kv", "--enable-mixed-chunk", "--chunked-prefill-size", str(CHUNK),
             "--max-total-tokens", "1024", "--kv-gpu-budget-tokens", str(BUDGET_TOKENS)]
    env = {POOL_STATS_FILE_ENV: str(root / "pool_stats.jsonl"), "PYTHONPATH": str(FAULT_INJECT_DIR),
           "KVPLANE_TEST_CORRUPT_LAYER": str(CORRUPT_LAYER), "KVPLANE_TEST_CORRUPT_FILE": str(root / "corrupt")}
    with running_server(tiny_model_dir, root, flags, env) as server:
        yield server


def _concurrent(server: SGLangServer) -> list[dict]:
    with ThreadPoolExecutor(len(PROMPTS_MIXED)) as pool:
        return list(pool.map(lambda p: greedy(server, p, NEW_TOKENS, logprobs=True), PROMPTS_MIXED))


def _mismatches(got: list[dict], want: list[dict]) -> int:
    bad = 0
    for prompt, g, w in zip(PROMPTS_MIXED, got, want, strict=True):
        try:
            assert_same_generation(g, w, prompt)
        except AssertionError:
            bad += 1
    return bad


@pytest.fixture(scope="module")
def reference(vanilla_server: SGLangServer) -> list[dict]:
    return [greedy(vanilla_server, p, NEW_TOKENS, logprobs=True) for p in PROMPTS_MIXED]


def test_mixed_batches_with_kv_on_host_match_vanilla(mixed, reference):
    """Concurrent requests, prefill chunks mixed with running decodes while most layer-KV sits on
    host: every request's tokens and per-token logprobs equal vanilla's."""
    log_before = len(mixed.log_path.read_text())
    stats_path = mixed.log_path.parent / "pool_stats.jsonl"
    before = len(read_jsonl(stats_path)) if stats_path.exists() else 0
    got = _concurrent(mixed)
    for prompt, g, w in zip(PROMPTS_MIXED, got, reference, strict=True):
        assert_same_generation(g, w, prompt)
    assert MIXED_PREFILL.search(mixed.log_path.read_text()[log_before:]), "no prefill chunk ran beside decodes"
    steps = read_jsonl(stats_path)[before:]
    assert max(s["host_layer_pages"] for s in steps) > 0, "nothing was offloaded"
    assert steps[-1]["fetched_layer_pages_total"] > steps[0]["fetched_layer_pages_total"]


def test_negative_control_a_corrupted_offloaded_page_fails_the_comparison(mixed, reference):
    """With the fault injector armed, the same concurrent run no longer matches vanilla (so the
    comparison above can fail: the requests that read a perturbed page differ, 1 of the 8 when
    measured); disarmed, with the cache flushed, it matches again."""
    with fault_armed(mixed, mixed.log_path.parent / "corrupt"):
        assert _mismatches(_concurrent(mixed), reference) >= 1
    assert _mismatches(_concurrent(mixed), reference) == 0
