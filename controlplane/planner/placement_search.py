"""Placement search over candidate assignments for one window (blocks fixed).

:class:`PlacementSearch` owns the incumbent, the deadline and the exact evaluation
(:meth:`PlacementSearch.offer`), and runs these stages within the deadline:

1. warm starts the caller passes (a previous window's plan, the MIP's answer), each also refilled
   (:class:`.ConstructiveStages`), and local search from them when they solve a nearly identical
   problem (``local_first``);
2. on small spaces (at most :attr:`PlacementSearch.best_first_max_leaves` complete assignments),
   **best-first branch and bound** (:class:`.BestFirstSearch`): complete assignments reach the
   exact model in ascending lower-bound order and the run proves optimality when the smallest
   bound left is no better than the incumbent; it is resumable, so nothing else runs first;
3. otherwise the constructive stages (:class:`.ConstructiveStages`: uniforms in lower-bound
   order, so the result is never worse than the best uniform distance; mixed fills; resident
   sets; greedy), exact-model local search (:class:`.LocalSearch`), the CBC stage
   (:class:`.MipStage`) when enough budget remains, and depth-first branch and bound
   (:class:`.BranchAndBound`) on batches of at most ``bnb_max_requests`` requests.

Every stage checks the deadline before each exact evaluation, so a search overruns it by at most
one evaluation (plus one neighbourhood scan or one node expansion). All candidates are evaluated
with :meth:`Evaluator.exact_ms`, so the returned step time is the exact model's prediction.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence

from controlplane.planner.best_first_search import BestFirstSearch
from controlplane.planner.branch_and_bound import BranchAndBound
from controlplane.planner.constructive_stages import ConstructiveStages
from controlplane.planner.evaluator import Evaluator
from controlplane.planner.interrupts import REL_EPS, Deadline, Satisfied
from controlplane.planner.local_search import LocalSearch
from controlplane.planner.mip_search import MipStage
from controlplane.planner.search_result import SearchResult


class PlacementSearch:
    """One search over candidate assignments; construct per solve (not thread-shared)."""

    best_first_max_leaves = 16384
    """Spaces (candidates ** requests) up to this size are searched best first (see module
    docstring); 4 requests at up to 32 layers (<= 11 candidates: 14641) stay below it."""

    CONSTRUCTIVE = ("uniforms", "mixed", "resident", "greedy")
    """Stages that build plans from scratch (the same for nearby windows of one request set)."""

    def __init__(
        self,
        ev: Evaluator,
        budget_blocks: int,
        deadline: float,
        *,
        bnb_node_limit: int = 20_000,
        bnb_max_requests: int = 24,
        target_ms: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``target_ms``: stop as soon as the incumbent's exact step time is at most this (the
        search can be continued later with :meth:`resume`)."""
        self.ev = ev
        self.target_ms = target_ms
        self.clock = clock
        """The clock ``deadline`` is read on (seconds)."""
        self.bnb_max_requests = bnb_max_requests
        self.budget = budget_blocks
        self.deadline = deadline
        self.bnb_node_limit = bnb_node_limit
        self.n_req = len(ev.blocks)
        self.n_cand = ev.cands.size
        self.best: tuple[int, ...] | None = None
        self.best_ms = math.inf
        self.best_src = ""
        self.seen: set[tuple[int, ...]] = set()
        self.runners_up: list[tuple[float, tuple[int, ...]]] = []
        """The three best assignments evaluated (exact step, assignment), warm starts for
        another window of the same requests."""
        self._done: set[str] = set()
        self._optimal = False
        self._mip: MipStage | None = None
        self._local = True
        self._exact = True
        self.wide = self.n_req * self.n_cand <= 400
        """Full neighbourhoods (small problems) or narrowed ones (large problems)."""
        self.patience = 16
        """Exact evaluations per local-search scan on large problems (:class:`.LocalSearch`)."""
        self.min_gain = 0.003
        """Relative improvement a local move must bring on large problems."""
        self.small = self.n_cand**self.n_req <= self.best_first_max_leaves
        """Searched best first (:class:`.BestFirstSearch`) instead of by the staged heuristics."""
        self.constructive = ConstructiveStages(self)
        self.local_search = LocalSearch(self)
        self._best_first: BestFirstSearch | None = None

    # --- incumbent ----------------------------------------------------------------------
    def expired(self) -> bool:
        """Whether the deadline has passed."""
        return self.clock() >= self.deadline

    def offer(self, assign: Sequence[int], src: str, min_gain: float = REL_EPS) -> bool:
        """Evaluate exactly (cut off at the incumbent); keep when better by ``min_gain``."""
        key = tuple(assign)
        if key in self.seen:
            return False
        self.seen.add(key)
        bar = self.best_ms * (1 - min_gain)
        t = self.ev.exact_ms(key, bar if self.best else math.inf)
        if t < math.inf:
            self.runners_up.append((t, key))
            self.runners_up.sort()
            del self.runners_up[3:]
        if t < bar or (self.best is None and t < math.inf):
            self.best, self.best_ms, self.best_src = key, t, src
            if self.target_ms is not None and t <= self.target_ms:
                raise Satisfied
            return True
        return False

    def offer_bounded(self, assign: Sequence[int], src: str) -> bool:
        """:meth:`offer` unless the lower bound already proves it no better than the best."""
        if self.best is not None and self.ev.lower_bound_ms(assign) >= self.best_ms * (
            1 - REL_EPS
        ):
            return False
        return self.offer(assign, src)

    def feasible(self) -> bool:
        """Whether even everything offloaded fits memory."""
        last = self.n_cand - 1
        return self.ev.memory([last] * self.n_req) <= self.budget

    # --- driver -------------------------------------------------------------------------
    def run(
        self,
        warm: Iterable[Sequence[int]] = (),
        *,
        mip: MipStage | None = None,
        local: bool = True,
        exact: bool = True,
        local_first: bool = True,
        skip: Iterable[str] = (),
    ) -> SearchResult | None:
        """Best assignment within the deadline, or None when nothing fits memory.

        ``local_first``: continue local search from the warm starts before the constructive
        stages (right when they solve a nearly identical problem, e.g. another window of the
        same requests; after a pause the constructive stages go first). ``skip``: stages not to
        run (e.g. the constructive ones, done by the search that produced the warm start).
        ``exact=False`` turns both branch and bounds off (heuristic stages only).
        """
        if not self.feasible():
            return None
        ev = self.ev
        none = (0,) * self.n_req
        if ev.memory(none) <= self.budget:
            self.best, self.best_ms, self.best_src = none, ev.compute_ms, "trivial"
            self._optimal = True
            return SearchResult(none, ev.compute_ms, "trivial", True, ev.evaluations)
        self._mip, self._local, self._exact = mip, local, exact
        self._done.update(skip)
        if not local_first:
            self._done.add("continue")
        try:
            self.constructive.warm(warm)
        except Deadline:
            pass
        return self._stages()

    def resume(self, deadline: float) -> SearchResult | None:
        """Continue the stages that did not complete, without a target, until ``deadline``."""
        if self.best is None and not self.feasible():
            return None
        self.deadline = deadline
        self.target_ms = None
        self._done.add("continue")  # constructive stages first: cheap, and they escape basins
        if self._optimal:
            return self._result()
        return self._stages()

    def mark_done(self, stage: str) -> None:
        """Never run ``stage`` again in this search (e.g. a node-limited branch and bound)."""
        self._done.add(stage)

    @property
    def done(self) -> frozenset[str]:
        """Stages that ran to completion."""
        return frozenset(self._done)

    def _stages(self) -> SearchResult:
        mip, local = self._mip, self._local
        run_local = self.local_search.run if local else None
        best_first = self._exact and self.small
        stages = [
            ("bestfirst", self._best_first_stage if best_first else None),
            ("continue", run_local),  # from a warm start (previous window)
            ("uniforms", self.constructive.uniforms),
            ("mixed", self.constructive.mixed),
            ("resident", self.constructive.resident_sets),
            ("local", run_local),
            ("greedy", self.constructive.greedy),
            ("relocal", run_local),
            ("mip", self._mip_stage if mip is not None else None),
            (
                "exact",
                self._bnb_stage
                if self._exact and not self.small and self.n_req <= self.bnb_max_requests
                else None,
            ),
        ]
        try:
            for name, stage in stages:
                if self._optimal:
                    break
                if stage is None or name in self._done:
                    continue
                if name == "continue" and self.best is None:
                    self._done.add(name)  # nothing to continue from; never run it later
                    continue
                stage()
                self._done.add(name)
        except Deadline:
            pass
        if self.best is None:  # the deadline hit before any stage finished: take "all"
            self.best = (self.n_cand - 1,) * self.n_req
            self.best_ms, self.best_src = self.ev.exact_ms(self.best), "fallback"
        return self._result()

    def _result(self) -> SearchResult:
        """The incumbent; labelled "exact" exactly when it is proved optimal."""
        assert self.best is not None
        src = self.best_src
        if self._optimal and src != "trivial":
            src = "exact"
        return SearchResult(self.best, self.best_ms, src, self._optimal, self.ev.evaluations)

    def _best_first_stage(self) -> None:
        if self._best_first is None:
            self._best_first = BestFirstSearch(self)
        self._optimal = self._best_first.run()

    def _mip_stage(self) -> None:
        """CBC on the linear surrogate when the space is too large to enumerate and at least
        ``MipStage.min_budget_ms`` remain; its proposals go through the exact model."""
        mip = self._mip
        assert mip is not None
        if self.n_cand**self.n_req <= 4096:
            return
        left_ms = (self.deadline - self.clock()) * 1e3
        if not mip.affordable(left_ms, self.n_req, self.n_cand):
            return
        cbc_ms = (left_ms - mip.overhead_ms(self.n_req, self.n_cand)) * 0.5
        self.constructive.warm(mip.solve(self.ev, self.budget, cbc_ms, self.best), "mip")
        if self._local:
            self.local_search.run()

    def _bnb_stage(self) -> None:
        self._optimal = BranchAndBound(self).run()
        if not self._optimal:
            raise Deadline
