"""A slot space beyond the device, in real SGLang servers (``sglang_ext.capacity_hooks``).

On a GPU SGLang sizes its KV slot space from a memory profile -- the device bytes left after the
weights, over one token's bytes at every layer -- and caps ``--max-total-tokens`` at it. The
layered pool keeps every layer of every slot on the host, so under ``--enable-layered-kv`` the
cap is lifted: the slot space is what was asked for, and the device keeps the profiled tokens'
worth of layer-pages. The CPU profile reads the host's free memory, so the test injector makes the
profile find room for :data:`PROFILE_TOKENS` tokens, as on a small GPU
(``KVPLANE_TEST_KV_PROFILE_BYTES``, ``tests/sglang/fault_inject/sitecustomize.py``).

Two servers, both with that profile and ``--max-total-tokens 4096`` (``CPU_ARGS``): stock SGLang
(kvplane installed, flag off: the negative control, which keeps the profile's slot space) and
the layered pool. The layered one then serves eight concurrent generations whose KV exceeds what
the profile fits, token-identical to the session's vanilla server.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from sglang_ext.settings import STATS_FILE_ENV
from sglang_ext.testing.jsonl import read_jsonl
from sglang_ext.testing.server import ServerError, SGLangServer
from tests.sglang.conftest import PROMPTS, concurrent_as_vanilla, fault_inject_path, running_servers

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1800)]

PROFILE_TOKENS = 1280
"""Tokens (at every layer) the injected memory profile fits: room for one layer of the 4096-token
slot space and its page maps (the layered pool refuses less without a budget)."""
SLOT_TOKENS = 4096
"""``--max-total-tokens`` of both servers (``CPU_ARGS``)."""


def token_bytes(model_dir: Path) -> int:
    """One token's KV bytes at every layer of the tiny model, served in float32."""
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 4


@pytest.fixture(scope="module")
def profiled_servers(tiny_model_dir, launch_zygote, tmp_path_factory) -> Iterator[tuple[SGLangServer, SGLangServer, Path]]:
    """(stock, layered, the layered server's stats file), both profiled at :data:`PROFILE_TOKENS`."""
    root = tmp_path_factory.mktemp("slot-space")
    stats = root / "stats.jsonl"
    env = {"PYTHONPATH": fault_inject_path(),
           "KVPLANE_TEST_KV_PROFILE_BYTES": str(PROFILE_TOKENS * token_bytes(tiny_model_dir))}
    (root / "stock").mkdir()
    (root / "layered").mkdir()
    specs = [(root / "stock", [], env),
             (root / "layered", ["--enable-layered-kv"], {**env, STATS_FILE_ENV: str(stats)})]
    with running_servers(tiny_model_dir, specs, zygote=launch_zygote) as (stock, layered):
        yield stock, layered, stats


def started(server: SGLangServer, name: str) -> int:
    """A figure of the scheduler's start line (``max_total_num_tokens=``, ``max_running_requests=``)."""
    (value,) = re.findall(rf"\b{name}=(\d+)", server.log_path.read_text())
    return int(value)


def pool_line(server: SGLangServer) -> dict[str, int]:
    """The integer fields of the layered pool's ``layered_kv_pool_created`` log line."""
    created = re.search(r"layered_kv_pool_created.*", server.log_path.read_text())
    assert created is not None, "no pool line"
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)\b", created.group(0))}


def test_the_layered_slot_space_is_what_was_asked_beyond_the_profile(profiled_servers, tiny_model_dir):
    """Stock SGLang keeps the profile's slot space (the control: the injected profile binds, and
    ``--max-total-tokens`` above it is ignored, with SGLang's warning); the layered pool's is
    ``--max-total-tokens``, its request count stays the profile's, and its device pages are the
    profile's tokens at every layer less the page map's device mirror (4 bytes per layer-page of
    the slot space)."""
    stock, layered, _ = profiled_servers
    assert started(stock, "max_total_num_tokens") == PROFILE_TOKENS
    assert "larger than the profiled value" in stock.log_path.read_text()
    assert started(layered, "max_total_num_tokens") == SLOT_TOKENS
    # the request count (and the request table SGLang sizes with it) stays the profile's: without
    # the hook it would be SGLang's count for 4096 tokens, min(2048, 4096 // 2) = 2048
    assert started(layered, "max_running_requests") == started(stock, "max_running_requests") < 2048
    log = layered.log_path.read_text()
    assert f"slot_tokens={SLOT_TOKENS}" in log and f"device_tokens_all_layers={PROFILE_TOKENS}" in log
    assert "layered_kv_slot_space_on_device" not in log and "layered_kv_budget_below_one_layer" not in log
    fields = pool_line(layered)
    layers, page = fields["layers"], fields["page_size"]
    logical = -(-(SLOT_TOKENS + page) // page)
    layer_page_bytes = token_bytes(tiny_model_dir) // layers * page
    mirror = -(-(layers * logical * 4) // layer_page_bytes)
    assert fields["logical_pages"] == logical
    assert fields["device_pages"] == PROFILE_TOKENS // page * layers - mirror
    assert fields["profiled_device_tokens"] == PROFILE_TOKENS


def test_more_kv_than_the_profile_fits_is_served_token_identical(profiled_servers, vanilla_server):
    """Eight concurrent 250-token generations hold more KV than the profile fits on the device
    (more live layer-pages than its device pages, some only on the host at once); every one ends
    by length, token-identical (tokens and logprobs) to vanilla SGLang's."""
    _, layered, stats_path = profiled_servers
    concurrent_as_vanilla(layered, vanilla_server, PROMPTS[:8], 250)
    pools = [line["pool"] for line in read_jsonl(stats_path) if line.get("pool")]
    assert pools, "no stats line with the pool"
    fields = pool_line(layered)
    device_total = pools[-1]["device_pages_total"]
    assert device_total < PROFILE_TOKENS // fields["page_size"] * fields["layers"]  # within the profile
    peak = max(p["live_layer_pages"] for p in pools)
    assert peak > device_total, f"the live KV ({peak} layer-pages) never exceeded the device ({device_total})"
    assert max(p["host_layer_pages"] for p in pools) > 0, "no live layer-page was only on the host"


def test_a_device_that_cannot_stage_one_layer_of_the_slot_space_is_refused_at_start(
        tiny_model_dir, launch_zygote, tmp_path_factory):
    """A profile of 600 tokens (2,400 layer-pages, 257 of them the page map's) cannot stage one
    layer of the 4096-token slot space (4,097 pages): the scheduler stops at start with the
    figures, the largest slot space that fits, and the flags to change; nothing is served from a
    pool every full batch would overflow. (The control: the fixture's 1,280-token profile starts.)"""
    root = tmp_path_factory.mktemp("slot-space-refused")
    env = {"PYTHONPATH": fault_inject_path(), "KVPLANE_TEST_KV_PROFILE_BYTES": str(600 * token_bytes(tiny_model_dir))}
    with pytest.raises(ServerError), running_servers(tiny_model_dir, [(root, ["--enable-layered-kv"], env)],
                                                     zygote=launch_zygote):
        pass
    log = (root / "server.log").read_text()
    assert "2143 device pages for the 4097 pages of one layer of the slot space" in log, log[-3000:]
    most = int(re.search(r"lower --max-total-tokens to at most (\d+)", log).group(1))
    # the largest slot space whose one layer fits beside its page map: 2,400 - ceil(16 (t+1) / 256) >= t + 1
    assert most == max(t for t in range(1, 2400) if 2400 - -(-16 * (t + 1) // 256) >= t + 1), most
    assert "--mem-fraction-static" in log and "--kv-gpu-budget-tokens" in log
