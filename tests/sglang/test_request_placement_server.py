"""Per-request placement info (``custom_params.kvplane_return_placement``) from a real layered
SGLang server: ``meta_info["kvplane"]`` on ``/generate``, ``sglext.kvplane`` on the OpenAI
endpoints, streaming and not, only when asked; its figures agree with the server's log and stats.

Scenario: two module-scoped layered servers. ``pressure`` has a device KV budget of 96
token-layers and a quick starvation guard (as ``test_pause_server.py``): the controller offloads
layers and pauses requests. ``relaxed`` has SGLang's whole pool as budget (nothing has to move).
Both write the per-step stats line (``$KVPLANE_STATS_FILE``) and the pool's stats line
(``$KVPLANE_POOL_STATS_FILE``).
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from sglang_ext.placement_record import RESULT_FIELDS
from sglang_ext.request_placement import KEY, PARAM
from sglang_ext.request_slo import SLO_PARAM
from sglang_ext.settings import POOL_STATS_FILE_ENV, STATS_FILE_ENV
from sglang_ext.testing.jsonl import read_jsonl, read_jsonl_settled
from sglang_ext.testing.server import SGLangServer
from tests.sglang.conftest import PROMPTS, running_servers
from tests.sglang.request_kinds import in_json

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1800)]  # two server start-ups on a loaded host

ASK = {PARAM: True}
MAX_NEW_TOKENS = 12
LONG_PROMPT = " ".join(PROMPTS[:3])
"""About 25 tokens: alone it needs more layer-pages than the pressure server's 96."""


class Served:
    """A server and its two stats files."""

    def __init__(self, server: SGLangServer, stats: Path, pool_stats: Path) -> None:
        self.server, self.stats_path, self.pool_stats_path = server, stats, pool_stats

    def stats(self) -> list[dict]:
        return _lines(self.stats_path)

    def pool_stats(self) -> list[dict]:
        return _lines(self.pool_stats_path)

    def generate(self, prompt: str, custom: dict | None = None, max_new_tokens: int = MAX_NEW_TOKENS,
                 stream: bool = False) -> Any:
        params: dict = {"max_new_tokens": max_new_tokens, "temperature": 0.0}
        if custom is not None:
            params["custom_params"] = custom
        payload = {"text": prompt, "sampling_params": params}
        return self.server.stream("/generate", payload) if stream else self.server.post("/generate", payload)


def _lines(path: Path) -> list[dict]:
    return read_jsonl(path)


def _spec(root: Path, flags: list[str]) -> tuple[Path, list[str], dict[str, str]]:
    env = {STATS_FILE_ENV: str(root / "stats.jsonl"), POOL_STATS_FILE_ENV: str(root / "pool_stats.jsonl")}
    return root, ["--enable-layered-kv", *flags], env


@pytest.fixture(scope="module")
def placement_servers(tiny_model_dir, launch_zygote, tmp_path_factory) -> Iterator[tuple[Served, Served]]:
    """:func:`pressure` and :func:`relaxed`, started side by side."""
    proot, rroot = tmp_path_factory.mktemp("placement-pressure"), tmp_path_factory.mktemp("placement-relaxed")
    policy = proot / "policy.json"
    policy.write_text(json.dumps({"max_paused_steps": 6, "window_min": 2, "window_max": 4}))
    # SGLang sizes CPU memory off what is free now; the shared host is often busy.
    pressure_flags = ["--kv-policy", str(policy), "--kv-gpu-budget-tokens", "96", "--mem-fraction-static", "0.3"]
    # pacing on (not the default): the streamed test reads the pacer's deposit
    relaxed_flags = ["--kv-pacing", "on"]
    specs = [_spec(proot, pressure_flags), _spec(rroot, relaxed_flags)]
    with running_servers(tiny_model_dir, specs, zygote=launch_zygote) as (p, r):
        yield (Served(p, proot / "stats.jsonl", proot / "pool_stats.jsonl"),
               Served(r, rroot / "stats.jsonl", rroot / "pool_stats.jsonl"))


@pytest.fixture(scope="module")
def pressure(placement_servers) -> Served:
    return placement_servers[0]


@pytest.fixture(scope="module")
def relaxed(placement_servers) -> Served:
    return placement_servers[1]


def _paused_in_log(log: str) -> dict[str, int]:
    """Pauses per request id from the scheduler's ``requests_paused rids=[...]`` log lines."""
    counts: dict[str, int] = {}
    for line in log.splitlines():
        if "requests_paused" in line:
            for rid in re.findall(r"'([0-9a-f]{32})'", line.split("rids=", 1)[1]):
                counts[rid] = counts.get(rid, 0) + 1
    return counts


