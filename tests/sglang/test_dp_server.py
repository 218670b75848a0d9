"""Data-parallel replicas (``--dp-size 2``) with a remote control plane: each replica is a worker of
its own.

Scenario: a real ``kvplane serve`` (gRPC, a policy that pauses quickly) and a layered SGLang server
with ``--dp-size 2`` using it, a device KV budget of 96 token-layers per replica, so requests on
both replicas are offloaded, and some paused. SGLang's DP controller starts one scheduler process per
replica (round-robin dispatch), each TP rank 0 of its own group. Checked: vanilla's greedy tokens
and logprobs; the control plane opened one session per replica (``ID-dp0``, ``ID-dp1``) and
replaced none; each replica wrote its own stats, pool-stats and event files, with its own
increasing step numbers. Before the replica-aware ids and files (found by a flag sweep), both
replicas reported as ``sglang-HOST-PORT``: the control plane replaced one session by the other ten
times in 54 s, putting the replicas into fallback, and their stats lines interleaved in one file
(step numbers 1, 2, 3, 4, 5, 6, 1, 7, 2, ...).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sglang_ext.settings import (
    POOL_STATS_FILE_ENV,
    RESIDENCY_EVENTS_FILE_ENV,
    STATS_FILE_ENV,
    rank_output_file,
)
from sglang_ext.testing.jsonl import read_jsonl, read_jsonl_settled
from sglang_ext.testing.server import SGLangServer
from tests.service.conftest import ServeProcess
from tests.sglang.conftest import PROMPTS, assert_same_generation, greedy, running_server
from tests.sglang.test_tp_server import tp_env

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1800)]

DP = 2
MAX_NEW_TOKENS = 10


@pytest.fixture(scope="module")
def dp_server(tiny_model_dir, launch_zygote, tmp_path_factory) -> Iterator[tuple[SGLangServer, ServeProcess, Path]]:
    root = tmp_path_factory.mktemp("dp2")
    service = ServeProcess.with_policy(root, {"max_paused_steps": 6, "window_min": 2, "window_max": 4})
    flags = ["--dp-size", str(DP), "--enable-layered-kv", "--kv-control-plane", f"grpc://{service.target}",
             "--kv-gpu-budget-tokens", "96", "--mem-fraction-static", "0.3"]
    env = {**tp_env(root), STATS_FILE_ENV: str(root / "stats.jsonl"),
           POOL_STATS_FILE_ENV: str(root / "pool_stats.jsonl"), RESIDENCY_EVENTS_FILE_ENV: str(root / "events.jsonl")}
    try:
        with running_server(tiny_model_dir, root, flags, env, zygote=launch_zygote) as server:
            yield server, service, root
    finally:
        service.kill()


def _log_events(path: Path, event: str) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == event:
            out.append(record)
    return out


def _paused(stats: list[list[dict]]) -> list[int]:
    """Requests each replica's plans paused, from its stats lines."""
    return [sum(len(line.get("paused_now") or ()) for line in lines) for lines in stats]


def test_each_replica_is_a_worker_with_its_own_session_and_files(dp_server, vanilla_server):
    server, service, root = dp_server
    prompts = PROMPTS[:16]
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: greedy(server, p, MAX_NEW_TOKENS, logprobs=True), prompts))
    for prompt, out in zip(prompts, got, strict=True):
        assert_same_generation(out, greedy(vanilla_server, prompt, MAX_NEW_TOKENS, logprobs=True), prompt)

    stats = [read_jsonl_settled(rank_output_file(root / "stats.jsonl", 0, d)) for d in range(DP)]
    for d, lines in enumerate(stats):
        steps = [line["step"] for line in lines]
        assert steps and steps == sorted(set(steps)), (d, steps[:20])
    # both replicas offload (their own pool-stats files); the plans pause some requests (on
    # which replica depends on timing: one run paused 0 and 3)
    pool = [read_jsonl(rank_output_file(root / "pool_stats.jsonl", 0, d)) for d in range(DP)]
    assert all(any(line["host_layer_pages"] > 0 for line in lines) for lines in pool)
    paused, waves = _paused(stats), 0
    while not sum(paused) and waves < 2:  # the plans come over gRPC: on a loaded host a wave of short
        waves += 1  # requests can end before one pauses anything; longer ones then overlap the plans
        with ThreadPoolExecutor(len(prompts)) as pool:
            list(pool.map(lambda p: greedy(server, p, 4 * MAX_NEW_TOKENS), prompts))
        paused = _paused([read_jsonl_settled(rank_output_file(root / "stats.jsonl", 0, d)) for d in range(DP)])
    assert sum(paused) > 0, f"expected the budget to pause requests: {paused} (after {waves} more waves)"
    assert all(read_jsonl(rank_output_file(root / "events.jsonl", 0, d)) for d in range(DP))

    opened = {r["worker"] for r in _log_events(service.log_path, "session_opened")}
    assert len(opened) == DP and {w.rsplit("-", 1)[1] for w in opened} == {f"dp{d}" for d in range(DP)}, opened
    assert _log_events(service.log_path, "session_replaced") == []
    assert "control_plane_unavailable" not in server.log_path.read_text()
