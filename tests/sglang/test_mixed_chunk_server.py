"""SGLang's mixed chunked prefill (``--enable-mixed-chunk``) under --enable-layered-kv with KV on host.

With ``--enable-mixed-chunk`` SGLang runs a prefill chunk and the running requests' decode tokens
as one extend batch (``ForwardMode.MIXED``, ``ScheduleBatch.mix_with_running``): the layered
extend path then reads the decoding requests' offloaded layers, staged, beside the new chunk's.
SGLang mixes only batches where no request asks for logprobs (``Scheduler`` 0.5.23, "TODO: support
return_logprob + mixed chunked prefill"), so the comparison here is the final hidden state of
every token (``return_hidden_states``, fp32: ~1e-6 apart between two forwards of the same tokens,
while one perturbed page moves them by orders of magnitude more), against a vanilla twin that
mixes and chunks the same way, under SGLang's normal loop and under its overlap loop
(``--kv-overlap-schedule on``). The test-only injector records each mixed batch SGLang builds
(``KVPLANE_TEST_MIXED_FILE``) as the evidence that they ran; its fault (one offloaded layer-page
of layer 3 perturbed per step on its way through host memory) is the negative control.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from sglang_ext.settings import POOL_STATS_FILE_ENV
from sglang_ext.testing.jsonl import read_jsonl
from sglang_ext.testing.server import SGLangServer
from tests.sglang.conftest import (
    PROMPTS,
    fault_armed,
    fault_inject_path,
    running_servers,
)

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1800)]

NEW_TOKENS = 16
CHUNK = 32
CORRUPT_LAYER = 3
BUDGET_TOKENS = 1100
"""Device layer-pages (page 1 on the CPU): one layer of the 1,024-token slot space and some, so any
batch can be staged, while the eight requests' ~2,400 live layer-pages mostly sit on host."""
HIDDEN_ATOL = 1e-4
"""Largest difference of a final hidden state allowed against vanilla (fp32 noise is ~1e-6)."""
PROMPTS_MIXED = tuple(" ".join(PROMPTS[(i + j) % len(PROMPTS)] for j in range(6)) for i in range(0, 16, 2))
"""Eight prompts of six test prompts each (~40-60 tokens): two chunks each, so chunks and decodes meet."""
SHARED_FLAGS = ("--enable-mixed-chunk", "--chunked-prefill-size", str(CHUNK), "--max-total-tokens", "1024",
                "--enable-return-hidden-states")


class Pair:
    """The layered server (injector loaded) and its vanilla twin."""

    def __init__(self, layered: SGLangServer, vanilla: SGLangServer) -> None:
        self.layered, self.vanilla = layered, vanilla
        root = layered.log_path.parent
        self.mixed, self.stats, self.corrupt = root / "mixed.txt", root / "pool_stats.jsonl", root / "corrupt"


LOOPS = ("normal-loop", "overlap-loop")


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Path, launch_zygote, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Pair]]:
    """A layered server under SGLang's normal loop and one under its overlap loop
    (``--kv-overlap-schedule on``), each paired with the one vanilla twin (SGLang's default, the
    overlap loop): three servers started side by side."""
    specs = []
    for loop in LOOPS:
        root = tmp_path_factory.mktemp(f"layered-mixed-chunk-{loop}")
        env = {POOL_STATS_FILE_ENV: str(root / "pool_stats.jsonl"), "PYTHONPATH": fault_inject_path(),
               "KVPLANE_TEST_MIXED_FILE": str(root / "mixed.txt"),
               "KVPLANE_TEST_CORRUPT_LAYER": str(CORRUPT_LAYER), "KVPLANE_TEST_CORRUPT_FILE": str(root / "corrupt")}
        flags = ["--kv-overlap-schedule", "on"] if loop == "overlap-loop" else []
        specs.append((root, ["--enable-layered-kv", *flags, "--kv-gpu-budget-tokens", str(BUDGET_TOKENS),
                             *SHARED_FLAGS], env))
    specs.append((tmp_path_factory.mktemp("vanilla-mixed-chunk"), SHARED_FLAGS, None))
    with running_servers(tiny_model_dir, specs, zygote=launch_zygote) as (*layered, twin):
        yield {loop: Pair(server, twin) for loop, server in zip(LOOPS, layered, strict=True)}


@pytest.fixture(scope="module", params=LOOPS)
def pair(request: pytest.FixtureRequest, servers: dict[str, Pair]) -> Pair:
    """The pair under SGLang's normal loop, then under its overlap loop."""
    return servers[request.param]


def _generate(server: SGLangServer, prompt: str) -> dict:
    return server.post("/generate", {"text": prompt, "return_hidden_states": True,
                                     "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0.0}})


def _concurrent(server: SGLangServer) -> list[dict]:
    """The eight prompts at once, from an empty prefix cache (so every prompt is prefilled in chunks)."""
    server.flush_cache()
    with ThreadPoolExecutor(len(PROMPTS_MIXED)) as pool:
        return list(pool.map(lambda p: _generate(server, p), PROMPTS_MIXED))


def _hidden(response: dict) -> np.ndarray:
    """The final hidden state that produced each output token: the last row of each entry (the
    first holds the rows of the prompt's last chunk, which differs with the chunking; a token
    decoded inside a MIXED batch comes as a one-row matrix, one decoded alone as a vector)."""
    entries = response["meta_info"]["hidden_states"]
    return np.stack([np.asarray(h, dtype=np.float64).reshape(-1, np.shape(h)[-1])[-1] for h in entries])


def _worst(got: list[dict], want: list[dict]) -> float:
    """Largest hidden-state difference over the requests (inf where the tokens differ)."""
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        if g["output_ids"] != w["output_ids"]:
            return float("inf")
        a, b = _hidden(g), _hidden(w)
        assert a.shape == b.shape and a.shape[0] == NEW_TOKENS
        worst = max(worst, float(np.abs(a - b).max()))
    return worst


@pytest.fixture(scope="module")
def reference(pair: Pair) -> list[dict]:
    return _concurrent(pair.vanilla)


def test_mixed_batches_with_kv_on_host_match_vanilla(pair, reference):
    """Concurrent requests, prefill chunks mixed with decodes in MIXED forwards while most layer-KV
    sits on host: every token and every final hidden state equal vanilla's."""
    mixed_before = len(pair.mixed.read_text().splitlines()) if pair.mixed.exists() else 0
    before = len(read_jsonl(pair.stats)) if pair.stats.exists() else 0
    got = _concurrent(pair.layered)
    assert _worst(got, reference) <= HIDDEN_ATOL
    mixed = len(pair.mixed.read_text().splitlines()) - mixed_before if pair.mixed.exists() else 0
    assert mixed >= 4, f"{mixed} mixed batches ran"
    steps = read_jsonl(pair.stats)[before:]
    assert steps and max(s["host_layer_pages"] for s in steps) > 0, "nothing was offloaded"
    assert steps[-1]["fetched_layer_pages_total"] > steps[0]["fetched_layer_pages_total"]


def test_negative_control_a_corrupted_offloaded_page_fails_the_comparison(pair, reference):
    """With the fault injector armed, the same concurrent run no longer matches vanilla (so the
    comparison above can fail: measured 4e-3 to 8e-3 apart, or other tokens, against 0 to 1e-6
    disarmed); disarmed, it matches again."""
    with fault_armed(pair.layered, pair.corrupt):
        assert _worst(_concurrent(pair.layered), reference) > HIDDEN_ATOL
    assert _worst(_concurrent(pair.layered), reference) <= HIDDEN_ATOL

