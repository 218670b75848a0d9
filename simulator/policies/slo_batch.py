"""vLLM-style serving with eLLM's Eq. (5) at r = 0: the common part of eLLM's three baselines.

eLLM §6.1 ("Metrics"): to be fair, eLLM's Eq. (5) with ``r = 0`` is integrated into
vLLM-Recompute, vLLM-Swap and HCache, "allowing them to update the estimated batch size for
maximum requests while maintaining SLO requirements for TPOT". Here that is the ``ellm`` policy's
own request-level rule with the ratio fixed at 0: among the FCFS prefixes of the waiting requests
that vLLM's limits admit (memory, batch size, token budget), the one maximising ``b / T(b)``
subject to ``T(b) <= SLO`` (the tightest TPOT SLO in the batch), ``T`` being the step model the
``ellm`` policy uses (:meth:`SimProfile.decode_resident_ms` of the batch's context tokens). ``T``
has a fixed part (weights read) and a part per context token, so a long prompt can lower
``b / T`` and wait even within the SLO; an idle server always admits its head (liveness). At
``r = 0`` the two policies therefore admit alike, and differ in what they do with memory.

Everything else is vLLM's scheduler as :class:`~simulator.policies.no_offload.NoOffloadPolicy`
models it (whose rules this class repeats; with ``eq5=False`` it makes the same decisions, which
``tests/simulator/test_ellm_baselines.py`` checks): the whole KV of every running request on the
GPU; when the next step's growth would overflow memory, the most recently arrived running request
is preempted (subclasses choose how: :attr:`preemption`); preempted requests come back before new
admissions (recompute-preempted ones re-enter at the queue head, swapped ones are resumed first,
while the predicted step stays within the SLO); no admissions while memory is under pressure.
Eq. (5) never preempts a running request (eLLM chooses ``b`` among waiting requests).
"""

from __future__ import annotations

from simulator.policies.base import BasePolicy
from simulator.policies.no_offload import preempt_and_resume
from simulator.state import Actions, EngineView, SimRequest

PREEMPTIONS = ("recompute", "swap")


class SloBatchPolicy(BasePolicy):
    """vLLM's FCFS within memory, batch size chosen by Eq. (5) at r = 0; preempt the newest on
    overflow."""

    name = "slo-batch"
    layered = False
    paused_hold_slot = False
    preemption = "recompute"
    """``recompute`` (KV dropped, re-prefilled) or ``swap`` (KV to host and back)."""

    def __init__(self, eq5: bool = True) -> None:
        if self.preemption not in PREEMPTIONS:
            raise ValueError(f"preemption: {self.preemption!r} is not one of {PREEMPTIONS}")
        self.eq5 = eq5

    def step_ms(self, reqs: list[SimRequest]) -> float:
        """eLLM Eq. (4) at r = 0 on this profile: a decode step with every layer resident."""
        return self.p.decode_resident_ms(sum(x.context for x in reqs))

    def _within_slo(self, batch: list[SimRequest]) -> bool:
        return self.step_ms(batch) <= min(x.spec.slo_tbt_ms for x in batch)

    def eq5_admissions(self, running: list[SimRequest], cands: list[SimRequest]) -> int:
        """How many of ``cands`` (an FCFS prefix vLLM's limits admit) to admit: eLLM Eq. (5) at
        r = 0, the prefix maximising ``b / T`` with ``T <= SLO`` (none when even the running
        batch misses the SLO; the head when the server is idle)."""
        if not self.eq5:
            return len(cands)
        step = self.p.decode_resident_ms
        tokens = sum(x.context for x in running)
        slo = min((x.spec.slo_tbt_ms for x in running), default=float("inf"))
        best: tuple[float, int] | None = None
        if running and step(tokens) <= slo:
            best = (len(running) / step(tokens), 0)
        for k, q in enumerate(cands, 1):
            tokens += q.context
            slo = min(slo, q.spec.slo_tbt_ms)
            t = step(tokens)
            if t > slo:
                break  # longer prefixes are slower and have a tighter or equal SLO
            if best is None or (len(running) + k) / t > best[0] + 1e-12:
                best = ((len(running) + k) / t, k)
        if best is None:
            return 0 if running else min(1, len(cands))
        return best[1]

    def decide(self, view: EngineView) -> Actions:
        p = self.p
        act = Actions()
        L = p.layers
        may_resume = (lambda run, r: not run or self._within_slo(run + [r])) if self.eq5 else None
        running, free = preempt_and_resume(p, view, act, self.preemption, may_resume)
        if act.preempt_recompute or act.preempt_swap or view.swapped and not act.resume:
            return act  # under memory pressure: no new admissions this step
        n = len(running)
        tokens = sum(r.context for r in running)
        cands: list[SimRequest] = []
        for q in view.queued:
            blocks = p.blocks(q.context + 1) * L
            if blocks > free or n + 1 > p.max_batch_size or (
                tokens + q.context > p.token_budget and n > 0
            ):
                break
            cands.append(q)
            free -= blocks
            n += 1
            tokens += q.context
        act.admit = [q.id for q in cands[:self.eq5_admissions(running, cands)]]
        return act
