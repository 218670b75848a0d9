"""The :class:`~controlplane.model.Plan` a :class:`.Planner` returns, built from its search.

Without recompute the memory split is the evaluator's; with it (a :class:`.SearchResult` whose
``recompute`` is set, issue 16) resident, staging and transient blocks come from the model's own
accounting (:func:`controlplane.model.memory_blocks`, :func:`controlplane.model.transient_blocks`)
and the plan carries ``recompute_blocks`` / ``recompute_layers`` for the requests with ``u > 0``.
"""

from __future__ import annotations

from collections.abc import Sequence

from controlplane.model import Batch, Plan, RequestSpec, memory_blocks, transient_blocks
from controlplane.planner.evaluator import Evaluator
from controlplane.planner.search_result import SearchResult


def build_plan(
    batch: Batch,
    *,
    reqs: Sequence[RequestSpec],
    window: int,
    result: SearchResult | None,
    ev: Evaluator | None,
    late_fraction: float,
    paused: Sequence[str],
    solve_ms: float,
    current_step: int | None,
) -> Plan:
    """The plan for the running ``reqs`` at ``window`` (none run when ``result`` is None)."""
    expiry = None if current_step is None else current_step + window
    if result is None or ev is None:
        return Plan(
            feasible=not batch.requests,
            paused=tuple(paused),
            placements={},
            predicted_step_ms=0.0,
            window_steps=window,
            resident_blocks=0,
            staging_blocks=0,
            solver="empty" if not batch.requests else "all-paused",
            solve_ms=solve_ms,
            expiry_step=expiry,
            extras={"late_fraction": 0.0, "optimal": True},
        )
    rows = ev.cands.rows
    placement = [rows[c] for c in result.assign]
    if result.recompute is None:
        resident, staging = ev.split_memory(result.assign)
        transient = 0
    else:
        resident, staging = memory_blocks(placement, ev.blocks, result.recompute)
        transient = transient_blocks(result.recompute)
    recomputing = [
        (r.id, u, k)
        for r, (u, k) in zip(reqs, result.recompute or [(0, 0)] * len(reqs), strict=True)
        if u
    ]
    return Plan(
        feasible=True,
        paused=tuple(paused),
        placements={r.id: row for r, row in zip(reqs, placement, strict=True)},
        predicted_step_ms=result.step_ms,
        window_steps=window,
        resident_blocks=resident,
        staging_blocks=staging,
        solver=result.solver,
        solve_ms=solve_ms,
        expiry_step=expiry,
        extras={
            "late_fraction": late_fraction,
            "optimal": result.optimal,
            "evaluations": result.evaluations,
            "layouts": [ev.cands.labels[c] for c in result.assign],
        },
        recompute_blocks={rid: u for rid, u, _ in recomputing},
        recompute_layers={rid: k for rid, _, k in recomputing},
        transient_blocks=transient,
    )
