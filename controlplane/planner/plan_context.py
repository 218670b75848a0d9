"""Per-call state of one :meth:`Planner.plan`: :class:`PlanContext`."""

from __future__ import annotations

from collections.abc import Callable

from controlplane.model import Batch
from controlplane.planner.candidates import candidate_set
from controlplane.planner.recompute_grid import RecomputeGrid
from controlplane.planner.solved import Solved


class PlanContext:
    """Deadline, clock, candidate set, recompute grid and the caches shared by one plan's
    searches (not thread-shared)."""

    def __init__(self, batch: Batch, deadline: float, clock: Callable[[], float]) -> None:
        self.batch = batch
        self.clock = clock
        """The clock ``deadline`` is read on (seconds)."""
        self.deadline = deadline
        self.cands = candidate_set(batch.model.layers)
        self.grid = RecomputeGrid.for_batch(batch)
        """The recompute grid, or None when the batch does not offer recompute (issue 16)."""
        self.chain_cache: dict[int, list[float]] = {}
        self.solved: dict[tuple[tuple[str, ...], tuple[int, ...]], Solved] = {}
        """Layout searches by (request ids, blocks): windows with equal blocks share one."""
        self.joint: dict[tuple[tuple[str, ...], tuple[int, ...]], Solved] = {}
        """Joint (layout + recompute) searches by (request ids, blocks)."""
        self.searches = 0

    def left_s(self) -> float:
        """Seconds left to the deadline (negative once past it)."""
        return self.deadline - self.clock()

    def share_deadline(self, share: float) -> float:
        """The deadline of a stage that may take ``share`` of what is left."""
        now = self.clock()
        return now + max(0.0, self.deadline - now) * share
