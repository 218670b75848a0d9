"""PolicyService over a real server: get / update / watch, bearer-token auth, validation, audit."""

from __future__ import annotations

import threading

import grpc
import pytest
from structlog.testing import capture_logs

from controlplane import api
from kvplane.v1 import controlplane_pb2 as pb
from kvplane.v1 import controlplane_pb2_grpc as pb_grpc

from .conftest import TOKEN, step_report, wait_until, worker_info


def test_get_policy_is_open(served, connect) -> None:  # type: ignore[no-untyped-def]
    """Reads need no token and return the full versioned policy."""
    policy = connect(served.target).get_policy()
    assert policy.version == 1
    assert policy == served.control_plane.get_policy()


def test_update_without_token_is_unauthenticated(served, connect) -> None:  # type: ignore[no-untyped-def]
    """An update without a bearer token gets UNAUTHENTICATED and changes nothing."""
    client = connect(served.target)
    with pytest.raises(api.Unauthenticated, match="authorization: Bearer"):
        client.update_policy({"alpha": 0.5})
    assert client.get_policy().version == 1


def test_update_with_wrong_token_is_unauthenticated(served, channel) -> None:  # type: ignore[no-untyped-def]
    """A wrong bearer token gets UNAUTHENTICATED (raw status checked on the wire)."""
    stub = pb_grpc.PolicyServiceStub(channel)
    request = pb.UpdatePolicyRequest(changes=pb.Policy(alpha=0.5))
    for metadata in ((("authorization", "Bearer nope"),), (("authorization", TOKEN),)):
        with pytest.raises(grpc.RpcError) as info:
            stub.UpdatePolicy(request, metadata=metadata, timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert stub.GetPolicy(pb.GetPolicyRequest(), timeout=5).version == 1


def test_update_with_right_token_is_applied_and_audited(served, connect) -> None:  # type: ignore[no-untyped-def]
    """The right token updates the policy (version + 1) and writes an audit record with actor and versions."""
    client = connect(served.target, token=TOKEN)
    with capture_logs() as logs:
        new = client.update_policy({"alpha": 0.5, "layerkv": {"tpot_margin": 0.8}})
    assert (new.version, new.alpha, new.layerkv.tpot_margin) == (2, 0.5, 0.8)
    assert client.get_policy() == new
    audit = [e for e in logs if e["event"] == "policy_audit"]
    assert len(audit) == 1
    assert audit[0]["old_version"] == 1 and audit[0]["new_version"] == 2
    assert audit[0]["actor"].startswith("ipv4:127.0.0.1:")
    assert audit[0]["changes"] == {"alpha": 0.5, "layerkv": {"tpot_margin": 0.8}}


def test_a_token_with_a_space_inside_works_end_to_end(serve, connect, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A token file holding ``abc def`` (a space inside: gRPC metadata carries it, the server's
    ``Bearer`` parse splits at the first space only) is read as such and authorizes writes on a
    real server; a token that differs after the space does not. The deploy fixes' review (session
    87) found the first version of the token check refusing it, which had worked before."""
    from controlplane.policy_store import load_token_file
    from controlplane.service.server import ServerConfig

    path = tmp_path / "token"
    path.write_text("abc def\n")
    token = load_token_file(path)
    served = serve(ServerConfig(max_sessions=4, max_watchers=2, policy_token=token))
    assert connect(served.target, token=token).update_policy({"alpha": 0.5}).version == 2
    with pytest.raises(api.Unauthenticated):
        connect(served.target, token="abc xyz").update_policy({"alpha": 0.25})


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"alpha": -1.0}, "alpha: -1.0 is out of range (allowed [0.0, 1000000.0])"),
        ({"window_min": 10, "window_max": 5}, "window_max: 5 is below window_min = 10"),
        ({"ewma_factor": 1.5}, "ewma_factor: 1.5 is out of range"),
        ({"scheduler": "magic"}, "scheduler: 'magic' is not one of"),
        ({"layerkv": {"tpot_margin": 0.0}}, "layerkv.tpot_margin"),  # the API path (was scheduler_params.layerkv...)
        # wrong types protobuf itself would coerce (True -> 1.0, 2 -> True): refused as the
        # embedded control plane refuses them (control-plane review, session 77)
        ({"slo_tbt_ms": True}, "slo_tbt_ms: expected a number, got True"),
        ({"deposit_credit": 2}, "deposit_credit: expected true or false, got 2"),
        ({"deposit_credit": 1}, "deposit_credit: expected true or false, got 1"),
        ({"victim_rule": False}, "victim_rule: expected a string, got False"),
        ({"layerkv": {"max_prefill_tokens": True}}, "layerkv.max_prefill_tokens: expected a number, got True"),
    ],
)
def test_invalid_update_names_field_and_range(served, connect, changes, fragment) -> None:  # type: ignore[no-untyped-def]
    """An out-of-range update gets INVALID_ARGUMENT naming the field and its allowed range."""
    client = connect(served.target, token=TOKEN)
    with pytest.raises(api.InvalidArgument) as info:
        client.update_policy(changes)
    assert fragment in str(info.value)
    assert client.get_policy().version == 1


def test_update_that_changes_nothing_makes_no_version_and_no_audit(served, connect) -> None:  # type: ignore[no-untyped-def]
    """Scenario: an update naming the current values. The store keeps the version and writes no
    audit record; the service logs no ``policy_audit`` either (it logged one per call) and answers
    ``old_version`` equal to the policy's version. The control: a real change right after is audited."""
    client = connect(served.target, token=TOKEN)
    current = client.get_policy()
    with capture_logs() as logs:
        same = client.update_policy({"alpha": current.alpha, "deposit_credit": current.deposit_credit})
    assert same == current
    assert [e for e in logs if e["event"] == "policy_audit"] == []
    raw = pb_grpc.PolicyServiceStub(client._channel).UpdatePolicy(  # noqa: SLF001 - the raw answer's old_version
        pb.UpdatePolicyRequest(changes=pb.Policy(alpha=current.alpha)),
        metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=5)
    assert raw.old_version == raw.policy.version == current.version
    with capture_logs() as logs:
        client.update_policy({"alpha": current.alpha / 2})
    assert [(e["old_version"], e["new_version"]) for e in logs if e["event"] == "policy_audit"] == [
        (current.version, current.version + 1)]


def test_empty_update_is_invalid(served, channel) -> None:  # type: ignore[no-untyped-def]
    """An update that sets no field gets INVALID_ARGUMENT naming `changes`."""
    stub = pb_grpc.PolicyServiceStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        stub.UpdatePolicy(
            pb.UpdatePolicyRequest(), metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=5
        )
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("changes:")


def test_watch_gets_current_then_every_update(served, connect) -> None:  # type: ignore[no-untyped-def]
    """A watcher first sees the current policy, then each accepted update in version order."""
    client = connect(served.target, token=TOKEN)
    watch = client.watch_policy()
    assert next(watch).version == 1
    seen: list[int] = []

    def consume() -> None:
        for policy in watch:
            seen.append(policy.version)
            if policy.version == 4:
                return

    t = threading.Thread(target=consume)
    t.start()
    for alpha in (0.3, 0.4, 0.6):
        client.update_policy({"alpha": alpha})
    t.join(10)
    assert seen == [2, 3, 4]
    watch.close()


def test_watch_ended_by_server_stop_is_unavailable(serve, connect) -> None:  # type: ignore[no-untyped-def]
    """Scenario: the server stops while a policy watch is open. The watch ends UNAVAILABLE (the
    client's iterator raises ``api.Unavailable``), not OK as if it had ended normally -- a watcher
    must tell an outage from the end (control-plane review, session 77). The control: a watch the
    client closes ends without an error."""
    served = serve()
    client = connect(served.target)
    closed = client.watch_policy()
    assert next(closed).version == 1
    closed.close()  # the client's own end: no error
    watch = client.watch_policy()
    assert next(watch).version == 1
    raw_channel = grpc.insecure_channel(served.target)
    raw = pb_grpc.PolicyServiceStub(raw_channel).WatchPolicy(pb.WatchPolicyRequest(), timeout=30)
    assert next(raw).policy.version == 1
    stopper = threading.Timer(0.3, lambda: served.server.stop(2.0))
    stopper.start()
    with pytest.raises(api.Unavailable, match="policy watch: the policy service is shutting down"):
        next(watch)
    with pytest.raises(grpc.RpcError) as info:
        next(raw)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    stopper.join(10)
    raw_channel.close()


def test_policy_update_racing_with_sessions(served, connect) -> None:  # type: ignore[no-untyped-def]
    """Updates racing with streaming sessions all apply once, in order; sessions keep streaming and see the new version."""
    client = connect(served.target, token=TOKEN)
    sessions = [client.open_session(worker_info(f"race{i}")) for i in range(4)]
    assert all(s.wait_connected(10) for s in sessions)
    stop = threading.Event()
    errors: list[BaseException] = []

    def stream(session) -> None:  # type: ignore[no-untyped-def]
        step = 0
        try:
            while not stop.is_set():
                session.report(step_report(step, {f"{session.worker_id}-r": 300 + step}))
                step += 1
                stop.wait(0.002)
        except BaseException as exc:  # report() must never raise
            errors.append(exc)

    workers = [threading.Thread(target=stream, args=(s,)) for s in sessions]
    for w in workers:
        w.start()
    updaters = [
        threading.Thread(target=lambda k=k: client.update_policy({"mismatch_threshold": 0.1 + 0.01 * k}))
        for k in range(10)
    ]
    for u in updaters:
        u.start()
    for u in updaters:
        u.join(20)
    final = client.get_policy()
    assert final.version == 11
    assert wait_until(
        lambda: all(
            s.last_decision is not None and s.last_decision.policy_version == final.version
            for s in sessions
        ),
        20,
    ), [s.last_decision.policy_version if s.last_decision else None for s in sessions]
    stop.set()
    for w in workers:
        w.join(10)
    assert not errors
    assert all(not s.degraded for s in sessions)