def test_only_requests_that_ask_get_the_info_and_it_matches_the_log_and_stats(pressure):
    """Scenario: the 20 prompts at once, every other one asking. The askers get ``meta_info
    ["kvplane"]`` with every field, the others none (negative control, in the same batches). Under
    this budget some askers were paused and had layers offloaded; each asker's pauses equal its
    ``requests_paused`` log lines, its paused steps the stats lines listing it paused, and its
    ``layers_offloaded_max`` is at least the most host layers any stats line shows for it."""
    start = len(pressure.stats())
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        outs = list(pool.map(lambda i: pressure.generate(PROMPTS[i], ASK if i % 2 == 0 else None), range(len(PROMPTS))))
    asked = {out["meta_info"]["id"]: out["meta_info"][KEY] for i, out in enumerate(outs) if i % 2 == 0}
    assert all(KEY not in out["meta_info"] for i, out in enumerate(outs) if i % 2 == 1)
    assert all(tuple(info) == RESULT_FIELDS for info in asked.values())

    lines = read_jsonl_settled(pressure.stats_path, start)  # the last step's line follows the responses
    log_pauses = _paused_in_log(pressure.server.log_path.read_text())
    layers = lines[0]["layers"]
    for rid, info in asked.items():
        assert info["layers"] == layers and 0 <= info["layers_offloaded"] <= info["layers_offloaded_max"] <= layers
        assert info["pauses"] == log_pauses.get(rid, 0), rid
        assert info["paused_steps"] == sum(rid in line["paused"] for line in lines), rid
        shown = [layers - line["gpu_layers"][rid] for line in lines if rid in line["gpu_layers"]]
        assert info["layers_offloaded_max"] >= max(shown, default=0), (rid, shown)
        assert 0.0 <= info["host_fraction"] <= 1.0
        assert info["slo_tbt_ms"] == 200.0 and info["deposit_source"] == "controller"
    assert sum(info["pauses"] for info in asked.values()) >= 1, "no asker was paused: no pressure"
    assert max(info["layers_offloaded_max"] for info in asked.values()) >= 1


def test_a_lone_request_reports_the_pools_host_fraction_and_a_relaxed_server_zero(pressure, relaxed):
    """A long request alone: its host fraction is the pool's at its last step (only its KV was
    live) and layers were offloaded. The same request on the relaxed server: 0 layers offloaded,
    host fraction 0, no pause (negative control)."""
    before = len(pressure.pool_stats())
    info = pressure.generate(LONG_PROMPT, ASK, max_new_tokens=6)["meta_info"][KEY]
    last = pressure.pool_stats()[before:][-1]
    assert last["live_requests"] == 1 and info["host_fraction"] == pytest.approx(last["host_fraction"], abs=1e-6)
    assert info["layers_offloaded"] >= 1 and info["host_fraction"] > 0.0
    calm = relaxed.generate(LONG_PROMPT, ASK, max_new_tokens=6)["meta_info"][KEY]
    assert (calm["layers_offloaded"], calm["layers_offloaded_max"], calm["host_fraction"], calm["pauses"]) == (0, 0, 0.0, 0)


