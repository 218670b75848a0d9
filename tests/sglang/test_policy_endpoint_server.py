"""Live policy in the default (embedded) mode: a real layered SGLang server with
``--kv-policy-listen`` serves ``kvplane.v1.PolicyService``; an update through gRPC changes the
next plan, an update without the token is refused, a watch sees it, a taken port is refused.

Scenario: one module-scoped layered server (embedded control plane, default budget) listening for
policy on a free port with a bearer token; it writes the per-step stats line. Updates go through
the project's gRPC client (:class:`GrpcControlPlane`), the way ``kvplane policy`` sends them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from controlplane import api
from controlplane.service.client import GrpcControlPlane
from controlplane.service.ports import free_port
from sglang_ext.request_placement import KEY, PARAM
from sglang_ext.settings import STATS_FILE_ENV
from sglang_ext.testing.jsonl import read_jsonl_settled
from tests.service.conftest import wait_until
from tests.sglang.conftest import PROMPTS, running_server
from tests.sglang.test_launch_validation import (
    assert_refused_in_one_line,
    forkable,
    launch_all,
    launch_forked,
)

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(1800)]

TOKEN = "tune-me-live"


@pytest.fixture(scope="module")
def live(tiny_model_dir, launch_zygote, tmp_path_factory) -> Iterator[Any]:
    root = tmp_path_factory.mktemp("policy-live")
    token, stats = root / "token", root / "stats.jsonl"
    token.write_text(TOKEN)
    port = free_port()
    flags = ["--enable-layered-kv", "--kv-policy-listen", f"127.0.0.1:{port}", "--kv-policy-listen-token-file", str(token)]
    with running_server(tiny_model_dir, root, flags, {STATS_FILE_ENV: str(stats)}, zygote=launch_zygote) as server:
        yield SimpleNamespace(server=server, port=port, target=f"127.0.0.1:{port}", stats_path=stats, token=token)


def _stats(path: Path) -> list[dict]:
    return read_jsonl_settled(path)  # a step's line is written after its responses went out


def _asked(live: Any, prompt: str = PROMPTS[0], max_new_tokens: int = 6) -> dict:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0,
                                                "custom_params": {PARAM: True}}}
    return live.server.post("/generate", body)["meta_info"][KEY]


def test_the_endpoint_serves_the_launch_policy(live):
    """The scheduler logged where it serves; the policy is the launch one (fcfs, 200 ms)."""
    started = [x for x in live.server.log_path.read_text().splitlines() if "policy_endpoint_started" in x]
    assert len(started) == 1 and f"listen=127.0.0.1:{live.port}" in started[0] and "token=True" in started[0]
    with GrpcControlPlane(live.target) as client:
        policy = client.get_policy()
    assert (policy.version, policy.scheduler, policy.slo_tbt_ms) == (1, "fcfs", 200.0)


def test_an_update_changes_the_next_plan_unauthenticated_ones_are_refused_and_watched(live):
    """Scenario: a request plans against the launch SLO (200 ms); an update without the token is
    UNAUTHENTICATED and changes nothing; with the token SLO 123 ms and alpha 0.5 become version
    2, which an open watch receives; the next request plans against 123 ms, and the controller's
    next decision says ``policy-change`` (no decision before the update did)."""
    assert _asked(live)["slo_tbt_ms"] == 200.0
    start = len(_stats(live.stats_path))
    seen: list[int] = []
    watcher = GrpcControlPlane(live.target)

    def watch_two() -> None:
        for policy in watcher.watch_policy():
            seen.append(policy.version)
            if len(seen) == 2:
                return

    reader = threading.Thread(target=watch_two, daemon=True)
    reader.start()
    assert wait_until(lambda: seen == [1], 30)
    with GrpcControlPlane(live.target) as anonymous, pytest.raises(api.Unauthenticated):
        anonymous.update_policy({"slo_tbt_ms": 1.0})
    with GrpcControlPlane(live.target, token="wrong") as wrong, pytest.raises(api.Unauthenticated):
        wrong.update_policy({"slo_tbt_ms": 1.0})
    assert _asked(live, PROMPTS[1])["slo_tbt_ms"] == 200.0  # nothing changed
    with GrpcControlPlane(live.target, token=TOKEN) as client:
        new = client.update_policy({"slo_tbt_ms": 123.0, "alpha": 0.5})
    assert (new.version, new.slo_tbt_ms, new.alpha) == (2, 123.0, 0.5)
    reader.join(30)
    watcher.close()
    assert seen == [1, 2]
    middle = len(_stats(live.stats_path))
    # long enough that the asynchronously planned policy-change decision lands inside the request
    assert _asked(live, PROMPTS[2], max_new_tokens=32)["slo_tbt_ms"] == 123.0
    lines = _stats(live.stats_path)
    before, after = lines[start:middle], lines[middle:]
    assert not any("policy-change" in (line["decision"] or "") for line in before)
    assert any("policy-change" in (line["decision"] or "") for line in after), [line["decision"] for line in after]
    log = live.server.log_path.read_text()
    assert "policy_audit" in log and "new_version=2" in log


def _burst(live: Any) -> int:
    """Six requests at once; the admission gate's held-back request-steps during them."""
    before = _stats(live.stats_path)[-1]["held_total"]
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda p: live.server.post("/generate", {"text": p, "sampling_params": {"max_new_tokens": 4}}),
                      PROMPTS[:6]))
    return int(_stats(live.stats_path)[-1]["held_total"]) - int(before)


def test_a_live_scheduler_change_reaches_the_admission_gate(live):
    """Under fcfs (the launch scheduler) SGLang admits on its own: a burst holds nothing back.
    Switched live to layerkv, the same burst waits for the controller's admissions (held-back
    steps > 0); switched back to fcfs, nothing is held again."""
    assert _burst(live) == 0
    with GrpcControlPlane(live.target, token=TOKEN) as client:
        assert client.update_policy({"scheduler": "layerkv"}).scheduler == "layerkv"
        assert _burst(live) > 0
        assert client.update_policy({"scheduler": "fcfs"}).scheduler == "fcfs"
    assert _burst(live) == 0


def test_launch_refuses_a_taken_port_and_updates_without_a_token(live, tiny_model_dir, launch_zygote, tmp_path):
    """A second server on the same policy port stops at launch with one line naming the flag and
    the address; so does one that would serve updates without a token. The launchers are forks
    of the session's zygote (a fresh launcher refuses as a fork does:
    ``test_launch_validation.py``), fresh processes where it cannot fork them."""
    cases = {
        "taken": (["--kv-policy-listen", live.target, "--kv-policy-listen-token-file", str(live.token)], None),
        "open": (["--kv-policy-listen", f"127.0.0.1:{free_port()}"], None),
    }
    got = (launch_forked(launch_zygote, tiny_model_dir, cases, tmp_path) if forkable(launch_zygote)
           else launch_all(tiny_model_dir, cases))
    assert_refused_in_one_line(got["taken"], f"--kv-policy-listen='{live.target}': cannot bind (Address already in use)")
    assert_refused_in_one_line(got["open"], "serves policy updates: give --kv-policy-listen-token-file FILE")
    assert live.server.post("/generate", {"text": "still", "sampling_params": {"max_new_tokens": 1}})["meta_info"]
