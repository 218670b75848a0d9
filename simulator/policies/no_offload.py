"""``no-offload``: the vLLM/SGLang default without KV offloading.

Admission is FCFS and limited by free GPU blocks (the whole prompt KV in every layer). When KV
growth would overflow the GPU, the most recently arrived running request is preempted (vLLM's
policy): by **recompute** (``no-offload``: KV dropped, the request re-prefills prompt + generated
tokens later, ahead of new arrivals) or by **swap** (``no-offload-swap``: all its KV goes to host
and comes back before it decodes again; transfers serialised with the step as vLLM 0.6 does).
"""

from __future__ import annotations

from collections.abc import Callable

from simulator.policies.base import BasePolicy
from simulator.state import Actions, EngineView, SimRequest


def preempt_and_resume(p, view: EngineView, act: Actions, preemption: str,  # noqa: ANN001 - SimProfile
                       may_resume: Callable[[list[SimRequest], SimRequest], bool] | None = None,
                       ) -> tuple[list[SimRequest], int]:
    """vLLM's memory rules before admission: when the next step's growth overflows the GPU the
    most recently arrived running request is preempted (``preemption``: recompute or swap);
    swapped requests come back first while they fit (and ``may_resume(running, r)``). Returns the
    requests that run and the blocks left free."""
    L, budget = p.layers, p.gpu_kv_budget_blocks
    running = sorted(view.running, key=lambda r: (r.spec.arrival_ms, r.id))
    # Blocks needed next step: one more token for every running request.
    need = sum(p.blocks(r.context + 1) * L for r in running)
    while running and need > budget:
        victim = running.pop()
        need -= p.blocks(victim.context + 1) * L
        (act.preempt_recompute if preemption == "recompute" else act.preempt_swap).append(victim.id)
    free = budget - need
    # Swapped requests come back first (vLLM prioritises swapped over waiting).
    for r in sorted(view.swapped, key=lambda r: (r.spec.arrival_ms, r.id)):
        blocks = p.blocks(r.context + 1) * L
        if blocks > free or len(running) + 1 > p.max_batch_size \
                or may_resume is not None and not may_resume(running, r):
            break
        act.resume.append(r.id)
        running.append(r)
        free -= blocks
    return running, free


class NoOffloadPolicy(BasePolicy):
    """vLLM-style admission with recompute or swap preemption."""

    layered = False

    def __init__(self, preemption: str = "recompute") -> None:
        if preemption not in ("recompute", "swap"):
            raise ValueError(f"preemption: {preemption!r} is not one of ('recompute', 'swap')")
        self.preemption = preemption
        self.name = "no-offload" if preemption == "recompute" else "no-offload-swap"
        self.paused_hold_slot = False

    def decide(self, view: EngineView) -> Actions:
        p = self.p
        act = Actions()
        L = p.layers
        running, free = preempt_and_resume(p, view, act, self.preemption)
        if act.preempt_recompute or act.preempt_swap or view.swapped and not act.resume:
            return act  # under memory pressure: no new admissions this step
        n = len(running)
        tokens = sum(r.context for r in running)
        for q in view.queued:
            blocks = p.blocks(q.context + 1) * L
            if blocks > free or n + 1 > p.max_batch_size or (
                tokens + q.context > p.token_budget and n > 0
            ):
                break
            act.admit.append(q.id)
            free -= blocks
            n += 1
            tokens += q.context
        return act
