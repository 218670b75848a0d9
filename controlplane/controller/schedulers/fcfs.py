"""First-come-first-served admission by batch limits, with prefill offload (OrbitFlow §5.1).

OrbitFlow admits queued prefills in arrival order while the batch has a free slot (batch size 4)
and the batch's total sequence length stays within its token budget (32K tokens, §5.1
"Workloads"); memory does not gate admission: the prompt layers that do not fit the free GPU
memory are offloaded at prefill and the planner places the request from the next step on
(§3.3). So here:

* a queued request is admitted when :class:`BatchLimits` admits it (running requests only: a
  paused request holds no slot, §3.4); admission stops at the first one that does not fit, so no
  later arrival overtakes an earlier one (head-of-line order is the point of FCFS);
* its retained layers (``min_gpu_layers``) are the layers of its prompt that fit the free blocks
  plus the blocks paused requests hold (evicted on demand, §3.4) after one staging layer; all
  ``L`` when the whole prompt fits. The free estimate shrinks with each admission.

``admission="full-kv"`` keeps the older rule (admit only while the whole prompt KV fits the free
blocks, vLLM's prefill reservation) as an ablation; it is not the default.

It never pauses or resumes: the planner's pause-on-infeasible and the controller's resume rule
handle that.
"""

from __future__ import annotations

from controlplane.controller.schedulers.base import (
    SchedulerDecision,
    SchedulerView,
    prompt_blocks,
)

ADMISSION_RULES = ("batch", "full-kv")


class FcfsScheduler:
    """Admit queued requests in arrival order while the batch limits allow (OrbitFlow §5.1)."""

    name = "fcfs"

    def __init__(self, admission: str = "batch") -> None:
        if admission not in ADMISSION_RULES:
            raise ValueError(f"admission: {admission!r} is not one of {ADMISSION_RULES}")
        self.admission = admission

    def schedule(self, view: SchedulerView) -> SchedulerDecision:
        layers = view.model.layers
        bs = view.model.block_size
        n = len(view.running)
        tokens = sum(r.context_tokens for r in view.running)
        if self.admission == "full-kv":
            free = view.free_gpu_blocks
        else:
            free = view.free_gpu_blocks + view.evictable_blocks()
        admit: list[str] = []
        retained: dict[str, int] = {}
        for q in sorted(view.queued, key=lambda q: (q.arrival_ms, q.id)):
            if not view.limits.admits(n, tokens, q.prompt_tokens):
                break
            b = prompt_blocks(q.prompt_tokens, bs)
            if self.admission == "full-kv":
                if b * layers > free:
                    break
                keep = layers
            else:
                keep = layers if b * layers <= free else max(0, free // b - 1)
            free = max(0, free - b * (keep + (0 if keep == layers else 1)))
            admit.append(q.id)
            retained[q.id] = keep
            n += 1
            tokens += q.prompt_tokens
        return SchedulerDecision(admit=tuple(admit), min_gpu_layers=retained)
