"""The placement a decision gives a set of running requests, as the step-time model reads it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from controlplane.api import Decision
from controlplane.model import ModelSpec
from controlplane.model.timeline import Recompute


class Running(Protocol):
    """A running request: from a worker's report (``RequestState``) or the controller's tracker."""

    @property
    def id(self) -> str: ...

    @property
    def context_tokens(self) -> int: ...


def placement_rows(
    decision: Decision | None, running: Iterable[Running], model: ModelSpec
) -> tuple[list[tuple[int, ...]], list[int], Recompute | None]:
    """Rows, blocks and (None unless the plan recomputes) ``(u, k)`` of ``running`` under
    ``decision``: a request it does not place (or places with the wrong layer count) runs all-GPU,
    as the worker runs it; ``u`` is clamped below the request's blocks, as the worker clamps it."""
    layers, bs = model.layers, model.block_size
    rows: list[tuple[int, ...]] = []
    blocks: list[int] = []
    placements = {} if decision is None else decision.plan.placements
    planned = {} if decision is None else decision.plan.recompute_blocks
    rec: list[tuple[int, int]] = []
    for r in running:
        row = placements.get(r.id)
        rows.append(tuple(row) if row is not None and len(row) == layers else (1,) * layers)
        blocks.append(-(-r.context_tokens // bs))
        u = min(planned.get(r.id, 0), blocks[-1] - 1)
        rec.append((u, decision.plan.recompute_layers.get(r.id, 0)) if u and decision else (0, 0))
    return rows, blocks, rec if planned else None
