"""Exact-model local search of a :class:`~controlplane.planner.placement_search.PlacementSearch`.

From the search's incumbent: single-request moves, then paired moves (one request offloads
less, another more), neighbours tried in lower-bound order and skipped when the bound proves they
cannot improve; first improvement wins; before stopping, the incumbent is refilled (moves to
heavier candidates can leave memory unused). Large problems (``requests x candidates > 400``)
narrow the neighbourhoods (single moves within two candidates, paired moves among the most
promising requests) and converge by clock-free rules (:meth:`LocalSearch.try_moves`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from controlplane.planner.interrupts import REL_EPS, Deadline

if TYPE_CHECKING:
    from controlplane.planner.placement_search import PlacementSearch


class LocalSearch:
    """Local search over one search's incumbent (shares its incumbent, seen set and deadline)."""

    def __init__(self, search: PlacementSearch) -> None:
        self.search = search
        self._local_optimum: tuple[int, ...] | None = None

    def run(self) -> None:
        """Local search from the incumbent until no move improves it."""
        s = self.search
        while s.best is not None and s.best != self._local_optimum:
            if s.expired():
                raise Deadline
            if self.try_moves(self._single_moves()) or self.try_moves(self._pair_moves()):
                continue
            filled = s.constructive.refill(s.best)
            if filled == s.best or not s.offer(filled, s.best_src + "+fill"):
                self._local_optimum = s.best
                return

    def try_moves(self, moves: list[tuple[float, tuple[int, ...]]]) -> bool:
        """First improvement among ``moves`` in lower-bound order. On large problems at most
        :attr:`PlacementSearch.patience` exact evaluations per scan, and a move must gain
        :attr:`PlacementSearch.min_gain`: by
        then the bound order has passed the promising moves and further gains are tiny
        (measured at 64 x 80: < 0.1% per 100 evaluations), so the search counts as converged
        (clock-free rules, so deterministic). Evaluations are cut off at the required gain."""
        s = self.search
        moves.sort()
        tag = s.best_src.removesuffix("+local") + "+local"
        limit, gain = (len(moves), REL_EPS) if s.wide else (s.patience, s.min_gain)
        for lb, a in moves[:limit]:
            if lb >= s.best_ms * (1 - gain):
                return False
            if s.expired():
                raise Deadline
            if s.offer(a, tag, gain):
                return True
        return False

    def _single_moves(self) -> list[tuple[float, tuple[int, ...]]]:
        s = self.search
        ev, cur = s.ev, s.best
        assert cur is not None
        mem = ev.memory(cur)
        work = ev.work(cur)
        top = ev.top_chains(cur)
        cutoff = s.best_ms * (1 - REL_EPS)
        out = []
        for r in range(s.n_req):
            c0 = cur[r]
            other = top[1][0] if top[0][1] == r else top[0][0]
            span = range(s.n_cand) if s.wide else range(max(0, c0 - 2), min(s.n_cand, c0 + 3))
            for c in span:
                if c == c0 or mem - ev.mem[r][c0] + ev.mem[r][c] > s.budget:
                    continue
                lb = ev.move_bound(work, other, r, c0, c)
                if lb >= cutoff:
                    continue
                a = cur[:r] + (c,) + cur[r + 1 :]
                if a not in s.seen:
                    out.append((lb, a))
        return out

    def _pair_moves(self) -> list[tuple[float, tuple[int, ...]]]:
        """One request offloads less (one step), another offloads just enough more to fit."""
        s = self.search
        ev, cur = s.ev, s.best
        assert cur is not None
        mem = ev.memory(cur)
        work = ev.work(cur)
        top = ev.top_chains(cur)
        cutoff = s.best_ms * (1 - REL_EPS)
        out = []
        downs: Sequence[int] = range(s.n_req)
        ups: Sequence[int] = range(s.n_req)
        if not s.wide:
            downs, ups = self._promising(cur, work, top)
        for r in downs:
            if s.expired():
                raise Deadline
            down = cur[r] - 1
            while down >= 0 and ev.mem[r][down] <= ev.mem[r][cur[r]]:
                down -= 1
            if down < 0:
                continue
            gain = ev.mem[r][down] - ev.mem[r][cur[r]]
            b_r = ev.blocks[r] / ev.bw
            dr_new, dr_old = ev.bound_cum[down], ev.bound_cum[cur[r]]
            work_r = [w + b_r * (dr_new[i] - dr_old[i]) for i, w in enumerate(work)]
            for q in ups:
                if q == r:
                    continue
                if s.expired():
                    raise Deadline
                for c in range(cur[q] + 1, s.n_cand):
                    if mem + gain - ev.mem[q][cur[q]] + ev.mem[q][c] <= s.budget:
                        other = next(v for v, p in top if p not in (r, q))
                        other = max(other, ev.chain[r][down])
                        lb = ev.move_bound(work_r, other, q, cur[q], c)
                        if lb < cutoff:
                            a = list(cur)
                            a[r], a[q] = down, c
                            t = tuple(a)
                            if t not in s.seen:
                                out.append((lb, t))
                        break
        return out

    def _promising(
        self, cur: tuple[int, ...], work: list[float], top: list[tuple[float, int]], k: int = 10
    ) -> tuple[list[int], list[int]]:
        """The ``k`` requests whose one-step lighter move and the ``k`` whose one-step heavier
        move raise the lower bound least (partners for paired moves on large problems)."""
        s = self.search
        ev = s.ev
        down, up = [], []
        for r, c in enumerate(cur):
            other = top[1][0] if top[0][1] == r else top[0][0]
            if c > 0:
                down.append((ev.move_bound(work, other, r, c, c - 1), r))
            if c + 1 < s.n_cand:
                up.append((ev.move_bound(work, other, r, c, c + 1), r))
        down.sort()
        up.sort()
        return [r for _, r in down[:k]], [r for _, r in up[:k]]
