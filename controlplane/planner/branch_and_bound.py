"""Branch and bound over the full candidate space of one :class:`PlacementSearch`.

Requests are assigned largest first; a child is pruned by memory (the rest all offloaded must
still fit), by the chain bound (per-request fetch chain, :mod:`.evaluator`) and by the aggregate
link bound on the evaluator's bound layers (a subset of layers keeps it valid and cheap). Leaves go
through the search's exact evaluation (cut off at the incumbent). When the tree is exhausted the
incumbent is optimal over the candidate space.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from controlplane.planner.interrupts import REL_EPS, Deadline

if TYPE_CHECKING:
    from controlplane.planner.placement_search import PlacementSearch


class BranchAndBound:
    """One depth-first branch and bound run over ``search``'s problem."""

    def __init__(self, search: PlacementSearch) -> None:
        self.search = search

    def run(self) -> bool:
        """True when the tree was exhausted (the search's incumbent is then optimal)."""
        search = self.search
        ev = search.ev
        n, nc = search.n_req, search.n_cand
        order = sorted(range(n), key=lambda r: -ev.blocks[r])
        last = nc - 1
        # min memory of requests order[i:] (everything offloaded)
        tail_min = [0] * (n + 1)
        for i in range(n - 1, -1, -1):
            tail_min[i] = tail_min[i + 1] + ev.mem[order[i]][last]
        # Aggregate bound on the bound layers only (a subset keeps it valid, and cheap).
        n_layers = len(ev.bound_layers)
        cum, suffix, bw, chain = ev.bound_cum, ev.bound_suffix, ev.bw, ev.chain
        inv = 1.0 / bw
        assign = [0] * n
        nodes = 0

        def dfs(i: int, mem: int, chain_lb: float, work: list[float]) -> None:
            # work[j]: W / bw at bound layer j of the requests assigned so far
            nonlocal nodes
            nodes += 1
            if nodes > search.bnb_node_limit:
                search.mark_done("exact")  # a node-limited tree: resuming would only repeat it
                raise Deadline
            if search.expired():
                raise Deadline
            if i == n:
                search.offer(tuple(assign), "bnb")
                return
            r = order[i]
            binv = ev.blocks[r] * inv
            cut = search.best_ms * (1 - REL_EPS)
            children = []
            for c in range(nc):
                m = mem + ev.mem[r][c]
                if m + tail_min[i + 1] > search.budget:
                    continue
                lb_c = max(chain_lb, chain[r][c])
                if lb_c >= cut:
                    continue
                if c:
                    new_work = [w + binv * k for w, k in zip(work, cum[c], strict=True)]
                    agg = max([w + s for w, s in zip(new_work, suffix, strict=True)])
                    lb = agg if agg > lb_c else lb_c
                else:
                    new_work, lb = work, lb_c
                if lb < cut:
                    children.append((lb, c, m, lb_c, new_work))
            children.sort(key=lambda ch: (ch[0], ch[1]))
            for lb, c, m, lb_c, new_work in children:
                if lb >= search.best_ms * (1 - REL_EPS):
                    break
                assign[r] = c
                dfs(i + 1, m, lb_c, new_work)
                assign[r] = 0

        try:
            dfs(0, 0, ev.compute_ms, [0.0] * n_layers)
        except Deadline:
            return False
        return True
