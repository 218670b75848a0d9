"""victim_rule "lost-first": requests whose TPOT SLO is provably lost are paused first (research,
served-admission), and the starvation guard pauses only those."""

from __future__ import annotations

import pytest

from controlplane.controller.schedulers.base import RequestView
from controlplane.controller.victims import select_victim, tpot_lost
from controlplane.planner import Planner
from controlplane.policy import Policy
from tests.controlplane.test_planner import VICTIM_CASE, make_batch


def view(*, now_first=0.0, generated=10, n=100, slo=100.0) -> RequestView:
    return RequestView("r", 1000, generated, slo, now_first, now_first, now_first, max_new_tokens=n)


def test_tpot_lost_is_the_budget_at_the_fastest_step():
    """Lost iff T_past + (N - n) floor > slo (N - 1): 10 of 100 tokens, floor 50 ms, SLO 100 ms:
    the budget is 9900 ms, the rest takes 4500 ms at least, so lost past 5400 ms."""
    r = view()
    assert not tpot_lost(r, 5400.0, 50.0)
    assert tpot_lost(r, 5400.1, 50.0)
    # no known length, or an SLO at/below the floor: nothing is singled out
    assert not tpot_lost(RequestView("r", 1000, 10, 100.0, 0.0, 0.0, 0.0), 1e9, 50.0)
    assert not tpot_lost(view(slo=50.0), 1e9, 50.0)


@pytest.mark.parametrize("t_past", [100.0, 3000.0, 5401.0, 20000.0])
def test_lost_at_the_limit_is_lost_at_every_shorter_length(t_past):
    """A proof for any output length up to max_new_tokens (the request may stop early)."""
    if tpot_lost(view(), t_past, 50.0):
        assert all(tpot_lost(view(n=m), t_past, 50.0) for m in range(11, 101))


def test_the_planner_pauses_first_ones_before_the_rule_order():
    """``first`` goes before the rule's order (here largest: r1), ``keep`` after it."""
    batch = make_batch(VICTIM_CASE["contexts"], deposits=VICTIM_CASE["deposits"], layers=4, budget=165,
                       window=(1, 1), block_size=1)
    assert Planner().plan(batch, victim_rule="lost-first").paused == ("r1",)
    plan = Planner().plan(batch, victim_rule="lost-first", first=frozenset({"r2"}))
    assert plan.paused == ("r2",) and plan.feasible
    plan = Planner().plan(batch, victim_rule="lost-first", first=frozenset({"r2"}), keep=frozenset({"r2"}))
    assert plan.paused == ("r1",)


def test_policy_accepts_the_rule_and_select_victim_orders_as_largest():
    assert Policy(victim_rule="lost-first").victim_rule == "lost-first"
    a = RequestView("a", 1000, 1, 100.0, 0.0, 0.0, 0.0)
    b = RequestView("b", 3000, 1, 100.0, 0.0, 0.0, 0.0)
    assert select_victim([a, b], "lost-first", 16).id == "b"


def _guard_case(a_tokens: int, rule: str, paused_steps: int = 10):  # noqa: ANN202
    """'a' runs, 's' starves (``paused_steps`` against a guard at 4: under the hard bound, 16, by
    default); they do not run together, each runs alone. 'a' has ``a_tokens`` output tokens in
    all: lost at now = 500 ms (floor 4 ms, SLO 6 ms) when below 233."""
    from dataclasses import replace

    from tests.controlplane.test_decision_builder_guard import build
    from tests.controlplane.test_decision_builder_guard import view as gview

    a = replace(gview("a", 500), max_new_tokens=a_tokens)
    s = replace(gview("s", 500, paused_steps), max_new_tokens=100)
    b, _, inp = build((a,), (s,), 48, victim_rule=rule, max_paused_steps=4)
    return b.build(inp)


def test_the_guard_pauses_a_request_that_can_still_meet_its_tpot_only_under_the_old_rule():
    assert _guard_case(10_000, "largest").pause == ("a",)  # control: the guard forces 's' in
    d = _guard_case(10_000, "lost-first")
    assert d.pause == () and d.resume == () and set(d.plan.placements) == {"a"}
    d = _guard_case(100, "lost-first")  # 'a' is lost: it gives its place
    assert d.pause == ("a",) and d.resume == ("s",)


def test_past_the_hard_bound_the_guard_forces_a_starving_request_in_whoever_it_pauses():
    """'s' paused 16 steps (4 x the guard's 4): forced in although 'a' can still meet its TPOT;
    at 15 it still waits (control)."""
    assert _guard_case(10_000, "lost-first", 15).resume == ()
    d = _guard_case(10_000, "lost-first", 16)
    assert d.pause == ("a",) and d.resume == ("s",)
