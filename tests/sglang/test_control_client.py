"""ControlClient: the scheduler's control-plane handle never raises and survives outages.

Real control planes only: the embedded controller in-process, and ``kvplane serve`` as a real
subprocess on a free port (killed and restarted on the same port for the outage cases).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from controlplane.api import RequestState, StepReport, WorkerInfo
from controlplane.embedded import EmbeddedControlPlane
from controlplane.model import Hardware, ModelSpec, Profile
from controlplane.policy import Policy
from controlplane.policy_store import PolicyStore
from controlplane.service.client import GrpcControlPlane
from controlplane.service.ports import free_ports
from controlplane.service.worker_session import Backoff
from sglang_ext.args import LayeredKVArgs
from sglang_ext.control_client import ControlClient, build_control_plane, fallback_counter
from tests.service.conftest import ServeProcess, wait_until

METRIC = "kvplane_control_plane_fallbacks_total"


def _worker(worker_id: str = "w0", budget_blocks: int = 40) -> WorkerInfo:
    return WorkerInfo(
        worker_id=worker_id,
        model=ModelSpec(layers=4, block_size=1, block_bytes=256),
        hardware=Hardware(gpu_kv_budget_blocks=budget_blocks, h2d_gbps=16.0),
        profile=Profile((1.0,) * 4),
    )


def _report(step: int, contexts: dict[str, int]) -> StepReport:
    running = tuple(RequestState(id=r, context_tokens=c, generated_tokens=step) for r, c in contexts.items())
    return StepReport(step=step, now_ms=10.0 * step, running=running, observed_step_ms=4.0)


class FakeClock:
    """Explicit time for the re-open backoff (no sleeps)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _counter_value(registry: CollectorRegistry) -> float:
    return registry.get_sample_value(METRIC) or 0.0


def test_embedded_report_returns_decisions_without_fallback():
    """With the embedded controller every report goes through and decisions come back."""
    registry = CollectorRegistry()
    cp = EmbeddedControlPlane(PolicyStore(Policy()), synchronous=True)
    client = ControlClient(cp, _worker(), fallbacks=fallback_counter(registry))
    got = client.report(_report(1, {"a": 10, "b": 12}))
    assert got and set(got[-1].plan.placements) == {"a", "b"}
    assert client.last_decision is got[-1]
    assert not client.in_fallback and _counter_value(registry) == 0
    client.close()


def test_embedded_session_failure_falls_back_then_reopens_with_backoff():
    """A session that raises yields [] and a counted fallback; it is re-opened after the backoff."""
    registry = CollectorRegistry()
    clock = FakeClock()
    cp = EmbeddedControlPlane(PolicyStore(Policy()), synchronous=True)
    client = ControlClient(
        cp, _worker(), fallbacks=fallback_counter(registry), reopen_initial_s=1.0, clock=clock
    )
    assert client.report(_report(1, {"a": 10}))
    client.session.close()  # the controller is gone: its report() raises Unavailable
    for step in (2, 3, 4):
        assert client.report(_report(step, {"a": 10 + step})) == []
    assert client.in_fallback and client.fallback_steps == 3 and client.outages == 1
    assert _counter_value(registry) == 3
    clock.now = 1.5  # past the first re-open delay
    got = client.report(_report(5, {"a": 15, "b": 3}))
    assert got and not client.in_fallback
    assert client.outages == 1


def test_a_session_whose_reports_keep_failing_is_reopened_with_growing_delays():
    """Scenario (plugin review, session 77): the session opens, but every report raises (here the
    controller refuses each one: a wrong-sized ``layer_compute_ms``). The re-opens back off
    (1, 2, 4, 8 s ...); each successful open reset the delays, so the session was torn down
    and rebuilt every second for good. Control: once a report goes through, the next outage
    backs off from the first delay again."""
    clock = FakeClock()
    cp = EmbeddedControlPlane(PolicyStore(Policy()), synchronous=True)
    opens: list[float] = []
    open_session = cp.open_session

    def counted(worker: WorkerInfo):  # noqa: ANN202
        opens.append(clock.now)
        return open_session(worker)

    cp.open_session = counted  # type: ignore[method-assign]
    client = ControlClient(cp, _worker(), reopen_initial_s=1.0, reopen_max_s=60.0, clock=clock)
    bad = dataclasses.replace(_report(1, {"a": 10}), layer_compute_ms=(1.0, 2.0))
    for tick in range(0, 400):  # 40 s of steps, one every 100 ms
        clock.now = tick / 10
        assert client.report(dataclasses.replace(bad, step=tick + 1)) == []
    gaps = [round(b - a, 1) for a, b in zip(opens, opens[1:], strict=False)]
    assert gaps == [1.0, 2.0, 4.0, 8.0, 16.0], gaps
    clock.now = 70.0  # past the next delay (32 s after 31): the next report opens a session that serves it
    assert client.report(_report(401, {"a": 10}))
    opened = len(opens)
    assert client.report(dataclasses.replace(bad, step=402)) == []
    clock.now += 1.0  # the first delay again
    assert client.report(_report(403, {"a": 10})) and len(opens) == opened + 1


def test_report_never_raises_on_a_malformed_report():
    """A report the controller rejects (step going backwards) is a fallback step, not an exception."""
    cp = EmbeddedControlPlane(PolicyStore(Policy()), synchronous=True)
    client = ControlClient(cp, _worker(), reopen_initial_s=0.01, reopen_max_s=0.01)
    client.report(_report(5, {"a": 10}))
    assert client.report(_report(3, {"a": 10})) == []
    assert client.in_fallback and client.last_error and "step" in client.last_error


