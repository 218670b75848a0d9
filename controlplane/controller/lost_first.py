"""The starvation guard under ``victim_rule="lost-first"`` (the default policy's since session 89).

A starving request is forced in only where it runs by pausing requests whose TPOT SLO is already
lost (:func:`~controlplane.controller.victims.tpot_lost`; held ones are never paused). Forcing it
in by pausing a request that can still meet its TPOT trades that request's SLO for one already
missed: it waits instead, resumed by a finish when a feasible plan exists, as OrbitFlow's paused
requests are (§3.4), or forced in later, when a lost request runs. One plan per starving request
tried: the planner's victim order puts the lost requests first and the forced one last
(``DecisionBuilder._plan`` passes the lost ones as ``first``). A request paused
:data:`HARD_BOUND_FACTOR` times ``max_paused_steps`` is forced in as under the other rules,
pausing others by the victim order (lost ones first): waiting has a hard bound (session 88).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from controlplane.controller.victims import tpot_lost
from controlplane.planner.slo_cap import floor_ms

HARD_BOUND_FACTOR = 4
"""Under ``lost-first`` a starving request paused this many times ``max_paused_steps`` is forced
in whoever it pauses (the guard of the other rules): without it, one that no lost request stood
in front of could wait for finishes indefinitely."""

if TYPE_CHECKING:
    from controlplane.controller.decision_builder import DecisionBuilder, PlanningInput
    from controlplane.controller.schedulers.base import RequestView
    from controlplane.model import Plan


def guarded_lost(
    builder: DecisionBuilder,
    inp: PlanningInput,
    running: list[RequestView],
    starving: list[RequestView],
    trials: int,
) -> tuple[Plan, list[RequestView], list[str], list[str], set[str]]:
    """``DecisionBuilder._guarded``'s answer under ``lost-first`` (module docstring): the plan,
    its members, the guard's victims, the starving requests tried and the one forced in."""
    now, floor = inp.now_ms, floor_ms(inp.layer_compute_ms)
    lost = {r.id for r in running if tpot_lost(r, now, floor)}
    together = builder._held_together(running, inp)
    kept = together or frozenset()
    tried: list[str] = []
    for f in starving[:trials]:
        tried.append(f.id)
        # the forced request needs a batch slot: lost requests give theirs
        members, guard_victims, room = builder.slot_for(
            f, running, inp, lambda r: r.id in lost and r.id not in inp.held
        )
        if not room:
            continue
        plan = builder._plan(members, inp, keep=kept | {f.id})
        if f.id in plan.paused or any(rid not in lost and rid not in inp.held for rid in plan.paused):
            continue
        return plan, members, guard_victims, tried, {f.id}
    plan, members, _ = builder._keeping(list(running), set(), inp, [], together)
    return plan, members, [], tried, set()
