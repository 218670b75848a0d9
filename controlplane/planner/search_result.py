"""The answer of one :class:`~controlplane.planner.placement_search.PlacementSearch`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SearchResult:
    """Best assignment found for one window."""

    assign: tuple[int, ...]
    """Candidate index per request."""
    step_ms: float
    """Exact model step time of ``assign``."""
    solver: str
    """"exact" when the search proved ``assign`` optimal over the candidate space (best-first
    or depth-first branch and bound exhausted its tree), "trivial" when everything fits on the
    GPU; otherwise the stage that found it: "uniform", "mixed", "resident", "greedy", "warm",
    "mip" or "bnb" (branch and bound cut short), with "+local" when local search improved it
    and "+fill" when a refill did."""
    optimal: bool
    """True when ``assign`` is proved optimal over the candidate space."""
    evaluations: int
    """Exact-model evaluations spent."""
    recompute: tuple[tuple[int, int], ...] | None = None
    """Per request ``(u, k)`` when some request recomputes (:class:`.RecomputeSearch`, issue 16;
    ``docs/recompute.md``), else None. With it, ``solver`` may also be "recompute" or
    "recompute+local" and ``optimal`` means optimal over the joint (layout x recompute) space."""
