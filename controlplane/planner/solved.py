"""What one window's search left: :class:`Solved` (the planner's per-window record)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from controlplane.model import RequestSpec
from controlplane.planner.evaluator import Evaluator
from controlplane.planner.placement_search import PlacementSearch
from controlplane.planner.recompute_search import RecomputeSearch
from controlplane.planner.search_result import SearchResult
from controlplane.planner.slo_cap import late_fraction


@dataclass(frozen=True)
class Solved:
    """The requests, window and best answer of one window's search (and the searches, for
    resuming them)."""

    reqs: tuple[RequestSpec, ...]
    """The running requests searched."""
    window: int
    """Decode window Δ (blocks sized at ``context + Δ``)."""
    ev: Evaluator
    """The layout evaluator of this window."""
    result: SearchResult | None
    """Best answer (None when nothing fits memory)."""
    search: PlacementSearch | None = None
    """The layout search (resumable)."""
    rsearch: RecomputeSearch | None = None
    """The joint layout + recompute search of this window (issue 16), when one ran."""

    def late_fraction(self) -> float:
        """The SLO cap's left-hand side at the found step time (:func:`.slo_cap.late_fraction`)."""
        if self.result is None:
            return math.inf
        return late_fraction(self.reqs, self.result.step_ms, self.window)

    def ok(self, alpha: float) -> bool:
        """Whether the answer meets the SLO cap ``alpha`` at this window."""
        return self.result is not None and self.late_fraction() <= alpha + 1e-12
