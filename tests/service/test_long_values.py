"""Bad input of any size gets INVALID_ARGUMENT naming the field, over a real server on port 0
(control-plane review, session 80): a 100,000-character policy field or hello scheduler was
echoed whole into the status, which went past gRPC's metadata limit, so the client saw
RESOURCE_EXHAUSTED ("Stream removed") instead, and the server logged 100 KB per request. The
client library answers with the API's own errors where grpc or protobuf raised raw ones."""

from __future__ import annotations

import grpc
import pytest
from structlog.testing import capture_logs

from controlplane import api
from controlplane.model import SHOWN_CHARS
from controlplane.service import convert
from controlplane.service.interceptors import MAX_DETAILS_BYTES
from kvplane.v1 import controlplane_pb2 as pb
from kvplane.v1 import controlplane_pb2_grpc as pb_grpc

from .conftest import TOKEN, worker_info

LONG = "x" * 100_000


def _status(call) -> tuple[grpc.StatusCode, str]:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


@pytest.mark.parametrize("n", [SHOWN_CHARS // 2, len(LONG)], ids=["short", "long"])
def test_a_long_bad_value_is_invalid_argument_naming_the_field(served, channel, n: int) -> None:  # type: ignore[no-untyped-def]
    """Each of the three is refused as INVALID_ARGUMENT naming its field, with the value cut to a
    prefix and its length; the server logs no more than the cut status. The short value is shown
    whole (the control that the cut is only for long ones)."""
    value = "x" * n
    policy = pb_grpc.PolicyServiceStub(channel)
    auth = (("authorization", f"Bearer {TOKEN}"),)
    hello = convert.worker_info_to_proto(worker_info("w-long"))
    hello.scheduler = value
    calls = {
        "victim_rule": lambda: policy.UpdatePolicy(
            pb.UpdatePolicyRequest(changes=pb.Policy(victim_rule=value)), metadata=auth, timeout=5),
        "scheduler": lambda: policy.UpdatePolicy(
            pb.UpdatePolicyRequest(changes=pb.Policy(scheduler=value)), metadata=auth, timeout=5),
        "hello.scheduler": lambda: list(pb_grpc.ControlPlaneStub(channel).Session(
            iter([pb.WorkerMessage(hello=hello)]), timeout=5)),
    }
    for field, call in calls.items():
        with capture_logs() as logs:
            code, details = _status(call)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (field, code, details[:200])
        assert details.startswith(f"{field}: '") and "is not one of" in details, details[:200]
        if n > SHOWN_CHARS:
            assert f"({n + 2} characters)" in details and len(details) < 400, details[:200]
        else:
            assert repr(value) in details
        assert max(len(repr(e)) for e in logs) < 1000
    assert policy.GetPolicy(pb.GetPolicyRequest(), timeout=5).version == 1  # nothing changed


@pytest.mark.parametrize("char", ["y", "\U0001F600"], ids=["ascii", "4-byte"])
def test_the_status_details_are_capped_whatever_the_message(served, channel, monkeypatch, char: str) -> None:  # type: ignore[no-untyped-def]
    """A backstop for messages that echo a value uncut: the interceptor sends at most
    ``MAX_DETAILS_BYTES`` of the details' UTF-8. Here the policy store's refusal is made 50,000
    characters long; without the cap the client sees RESOURCE_EXHAUSTED. A character cap let
    4-byte characters through (12 bytes each percent-encoded: review of session 80), so five
    calls each."""
    from controlplane.policy_store import PolicyStore

    def refuse(self, changes, **kwargs):  # type: ignore[no-untyped-def]
        raise api.InvalidArgument("alpha: " + char * 50_000)

    monkeypatch.setattr(PolicyStore, "update", refuse)
    for _ in range(5):
        code, details = _status(lambda: pb_grpc.PolicyServiceStub(channel).UpdatePolicy(
            pb.UpdatePolicyRequest(changes=pb.Policy(alpha=0.5)),
            metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=5))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("alpha: " + char * 3)
        assert len(details.encode()) <= MAX_DETAILS_BYTES + 40 and details.endswith("(50007 characters)")


@pytest.mark.parametrize("plane", ["embedded", "grpc"])
def test_out_of_range_numbers_and_unknown_keys_are_invalid_argument_cut(served, connect, plane: str) -> None:  # type: ignore[no-untyped-def]
    """Review of session 80: an integer past a double (``float()``'s OverflowError), one too long
    to print (Python's 4,300-digit limit: ValueError), and a 100,000-character unknown key were
    raw errors or echoed whole; each is ``InvalidArgument`` with a short message, on both planes.
    Control: the same calls with sane values work."""
    from controlplane.embedded import EmbeddedControlPlane

    cp = EmbeddedControlPlane() if plane == "embedded" else connect(served.target, token=TOKEN)
    try:
        def batch(**over: object) -> dict:
            b = {"model": {"layers": 8, "block_size": 16, "block_bytes": 65536},
                 "hardware": {"gpu_kv_budget_blocks": 200, "h2d_gbps": 25.0}, "profile": {"layer_compute_ms": 0.5},
                 "requests": [{"id": "r0", "context_tokens": 100, "slo_tbt_ms": 200.0}]}
            for key, value in over.items():
                b["hardware" if key == "h2d_gbps" else "model"][key] = value
            return b
        assert cp.plan(batch()).feasible  # control
        for call in (lambda: cp.plan(batch(h2d_gbps=10**400)), lambda: cp.plan(batch(layers=10**5000)),
                     lambda: cp.update_policy({"slo_tbt_ms": 10**400}), lambda: cp.update_policy({"k" * 100_000: 1}),
                     lambda: cp.update_policy({"layerkv": {"k" * 100_000: 1}})):
            with pytest.raises(api.InvalidArgument) as info:
                call()
            assert len(str(info.value)) < 400, str(info.value)[:200]
        assert cp.update_policy({"slo_tbt_ms": 150.0}).slo_tbt_ms == 150.0  # control
    finally:
        cp.close()


def test_a_close_racing_a_call_is_unavailable(served, connect, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Review of session 80: ``close()`` landing between a call's open check and its work let
    ``open_session`` return a session whose thread died on the closed channel (still tracked,
    degraded for good) and ``plan`` raise grpc's ValueError. The close is forced in between."""
    import threading

    from controlplane.service import client as client_mod

    for what in ("open_session", "plan"):
        client = connect(served.target)
        real_w, real_b = convert.worker_info_to_proto, convert.batch_to_proto

        def closing(real, client=client):  # type: ignore[no-untyped-def]
            def f(x):  # type: ignore[no-untyped-def]
                t = threading.Thread(target=client.close, kwargs={"drain_s": 0.5})
                t.start()
                t.join()
                return real(x)
            return f

        monkeypatch.setattr(client_mod.convert, "worker_info_to_proto", closing(real_w))
        monkeypatch.setattr(client_mod.convert, "batch_to_proto", closing(real_b))
        with pytest.raises(api.Unavailable, match="is closed"):
            if what == "open_session":
                client.open_session(worker_info("w-race"))
            else:
                client.plan({"model": {"layers": 8, "block_size": 16, "block_bytes": 65536},
                             "hardware": {"gpu_kv_budget_blocks": 200, "h2d_gbps": 25.0},
                             "profile": {"layer_compute_ms": 0.5},
                             "requests": [{"id": "r0", "context_tokens": 100, "slo_tbt_ms": 200.0}]})
        monkeypatch.undo()
        assert not client._sessions


def test_the_client_answers_with_the_apis_errors(served, connect) -> None:  # type: ignore[no-untyped-def]
    """``update_policy`` of a non-mapping, and ``plan`` of an integer past int64, are
    ``InvalidArgument`` (AttributeError and ValueError before); after ``close()`` every call is
    ``Unavailable`` (before: ``open_session`` returned a session whose thread had died on the
    closed channel, and ``get_policy`` raised grpc's ValueError). Control: a valid update works."""
    client = connect(served.target, token=TOKEN)
    with pytest.raises(api.InvalidArgument, match="policy: expected an object, got list"):
        client.update_policy([("alpha", 0.5)])  # type: ignore[arg-type]
    batch = {"model": {"layers": 8, "block_size": 16, "block_bytes": 65536},
             "hardware": {"gpu_kv_budget_blocks": 200, "h2d_gbps": 25.0}, "profile": {"layer_compute_ms": 0.5},
             "requests": [{"id": "r0", "context_tokens": 2**70, "slo_tbt_ms": 200.0}]}
    with pytest.raises(api.InvalidArgument, match="batch: does not fit the wire format"):
        client.plan(batch)
    assert client.update_policy({"alpha": 0.5}).alpha == 0.5
    client.close()
    for call in (lambda: client.open_session(worker_info("w-closed")), client.get_policy, client.health,
                 lambda: client.update_policy({"alpha": 0.25}), lambda: next(client.watch_policy()),
                 lambda: client.plan(batch)):
        with pytest.raises(api.Unavailable, match="is closed"):
            call()
