"""Placement search over candidate assignments for one window (blocks fixed).

:class:`PlacementSearch` combines, within a deadline:

1. every memory-feasible *uniform* assignment (one candidate for all requests), in lower-bound
   order, pruned only by a valid lower bound — so the result is never worse than the best
   uniform distance;
2. *mixed fills*: from the least-offloading uniform that fits, requests step back to the next
   lighter candidate while memory allows, in a few orders (chain-bound cost per block, largest
   first, smallest first) — cheap constructive plans that use the memory the uniform wastes;
   and, on small problems, a *greedy* fill by lower bound per block freed;
3. warm starts the caller passes (a previous window's plan, the MIP's answer);
4. *local search* with the exact model: single-request moves, then paired moves (one request
   offloads less, another more), neighbours tried in lower-bound order and skipped when the bound
   proves they cannot improve;
5. the CBC stage (:class:`MipStage`) when enough budget remains;
6. *branch and bound* over the full candidate space (exact model at the leaves, chain/aggregate
   bounds and memory to prune) on batches of at most ``bnb_max_requests`` requests; when it
   completes the result is optimal over the candidate space.

Large problems (``requests x candidates > 400``) use narrower neighbourhoods: single moves to
candidates within two steps, paired moves among the most promising requests only. Every stage
checks the deadline before each exact evaluation, so a search overruns it by at most one
evaluation.

All candidates are evaluated with :meth:`Evaluator.exact_ms`, so the returned step time is the
exact model's prediction.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from controlplane.planner.branch_and_bound import BranchAndBound
from controlplane.planner.evaluator import Evaluator
from controlplane.planner.interrupts import REL_EPS as _REL_EPS
from controlplane.planner.interrupts import Deadline as _Deadline
from controlplane.planner.interrupts import Satisfied as _Satisfied
from controlplane.planner.mip_search import MipStage


@dataclass(frozen=True)
class SearchResult:
    """Best assignment found for one window."""

    assign: tuple[int, ...]
    """Candidate index per request."""
    step_ms: float
    """Exact model step time of ``assign``."""
    solver: str
    """The search stage that found ``assign`` ("trivial", "uniform", "greedy", "warm", "mip",
    with "+local" when local search improved it, or "exact" when branch and bound proved it)."""
    optimal: bool
    """True when branch and bound completed: optimal over the candidate space."""
    evaluations: int
    """Exact-model evaluations spent."""


class PlacementSearch:
    """One search over candidate assignments; construct per solve (not thread-shared)."""

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
        self._local_optimum: tuple[int, ...] | None = None
        self._done: set[str] = set()
        self._optimal = False
        self._mip: MipStage | None = None
        self._local = True
        self._exact = True
        self.wide = self.n_req * self.n_cand <= 400
        self.patience = 16
        """Exact evaluations per local-search scan on large problems (see :meth:`_try`)."""
        self.min_gain = 0.003
        """Relative improvement a local move must bring on large problems (see :meth:`_try`)."""
        """Full neighbourhoods (small problems) or narrowed ones (large problems)."""

    # --- helpers ------------------------------------------------------------------------
    def _expired(self) -> bool:
        return self.clock() >= self.deadline

    def _offer(self, assign: Sequence[int], src: str, min_gain: float = _REL_EPS) -> bool:
        """Evaluate exactly (cut off at the incumbent); keep when better by ``min_gain``."""
        key = tuple(assign)
        if key in self.seen:
            return False
        self.seen.add(key)
        bar = self.best_ms * (1 - min_gain)
        t = self.ev.exact_ms(key, bar if self.best else math.inf)
        if t < bar or (self.best is None and t < math.inf):
            self.best, self.best_ms, self.best_src = key, t, src
            if self.target_ms is not None and t <= self.target_ms:
                raise _Satisfied
            return True
        return False

    def _offer_bounded(self, assign: Sequence[int], src: str) -> bool:
        """:meth:`_offer` unless the lower bound already proves it no better than the best."""
        if self.best is not None and self.ev.lower_bound_ms(assign) >= self.best_ms * (
            1 - _REL_EPS
        ):
            return False
        return self._offer(assign, src)

    def feasible(self) -> bool:
        """Whether even everything offloaded fits memory."""
        last = self.n_cand - 1
        return self.ev.memory([last] * self.n_req) <= self.budget

    # --- stages -------------------------------------------------------------------------
    def uniforms(self) -> None:
        """Every memory-feasible uniform assignment not excluded by its lower bound."""
        ev = self.ev
        options = []
        for c in range(self.n_cand):
            a = (c,) * self.n_req
            if ev.memory(a) <= self.budget:
                options.append((ev.lower_bound_ms(a), c, a))
        options.sort()
        for lb, _, a in options:
            if self.best is not None and lb >= self.best_ms * (1 - _REL_EPS):
                break
            if self.best is not None and self._expired():
                raise _Deadline
            self._offer(a, "uniform")

    def mixed(self) -> None:
        """Mixed fills between the least-offloading feasible uniform and lighter candidates."""
        ev, n = self.ev, self.n_req
        hi = next((c for c in range(self.n_cand) if ev.memory((c,) * n) <= self.budget), None)
        if not hi:  # nothing fits (None) or nothing needs offloading (0)
            return
        mem_rows, chain = ev.mem, ev.chain
        lo = hi - 1

        def per_block(r: int) -> float:
            extra = mem_rows[r][lo] - mem_rows[r][hi]
            return (chain[r][lo] - chain[r][hi]) / extra if extra > 0 else math.inf

        orders = [
            sorted(range(n), key=per_block),
            sorted(range(n), key=lambda r: -ev.blocks[r]),
            sorted(range(n), key=lambda r: ev.blocks[r]),
        ]
        for order in orders:
            if self.best is not None and self._expired():
                raise _Deadline
            self._offer_bounded(self._fill([hi] * n, order), "mixed")

    def resident_sets(self) -> None:
        """Keep the ``j`` largest requests wholly on the GPU and offload the rest (mixed fill).

        Staging costs every offloading request one layer of its blocks, and a large request's
        fetches are long (``b_r / bw``), so optima often keep the largest requests resident and
        offload the small ones heavily; single-step local moves rarely find that.
        """
        ev, n = self.ev, self.n_req
        if n < 2:
            return
        mem_rows, chain, last = ev.mem, ev.chain, self.n_cand - 1
        big = sorted(range(n), key=lambda r: -ev.blocks[r])
        steps = {1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112}
        steps |= {j * n // 8 for j in range(1, 8)}
        for j in sorted(steps & set(range(1, n))):
            res, rest = big[:j], big[j:]
            fixed = sum(mem_rows[r][0] for r in res)
            hi = next(
                (
                    c
                    for c in range(1, self.n_cand)
                    if fixed + sum(mem_rows[r][c] for r in rest) <= self.budget
                ),
                None,
            )
            if hi is None:
                break  # the rest cannot fit even all offloaded; larger j only needs more
            a = [0] * n
            for r in rest:
                a[r] = hi
            lo = hi - 1

            def per_block(r: int, lo: int = lo, hi: int = hi) -> float:
                extra = mem_rows[r][lo] - mem_rows[r][hi]
                return (chain[r][lo] - chain[r][hi]) / extra if extra > 0 else math.inf

            if self.best is not None and self._expired():
                raise _Deadline
            self._offer_bounded(self._fill(a, sorted(rest, key=per_block)), "resident")
            if hi == last and j > 1 and self.best_src != "resident":
                break

    def _fill(self, start: list[int], order: Sequence[int]) -> tuple[int, ...]:
        """Step requests (in ``order``) to lighter candidates while memory fits, three passes."""
        mem_rows = self.ev.mem
        a = list(start)
        mem = self.ev.memory(a)
        for _ in range(3):
            moved = False
            for r in order:
                c = a[r]
                if c == 0:
                    continue
                extra = mem_rows[r][c - 1] - mem_rows[r][c]
                if mem + extra <= self.budget:
                    a[r] = c - 1
                    mem += extra
                    moved = True
            if not moved:
                break
        return tuple(a)

    def greedy(self, max_moves: int = 400) -> None:
        """Offload where the lower bound grows least per block freed, until memory fits."""
        ev = self.ev
        if self.n_req * self.n_cand > max_moves:
            return
        assign = [0] * self.n_req
        mem = ev.memory(assign)
        while mem > self.budget:
            if self.best is not None and self._expired():
                raise _Deadline
            work = ev.work(assign)
            top = self._top_chain(assign)
            base = ev.lower_bound_ms(assign)
            choice = None
            for r in range(self.n_req):
                cur = assign[r]
                other = top[1][0] if top[0][1] == r else top[0][0]
                for c in range(cur + 1, self.n_cand):
                    freed = ev.mem[r][cur] - ev.mem[r][c]
                    if freed <= 0:
                        continue
                    lb = ev.move_bound(work, other, r, cur, c)
                    over = mem - freed - self.budget
                    key = (0 if over <= 0 else 1, (lb - base) / freed, lb, -freed)
                    if choice is None or key < choice[0]:
                        choice = (key, r, c, freed)
            if choice is None:
                return
            _, r, c, freed = choice
            assign[r] = c
            mem -= freed
        self._offer(assign, "greedy")

    def warm(self, starts: Iterable[Sequence[int]], src: str = "warm") -> None:
        """Evaluate caller-provided assignments (e.g. the previous window's plan), each also
        refilled: requests step to lighter candidates while memory allows (after a pause the
        survivors' old layouts leave the paused request's memory unused)."""
        ev = self.ev
        for a in starts:
            if len(a) != self.n_req or ev.memory(a) > self.budget:
                continue
            filled = self._refill(a)
            if filled != tuple(a):  # usually the better one: try it first
                self._offer(filled, src + "+fill")
            self._offer(a, src)

    def _refill(self, a: Sequence[int]) -> tuple[int, ...]:
        """``a`` with requests stepped to lighter candidates while memory allows, cheapest
        chain-bound increase per block first."""
        chain, mem_rows = self.ev.chain, self.ev.mem

        def per_block(r: int) -> float:
            c = a[r]
            if c == 0:
                return math.inf
            extra = mem_rows[r][c - 1] - mem_rows[r][c]
            return (chain[r][c - 1] - chain[r][c]) / extra if extra > 0 else math.inf

        return self._fill(list(a), sorted(range(self.n_req), key=per_block))

    def _top_chain(self, assign: Sequence[int]) -> list[tuple[float, int]]:
        chain = self.ev.chain
        vals = sorted(((chain[r][c], r) for r, c in enumerate(assign)), reverse=True)
        vals += [(self.ev.compute_ms, -1)] * 3
        return vals[:3]

    def local(self) -> None:
        """Exact-model local search from the incumbent until no move improves it."""
        while self.best is not None and self.best != self._local_optimum:
            if self._expired():
                raise _Deadline
            if self._try(self._single_moves()) or self._try(self._pair_moves()):
                continue
            # Moves to heavier candidates can leave memory unused: refill before stopping.
            filled = self._refill(self.best)
            if filled == self.best or not self._offer(filled, self.best_src + "+fill"):
                self._local_optimum = self.best
                return

    def _try(self, moves: list[tuple[float, tuple[int, ...]]]) -> bool:
        """First improvement among ``moves`` in lower-bound order. On large problems at most
        :attr:`patience` exact evaluations per scan, and a move must gain :attr:`min_gain`: by
        then the bound order has passed the promising moves and further gains are tiny
        (measured at 64 x 80: < 0.1% per 100 evaluations), so the search counts as converged
        (clock-free rules, so deterministic). Evaluations are cut off at the required gain."""
        moves.sort()
        tag = self.best_src.removesuffix("+local") + "+local"
        limit, gain = (len(moves), _REL_EPS) if self.wide else (self.patience, self.min_gain)
        for lb, a in moves[:limit]:
            if lb >= self.best_ms * (1 - gain):
                return False
            if self._expired():
                raise _Deadline
            if self._offer(a, tag, gain):
                return True
        return False

    def _single_moves(self) -> list[tuple[float, tuple[int, ...]]]:
        ev, cur = self.ev, self.best
        assert cur is not None
        mem = ev.memory(cur)
        work = ev.work(cur)
        top = self._top_chain(cur)
        cutoff = self.best_ms * (1 - _REL_EPS)
        out = []
        for r in range(self.n_req):
            c0 = cur[r]
            other = top[1][0] if top[0][1] == r else top[0][0]
            span = (
                range(self.n_cand) if self.wide else range(max(0, c0 - 2), min(self.n_cand, c0 + 3))
            )
            for c in span:
                if c == c0 or mem - ev.mem[r][c0] + ev.mem[r][c] > self.budget:
                    continue
                lb = ev.move_bound(work, other, r, c0, c)
                if lb >= cutoff:
                    continue
                a = cur[:r] + (c,) + cur[r + 1 :]
                if a not in self.seen:
                    out.append((lb, a))
        return out

    def _pair_moves(self) -> list[tuple[float, tuple[int, ...]]]:
        """One request offloads less (one step), another offloads just enough more to fit."""
        ev, cur = self.ev, self.best
        assert cur is not None
        mem = ev.memory(cur)
        work = ev.work(cur)
        top = self._top_chain(cur)
        cutoff = self.best_ms * (1 - _REL_EPS)
        out = []
        downs: Sequence[int] = range(self.n_req)
        ups: Sequence[int] = range(self.n_req)
        if not self.wide:
            downs, ups = self._promising(cur, work, top)
        for r in downs:
            if self._expired():
                raise _Deadline
            down = cur[r] - 1
            while down >= 0 and ev.mem[r][down] <= ev.mem[r][cur[r]]:
                down -= 1
            if down < 0:
                continue
            gain = ev.mem[r][down] - ev.mem[r][cur[r]]
            b_r = ev.blocks[r] / ev.bw
            dr_new, dr_old = ev.bound_cum[down], ev.bound_cum[cur[r]]
            work_r = [w + b_r * (dr_new[i] - dr_old[i]) for i, w in enumerate(work)]
            for s in ups:
                if s == r:
                    continue
                if self._expired():
                    raise _Deadline
                for c in range(cur[s] + 1, self.n_cand):
                    if mem + gain - ev.mem[s][cur[s]] + ev.mem[s][c] <= self.budget:
                        other = next(v for v, q in top if q not in (r, s))
                        other = max(other, ev.chain[r][down])
                        lb = ev.move_bound(work_r, other, s, cur[s], c)
                        if lb < cutoff:
                            a = list(cur)
                            a[r], a[s] = down, c
                            t = tuple(a)
                            if t not in self.seen:
                                out.append((lb, t))
                        break
        return out

    def _promising(
        self, cur: tuple[int, ...], work: list[float], top: list[tuple[float, int]], k: int = 10
    ) -> tuple[list[int], list[int]]:
        """The ``k`` requests whose one-step lighter move and the ``k`` whose one-step heavier
        move raise the lower bound least (partners for paired moves on large problems)."""
        ev = self.ev
        down, up = [], []
        for r, c in enumerate(cur):
            other = top[1][0] if top[0][1] == r else top[0][0]
            if c > 0:
                down.append((ev.move_bound(work, other, r, c, c - 1), r))
            if c + 1 < self.n_cand:
                up.append((ev.move_bound(work, other, r, c, c + 1), r))
        down.sort()
        up.sort()
        return [r for _, r in down[:k]], [r for _, r in up[:k]]

    def branch_and_bound(self) -> bool:
        """Exact search over the candidate space; True when it completed (proved optimal)."""
        return BranchAndBound(self).run()

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
            self.warm(warm)
        except _Deadline:
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
            return SearchResult(
                self.best or (), self.best_ms, self.best_src, True, self.ev.evaluations
            )
        return self._stages()

    CONSTRUCTIVE = ("uniforms", "mixed", "resident", "greedy")
    """Stages that build plans from scratch (the same for nearby windows of one request set)."""

    @property
    def done(self) -> frozenset[str]:
        """Stages that ran to completion."""
        return frozenset(self._done)

    def _stages(self) -> SearchResult:
        ev, mip, local = self.ev, self._mip, self._local
        stages = [
            ("continue", self.local if local else None),  # from a warm start (previous window)
            ("uniforms", self.uniforms),
            ("mixed", self.mixed),
            ("resident", self.resident_sets),
            ("local", self.local if local else None),
            ("greedy", self.greedy),
            ("relocal", self.local if local else None),
            ("mip", self._mip_stage if mip is not None else None),
            (
                "exact",
                self._bnb_stage if self._exact and self.n_req <= self.bnb_max_requests else None,
            ),
        ]
        try:
            for name, stage in stages:
                if stage is None or name in self._done:
                    continue
                if name == "continue" and self.best is None:
                    self._done.add(name)  # nothing to continue from; never run it later
                    continue
                stage()
                self._done.add(name)
        except _Deadline:
            pass
        if self.best is None:  # the deadline hit before any stage finished: take "all"
            self.best = (self.n_cand - 1,) * self.n_req
            self.best_ms, self.best_src = ev.exact_ms(self.best), "fallback"
        optimal = self._optimal
        src = "exact" if optimal and self.best_src == "exact" else self.best_src
        return SearchResult(self.best, self.best_ms, src, optimal, ev.evaluations)

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
        self.warm(mip.solve(self.ev, self.budget, cbc_ms, self.best), "mip")
        if self._local:
            self.local()

    def _bnb_stage(self) -> None:
        self._optimal = self.branch_and_bound()
        if not self._optimal:
            raise _Deadline
