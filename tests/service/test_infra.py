"""Server plumbing: health, reflection, the Plan RPC, malformed/oversized input, error mapping."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from controlplane import api
from controlplane.cli.serve_cmd import build_control_plane
from controlplane.model import SchemaError
from controlplane.service import convert
from controlplane.service.errors import error_for, status_for
from controlplane.service.server import ServerConfig, create_server
from kvplane.v1 import controlplane_pb2 as pb
from kvplane.v1 import controlplane_pb2_grpc as pb_grpc

from .conftest import small_batch


def test_health_serving_for_every_service(served, channel) -> None:  # type: ignore[no-untyped-def]
    """grpc.health.v1 answers SERVING for the server and each kvplane service."""
    stub = health_pb2_grpc.HealthStub(channel)
    for name in ("", "kvplane.v1.ControlPlane", "kvplane.v1.PolicyService"):
        got = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        assert got.status == health_pb2.HealthCheckResponse.SERVING, name


def test_health_not_serving_after_stop(serve) -> None:  # type: ignore[no-untyped-def]
    """After a graceful stop begins, health reports NOT_SERVING (or the port is closed)."""
    s = serve()
    s.server.health.enter_graceful_shutdown()
    with grpc.insecure_channel(s.target) as ch:
        got = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert got.status == health_pb2.HealthCheckResponse.NOT_SERVING


def test_reflection_lists_services(channel) -> None:  # type: ignore[no-untyped-def]
    """Server reflection lists the kvplane services, health and reflection itself."""
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
    )
    names = {s.name for r in responses for s in r.list_services_response.service}
    assert {
        "kvplane.v1.ControlPlane",
        "kvplane.v1.PolicyService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= names


def test_plan_rpc_matches_embedded_planner(served, client) -> None:  # type: ignore[no-untyped-def]
    """The Plan RPC returns what the embedded control plane's planner returns for the same batch."""
    from controlplane.planner import Planner

    batch = small_batch(4, budget_blocks=150)
    remote = client.plan(batch)
    local = Planner().plan(batch, victim_rule=served.control_plane.get_policy().victim_rule)
    assert remote.feasible == local.feasible
    assert remote.paused == local.paused
    assert remote.placements == local.placements
    assert remote.predicted_step_ms == pytest.approx(local.predicted_step_ms, rel=1e-9)
    assert (remote.resident_blocks, remote.staging_blocks, remote.window_steps) == (
        local.resident_blocks,
        local.staging_blocks,
        local.window_steps,
    )


