"""First-come-first-served admission: admit queued prefills in arrival order while memory allows.

The baseline. A prefill needs its whole prompt KV on the GPU (``ceil(prompt / block_size)`` blocks
in every layer); admission stops at the first queued request that does not fit, so no later
arrival overtakes an earlier one (head-of-line order is the point of FCFS). It never pauses or
resumes: the planner's pause-on-infeasible and the controller's resume rule handle that.
"""

from __future__ import annotations

from controlplane.controller.schedulers.base import (
    SchedulerDecision,
    SchedulerView,
    prompt_blocks,
)


class FcfsScheduler:
    """Admit queued requests in arrival order while their full KV fits the free GPU blocks."""

    name = "fcfs"

    def schedule(self, view: SchedulerView) -> SchedulerDecision:
        free = view.free_gpu_blocks
        admit: list[str] = []
        for q in sorted(view.queued, key=lambda q: (q.arrival_ms, q.id)):
            need = prompt_blocks(q.prompt_tokens, view.model.block_size) * view.model.layers
            if need > free:
                break
            free -= need
            admit.append(q.id)
        return SchedulerDecision(admit=tuple(admit))
