"""Compatibility names for the placement search, which now lives in one module per class:
:mod:`.placement_search` (:class:`PlacementSearch`), :mod:`.search_result` (:class:`SearchResult`),
:mod:`.constructive_stages`, :mod:`.local_search`, :mod:`.best_first_search`,
:mod:`.branch_and_bound`. Kept for ``controlplane.bench.planner_bench``; new code imports the
modules above."""

from controlplane.planner.placement_search import PlacementSearch
from controlplane.planner.search_result import SearchResult

__all__ = ["PlacementSearch", "SearchResult"]
