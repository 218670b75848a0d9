"""Protobuf <-> domain translation: lossless round trips and validation that names the field."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane import api
from controlplane.model import Plan
from controlplane.policy import Policy
from controlplane.service import convert, policy_convert
from kvplane.v1 import controlplane_pb2 as pb

from .conftest import small_batch, worker_info

ids = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
finite = st.floats(min_value=0.0, max_value=1e6, allow_nan=False, allow_infinity=False)
positive = st.floats(min_value=1e-3, max_value=1e6, allow_nan=False, allow_infinity=False)
counts = st.integers(min_value=1, max_value=1 << 40)


@st.composite
def step_reports(draw: st.DrawFn) -> api.StepReport:
    rids = draw(st.lists(ids, unique=True, max_size=6))
    running = tuple(
        api.RequestState(
            id=rid,
            context_tokens=draw(counts),
            generated_tokens=draw(st.integers(0, 1 << 30)),
            slo_tbt_ms=draw(st.none() | positive),
            paused=draw(st.booleans()),
            gpu_layers=draw(st.none() | st.integers(0, 4096)),
            max_new_tokens=draw(st.none() | counts),
        )
        for rid in rids
    )
    queued = tuple(
        api.QueuedRequest(
            id=rid,
            prompt_tokens=draw(counts),
            arrival_ms=draw(finite),
            slo_ttft_ms=draw(st.none() | positive),
        )
        for rid in draw(st.lists(ids, unique=True, max_size=4))
    )
    layer_ms = draw(st.none() | st.lists(finite, min_size=1, max_size=8).map(tuple))
    return api.StepReport(
        step=draw(st.integers(0, 1 << 50)),
        now_ms=draw(finite),
        running=running,
        queued=queued,
        observed_step_ms=draw(st.none() | finite),
        layer_compute_ms=layer_ms,
        h2d_gbps=draw(st.none() | positive),
        finished=tuple(draw(st.lists(ids, max_size=4))),
        free_gpu_blocks=draw(st.none() | st.integers(0, 1 << 40)),
        pauses_dropped=tuple(draw(st.lists(ids, max_size=3))),
    )


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    layers = draw(st.integers(1, 8))
    placements = {
        rid: tuple(draw(st.lists(st.integers(0, 1), min_size=layers, max_size=layers)))
        for rid in draw(st.lists(ids, unique=True, max_size=5))
    }
    return Plan(
        feasible=draw(st.booleans()),
        paused=tuple(draw(st.lists(ids, max_size=3))),
        placements=placements,
        predicted_step_ms=draw(finite),
        window_steps=draw(st.integers(1, 1000)),
        resident_blocks=draw(st.integers(0, 1 << 40)),
        staging_blocks=draw(st.integers(0, 1 << 40)),
        solver=draw(st.sampled_from(["mip", "exhaustive", "greedy"])),
        solve_ms=draw(finite),
        expiry_step=draw(st.none() | st.integers(0, 1 << 40)),
    )


@settings(max_examples=60, deadline=None)
@given(step_reports())
def test_step_report_round_trip(report: api.StepReport) -> None:
    """A valid StepReport survives proto encoding, bytes and decoding unchanged."""
    wire = pb.StepReport.FromString(convert.step_report_to_proto(report).SerializeToString())
    assert convert.step_report_from_proto(wire) == report


@settings(max_examples=60, deadline=None)
@given(plans(), st.integers(0, 1 << 40), st.lists(ids, max_size=3), st.lists(ids, max_size=3))
def test_decision_round_trip(plan: Plan, step: int, pause: list[str], admit: list[str]) -> None:
    """A Decision survives the wire unchanged (plan, steps, pause/resume/admit, min layers)."""
    d = api.Decision(
        plan=plan,
        apply_at_step=step + 1,
        expiry_step=step + plan.window_steps,
        pause=tuple(pause),
        resume=tuple(reversed(pause)),
        admit=tuple(admit),
        min_gpu_layers={a: 3 for a in admit},
        reason="batch-change",
        policy_version=7,
    )
    wire = pb.Decision.FromString(convert.decision_to_proto(d).SerializeToString())
    assert convert.decision_from_proto(wire) == d


def test_batch_and_worker_info_round_trip() -> None:
    """Batch and WorkerInfo survive the wire unchanged."""
    batch = small_batch(4)
    assert convert.batch_from_proto(convert.batch_to_proto(batch)) == batch
    info = worker_info("w-7")
    assert convert.worker_info_from_proto(convert.worker_info_to_proto(info)) == info


def test_policy_round_trip_and_partial_changes() -> None:
    """A full policy round-trips; a partial update carries only the fields that were set."""
    policy = Policy.from_dict({"alpha": 0.25, "scheduler": "lvf", "lvf": {"beta_b": 0.9}})
    assert policy_convert.policy_from_proto(policy_convert.policy_to_proto(policy)) == policy
    msg = policy_convert.policy_changes_to_proto({"window_max": 32, "layerkv": {"tpot_margin": 0.5}})
    assert policy_convert.policy_changes_from_proto(msg) == {
        "window_max": 32,
        "layerkv": {"tpot_margin": 0.5},
    }
    with pytest.raises(api.InvalidArgument, match="bogus"):
        policy_convert.policy_changes_to_proto({"bogus": 1})


@pytest.mark.parametrize(
    ("mutate", "field", "fragment"),
    [
        (lambda m: setattr(m, "step", -1), "report.step", "allowed [0, 4611686018427387904]"),
        (lambda m: setattr(m, "step", 2**63 - 1), "report.step", "allowed [0, 4611686018427387904]"),
        (lambda m: setattr(m, "now_ms", math.nan), "report.now_ms", "not finite"),
        (lambda m: m.running.add(id="a", context_tokens=0), "report.running[0].context_tokens", "allowed >= 1"),
        (lambda m: m.running.add(id="", context_tokens=5), "report.running[0].id", "non-empty"),
        (lambda m: m.running.add(id="a" * 300, context_tokens=5), "report.running[0].id", "[1, 256]"),
        (lambda m: m.queued.add(id="q", prompt_tokens=-3), "report.queued[0].prompt_tokens", "allowed >= 1"),
        (lambda m: setattr(m, "h2d_gbps", 0.0), "report.h2d_gbps", "allowed > 0"),
        (lambda m: m.layer_compute_ms.append(-1.0), "report.layer_compute_ms[0]", "allowed >= 0"),
        (lambda m: m.pauses_dropped.append(""), "report.pauses_dropped[0]", "non-empty"),
        (lambda m: m.pauses_dropped.extend(["p"] * 70_000), "report.pauses_dropped", "65536"),
    ],
)
def test_step_report_validation_names_field(mutate, field: str, fragment: str) -> None:  # type: ignore[no-untyped-def]
    """An out-of-range report field raises InvalidArgument starting with its path and the range."""
    msg = pb.StepReport(step=1, now_ms=1.0)
    mutate(msg)
    with pytest.raises(api.InvalidArgument) as info:
        convert.step_report_from_proto(msg)
    assert str(info.value).startswith(field + ":"), str(info.value)
    assert fragment in str(info.value)


def test_a_link_that_moves_no_block_per_ms_is_refused() -> None:
    """h2d_gbps 1e-320 with the largest block: each field in range, their ratio 0 blocks/ms (the
    planner divided by it). Refused at the hello and in a batch, naming h2d_gbps; control: 1e-3 GB/s
    passes both."""
    from controlplane.model import Batch, SchemaError

    hello = pb.WorkerInfo(worker_id="w", model=pb.ModelSpec(layers=2, block_size=16, block_bytes=2**63 - 1),
                          hardware=pb.Hardware(gpu_kv_budget_blocks=10, h2d_gbps=1e-320),
                          profile=pb.Profile(layer_compute_ms=[0.5]))
    with pytest.raises(api.InvalidArgument, match=r"^hello\.hardware\.h2d_gbps: "):
        convert.worker_info_from_proto(hello)
    batch = {"model": {"layers": 2, "block_size": 16, "block_bytes": 2**63 - 1},
             "hardware": {"gpu_kv_budget_blocks": 10, "h2d_gbps": 1e-320}, "profile": {"layer_compute_ms": 0.5},
             "requests": [{"id": "a", "context_tokens": 10, "slo_tbt_ms": 100.0}]}
    with pytest.raises(SchemaError, match="hardware.h2d_gbps"):
        Batch.from_dict(batch)
    hello.hardware.h2d_gbps = batch["hardware"]["h2d_gbps"] = 1e-3
    assert convert.worker_info_from_proto(hello).hardware.h2d_gbps == 1e-3
    assert Batch.from_dict(batch).bw_blocks_per_ms > 0


def test_steps_past_max_step_are_refused() -> None:
    """A report at MAX_STEP (2^62: a decision adds at most a window of 10^6 steps to it and stays
    int64 on the wire) is accepted; the step after it is refused naming the field (before, a step
    near 2^63 was accepted and its decision's int64 overflow ended the stream INTERNAL)."""
    msg = pb.StepReport(step=convert.MAX_STEP, now_ms=1.0)
    assert convert.step_report_from_proto(msg).step == convert.MAX_STEP
    msg.step = convert.MAX_STEP + 1
    with pytest.raises(api.InvalidArgument, match=r"^report\.step: "):
        convert.step_report_from_proto(msg)


def test_duplicate_running_ids_rejected() -> None:
    """Two running requests with one id are rejected naming the second."""
    msg = pb.StepReport(step=1, now_ms=1.0)
    msg.running.add(id="x", context_tokens=3)
    msg.running.add(id="x", context_tokens=3)
    with pytest.raises(api.InvalidArgument, match=r"report\.running\[1\]\.id: duplicate"):
        convert.step_report_from_proto(msg)


def test_duplicate_queued_ids_rejected() -> None:
    """Two queued requests with one id are rejected naming the second (the controller admitted
    it twice: control-plane review, session 54); on both decode paths. Control: distinct ids pass."""
    msg = pb.StepReport(step=1, now_ms=1.0)
    msg.queued.add(id="q", prompt_tokens=3)
    msg.queued.add(id="r", prompt_tokens=3)
    assert [q.id for q in convert.step_report_from_proto(msg).queued] == ["q", "r"]
    msg.queued.add(id="q", prompt_tokens=3)
    with pytest.raises(api.InvalidArgument, match=r"report\.queued\[2\]\.id: duplicate id 'q'"):
        convert.step_report_from_proto(msg)
    assert convert._step_report_fast(msg) is None


def test_batch_validation_uses_plan_schema_paths() -> None:
    """Batch errors name the `kvplane plan` schema path under `batch.`."""
    msg = convert.batch_to_proto(small_batch(2))
    msg.model.layers = 0
    with pytest.raises(api.InvalidArgument, match=r"^batch\.model\.layers: 0 is out of range \(allowed \[1, 4096\]\)"):
        convert.batch_from_proto(msg)
    msg = convert.batch_to_proto(small_batch(2))
    msg.ClearField("hardware")
    with pytest.raises(api.InvalidArgument, match=r"^batch\.hardware: is required"):
        convert.batch_from_proto(msg)
    msg = convert.batch_to_proto(small_batch(2))
    msg.requests[1].slo_tbt_ms = -5
    with pytest.raises(api.InvalidArgument, match=r"^batch\.requests\[1\]\.slo_tbt_ms"):
        convert.batch_from_proto(msg)


@pytest.mark.parametrize("value", [2, -1])
def test_a_placement_value_other_than_0_or_1_is_refused(value: int) -> None:
    """A worker read on_gpu values through bool() (2 and -1 meant the GPU): a decision carrying
    one is now refused, naming the request and the value. Control: 0 and 1 decode."""
    ok = pb.Plan(placements={"a": pb.Placement(on_gpu=[1, 0, 1])})
    assert convert.plan_from_proto(ok).placements == {"a": (1, 0, 1)}
    bad = pb.Plan(placements={"a": pb.Placement(on_gpu=[1, 0]), "b": pb.Placement(on_gpu=[1, value])})
    with pytest.raises(api.InvalidArgument, match=rf"plan.placements\['b'\].on_gpu: {value} is not 0"):
        convert.plan_from_proto(bad)
