"""Fuzz: hypothesis-generated protobuf messages against every RPC of a live server.

Each call must end with OK or a proper client-error status (never INTERNAL/UNKNOWN/a hang), and
the server must keep serving afterwards. Messages are generated from the proto descriptors, so a
new field is fuzzed without touching this file.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.cli.serve_cmd import build_control_plane
from controlplane.service.metrics import ServiceMetrics
from controlplane.service.server import ServerConfig, create_server
from kvplane.v1 import controlplane_pb2 as pb
from kvplane.v1 import controlplane_pb2_grpc as pb_grpc

from .conftest import TOKEN

ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.NOT_FOUND,
}
CALL_TIMEOUT_S = 20.0

_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
}


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    small = st.integers(max(lo, -3), min(hi, 70))
    return st.one_of(small, st.sampled_from([lo, hi, 0, 1]), st.integers(lo, hi))


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[object]:
    t = field.type
    if t in _INT_RANGES:
        return _ints(*_INT_RANGES[t])
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.one_of(st.floats(-10.0, 500.0), st.floats(allow_nan=True, allow_infinity=True, width=32 if t == FieldDescriptor.TYPE_FLOAT else 64))
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t == FieldDescriptor.TYPE_STRING:
        return st.one_of(st.sampled_from(["", "r0", "fcfs", "lvf", "largest"]), st.text(max_size=12))
    if t == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=16)
    if t == FieldDescriptor.TYPE_ENUM:
        return st.sampled_from([v.number for v in field.enum_type.values])
    raise NotImplementedError(field.full_name)


@st.composite
def messages(draw: st.DrawFn, descriptor: Descriptor, depth: int = 0) -> object:
    """A random message of ``descriptor``'s type (every field maybe set, lists up to 4)."""
    cls = getattr(pb, descriptor.name) if descriptor.containing_type is None else None
    msg = cls() if cls is not None else None
    assert msg is not None, descriptor.full_name
    _fill(draw, msg, depth)
    return msg


def _fill(draw: st.DrawFn, msg: object, depth: int) -> None:
    for field in msg.DESCRIPTOR.fields:  # type: ignore[attr-defined]
        if not draw(st.booleans()):
            continue
        is_map = field.message_type is not None and field.message_type.GetOptions().map_entry
        if is_map:
            key_f, val_f = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            target = getattr(msg, field.name)
            for _ in range(draw(st.integers(0, 3))):
                key = draw(_scalar(key_f))
                if val_f.message_type is not None:
                    if depth < 3:
                        _fill(draw, target[key], depth + 1)
                else:
                    target[key] = draw(_scalar(val_f))
        elif field.is_repeated:
            target = getattr(msg, field.name)
            for _ in range(draw(st.integers(0, 4))):
                if field.message_type is not None:
                    if depth < 3:
                        _fill(draw, target.add(), depth + 1)
                else:
                    target.append(draw(_scalar(field)))
        elif field.message_type is not None:
            if depth < 3:
                sub = getattr(msg, field.name)
                sub.SetInParent()
                _fill(draw, sub, depth + 1)
        else:
            setattr(msg, field.name, draw(_scalar(field)))


@pytest.fixture(scope="module")
def fuzz_target() -> Iterator[str]:
    config = ServerConfig(max_sessions=8, max_watchers=4, policy_token=TOKEN)
    metrics = ServiceMetrics()
    cp, notifier = build_control_plane(None, TOKEN, metrics)
    server, port = create_server("127.0.0.1:0", cp, config, metrics, notifier)
    server.start()
    yield f"127.0.0.1:{port}"
    pb_grpc.PolicyServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}")).GetPolicy(
        pb.GetPolicyRequest(), timeout=5
    )  # still serving after everything
    server.stop(0.5)
    cp.close()


@pytest.fixture(scope="module")
def fuzz_channel(fuzz_target: str) -> Iterator[grpc.Channel]:
    ch = grpc.insecure_channel(fuzz_target)
    yield ch
    ch.close()


def _code(fn) -> grpc.StatusCode:  # type: ignore[no-untyped-def]
    try:
        fn()
        return grpc.StatusCode.OK
    except grpc.RpcError as err:
        return err.code()


FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@FUZZ
@given(messages(pb.PlanRequest.DESCRIPTOR))
def test_fuzz_plan(fuzz_channel, request) -> None:  # type: ignore[no-untyped-def]
    """Plan answers any PlanRequest with OK or a client-error status."""
    stub = pb_grpc.ControlPlaneStub(fuzz_channel)
    code = _code(lambda: stub.Plan(request, timeout=CALL_TIMEOUT_S))
    assert code in ALLOWED, (code, request)


@FUZZ
@given(messages(pb.UpdatePolicyRequest.DESCRIPTOR), st.sampled_from([None, TOKEN, "bad"]))
def test_fuzz_policy(fuzz_channel, request, token) -> None:  # type: ignore[no-untyped-def]
    """GetPolicy/UpdatePolicy/WatchPolicy answer any input with OK or a client-error status."""
    stub = pb_grpc.PolicyServiceStub(fuzz_channel)
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    code = _code(lambda: stub.UpdatePolicy(request, metadata=metadata, timeout=CALL_TIMEOUT_S))
    assert code in ALLOWED, (code, request)
    if token != TOKEN:
        assert code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT)
    assert _code(lambda: stub.GetPolicy(pb.GetPolicyRequest(), timeout=CALL_TIMEOUT_S)) == grpc.StatusCode.OK
    watch = stub.WatchPolicy(pb.WatchPolicyRequest(), timeout=CALL_TIMEOUT_S)
    assert next(watch).policy.version >= 1
    watch.cancel()


@FUZZ
@given(
    st.one_of(
        st.tuples(messages(pb.WorkerInfo.DESCRIPTOR).map(lambda h: pb.WorkerMessage(hello=h))),
        st.tuples(messages(pb.WorkerMessage.DESCRIPTOR)),
    ),
    st.lists(messages(pb.WorkerMessage.DESCRIPTOR), max_size=5),
)
def test_fuzz_session(fuzz_channel, first, rest) -> None:  # type: ignore[no-untyped-def]
    """A Session fed random messages ends with OK or a client-error status, or stays open answering."""
    stub = pb_grpc.ControlPlaneStub(fuzz_channel)
    call = stub.Session(iter([*first, *rest]), timeout=CALL_TIMEOUT_S)
    code = _code(lambda: list(call))
    assert code in ALLOWED, (code, first, rest)
