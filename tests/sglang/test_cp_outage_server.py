"""Killing the remote control plane mid-run loses no request; a restarted one is reconnected to.

Scenario: a real ``kvplane serve`` (subprocess, fixed free port, a policy that pauses quickly) and
a real SGLang server launched with ``--kv-control-plane grpc://127.0.0.1:PORT`` and a small device
KV budget, so decisions (placements, pauses, resumes) are flowing when the service is killed
(SIGKILL) in the middle of a concurrent batch. Every request must still complete with all its
tokens; the per-step stats must show the fallback; after the service restarts on the same port
the scheduler's session reconnects and decisions flow again.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sglang_ext.settings import STATS_FILE_ENV
from sglang_ext.testing.jsonl import read_jsonl, read_jsonl_settled
from sglang_ext.testing.server import SGLangServer
from tests.service.conftest import ServeProcess, wait_until
from tests.sglang.conftest import PROMPTS

# Two SGLang start-ups (30-600 s each on the shared 2-core host) happen inside the first test.
pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1800)]

MAX_NEW_TOKENS = 48


@pytest.fixture(scope="module")
def remote(tiny_model_dir, launch_zygote, tmp_path_factory) -> Iterator[tuple[SGLangServer, ServeProcess, Path]]:
    """`kvplane serve` plus an SGLang server using it over gRPC."""
    root = tmp_path_factory.mktemp("outage")
    service = ServeProcess.with_policy(root, {"max_paused_steps": 3, "window_min": 2, "window_max": 4})
    stats = root / "stats.jsonl"
    server = SGLangServer(
        tiny_model_dir,
        log_path=root / "server.log",
        extra_args=[
            "--enable-layered-kv",
            "--kv-control-plane",
            f"grpc://{service.target}",
            "--kv-gpu-budget-tokens",
            "128",
            "--mem-fraction-static",
            "0.3",
        ],
        env={STATS_FILE_ENV: str(stats)},
        startup_timeout_s=600.0,
        zygote=launch_zygote,
    )
    try:
        server.start()
        yield server, service, stats
    finally:
        server.stop()
        service.kill()


def _lines(path: Path) -> list[dict]:
    return read_jsonl(path)


def _generate(server: SGLangServer, prompt: str) -> dict:
    return server.post(
        "/generate",
        {
            "text": prompt,
            "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.0, "ignore_eos": True},
        },
        timeout_s=600.0,
    )


def test_killing_the_control_plane_mid_run_loses_no_request(remote):
    """SIGKILL of `kvplane serve` during a concurrent batch: every request completes in full."""
    server, service, stats = remote
    start = len(_lines(stats))
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(_generate, server, p) for p in PROMPTS]
        # Mid-run: decisions from the service have been installed, and decoding goes on.
        assert wait_until(
            lambda: sum(1 for line in _lines(stats)[start:] if line["decision"]) >= 3, 300.0, every_s=0.2
        ), "no control-plane decision reached the scheduler"
        warned_before = server.log_path.read_text().count("control_plane_unavailable")
        service.kill()
        killed_at = len(_lines(stats))
        outs = [f.result(timeout=900) for f in futures]
    for out in outs:
        assert out["meta_info"]["completion_tokens"] == MAX_NEW_TOKENS
        assert out["meta_info"]["finish_reason"]["type"] == "length"
    if not any(line["fallback"] for line in _lines(stats)[killed_at:]):
        # the batch ended before the scheduler's session noticed the outage (slow host): the
        # next request runs during it
        out = _generate(server, "Outage probe: the control plane is down")
        assert out["meta_info"]["completion_tokens"] == MAX_NEW_TOKENS
    after = read_jsonl_settled(stats, killed_at)  # the last step's line follows the responses
    assert after, "nothing ran during the outage"
    assert any(line["fallback"] for line in after), "no fallback recorded during the outage"
    assert after[-1]["paused"] == []
    warned = server.log_path.read_text().count("control_plane_unavailable") - warned_before
    assert warned == 1, "warn once per outage"


def test_restarted_control_plane_is_reconnected(remote):
    """After `kvplane serve` restarts on the same port, steps leave fallback and decisions resume."""
    server, service, stats = remote
    service.start(timeout_s=60.0)
    start = len(_lines(stats))

    def recovered() -> bool:
        _generate(server, "Reconnect probe: the quick brown fox")
        new = _lines(stats)[start:]
        return any(not line["fallback"] and line["decision"] for line in new)

    assert wait_until(recovered, 300.0, every_s=0.5)
    assert "control_plane_recovered" in server.log_path.read_text()
