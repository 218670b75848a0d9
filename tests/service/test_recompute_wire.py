"""The recompute option on the wire (issue 16, docs/recompute.md): the profile's
``recompute_ms_per_token``, the batch policy's ``max_recompute_ratio`` and the plan's
``recompute_blocks`` / ``recompute_layers`` / ``transient_blocks`` survive protobuf, are checked
when decoded, and a remote worker whose hello carries the recompute cost gets planned recompute
in its decisions from a real gRPC server."""

from __future__ import annotations

import dataclasses

import pytest

from controlplane import api
from controlplane.model import Batch, Hardware, ModelSpec, Plan, Profile
from controlplane.policy import Policy
from controlplane.service import convert
from controlplane.service.server import ServerConfig
from kvplane.v1 import controlplane_pb2 as pb

from .conftest import small_batch, wait_until

PLAN = Plan(
    feasible=True, paused=(), placements={"a": (1, 1, 0, 1), "b": (1, 1, 1, 1)}, predicted_step_ms=4.5,
    window_steps=16, resident_blocks=900, staging_blocks=300, solver="recompute", solve_ms=1.5,
    expiry_step=40, recompute_blocks={"a": 120}, recompute_layers={"a": 2}, transient_blocks=120,
)


def worker(rms: tuple[float, ...] | None = (1e-4,) * 4) -> api.WorkerInfo:
    """A 4-layer worker on a slow link whose 2304-block budget a 700-token request overflows."""
    return api.WorkerInfo(
        worker_id="recompute-w", model=ModelSpec(layers=4, block_size=1, block_bytes=256),
        hardware=Hardware(gpu_kv_budget_blocks=2304, h2d_gbps=1e-3), profile=Profile((1.0,) * 4, rms),
    )


def test_plan_recompute_fields_round_trip() -> None:
    """A decision's plan keeps u, k and the transient blocks through the bytes; a plan without
    recompute stays without (backward compatible: empty maps, 0)."""
    d = api.Decision(plan=PLAN, apply_at_step=24, expiry_step=40, reason="batch-change")
    wire = pb.Decision.FromString(convert.decision_to_proto(d).SerializeToString())
    got = convert.decision_from_proto(wire)
    assert got == d and got.plan.recompute_blocks == {"a": 120}
    plain = dataclasses.replace(PLAN, recompute_blocks={}, recompute_layers={}, transient_blocks=0)
    back = convert.plan_from_proto(convert.plan_to_proto(plain))
    assert back == plain
    # negative control: the two plans differ exactly in the recompute fields
    assert back != got.plan


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda m: m.recompute_layers.pop("a"), "plan.recompute_layers"),
        (lambda m: m.recompute_blocks.__setitem__("a", 0), "plan.recompute_blocks['a']"),
        (lambda m: m.recompute_layers.__setitem__("a", -1), "plan.recompute_layers['a']"),
        (lambda m: setattr(m, "transient_blocks", -3), "plan.transient_blocks"),
    ],
)
def test_bad_plan_recompute_is_refused_naming_the_field(mutate, field: str) -> None:  # type: ignore[no-untyped-def]
    """Keys that disagree, u < 1, k < 0 or negative transient blocks: InvalidArgument naming it."""
    msg = convert.plan_to_proto(PLAN)
    convert.plan_from_proto(msg)  # negative control: the unmutated message decodes
    mutate(msg)
    with pytest.raises(api.InvalidArgument, match=field.replace("[", r"\[").replace("]", r"\]")):
        convert.plan_from_proto(msg)


def test_batch_and_hello_carry_the_recompute_option() -> None:
    """The Plan RPC's batch keeps profile.recompute_ms_per_token and policy.max_recompute_ratio
    (so it offers recompute exactly like `kvplane plan`); the hello keeps the worker's figure."""
    d = small_batch(3).to_dict()
    d["profile"]["recompute_ms_per_token"] = [0.001 * (i + 1) for i in range(8)]
    d["policy"]["max_recompute_ratio"] = 0.4
    batch = Batch.from_dict(d)
    back = convert.batch_from_proto(convert.batch_to_proto(batch))
    assert back == batch and back.offers_recompute
    old = small_batch(3)  # negative control: without the fields nothing appears
    assert convert.batch_from_proto(convert.batch_to_proto(old)) == old and not old.offers_recompute
    info = worker()
    assert convert.worker_info_from_proto(convert.worker_info_to_proto(info)) == info
    bad = convert.worker_info_to_proto(info)
    bad.profile.recompute_ms_per_token[:] = [1e-4, 1e-4]
    with pytest.raises(api.InvalidArgument, match="recompute_ms_per_token"):
        convert.worker_info_from_proto(bad)


@pytest.mark.parametrize("rms", [(1e-4,) * 4, None])
def test_remote_worker_gets_planned_recompute(serve, connect, rms) -> None:  # type: ignore[no-untyped-def]
    """Over a real gRPC server (policy max_recompute_ratio 0.5): a worker whose hello carries the
    recompute cost gets decisions with an uncached prefix for its overflowing request; the same
    worker without the figure never does (negative control)."""
    policy = Policy(max_recompute_ratio=0.5, solve_budget_fraction=10.0)  # budget: see test_planned_recompute
    served = serve(ServerConfig(max_sessions=4, max_watchers=1), policy=policy)
    session = connect(served.target).open_session(dataclasses.replace(worker(rms), worker_id=f"w-{rms is None}"))
    assert session.wait_connected(10)
    got: list[api.Decision] = []
    step = 0

    def more() -> bool:
        nonlocal step
        running = (api.RequestState(id="a", context_tokens=700 + step, generated_tokens=1 + step),)
        got.extend(session.report(api.StepReport(step=step, now_ms=step * 10.0, running=running,
                                                 observed_step_ms=4.0 if step else None)))
        step += 1
        return bool(got)

    assert wait_until(more, 20.0, 0.01)
    plan = got[-1].plan
    if rms is None:
        assert not plan.recompute_blocks and plan.transient_blocks == 0
    else:
        assert set(plan.recompute_blocks) == set(plan.recompute_layers) == {"a"}
        assert plan.recompute_blocks["a"] > 0 and plan.placements["a"] == (1, 1, 1, 1)
    session.close()
