"""EmbeddedControlPlane end to end (real planner, CBC, threads): sessions, what-if plan, policy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controlplane.api import ControlPlane, InvalidArgument, Unauthenticated
from controlplane.embedded import EmbeddedControlPlane
from controlplane.model import Batch
from tests.controlplane.test_controller_harness import WorkerLoop, worker_info

BATCH = {
    "model": {"layers": 4, "block_size": 16, "block_bytes": 4096},
    "hardware": {"gpu_kv_budget_blocks": 30, "h2d_gbps": 10.0},
    "profile": {"layer_compute_ms": 1.0},
    "requests": [
        {"id": "a", "context_tokens": 100, "slo_tbt_ms": 100.0},
        {"id": "b", "context_tokens": 50, "slo_tbt_ms": 100.0},
    ],
    "policy": {"window_min": 2, "window_max": 8},
}


def test_async_sessions_end_to_end(tmp_path: Path) -> None:
    """Two workers run several steps in async mode; decisions arrive, a policy update reaches both."""
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text("window_min: 4\nwindow_max: 4\nslo_tbt_ms: 500\n")
    cp = EmbeddedControlPlane.from_files(policy_file)
    _: ControlPlane = cp  # satisfies the protocol the plugin and the gRPC servicer use
    try:
        loops = []
        for wid in ("w0", "w1"):
            info = worker_info(budget_blocks=60)
            session = cp.open_session(type(info)(wid, info.model, info.hardware, info.profile))
            loop = WorkerLoop(session)
            loop.add("x", 200)
            loop.add("y", 120)
            loops.append(loop)
        for _ in range(12):
            for loop in loops:
                loop.report()
        for loop in loops:
            assert loop.session.flush(30)  # type: ignore[attr-defined]
            loop.report()
            assert loop.decisions, "no decision reached the worker"
            assert all(d.plan.feasible for d in loop.decisions)
        new = cp.update_policy({"alpha": 0.5})
        for loop in loops:
            loop.report()
            assert loop.session.flush(30)  # type: ignore[attr-defined]
            loop.report()
            assert loop.decisions[-1].policy_version == new.version
        snap = cp.counters.snapshot()
        assert snap.plans >= 4 and snap.errors == 0
        assert set(cp.sessions()) == {"w0", "w1"}
    finally:
        cp.close()
    assert cp.sessions() == {}


def test_reopen_replaces_and_close_forgets() -> None:
    """Re-opening a worker id closes the old session; closing a session removes it."""
    cp = EmbeddedControlPlane(synchronous=True)
    s1 = cp.open_session(worker_info())
    s2 = cp.open_session(worker_info())
    assert s1.closed and not s2.closed and cp.sessions() == {"w0": s2}
    s1.close()  # a stale close must not drop the new session
    assert cp.sessions() == {"w0": s2}
    s2.close()
    assert cp.sessions() == {}


def test_what_if_plan_matches_the_planner_and_validates() -> None:
    """plan() accepts a Batch or its JSON mapping; a malformed batch is InvalidArgument naming the field."""
    cp = EmbeddedControlPlane()
    plan = cp.plan(BATCH)
    assert plan.feasible and set(plan.placements) == {"a", "b"}
    assert plan.resident_blocks + plan.staging_blocks <= BATCH["hardware"]["gpu_kv_budget_blocks"]
    again = cp.plan(Batch.from_dict(BATCH))
    assert again.feasible and set(again.placements) == {"a", "b"}
    bad = json.loads(json.dumps(BATCH))
    bad["requests"][0]["context_tokens"] = 0
    with pytest.raises(InvalidArgument, match=r"requests\[0\]\.context_tokens"):
        cp.plan(bad)
    with pytest.raises(InvalidArgument, match="batch"):
        cp.plan([1, 2])


def test_policy_api_with_token_file(tmp_path: Path) -> None:
    """get/update/watch through the control plane; the token file gates updates."""
    token = tmp_path / "token"
    token.write_text("tok\n")
    cp = EmbeddedControlPlane.from_files(None, token)
    watch = cp.watch_policy()
    assert next(watch).version == 1
    with pytest.raises(Unauthenticated):
        cp.update_policy({"scheduler": "lvf"})
    with pytest.raises(InvalidArgument, match="scheduler: 'x' is not one of"):
        cp.update_policy({"scheduler": "x"}, token="tok")
    new = cp.update_policy({"scheduler": "lvf"}, token="tok", actor="ops")
    assert next(watch) == new == cp.get_policy()
    assert cp.store.audit_log()[-1].actor == "ops"
    watch.close()


def test_sessions_follow_the_policy_scheduler() -> None:
    """A session without a scheduler override uses the policy's; an update switches it live."""
    cp = EmbeddedControlPlane(synchronous=True)
    session = cp.open_session(worker_info())
    loop = WorkerLoop(session)
    loop.add("a", 64)
    loop.report()
    from controlplane.api import QueuedRequest

    loop.queued.append(QueuedRequest("q", prompt_tokens=32, arrival_ms=1.0))
    (d,) = loop.report()
    assert d.admit == ("q",)  # fcfs (the default) admits while memory allows
    cp.update_policy({"scheduler": "layerkv", "layerkv": {"max_prefill_tokens": 16}})
    loop.queued.append(QueuedRequest("r", prompt_tokens=8, arrival_ms=2.0))
    decisions = loop.report()
    assert decisions[-1].policy_version == 2
    assert decisions[-1].admit == ("r",) and decisions[-1].min_gpu_layers.keys() == {"r"}
    cp.close()