def test_plan_rpc_validation_names_field(channel) -> None:  # type: ignore[no-untyped-def]
    """A batch with a bad field gets INVALID_ARGUMENT naming the `kvplane plan` path and range."""
    stub = pb_grpc.ControlPlaneStub(channel)
    msg = convert.batch_to_proto(small_batch(2))
    msg.requests[0].context_tokens = 0
    with pytest.raises(grpc.RpcError) as info:
        stub.Plan(pb.PlanRequest(batch=msg), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "batch.requests[0].context_tokens: 0 is out of range (allowed >= 1)"
    with pytest.raises(grpc.RpcError) as info:
        stub.Plan(pb.PlanRequest(), timeout=10)
    assert info.value.details() == "batch: is required"


def test_plan_of_a_bad_mapping_is_refused_alike_remote_and_embedded(served, client) -> None:  # type: ignore[no-untyped-def]
    """``plan`` of a mapping with a bad field raises ``api.InvalidArgument`` naming the field on the
    gRPC client as on the embedded control plane (the ``api.ControlPlane`` contract), not the
    model's own ``SchemaError``; a good mapping plans on both."""
    good = small_batch(2).to_dict()
    assert client.plan(good).placements == served.control_plane.plan(good).placements
    bad = small_batch(2).to_dict()
    bad["requests"][0]["context_tokens"] = 0
    messages = []
    for plane in (client, served.control_plane):
        with pytest.raises(api.InvalidArgument) as info:
            plane.plan(bad)
        assert not isinstance(info.value, SchemaError)
        messages.append(str(info.value))
    assert messages[0] == messages[1]
    assert messages[0].startswith("requests[0].context_tokens: 0 is out of range")


def test_malformed_bytes_get_invalid_argument(served, channel) -> None:  # type: ignore[no-untyped-def]
    """Bytes that are not a valid protobuf get INVALID_ARGUMENT; the server keeps serving."""
    raw = channel.unary_unary("/kvplane.v1.ControlPlane/Plan")  # no serializer: raw bytes
    for garbage in (b"\xff\xff\xff\xff", b"\x0a\x05abc", b"\x08\x80\x80\x80\x80\x80\x80\x80\x80\x80\x80"):
        with pytest.raises(grpc.RpcError) as info:
            raw(garbage, timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, garbage
        assert "not a valid kvplane.v1.PlanRequest" in info.value.details()
    stream = channel.stream_stream("/kvplane.v1.ControlPlane/Session")
    with pytest.raises(grpc.RpcError) as info:
        list(stream(iter([b"\xff\xff\xff"]), timeout=5))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert pb_grpc.PolicyServiceStub(channel).GetPolicy(pb.GetPolicyRequest(), timeout=5).version >= 1


def test_oversized_message_rejected_naming_limit(serve) -> None:  # type: ignore[no-untyped-def]
    """A message above max_message_bytes gets RESOURCE_EXHAUSTED stating the limit; server keeps serving."""
    s = serve(ServerConfig(max_sessions=4, max_watchers=1, max_message_bytes=64 * 1024))
    batch = convert.batch_to_proto(small_batch(2))
    for i in range(20_000):
        batch.requests.add(id=f"pad-{i:06d}", context_tokens=10, slo_tbt_ms=100.0)
    assert batch.ByteSize() > 64 * 1024
    with grpc.insecure_channel(s.target, options=[("grpc.max_send_message_length", -1)]) as ch:
        stub = pb_grpc.ControlPlaneStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            stub.Plan(pb.PlanRequest(batch=batch), timeout=10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert str(64 * 1024) in info.value.details()
        assert pb_grpc.PolicyServiceStub(ch).GetPolicy(pb.GetPolicyRequest(), timeout=5).version == 1


ERROR_CASES = [
    (api.InvalidArgument("x.y: bad"), grpc.StatusCode.INVALID_ARGUMENT),
    (SchemaError("x.y", "bad"), grpc.StatusCode.INVALID_ARGUMENT),
    (api.NotFound("no such"), grpc.StatusCode.NOT_FOUND),
    (api.Unauthenticated("who"), grpc.StatusCode.UNAUTHENTICATED),
    (api.Unavailable("down"), grpc.StatusCode.UNAVAILABLE),
    (api.ResourceExhausted("full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (RuntimeError("bug"), grpc.StatusCode.INTERNAL),
]




@contextlib.contextmanager
def _served_plan(plan: Callable[[object], object]) -> Iterator[grpc.Channel]:
    """A real server on port 0 whose control plane plans with ``plan``; a channel to it."""
    cp, _ = build_control_plane(None, None)
    cp.plan = plan  # type: ignore[method-assign]
    server, port = create_server("127.0.0.1:0", cp, ServerConfig(max_sessions=2, max_watchers=1))
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            yield ch
    finally:
        server.stop(0)
        cp.close()

@pytest.mark.parametrize(("exc", "code"), ERROR_CASES, ids=lambda v: type(v).__name__)
def test_domain_error_maps_to_status(exc: Exception, code: grpc.StatusCode) -> None:
    """Each domain error raised by the control plane reaches the client as its status code."""

    def failing_plan(batch: object) -> object:
        raise exc

    with _served_plan(failing_plan) as ch:
        stub = pb_grpc.ControlPlaneStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            stub.Plan(pb.PlanRequest(batch=convert.batch_to_proto(small_batch(1))), timeout=5)
        assert info.value.code() == code
        if code != grpc.StatusCode.INTERNAL:
            assert str(exc) in info.value.details()
            assert type(error_for(info.value)) is (
                api.InvalidArgument if isinstance(exc, SchemaError) else type(exc)
            )
        else:
            assert "bug" not in info.value.details()  # internals are not leaked
        assert status_for(exc) == (None if code == grpc.StatusCode.INTERNAL else code)
        assert pb_grpc.PolicyServiceStub(ch).GetPolicy(pb.GetPolicyRequest(), timeout=5)


def test_a_what_if_plan_past_the_size_limit_is_refused_by_name(channel) -> None:  # type: ignore[no-untyped-def]
    """1,025 requests x 1,024 layers is past MAX_WHAT_IF_CELLS: RESOURCE_EXHAUSTED naming the
    sizes and the limit, before any planning (such calls took seconds each and queued up every
    other what-if plan: control-plane review, session 54). Control: 1,024 x 1,024 is planned."""
    from controlplane.service.session_servicer import MAX_WHAT_IF_CELLS

    stub = pb_grpc.ControlPlaneStub(channel)
    assert MAX_WHAT_IF_CELLS == 1024 * 1024
    with pytest.raises(grpc.RpcError) as info:
        stub.Plan(pb.PlanRequest(batch=convert.batch_to_proto(small_batch(1025, layers=1024))), timeout=30)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
    assert info.value.details() == (
        "batch: 1025 requests x 1024 layers = 1049600 placements (limit 1048576 for a what-if plan)")
    reply = stub.Plan(pb.PlanRequest(batch=convert.batch_to_proto(small_batch(1024, layers=1024))), timeout=120)
    assert len(reply.plan.placements) + len(reply.plan.paused) == 1024


def test_a_what_if_plan_waits_a_bounded_time_for_the_one_running() -> None:
    """A slow what-if plan runs; a second caller is RESOURCE_EXHAUSTED after WHAT_IF_WAIT_S
    instead of holding a server thread until the slow one ends (queued callers reached the RPC
    limit, and health checks were refused), and the policy service answers meanwhile. Control:
    once the slow plan is done, the next plan is served."""
    import threading
    import time

    from controlplane.planner import Planner
    from controlplane.service.session_servicer import WHAT_IF_WAIT_S

    release = threading.Event()

    def slow_plan(batch: object) -> object:
        release.wait(30)
        return Planner().plan(batch)  # type: ignore[arg-type]

    with _served_plan(slow_plan) as ch:
        try:
            stub = pb_grpc.ControlPlaneStub(ch)
            request = pb.PlanRequest(batch=convert.batch_to_proto(small_batch(1)))
            first = stub.Plan.future(request, timeout=60)
            time.sleep(0.3)  # the first holds the gate
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                stub.Plan(request, timeout=30)
            waited = time.monotonic() - t0
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value
            assert "another what-if plan is running" in info.value.details()
            assert WHAT_IF_WAIT_S <= waited + 0.05 < WHAT_IF_WAIT_S + 5
            assert pb_grpc.PolicyServiceStub(ch).GetPolicy(pb.GetPolicyRequest(), timeout=5)
            release.set()
            assert first.result().plan.feasible
            assert stub.Plan(request, timeout=30).plan.feasible
        finally:
            release.set()


def test_a_plan_policy_naming_some_fields_takes_the_defaults_for_the_rest() -> None:
    """``PlanPolicy`` fields are optional: a policy naming only ``deposit_credit`` (or only the
    windows) plans with the planner's defaults for the others (before, an unset field arrived as
    0: ``window_min: 0 is out of range``). Control: an explicit out-of-range value is still refused
    naming the field; a full policy round-trips."""
    from controlplane.model import Batch
    from controlplane.model.batch import PlanPolicy as Defaults

    base = convert.batch_to_proto(small_batch(1))
    only_credit = pb.Batch()
    only_credit.CopyFrom(base)
    only_credit.policy.Clear()
    only_credit.policy.deposit_credit = False
    got = convert.batch_from_proto(only_credit)
    defaults = Defaults()
    assert (got.policy.window_min, got.policy.window_max, got.policy.alpha) == (
        defaults.window_min, defaults.window_max, defaults.alpha)
    assert got.policy.deposit_credit is False
    bad = pb.Batch()
    bad.CopyFrom(only_credit)
    bad.policy.window_min = 0
    with pytest.raises(api.InvalidArgument, match="window_min"):
        convert.batch_from_proto(bad)
    assert isinstance(convert.batch_from_proto(base), Batch)
