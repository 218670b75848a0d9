"""``deposit_credit``: whether token deposits mask late steps in the planner's SLO cap
(OrbitFlow §3.3.1 with §3.2; ``controlplane/planner/README.md``, "Deposit credit")."""

from __future__ import annotations

import pytest

from controlplane.model import Batch, SchemaError
from controlplane.planner import Planner
from controlplane.policy import Policy
from controlplane.service import convert
from tests.controlplane.test_planner import VICTIM_CASE, fetch_bound, make_batch


def _with_credit(batch: Batch, credit: bool) -> Batch:
    d = batch.to_dict()
    d["policy"]["deposit_credit"] = credit
    return Batch.from_dict(d)


def test_without_credit_a_request_its_deposit_would_cover_is_paused():
    """Step 10 ms against a 5 ms SLO, deposit 8, window 8: the deposit covers the window
    (D = Δ (T/slo - 1)), so with the credit the request runs; without it every step fails and,
    at alpha 0, it is paused."""
    batch = fetch_bound([10], slo=5.0, deposits=[8], alpha=0.0, window=(8, 8))
    assert batch.policy.deposit_credit  # the planner's default is the paper's rule
    kept = Planner().plan(batch)
    assert kept.feasible and kept.paused == ()
    paused = Planner().plan(_with_credit(batch, False))
    assert paused.paused == ("r0",) and not paused.feasible


def test_the_victim_rule_still_weighs_deposits_without_credit():
    """The largest rule pauses r1 (61 blocks + 50 deposited > r0's 101 + 0) with or without the
    credit: the deposits leave only the cap."""
    batch = make_batch(VICTIM_CASE["contexts"], deposits=VICTIM_CASE["deposits"], layers=4,
                       budget=165, window=(1, 1), block_size=1)
    for credit in (True, False):
        plan = Planner().plan(_with_credit(batch, credit), victim_rule="largest")
        assert plan.paused == ("r1",), credit


def test_the_flag_travels_in_the_batch_schema_and_on_the_wire():
    """Absent: true (batch files written before it plan as before); false survives to_dict,
    from_dict and the Plan RPC's message; a non-boolean is refused naming the field."""
    batch = make_batch([10, 20], deposits=[3, 0])
    off = _with_credit(batch, False)
    assert not off.policy.deposit_credit and Batch.from_dict(off.to_dict()) == off
    assert convert.batch_from_proto(convert.batch_to_proto(off)) == off
    assert convert.batch_from_proto(convert.batch_to_proto(batch)).policy.deposit_credit
    d = batch.to_dict()
    d["policy"]["deposit_credit"] = "no"
    with pytest.raises(SchemaError, match=r"policy.deposit_credit.*expected true or false"):
        Batch.from_dict(d)


def test_the_served_policy_defaults_to_no_credit_and_passes_it_to_the_planner():
    """Policy.deposit_credit is false by default (kvplane's measured choice) and reaches the
    planner's PlanPolicy; the paper's rule is one policy update away."""
    assert Policy().plan_policy.deposit_credit is False
    assert Policy.from_dict({"deposit_credit": True}).plan_policy.deposit_credit is True
    with pytest.raises(SchemaError, match="deposit_credit"):
        Policy.from_dict({"deposit_credit": 1})
