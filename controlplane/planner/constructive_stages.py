"""Constructive stages of a :class:`~controlplane.planner.placement_search.PlacementSearch`:
plans built from scratch (or from a caller's warm start), each offered to the search's exact
evaluation.

* :meth:`ConstructiveStages.uniforms`: every memory-feasible uniform assignment (one candidate
  for all requests) in lower-bound order, pruned only by a valid lower bound, so the search is
  never worse than the best uniform distance;
* :meth:`ConstructiveStages.mixed`: from the least-offloading uniform that fits, requests step
  back to the next lighter candidate while memory allows, in three orders;
* :meth:`ConstructiveStages.resident_sets`: the ``j`` largest requests wholly on the GPU, the rest
  offloaded with a mixed fill;
* :meth:`ConstructiveStages.greedy`: offload where the lower bound grows least per block freed
  (small problems only);
* :meth:`ConstructiveStages.warm`: caller-provided assignments, each also refilled.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from controlplane.planner.interrupts import REL_EPS, Deadline

if TYPE_CHECKING:
    from controlplane.planner.placement_search import PlacementSearch


class ConstructiveStages:
    """The constructive stages of one search (they share its incumbent and deadline)."""

    def __init__(self, search: PlacementSearch) -> None:
        self.search = search

    def uniforms(self) -> None:
        """Every memory-feasible uniform assignment not excluded by its lower bound."""
        s = self.search
        ev = s.ev
        options = []
        for c in range(s.n_cand):
            a = (c,) * s.n_req
            if ev.memory(a) <= s.budget:
                options.append((ev.lower_bound_ms(a), c, a))
        options.sort()
        for lb, _, a in options:
            if s.best is not None and lb >= s.best_ms * (1 - REL_EPS):
                break
            if s.best is not None and s.expired():
                raise Deadline
            s.offer(a, "uniform")

    def mixed(self) -> None:
        """Mixed fills between the least-offloading feasible uniform and lighter candidates."""
        s = self.search
        ev, n = s.ev, s.n_req
        hi = next((c for c in range(s.n_cand) if ev.memory((c,) * n) <= s.budget), None)
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
            if s.best is not None and s.expired():
                raise Deadline
            s.offer_bounded(self.fill([hi] * n, order), "mixed")

    def resident_sets(self) -> None:
        """Keep the ``j`` largest requests wholly on the GPU and offload the rest (mixed fill).

        Staging costs every offloading request one layer of its blocks, and a large request's
        fetches are long (``b_r / bw``), so optima often keep the largest requests resident and
        offload the small ones heavily; single-step local moves rarely find that.
        """
        s = self.search
        ev, n = s.ev, s.n_req
        if n < 2:
            return
        mem_rows, chain, last = ev.mem, ev.chain, s.n_cand - 1
        big = sorted(range(n), key=lambda r: -ev.blocks[r])
        steps = {1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112}
        steps |= {j * n // 8 for j in range(1, 8)}
        for j in sorted(steps & set(range(1, n))):
            res, rest = big[:j], big[j:]
            fixed = sum(mem_rows[r][0] for r in res)
            hi = next(
                (
                    c
                    for c in range(1, s.n_cand)
                    if fixed + sum(mem_rows[r][c] for r in rest) <= s.budget
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

            if s.best is not None and s.expired():
                raise Deadline
            s.offer_bounded(self.fill(a, sorted(rest, key=per_block)), "resident")
            if hi == last and j > 1 and s.best_src != "resident":
                break

    def fill(self, start: list[int], order: Sequence[int]) -> tuple[int, ...]:
        """Step requests (in ``order``) to lighter candidates while memory fits, three passes."""
        s = self.search
        mem_rows = s.ev.mem
        a = list(start)
        mem = s.ev.memory(a)
        for _ in range(3):
            moved = False
            for r in order:
                c = a[r]
                if c == 0:
                    continue
                extra = mem_rows[r][c - 1] - mem_rows[r][c]
                if mem + extra <= s.budget:
                    a[r] = c - 1
                    mem += extra
                    moved = True
            if not moved:
                break
        return tuple(a)

    def greedy(self, max_moves: int = 400) -> None:
        """Offload where the lower bound grows least per block freed, until memory fits."""
        s = self.search
        ev = s.ev
        if s.n_req * s.n_cand > max_moves:
            return
        assign = [0] * s.n_req
        mem = ev.memory(assign)
        while mem > s.budget:
            if s.best is not None and s.expired():
                raise Deadline
            work = ev.work(assign)
            top = ev.top_chains(assign)
            base = ev.lower_bound_ms(assign)
            choice = None
            for r in range(s.n_req):
                cur = assign[r]
                other = top[1][0] if top[0][1] == r else top[0][0]
                for c in range(cur + 1, s.n_cand):
                    freed = ev.mem[r][cur] - ev.mem[r][c]
                    if freed <= 0:
                        continue
                    lb = ev.move_bound(work, other, r, cur, c)
                    over = mem - freed - s.budget
                    key = (0 if over <= 0 else 1, (lb - base) / freed, lb, -freed)
                    if choice is None or key < choice[0]:
                        choice = (key, r, c, freed)
            if choice is None:
                return
            _, r, c, freed = choice
            assign[r] = c
            mem -= freed
        s.offer(assign, "greedy")

    def warm(self, starts: Iterable[Sequence[int]], src: str = "warm") -> None:
        """Evaluate caller-provided assignments (e.g. the previous window's plan), each also
        refilled: requests step to lighter candidates while memory allows (after a pause the
        survivors' old layouts leave the paused request's memory unused)."""
        s = self.search
        for a in starts:
            if len(a) != s.n_req or s.ev.memory(a) > s.budget:
                continue
            filled = self.refill(a)
            if filled != tuple(a):  # usually the better one: try it first
                s.offer(filled, src + "+fill")
            s.offer(a, src)

    def refill(self, a: Sequence[int]) -> tuple[int, ...]:
        """``a`` with requests stepped to lighter candidates while memory allows, cheapest
        chain-bound increase per block first."""
        s = self.search
        chain, mem_rows = s.ev.chain, s.ev.mem

        def per_block(r: int) -> float:
            c = a[r]
            if c == 0:
                return math.inf
            extra = mem_rows[r][c - 1] - mem_rows[r][c]
            return (chain[r][c - 1] - chain[r][c]) / extra if extra > 0 else math.inf

        return self.fill(list(a), sorted(range(s.n_req), key=per_block))
