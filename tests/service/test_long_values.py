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
from controlplane.service.interceptors import MAX_DETAILS_CHARS
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


def test_the_status_details_are_capped_whatever_the_message(served, channel, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A backstop for messages that echo a value uncut: the interceptor sends at most
    ``MAX_DETAILS_CHARS`` of the details. Here the policy store's refusal is made 50,000 characters
    long; without the cap the client sees RESOURCE_EXHAUSTED."""
    from controlplane.policy_store import PolicyStore

    def refuse(self, changes, **kwargs):  # type: ignore[no-untyped-def]
        raise api.InvalidArgument("alpha: " + "y" * 50_000)

    monkeypatch.setattr(PolicyStore, "update", refuse)
    code, details = _status(lambda: pb_grpc.PolicyServiceStub(channel).UpdatePolicy(
        pb.UpdatePolicyRequest(changes=pb.Policy(alpha=0.5)),
        metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("alpha: yyy")
    assert len(details) <= MAX_DETAILS_CHARS + 40 and details.endswith("(50007 characters)")


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
    for call in (lambda: client.open_session(worker_info("w-closed")), client.get_policy,
                 lambda: client.update_policy({"alpha": 0.25}), lambda: next(client.watch_policy()),
                 lambda: client.plan(batch)):
        with pytest.raises(api.Unavailable, match="is closed"):
            call()
