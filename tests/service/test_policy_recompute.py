"""The recompute policy field (issue 16) over a real PolicyService on 127.0.0.1:0: updated, read
back on the wire and by the client, out-of-range values refused naming the field and range."""

from __future__ import annotations

import grpc
import pytest

from controlplane import api
from kvplane.v1 import controlplane_pb2 as pb
from kvplane.v1 import controlplane_pb2_grpc as pb_grpc

from .conftest import TOKEN


def test_max_recompute_ratio_updates_and_reads_back(served, connect, channel) -> None:  # type: ignore[no-untyped-def]
    """An update of max_recompute_ratio is applied (version + 1), read back by GetPolicy on the
    raw stub and by the client, and reaches the planner's part of the policy."""
    stub = pb_grpc.PolicyServiceStub(channel)
    before = stub.GetPolicy(pb.GetPolicyRequest(), timeout=5)
    assert before.HasField("max_recompute_ratio") and before.max_recompute_ratio == 0.0
    client = connect(served.target, token=TOKEN)
    new = client.update_policy({"max_recompute_ratio": 0.35})
    assert (new.version, new.max_recompute_ratio) == (2, 0.35)
    wire = stub.GetPolicy(pb.GetPolicyRequest(), timeout=5)
    assert (wire.version, wire.max_recompute_ratio) == (2, 0.35)
    assert client.get_policy().plan_policy.max_recompute_ratio == 0.35
    # negative control: the fields the update did not name kept their values
    assert wire.alpha == before.alpha and wire.window_max == before.window_max


@pytest.mark.parametrize("bad", [1.0, -0.25, 7.5])
def test_out_of_range_ratio_is_refused(served, connect, channel, bad) -> None:  # type: ignore[no-untyped-def]
    """A ratio outside [0, 1) gets INVALID_ARGUMENT naming the field and range; nothing changes."""
    client = connect(served.target, token=TOKEN)
    with pytest.raises(api.InvalidArgument) as info:
        client.update_policy({"max_recompute_ratio": bad})
    assert f"max_recompute_ratio: {bad} is out of range (allowed [0.0, 1.0))" in str(info.value)
    stub = pb_grpc.PolicyServiceStub(channel)
    with pytest.raises(grpc.RpcError) as raw:
        stub.UpdatePolicy(
            pb.UpdatePolicyRequest(changes=pb.Policy(max_recompute_ratio=bad)),
            metadata=(("authorization", f"Bearer {TOKEN}"),),
            timeout=5,
        )
    assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_recompute_ratio" in (raw.value.details() or "")
    policy = client.get_policy()
    assert (policy.version, policy.max_recompute_ratio) == (1, 0.0)
