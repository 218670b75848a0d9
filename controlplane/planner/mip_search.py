"""The MIP stage: CBC (python-mip) on a linear surrogate of the step time.

Variables ``y[r][c]`` (request r takes candidate c) and a continuous ``T``:

* ``sum_c y[r][c] = 1`` per request;
* memory: ``sum b_r * mem_units[c] * y[r][c] <= gpu_kv_budget_blocks`` (exact, issue 2 §2);
* ``T >= chain_r(c)`` per request (its own fetch chain with the link to itself) and
  ``T >= W_l / bw + suffix_l`` on a subset of layers (all fetches up to layer l through the link),
  i.e. the linear stall bounds of :mod:`controlplane.planner.evaluator`;
* objective ``T + eps * mean_r chain_r`` (prefer fewer per-request stalls among equal bounds).

CBC's answer (and any extra solutions in its pool) are then evaluated with the exact model by the
caller; the MIP only proposes. Measured on the 2-core dev machine: loading CBC costs ~0.7 s once per
process, and building plus solving the model costs ~60 ms at 4 requests x 11 candidates, ~110 ms at
16 x 11 and ~500 ms at 64 x 17 *even with a 20 ms CBC limit* (python-mip model construction and CBC
preprocessing do not honour ``max_seconds``). So the search runs this stage only when the remaining
budget is generous (:meth:`MipStage.affordable`: at least :attr:`min_budget_ms` and twice
:meth:`MipStage.overhead_ms`), e.g. ``kvplane plan --time-budget-ms 2000`` or the reference search
of ``kvplane bench planner``; under the default budget (25% of a step, a few ms) it never does.
"""

from __future__ import annotations

import functools

import structlog
from mip import BINARY, CBC, MINIMIZE, Model, OptimizationStatus, Var, xsum

from controlplane.planner.evaluator import Evaluator

log = structlog.get_logger(__name__)


def _value(row: list[Var], k: int, c: int) -> float:
    """Value of ``row[c]`` in CBC's k-th solution (0 when unset)."""
    return float(row[c].xi(k) or 0.0)


class MipStage:
    """Builds and solves the surrogate MIP for one :class:`Evaluator`."""

    min_budget_ms: float = 200.0
    """Below this remaining budget the stage is skipped."""

    _loaded = False  # CBC's shared library is loaded on the first Model() of a process

    @classmethod
    def overhead_ms(cls, n_req: int, n_cand: int) -> float:
        """Estimated wall time of building and starting the model (not CBC's own search)."""
        return 60.0 + 0.45 * n_req * n_cand + (0.0 if cls._loaded else 700.0)

    def affordable(self, left_ms: float, n_req: int, n_cand: int) -> bool:
        """Whether ``left_ms`` leaves room for this stage."""
        return left_ms >= max(self.min_budget_ms, 2.0 * self.overhead_ms(n_req, n_cand))

    def solve(
        self,
        ev: Evaluator,
        budget_blocks: int,
        time_ms: float,
        start: tuple[int, ...] | None = None,
    ) -> list[tuple[int, ...]]:
        """Assignments proposed by CBC within ``time_ms`` (best first; may be empty)."""
        n_req, n_cand = len(ev.blocks), ev.cands.size
        m = Model(sense=MINIMIZE, solver_name=CBC)
        MipStage._loaded = True
        m.verbose = 0
        m.threads = 1
        y = [[m.add_var(var_type=BINARY) for _ in range(n_cand)] for _ in range(n_req)]
        t_var = m.add_var(lb=ev.compute_ms)
        for r in range(n_req):
            m.add_constr(xsum(y[r]) == 1)
        m.add_constr(
            xsum(ev.mem[r][c] * y[r][c] for r in range(n_req) for c in range(n_cand))
            <= budget_blocks
        )
        for r in range(n_req):
            m.add_constr(t_var >= xsum(ev.chain[r][c] * y[r][c] for c in range(n_cand)))
        inv = 1.0 / ev.bw
        for i, suffix in enumerate(ev.bound_suffix):
            m.add_constr(
                t_var
                >= suffix
                + xsum(
                    ev.blocks[r] * inv * ev.bound_cum[c][i] * y[r][c]
                    for r in range(n_req)
                    for c in range(1, n_cand)
                    if ev.bound_cum[c][i]
                )
            )
        eps = 1e-3 / max(1, n_req)
        m.objective = t_var + xsum(
            eps * ev.chain[r][c] * y[r][c] for r in range(n_req) for c in range(n_cand)
        )
        if start is not None:
            m.start = [(y[r][c], 1.0) for r, c in enumerate(start)]
        status = m.optimize(max_seconds=max(0.001, time_ms / 1e3))
        if status not in (OptimizationStatus.OPTIMAL, OptimizationStatus.FEASIBLE):
            log.debug("mip_no_solution", status=status.name)
            return []
        out: list[tuple[int, ...]] = []
        for k in range(m.num_solutions):
            a = tuple(
                max(range(n_cand), key=functools.partial(_value, y[r], k)) for r in range(n_req)
            )
            if a not in out:
                out.append(a)
        return out