def test_streamed_generate_carries_it_on_the_last_chunk_with_the_pacers_deposit(relaxed):
    """A paced ``/generate`` stream (``--kv-pacing on`` on this server) that asked: only the final
    chunk has the info, its deposit is the pacer's; a stream that did not ask has none."""
    chunks = relaxed.generate(PROMPTS[1], ASK, max_new_tokens=6, stream=True)
    assert [KEY in c["meta_info"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    info = chunks[-1]["meta_info"][KEY]
    assert info["deposit_source"] == "pacer" and 0 <= info["deposit_tokens"] <= 5
    assert not any(KEY in c["meta_info"] for c in relaxed.generate(PROMPTS[1], None, max_new_tokens=6, stream=True))


@pytest.mark.parametrize("chat", [False, True])
def test_openai_endpoints_return_sglext_kvplane_only_when_asked(relaxed, chat):
    """``/v1/completions`` and ``/v1/chat/completions``, streaming and not: ``sglext.kvplane``
    with every field when ``custom_params`` ask; no ``sglext`` at all otherwise."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict = {"model": "m", "max_tokens": 4, "temperature": 0}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "Once upon a time"})
    plain = relaxed.server.post(path, body)
    asked = relaxed.server.post(path, {**body, "custom_params": ASK})
    assert "sglext" not in plain and tuple(asked["sglext"][KEY]) == RESULT_FIELDS
    assert asked["sglext"][KEY]["deposit_source"] == "controller"
    streamed = relaxed.server.stream(path, {**body, "custom_params": ASK})
    extensions = [c for c in streamed if "sglext" in c]
    assert len(extensions) == 1 and extensions[0]["choices"] == [] and extensions[0] is streamed[-1]
    assert tuple(extensions[0]["sglext"][KEY]) == RESULT_FIELDS
    assert extensions[0]["sglext"][KEY]["deposit_source"] == "pacer"
    assert not any("sglext" in c for c in relaxed.server.stream(path, body))


def _status(server: SGLangServer, path: str, body: dict) -> tuple[int, str]:
    """POST ``body`` as is (streaming or not); the HTTP status and the body's first 2 KB."""
    req = urllib.request.Request(server.base_url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read(2048).decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(2048).decode(errors="replace")


@pytest.mark.parametrize(("path", "stream"), [("/generate", False), ("/generate", True),
                                              ("/v1/completions", False), ("/v1/chat/completions", True)])
def test_a_bad_opt_in_value_is_http_400_naming_the_field(relaxed, path, stream):
    """``"kvplane_return_placement": "yes"`` is refused with HTTP 400 and the field's name where
    the request enters, streaming or not; ``true`` on the same request is served (negative control)."""
    def body(value: Any) -> dict:
        custom = {PARAM: value}
        if path == "/generate":
            return {"text": "x", "stream": stream, "sampling_params": {"max_new_tokens": 2, "custom_params": custom}}
        prompt = {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"}
        return {"model": "m", **prompt, "max_tokens": 2, "stream": stream, "custom_params": custom}

    status, text = _status(relaxed.server, path, body("yes"))
    assert status == 400 and in_json(f'custom_params.{PARAM}="yes" is invalid (allowed: true or false)') in text, \
        (status, text)
    status, text = _status(relaxed.server, path, body(True))
    assert status == 200 and KEY in text, (status, text)


TERMINAL = ("response.completed", "response.incomplete", "response.failed")


def _responses_body(served: Served, **extra: Any) -> dict:
    """A ``/v1/responses`` request (SGLang's Responses API checks ``model`` against the served name;
    its request model has no ``custom_params``: kvplane reads them from the body)."""
    return {"model": str(served.server.model_dir), "input": "Once upon a time", "max_output_tokens": 6,
            "temperature": 0, **extra}


def test_responses_endpoint_returns_sglext_kvplane_only_when_asked(relaxed):
    """``/v1/responses``, non-streaming: ``sglext.kvplane`` with every field when the body's
    ``custom_params`` ask, and the request's own SLO in it (so the keys reached the engine); no
    ``sglext`` otherwise (negative control). Streaming (paced on this server): only the terminal
    lifecycle event's ``response`` carries it, with the pacer's deposit; a stream that did not ask
    has none."""
    plain = relaxed.server.post("/v1/responses", _responses_body(relaxed))
    asked = relaxed.server.post("/v1/responses", _responses_body(relaxed, custom_params={**ASK, SLO_PARAM: 77}))
    assert plain["object"] == asked["object"] == "response" and plain["output"] and asked["output"]
    assert "sglext" not in plain and tuple(asked["sglext"][KEY]) == RESULT_FIELDS, asked.get("sglext")
    assert asked["sglext"][KEY]["slo_tbt_ms"] == 77.0 and asked["sglext"][KEY]["deposit_source"] == "controller"
    text = [r["output"][0]["content"][0]["text"] for r in (plain, asked)]
    assert text[0] == text[1] and asked["usage"]["output_tokens"] == plain["usage"]["output_tokens"]  # SGLang's own

    events = relaxed.server.stream("/v1/responses", _responses_body(relaxed, custom_params=ASK))
    carrying = [e for e in events if "sglext" in json.dumps(e)]
    assert len(carrying) == 1 and carrying[0] is events[-1] and carrying[0]["type"] in TERMINAL, \
        [e.get("type") for e in events]
    info = carrying[0]["response"]["sglext"][KEY]
    assert tuple(info) == RESULT_FIELDS and info["deposit_source"] == "pacer"
    plain_events = relaxed.server.stream("/v1/responses", _responses_body(relaxed))
    assert plain_events[-1]["type"] in TERMINAL and not any("sglext" in json.dumps(e) for e in plain_events)


@pytest.mark.parametrize("stream", [False, True])
def test_a_bad_kvplane_param_on_responses_is_http_400_naming_the_field(relaxed, stream):
    """``/v1/responses`` refuses a bad opt-in, a bad SLO and a ``custom_params`` that is not an
    object with HTTP 400 naming it, before anything streams; ``true`` is served (negative control)."""
    def body(custom: Any) -> dict:
        return _responses_body(relaxed, stream=stream, custom_params=custom)

    for custom, message in (({PARAM: "yes"}, f'custom_params.{PARAM}="yes" is invalid (allowed: true or false)'),
                            ({SLO_PARAM: -1}, f"custom_params.{SLO_PARAM}=-1 is out of range"),
                            ("yes", 'custom_params="yes" is invalid (allowed: an object)')):
        status, text = _status(relaxed.server, "/v1/responses", body(custom))
        assert status == 400 and in_json(message) in text and '"param":"custom_params"' in text.replace(" ", ""), \
            (status, text)
    status, text = _status(relaxed.server, "/v1/responses", body(ASK))
    assert status == 200, (status, text)