def test_build_control_plane_embedded_loads_the_policy_file(tmp_path: Path):
    """--kv-policy is loaded into the embedded control plane."""
    policy = tmp_path / "p.json"
    policy.write_text(json.dumps({"slo_tbt_ms": 123.0, "max_paused_steps": 7}))
    cp = build_control_plane(LayeredKVArgs(enable_layered_kv=True, kv_policy=str(policy)))
    assert isinstance(cp, EmbeddedControlPlane)
    assert cp.get_policy().slo_tbt_ms == 123.0 and cp.get_policy().max_paused_steps == 7


def test_build_control_plane_grpc_uses_target_and_token(tmp_path: Path):
    """grpc://HOST:PORT builds a GrpcControlPlane carrying the bearer token from the token file."""
    token = tmp_path / "token"
    token.write_text("tok-123\n")
    args = LayeredKVArgs(
        enable_layered_kv=True, kv_control_plane="grpc://127.0.0.1:9", kv_policy_token_file=str(token)
    )
    cp = build_control_plane(args)
    try:
        assert isinstance(cp, GrpcControlPlane)
        assert cp.target == "127.0.0.1:9" and cp._token == "tok-123"
    finally:
        cp.close()


def test_build_control_plane_reads_the_token_with_the_launch_check(tmp_path: Path):
    """The client reads --kv-policy-token-file with ``load_token_file`` (the launch check's reader):
    a file rewritten after launch with a two-line token is refused naming the flag, not sent as
    metadata gRPC cannot carry. Negative control: the old ``read_text().strip()`` built the client."""
    token = tmp_path / "token"
    token.write_text("tok-123\n")
    args = LayeredKVArgs(
        enable_layered_kv=True, kv_control_plane="grpc://127.0.0.1:9", kv_policy_token_file=str(token)
    )
    token.write_text("A" * 64 + "\n" + "B" * 24 + "\n")
    with pytest.raises(ValueError, match=r"^--kv-policy-token-file: token file .* character 65 of the token is a line break"):
        build_control_plane(args)


@pytest.fixture
def serve(tmp_path: Path):
    """A real `kvplane serve` on a fixed free port (restartable on that port)."""
    proc = ServeProcess(*free_ports(2), tmp_path / "serve.log")
    proc.start()
    try:
        yield proc
    finally:
        proc.kill()


def _report_until(client: ControlClient, start: int, predicate, timeout_s: float = 20.0) -> int:
    """Report successive steps (fresh contexts) until ``predicate(decisions)``; returns the next step."""
    step = start
    seen: list = []

    def once() -> bool:
        nonlocal step
        seen[:] = client.report(_report(step, {"a": 10 + step, f"r{step % 3}": 5}))
        step += 1
        return bool(predicate(seen))

    assert wait_until(once, timeout_s, every_s=0.02), "condition not reached"
    return step


def test_grpc_outage_falls_back_and_reconnects_after_restart(serve):
    """Killing `kvplane serve` mid-run: report() returns [] with fallbacks counted, never raises;
    after a restart on the same port the session reconnects and decisions flow again."""
    registry = CollectorRegistry()
    cp = GrpcControlPlane(
        f"grpc://{serve.target}", timeout_s=2.0, backoff=Backoff(initial_s=0.05, max_s=0.2)
    )
    client = ControlClient(cp, _worker("outage-w"), fallbacks=fallback_counter(registry), connect_wait_s=10.0)
    try:
        step = _report_until(client, 1, lambda got: bool(got))
        assert not client.in_fallback

        serve.kill()
        step = _report_until(client, step, lambda got: client.in_fallback)
        before = _counter_value(registry)
        for _ in range(5):
            assert client.report(_report(step, {"a": 10 + step})) == []
            step += 1
        assert _counter_value(registry) >= before + 5
        assert client.outages == 1, "one warning per outage"
        assert client.last_decision is not None  # the last plan is kept

        serve.start()
        step = _report_until(client, step, lambda got: not client.in_fallback and bool(got), 30.0)
        assert client.outages == 1
        assert client.session.stats.reconnects >= 1
    finally:
        client.close()


def test_a_hung_control_plane_sends_the_scheduler_to_its_fallback():
    """A control plane whose stream stays up but never answers (scripted: acks the hello, then
    hangs): once the session's reports have gone unanswered ``stale_after_s``, the scheduler's
    handle runs its fallback and says the outage (``on_outage(True)``); before, it counted 0
    fallback steps and no outage, and under LayerKV admission waited for admissions that never
    came. Control: the same steps against the embedded controller run no fallback."""
    import time
    from concurrent import futures

    import grpc

    from kvplane.v1 import controlplane_pb2_grpc as pb_grpc
    from tests.service.test_misbehaving_control_plane import _Scripted

    servicer = _Scripted("hang")
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_ControlPlaneServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    outages: list[bool] = []
    client = ControlClient(GrpcControlPlane(f"127.0.0.1:{port}", backoff=Backoff(0.05, 0.2)), _worker(),
                           on_outage=outages.append, connect_wait_s=2.0)
    try:
        client.report(_report(0, {"a": 10}))
        client.session.stale_after_s = 0.3
        for step in range(1, 40):
            client.report(_report(step, {"a": 10}))
            time.sleep(0.02)
        assert client.fallback_steps > 0 and outages == [True], (client.fallback_steps, outages)
    finally:
        servicer.stop.set()
        client.close()
        server.stop(0)
    embedded = ControlClient(EmbeddedControlPlane(PolicyStore(Policy())), _worker())
    for step in range(40):
        embedded.report(_report(step, {"a": 10}))
    assert embedded.fallback_steps == 0
