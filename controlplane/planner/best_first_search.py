"""Best-first branch and bound over the candidate space of one small search.

Requests are assigned largest first; every node carries a valid lower bound on the exact step
time of any completion (the chain bound of the requests assigned so far and the aggregate link
bound on the evaluator's bound layers, :mod:`.evaluator`), and memory prunes children whose
remaining requests could not fit even all offloaded. Nodes are expanded in bound order (deeper
first on ties), so complete assignments reach the exact model in ascending lower-bound order:
the one with the smallest bound first, which on random small batches is the optimum or within
1% of it in nine cases out of ten. The run stops, proved optimal, when the smallest bound left is
no better than the incumbent; until then it is resumable (the frontier is kept), so a satisficing
probe and the later polish share one tree.

Requests with equal block counts are interchangeable: memory and the exact step time depend
only on the multiset of (blocks, candidate) pairs (:meth:`.Evaluator.exact_ms` groups fetches by
candidate and sorts them), so among such requests (adjacent in the assignment order) only
non-decreasing candidate indices are expanded. Every assignment has such a permutation with the
same memory and step time, so the optimum is kept and the proof stays valid, while the tree
shrinks from ``C ** k`` to ``C (C + 1) ... (C + k - 1) / k!`` leaves for ``k`` equal requests
(4 equal requests, 5 candidates: 625 -> 70).

Unlike :class:`.BranchAndBound` (depth first, any size), the frontier grows with the tree, so
:class:`PlacementSearch` uses it only while the space has at most
``PlacementSearch.best_first_max_leaves`` complete assignments.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from operator import add
from typing import TYPE_CHECKING

from controlplane.planner.candidates import CandidateSet
from controlplane.planner.evaluator import bound_layers
from controlplane.planner.interrupts import REL_EPS, Deadline, Unreachable

if TYPE_CHECKING:
    from controlplane.planner.placement_search import PlacementSearch

@functools.lru_cache(maxsize=64)
def _min_cum(cands: CandidateSet) -> list[list[int]]:
    """Per first candidate c0, the elementwise least offloaded-layer counts at the bound layers
    over the candidates ``c >= c0`` (the ones a memory allowance leaves)."""
    _, cum = bound_layers(cands)
    out = [list(cum[-1])]
    for c in range(len(cum) - 2, -1, -1):
        out.append(list(map(min, out[-1], cum[c])))
    return out[::-1]


_Node = tuple[float, int, int, tuple[int, ...], int, float, list[float]]
"""(lower bound, -depth, sequence, candidates of the first ``depth`` requests in ``order``,
memory so far, chain bound so far, aggregate work per bound layer)."""


class BestFirstSearch:
    """One resumable best-first run over ``search``'s problem."""

    def __init__(self, search: PlacementSearch) -> None:
        self.search = search
        ev = search.ev
        n, last = search.n_req, search.n_cand - 1
        self.order = sorted(range(n), key=lambda r: -ev.blocks[r])
        # tied[i]: order[i] has the blocks of order[i - 1] (interchangeable; see module docstring)
        self.tied = [
            i > 0 and ev.blocks[self.order[i]] == ev.blocks[self.order[i - 1]] for i in range(n)
        ]
        # memory of requests order[i:] all offloaded (the least they can take)
        self.tail_min = [0] * (n + 1)
        for i in range(n - 1, -1, -1):
            self.tail_min[i] = self.tail_min[i + 1] + ev.mem[self.order[i]][last]
        self._scaled: dict[tuple[int, int], list[float]] = {}
        self._min_scaled: dict[tuple[int, int], list[float]] = {}
        self._min_chain = [
            [min(row[c:]) for c in range(len(row))] for row in (ev.chain[r] for r in range(n))
        ]
        self._seq = itertools.count()
        root_work = [0.0] * len(ev.bound_layers)
        self.frontier: list[_Node] = [(ev.compute_ms, 0, 0, (), 0, ev.compute_ms, root_work)]
        self.expanded = 0

    def scaled(self, r: int, c: int) -> list[float]:
        """Link time request ``r`` adds at each bound layer under candidate ``c`` (cached)."""
        key = (r, c)
        row = self._scaled.get(key)
        if row is None:
            f = self.search.ev.blocks[r] / self.search.ev.bw
            row = self._scaled[key] = [f * k for k in self.search.ev.bound_cum[c]]
        return row

    def min_scaled(self, r: int, c0: int) -> list[float]:
        """The least link time ``r`` adds at each bound layer over candidates ``c >= c0``."""
        key = (r, c0)
        row = self._min_scaled.get(key)
        if row is None:
            f = self.search.ev.blocks[r] / self.search.ev.bw
            row = self._min_scaled[key] = [f * k for k in _min_cum(self.search.ev.cands)[c0]]
        return row

    @property
    def complete(self) -> bool:
        """True once the frontier is exhausted (the incumbent is then optimal)."""
        return not self.frontier

    def run(self) -> bool:
        """Expand until proved (True) or the deadline stops it (raises :class:`Deadline`), or a
        satisficing target is met (:class:`Satisfied`) or proved out of reach by the smallest
        bound left (:class:`Unreachable`); the frontier is kept for a later call.

        Without an incumbent the run first dives (always into the child with the smallest
        bound, siblings kept in the frontier): at most one expansion per request before the
        first exact evaluation, so the deadline checks, which need an incumbent to fall back
        on, start early."""
        s = self.search
        n = s.n_req
        frontier = self.frontier
        node: _Node | None = None
        while frontier or node is not None:
            if node is None:
                lb = frontier[0][0]
                if s.best is not None and lb >= s.best_ms * (1 - REL_EPS):
                    frontier.clear()  # every node left is bounded by the incumbent
                    break
                if s.target_ms is not None and lb > s.target_ms and s.best is not None:
                    raise Unreachable  # no completion can meet the probe's target
                if s.best is not None and s.expired():
                    raise Deadline
                node = heapq.heappop(frontier)
            depth, prefix = -node[1], node[3]
            if depth == n:
                node = None
                assign = [0] * n
                for i, c in enumerate(prefix):
                    assign[self.order[i]] = c
                s.offer(assign, "bnb")
                continue
            children = self._expand(node, depth, prefix)
            self.expanded += 1
            node = None
            if s.best is None and children:  # dive: continue with the most promising child
                children.sort(key=lambda ch: ch[:3])
                node = children.pop(0)
            for child in children:
                heapq.heappush(frontier, child)
        return True

    def _rest(self, depth: int, mem: int, floor: int = 0) -> tuple[list[float] | None, float]:
        """What the unassigned requests ``order[depth:]`` must add whatever their candidates,
        given ``mem`` blocks already taken: each has to leave the others room to fit all
        offloaded, so only its candidates from some ``c0`` on fit, and it adds at least their
        elementwise least link time per bound layer and their least chain bound (valid bounds:
        each request's own contribution is at least its minimum over what fits). The requests
        tied with ``order[depth - 1]`` take candidates from ``floor`` on (symmetry breaking)."""
        s = self.search
        ev = s.ev
        free = s.budget - mem - self.tail_min[depth]
        vec: list[float] | None = None
        chain = 0.0
        last = s.n_cand - 1
        tied = self.tied
        for i in range(depth, s.n_req):
            q = self.order[i]
            mem_q = ev.mem[q]
            allowance = free + mem_q[last]
            if not tied[i]:
                floor = 0
            c0 = floor
            while mem_q[c0] > allowance:
                c0 += 1
            v = self.min_scaled(q, c0)
            vec = v if vec is None else list(map(add, vec, v))
            if self._min_chain[q][c0] > chain:
                chain = self._min_chain[q][c0]
        return vec, chain

    def _expand(self, node: _Node, depth: int, prefix: tuple[int, ...]) -> list[_Node]:
        """The children of ``node`` that fit memory and whose bound beats the incumbent."""
        s = self.search
        ev = s.ev
        r = self.order[depth]
        mem, chain_lb, work = node[4], node[5], node[6]
        mem_r, chain_r = ev.mem[r], ev.chain[r]
        base = list(map(add, work, ev.bound_suffix))  # the aggregate terms so far
        room = s.budget - self.tail_min[depth + 1]
        cut = s.best_ms * (1 - REL_EPS)
        seq = self._seq
        out: list[_Node] = []
        for c in range(prefix[-1] if self.tied[depth] else 0, s.n_cand):
            m = mem + mem_r[c]
            if m > room:
                continue
            lb_c = chain_r[c] if chain_r[c] > chain_lb else chain_lb
            if lb_c >= cut:
                continue
            rest, rest_chain = self._rest(depth + 1, m, c)
            terms = list(map(add, base, self.scaled(r, c))) if c else base
            agg = max(map(add, terms, rest)) if rest is not None else max(terms)
            lb = max(agg, lb_c, rest_chain)
            if lb < cut:
                new_work = list(map(add, work, self.scaled(r, c))) if c else work
                out.append((lb, -depth - 1, next(seq), (*prefix, c), m, lb_c, new_work))
        return out
