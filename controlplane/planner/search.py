"""Placement search over candidate assignments for one window (blocks fixed).

:class:`PlacementSearch` combines, within a deadline:

1. every memory-feasible *uniform* assignment (one candidate for all requests), in lower-bound
   order, pruned only by a valid lower bound — so the result is never worse than the best
   uniform distance;
2. a *greedy* fill: start with nothing offloaded and offload where the lower bound grows least per
   block freed until memory fits;
3. warm starts the caller passes (a previous window's plan, the MIP's answer);
4. *local search* with the exact model: single-request moves, then paired moves (one request
   offloads less, another more), neighbours tried in lower-bound order and skipped when the bound
   proves they cannot improve;
5. *branch and bound* over the full candidate space (exact model at the leaves, chain/aggregate
   bounds and memory to prune); when it completes the result is optimal over the candidate space.

All candidates are evaluated with :meth:`Evaluator.exact_ms`, so the returned step time is the
exact model's prediction.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from controlplane.planner.evaluator import Evaluator
from controlplane.planner.mip_search import MipStage

_REL_EPS = 1e-12


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


class _Deadline(Exception):
    pass


class PlacementSearch:
    """One search over candidate assignments; construct per solve (not thread-shared)."""

    def __init__(
        self,
        ev: Evaluator,
        budget_blocks: int,
        deadline: float,
        *,
        bnb_node_limit: int = 20_000,
    ) -> None:
        self.ev = ev
        self.budget = budget_blocks
        self.deadline = deadline
        self.bnb_node_limit = bnb_node_limit
        self.n_req = len(ev.blocks)
        self.n_cand = ev.cands.size
        self.best: tuple[int, ...] | None = None
        self.best_ms = math.inf
        self.best_src = ""
        self.seen: set[tuple[int, ...]] = set()

    # --- helpers ------------------------------------------------------------------------
    def _expired(self) -> bool:
        return time.perf_counter() >= self.deadline

    def _offer(self, assign: Sequence[int], src: str) -> bool:
        """Evaluate exactly (cut off at the incumbent); keep when strictly better."""
        key = tuple(assign)
        if key in self.seen:
            return False
        self.seen.add(key)
        t = self.ev.exact_ms(key, self.best_ms * (1 - _REL_EPS) if self.best else math.inf)
        if t < self.best_ms * (1 - _REL_EPS) or (self.best is None and t < math.inf):
            self.best, self.best_ms, self.best_src = key, t, src
            return True
        return False

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
        """Evaluate caller-provided assignments (e.g. the previous window's plan)."""
        for a in starts:
            if len(a) == self.n_req and self.ev.memory(a) <= self.budget:
                self._offer(a, src)

    def _top_chain(self, assign: Sequence[int]) -> list[tuple[float, int]]:
        chain = self.ev.chain
        vals = sorted(((chain[r][c], r) for r, c in enumerate(assign)), reverse=True)
        vals += [(self.ev.compute_ms, -1)] * 3
        return vals[:3]

    def local(self) -> None:
        """Exact-model local search from the incumbent until no move improves it."""
        while self.best is not None:
            if self._expired():
                raise _Deadline
            if not (self._try(self._single_moves()) or self._try(self._pair_moves())):
                return

    def _try(self, moves: list[tuple[float, tuple[int, ...]]]) -> bool:
        moves.sort()
        tag = self.best_src.removesuffix("+local") + "+local"
        for lb, a in moves:
            if lb >= self.best_ms * (1 - _REL_EPS):
                return False
            if self._expired():
                raise _Deadline
            if self._offer(a, tag):
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
            for c in range(self.n_cand):
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
        for r in range(self.n_req):
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
            for s in range(self.n_req):
                if s == r:
                    continue
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

    def branch_and_bound(self) -> bool:
        """Exact search over the candidate space; True when it completed (proved optimal)."""
        ev = self.ev
        n, nc = self.n_req, self.n_cand
        order = sorted(range(n), key=lambda r: -ev.blocks[r])
        last = nc - 1
        # min memory of requests order[i:] (everything offloaded)
        tail_min = [0] * (n + 1)
        for i in range(n - 1, -1, -1):
            tail_min[i] = tail_min[i + 1] + ev.mem[order[i]][last]
        n_layers = ev.n_layers
        cum, suffix, bw, chain = ev.cum, ev.suffix, ev.bw, ev.chain
        work = [0.0] * n_layers  # W_l of the requests assigned so far
        assign = [0] * n
        nodes = 0

        def agg_bound() -> float:
            best = ev.compute_ms
            for layer in range(n_layers):
                v = work[layer] / bw + suffix[layer]
                if v > best:
                    best = v
            return best

        def dfs(i: int, mem: int, chain_lb: float) -> None:
            nonlocal nodes
            nodes += 1
            if nodes > self.bnb_node_limit or (nodes & 63 == 0 and self._expired()):
                raise _Deadline
            if i == n:
                self._offer(tuple(assign), "exact")
                return
            r = order[i]
            b = ev.blocks[r]
            children = []
            for c in range(nc):
                m = mem + ev.mem[r][c]
                if m + tail_min[i + 1] > self.budget:
                    continue
                lb_c = max(chain_lb, chain[r][c])
                if lb_c >= self.best_ms * (1 - _REL_EPS):
                    continue
                counts = cum[c]
                if c:
                    for layer in range(n_layers):
                        work[layer] += b * counts[layer]
                lb = max(lb_c, agg_bound()) if c else lb_c
                if c:
                    for layer in range(n_layers):
                        work[layer] -= b * counts[layer]
                if lb < self.best_ms * (1 - _REL_EPS):
                    children.append((lb, c, m, lb_c))
            children.sort()
            for lb, c, m, lb_c in children:
                if lb >= self.best_ms * (1 - _REL_EPS):
                    break
                counts = cum[c]
                if c:
                    for layer in range(n_layers):
                        work[layer] += b * counts[layer]
                assign[r] = c
                try:
                    dfs(i + 1, m, lb_c)
                finally:
                    if c:
                        for layer in range(n_layers):
                            work[layer] -= b * counts[layer]
                assign[r] = 0

        try:
            dfs(0, 0, ev.compute_ms)
        except _Deadline:
            return False
        return True

    # --- driver -------------------------------------------------------------------------
    def run(
        self,
        warm: Iterable[Sequence[int]] = (),
        *,
        mip: MipStage | None = None,
        local: bool = True,
        exact: bool = True,
    ) -> SearchResult | None:
        """Best assignment within the deadline, or None when nothing fits memory."""
        if not self.feasible():
            return None
        ev = self.ev
        optimal = False
        none = (0,) * self.n_req
        if ev.memory(none) <= self.budget:
            return SearchResult(none, ev.compute_ms, "trivial", True, ev.evaluations)
        try:
            self.warm(warm)
            self.uniforms()
            self.greedy()
            if local:
                self.local()
            small = self.n_cand**self.n_req <= 4096
            if mip is not None and not small:
                left_ms = (self.deadline - time.perf_counter()) * 1e3
                if left_ms >= mip.min_budget_ms:
                    self.warm(mip.solve(ev, self.budget, left_ms * 0.5, self.best), "mip")
                    if local:
                        self.local()
            if exact:
                optimal = self.branch_and_bound()
        except _Deadline:
            pass
        if self.best is None:  # the deadline hit before any stage finished: take "all"
            self.best = (self.n_cand - 1,) * self.n_req
            self.best_ms, self.best_src = ev.exact_ms(self.best), "fallback"
        src = "exact" if optimal and self.best_src == "exact" else self.best_src
        return SearchResult(self.best, self.best_ms, src, optimal, ev.evaluations)
