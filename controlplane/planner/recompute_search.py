"""The recompute option, searched together with the layouts for one window (issue 16).

:class:`RecomputeSearch` starts from the answer of the layout-only :class:`.PlacementSearch` of
the same window (its incumbent, so the result is **never worse** than the plan without
recompute) and searches joint assignments (per request a layout and a ``(u, k)`` of the
:class:`.RecomputeGrid`; :class:`.RecomputeEvaluator`) under the same memory budget, with every
candidate timed by the exact model:

1. **Small joint spaces** (at most :attr:`RecomputeSearch.exhaustive_max_leaves` complete
   assignments, e.g. 2 requests x 16 layers: 7 layouts x 19 options each): best-first branch and
   bound over requests (largest first). Nodes carry memory and the valid compute, aggregate-link
   and chain bounds of the options chosen so far (all monotone in what later requests add);
   complete assignments reach the exact model in ascending bound order, and the run stops,
   **proved optimal** over the joint space, when the smallest bound left is no better than the
   incumbent. Resumable: a satisficing probe and the later polish share one tree.
2. **Larger spaces**: uniform starts (every request takes the same ``(u, k)`` with its current
   layout, then layouts are lightened, largest request first, while the memory the uncached
   prefixes freed allows), then local search from the incumbent: single-request moves and paired
   moves (one of the largest requests frees memory with another ``(u, k)``, another moves to a
   lighter layout), tried in order of an O(1) valid bound (compute and link volume), at most
   :attr:`RecomputeSearch.patience` exact evaluations per scan on large problems, first
   improvement wins.

Like :class:`.PlacementSearch` it checks the deadline before every exact evaluation and stops
with :class:`.Satisfied` as soon as its incumbent meets a probe's target.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Sequence

from controlplane.planner.interrupts import REL_EPS, Deadline, Satisfied, Unreachable
from controlplane.planner.recompute_evaluator import RecomputeEvaluator
from controlplane.planner.search_result import SearchResult

_Node = tuple[float, int, int, tuple[int, ...], int, list[float], list[float], float]
"""(lower bound, -depth, sequence, options of the first ``depth`` requests in ``order``, memory,
compute per layer, cumulative fetched blocks per layer, largest chain bound)."""


class RecomputeSearch:
    """One joint (layout + recompute) search for one window; construct per solve."""

    exhaustive_max_leaves = 20_000
    """Joint spaces up to this many complete assignments are searched best first."""
    patience = 24
    """Exact evaluations per local-search scan on large problems."""
    pair_requests = 8
    """Paired moves are tried among this many largest requests."""

    def __init__(
        self,
        ev: RecomputeEvaluator,
        budget_blocks: int,
        deadline: float,
        *,
        target_ms: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.ev = ev
        self.budget = budget_blocks
        self.deadline = deadline
        self.target_ms = target_ms
        self.clock = clock
        self.n_req = len(ev.blocks)
        self.best: tuple[int, ...] | None = None
        self.best_ms = math.inf
        self.best_src = ""
        self.base: SearchResult | None = None
        self.seen: set[tuple[int, ...]] = set()
        leaves = math.prod(ev.n_options(r) for r in range(self.n_req))
        self.small = leaves <= self.exhaustive_max_leaves
        """Searched best first (proves optimality) instead of by starts and local search."""
        self.wide = sum(ev.n_options(r) for r in range(self.n_req)) <= 400
        """Full neighbourhoods (small problems) or ``patience``-limited scans."""
        self._optimal = False
        self._done: set[str] = set()
        self._frontier: list[_Node] | None = None
        self._seq = itertools.count()
        self._exact = True

    # --- incumbent ----------------------------------------------------------------------
    def expired(self) -> bool:
        """Whether the deadline has passed."""
        return self.clock() >= self.deadline

    def offer(self, assign: Sequence[int], src: str, min_gain: float = REL_EPS) -> bool:
        """Evaluate exactly (cut off at the incumbent); keep when better by ``min_gain``."""
        key = tuple(assign)
        if key in self.seen or self.ev.memory(key) > self.budget:
            return False
        self.seen.add(key)
        bar = self.best_ms * (1 - min_gain)
        t = self.ev.exact_ms(key, bar)
        if t < bar:
            self.best, self.best_ms, self.best_src = key, t, src
            if self.target_ms is not None and t <= self.target_ms:
                raise Satisfied
            return True
        return False

    def _seed(self, base: SearchResult) -> None:
        """Take the layout-only answer as incumbent when it beats the current one."""
        joint = self.ev.from_layouts(base.assign)
        self.seen.add(joint)
        if self.best is None or base.step_ms < self.best_ms * (1 - REL_EPS):
            self.best, self.best_ms, self.best_src = joint, base.step_ms, base.solver
            self.base = base
            self._done.discard("local")  # a new incumbent: local search may move again
        if base.solver == "trivial" or base.step_ms <= self.ev.compute_ms * (1 + REL_EPS):
            self._optimal = True  # nothing beats the all-on-GPU compute

    # --- driver -------------------------------------------------------------------------
    def run(self, base: SearchResult | None, *, exact: bool = True) -> SearchResult | None:
        """Best joint assignment within the deadline; None when nothing fits memory (then
        nothing fits with recompute either: every option takes at least ``b_r`` blocks).
        ``exact=False``: starts and local search only."""
        if base is None:
            return None
        self._exact = exact
        self._seed(base)
        return self._stages()

    def resume(
        self, base: SearchResult | None, deadline: float, *, target_ms: float | None = None
    ) -> SearchResult | None:
        """Continue until ``deadline`` (or until the incumbent meets ``target_ms``), after
        taking ``base`` (e.g. the layout search's polished answer) when it is better."""
        self.deadline = deadline
        self.target_ms = target_ms
        if base is not None:
            self._seed(base)
        if self.best is None:
            return None
        return self._stages()

    def _stages(self) -> SearchResult:
        stages: list[tuple[str, Callable[[], None]]] = (
            [("bestfirst", self._best_first)]
            if self.small and self._exact
            else [("starts", self._starts), ("local", self._local)]
        )
        try:
            if self.target_ms is not None and self.best_ms <= self.target_ms:
                raise Satisfied
            for name, stage in stages:
                if self._optimal:
                    break
                if name in self._done:
                    continue
                stage()
                self._done.add(name)
        except Deadline:
            pass
        return self._result()

    def _result(self) -> SearchResult:
        """The incumbent as a layout assignment with its ``(u, k)`` (None when no request
        recomputes); labelled "exact" exactly when proved optimal over the joint space."""
        assert self.best is not None
        opts = self.ev.chosen(self.best)
        layouts = tuple(o.layout for o in opts)
        recompute = tuple((o.u, o.k) for o in opts)
        src = "exact" if self._optimal and self.best_src != "trivial" else self.best_src
        return SearchResult(
            layouts,
            self.best_ms,
            src,
            self._optimal,
            self.ev.evaluations + (self.base.evaluations if self.base is not None else 0),
            recompute if any(u for u, _ in recompute) else None,
        )

    # --- best first (small spaces) --------------------------------------------------------
    def _best_first(self) -> None:
        ev = self.ev
        n = self.n_req
        order = sorted(range(n), key=lambda r: -ev.blocks[r])
        tail = [0] * (n + 1)
        for i in range(n - 1, -1, -1):
            tail[i] = tail[i + 1] + ev.min_mem[order[i]]
        if self._frontier is None:
            root: _Node = (ev.compute_ms, 0, 0, (), 0, list(ev.comp), [0.0] * ev.n_layers, 0.0)
            self._frontier = [root]
        frontier = self._frontier
        while frontier:
            lb = frontier[0][0]
            if lb >= self.best_ms * (1 - REL_EPS):
                frontier.clear()  # every node left is bounded by the incumbent
                break
            if self.target_ms is not None and lb > self.target_ms:
                raise Unreachable
            if self.expired():
                raise Deadline
            node = heapq.heappop(frontier)
            depth, prefix = -node[1], node[3]
            if depth == n:
                assign = [0] * n
                for i, o in enumerate(prefix):
                    assign[order[i]] = o
                self.offer(assign, "recompute")
                continue
            try:
                children = self._expand(node, order[depth], tail[depth + 1])
            except Deadline:
                heapq.heappush(frontier, node)  # expanded again when resumed: nothing is lost
                raise
            for child in children:
                heapq.heappush(frontier, child)
        self._optimal = True

    def _expand(self, node: _Node, r: int, tail_mem: int) -> list[_Node]:
        """Children of ``node`` (request ``r`` takes each option) that fit and may improve."""
        ev = self.ev
        _, neg_depth, _, prefix, mem, comp, work, chain = node
        cut = self.best_ms * (1 - REL_EPS)
        out: list[_Node] = []
        for j, opt_mem in enumerate(ev.mem[r]):
            m = mem + opt_mem
            if m + tail_mem > self.budget:
                continue
            if not j % 16 and self.expired():
                raise Deadline
            o = ev.option(r, j)
            comp2 = comp
            if o.tokens:
                comp2 = list(comp)
                for layer in range(o.k):
                    comp2[layer] += o.tokens * ev.rms[layer]
            work2 = work
            chain2 = chain
            if o.fetches:
                work2 = [w + c for w, c in zip(work, o.cum, strict=True)]
                prefix_ms = [0.0, *itertools.accumulate(comp2)]
                chain2 = max(chain, prefix_ms[-1] + ev.chain_ms(o, prefix_ms))
            lb = ev.bound_from(comp2, work2, chain2)
            if lb < cut:
                out.append((lb, neg_depth - 1, next(self._seq), (*prefix, j), m, comp2, work2, chain2))
        return out

    # --- starts and local search (larger spaces) ---------------------------------------------
    def _starts(self) -> None:
        """Every request takes the same ``(u, k)`` (its ``i``-th largest ``u``) with its current
        layout; then layouts are lightened, largest request first, while memory allows."""
        ev = self.ev
        assert self.best is not None
        current = [ev.spec(r, j) for r, j in enumerate(self.best)]
        grid = ev.grid
        order = sorted(range(self.n_req), key=lambda r: -ev.blocks[r])
        for i, k in itertools.product(range(len(grid.u_fractions)), grid.layer_choices):
            assign = []
            for r, (layout, _, _) in enumerate(current):
                us = grid.block_choices(ev.blocks[r])
                u = us[min(i, len(us) - 1)] if us else 0
                j = ev.index_of(r, layout, u, k)
                assign.append(self.best[r] if j is None else j)
            mem = ev.memory(assign)
            if mem > self.budget:
                continue
            for r in order:
                now, u, k_eff = ev.spec(r, assign[r])
                for layout in range(now - 1, -1, -1):
                    j = ev.index_of(r, layout, u, k_eff)
                    if j is None:
                        break
                    grown = mem - ev.mem[r][assign[r]] + ev.mem[r][j]
                    if grown > self.budget:
                        break
                    assign[r], mem = j, grown
            if self.expired():
                raise Deadline
            self.offer(assign, "recompute")

    def _local(self) -> None:
        """Single and paired moves until none improves (first improvement in bound order)."""
        while True:
            if self.expired():
                raise Deadline
            if not (self._try(self._single_moves()) or self._try(self._pair_moves())):
                return

    def _totals(self) -> tuple[int, float, int]:
        """Memory, recompute time and fetched volume of the incumbent."""
        ev = self.ev
        assert self.best is not None
        return (
            sum(ev.mem[r][j] for r, j in enumerate(self.best)),
            sum(ev.recompute_ms[r][j] for r, j in enumerate(self.best)),
            sum(ev.volume[r][j] for r, j in enumerate(self.best)),
        )

    def _single_moves(self) -> list[tuple[float, tuple[int, ...]]]:
        ev = self.ev
        best = self.best
        assert best is not None
        mem, rec, vol = self._totals()
        cut = self.best_ms * (1 - REL_EPS)
        moves = []
        for r, now in enumerate(best):
            mem_r, rec_r, vol_r = ev.mem[r], ev.recompute_ms[r], ev.volume[r]
            free = self.budget - mem + mem_r[now]
            rec_0, vol_0 = rec - rec_r[now], vol - vol_r[now]
            for j in range(len(mem_r)):
                if j == now or mem_r[j] > free:
                    continue
                lb = ev.volume_bound_ms(rec_0 + rec_r[j], vol_0 + vol_r[j])
                if lb < cut:
                    a = list(best)
                    a[r] = j
                    moves.append((lb, tuple(a)))
        return moves

    def _pair_moves(self) -> list[tuple[float, tuple[int, ...]]]:
        """Request ``r`` takes another ``(u, k)`` with its layout and frees memory; request
        ``s`` takes a lighter layout with its ``(u, k)``."""
        ev = self.ev
        best = self.best
        assert best is not None
        mem, rec, vol = self._totals()
        cut = self.best_ms * (1 - REL_EPS)
        top = sorted(range(self.n_req), key=lambda r: -ev.blocks[r])[: self.pair_requests]
        moves = []
        for r, s in itertools.permutations(top, 2):
            now_r, now_s = best[r], best[s]
            layout_r = ev.spec(r, now_r)[0]
            layout_s, u_s, k_s = ev.spec(s, now_s)
            frees = [j for j in ev.layout_options(r, layout_r) if ev.mem[r][j] < ev.mem[r][now_r]]
            takes = [
                j
                for j in (ev.index_of(s, c, u_s, k_s) for c in range(layout_s))
                if j is not None
            ]
            base_mem = mem - ev.mem[r][now_r] - ev.mem[s][now_s]
            base_rec = rec - ev.recompute_ms[r][now_r] - ev.recompute_ms[s][now_s]
            base_vol = vol - ev.volume[r][now_r] - ev.volume[s][now_s]
            for jr, js in itertools.product(frees, takes):
                if base_mem + ev.mem[r][jr] + ev.mem[s][js] > self.budget:
                    continue
                lb = ev.volume_bound_ms(
                    base_rec + ev.recompute_ms[r][jr] + ev.recompute_ms[s][js],
                    base_vol + ev.volume[r][jr] + ev.volume[s][js],
                )
                if lb < cut:
                    a = list(best)
                    a[r], a[s] = jr, js
                    moves.append((lb, tuple(a)))
        return moves

    def _try(self, moves: list[tuple[float, tuple[int, ...]]]) -> bool:
        moves.sort()
        limit = len(moves) if self.wide else self.patience
        tag = "recompute+local"
        for lb, a in moves[:limit]:
            if lb >= self.best_ms * (1 - REL_EPS):
                return False
            if self.expired():
                raise Deadline
            if self.offer(a, tag):
                return True
        return False
