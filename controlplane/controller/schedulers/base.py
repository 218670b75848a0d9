"""What a scheduler sees and decides, and the protocol every scheduler implements.

A scheduler is a pure function of a :class:`SchedulerView` (one worker's state at one step):
it decides which queued prefills to admit and, for rotating schedulers, which running requests to
rotate out (pause) and which paused ones to rotate in (resume). Placement is not its business:
the planner places the resulting batch, and may still pause victims when it is infeasible.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from controlplane.api import QueuedRequest
from controlplane.controller.batch_limits import UNLIMITED, BatchLimits
from controlplane.model import Hardware, ModelSpec
from controlplane.policy import Policy


@dataclass(frozen=True)
class RequestView:
    """A decoding (running or paused) request as the controller tracks it."""

    id: str
    """Request id."""
    context_tokens: int
    """Tokens in context including the one being decoded."""
    generated_tokens: int
    """Output tokens generated so far (N_past of LayerKV Eq. 1)."""
    slo_tbt_ms: float
    """Effective TBT SLO (request's own or the policy default)."""
    first_seen_ms: float
    """When the controller first saw it decoding (origin of T_past, LayerKV Eq. 1)."""
    run_since_ms: float
    """When it last entered the running state (t_run of SuperInfer's VLT)."""
    last_token_ms: float
    """When it last generated a token (t_last of SuperInfer's VLT)."""
    deposit_tokens: int = 0
    """Token-deposit balance (OrbitFlow §3.2)."""
    paused: bool = False
    """True while paused (SuperInfer's rotary state)."""
    paused_steps: int = 0
    """Steps spent paused so far (starvation guard)."""
    max_new_tokens: int | None = None
    """Output length limit, if known."""
    gpu_layers: int | None = None
    """Layers resident on the GPU as the worker last reported them (a paused request's are
    evictable, OrbitFlow §3.4), if known."""

    @property
    def remaining_tokens(self) -> int | None:
        """Tokens it still decodes after the next step's (a paused one: after its next), the
        planner's ``RequestSpec.remaining_tokens``; None without a known limit."""
        if self.max_new_tokens is None:
            return None
        return max(0, self.max_new_tokens - self.generated_tokens - (0 if self.paused else 1))

    def blocks_per_layer(self, block_size: int) -> int:
        """ceil(context_tokens / block_size)."""
        return -(-self.context_tokens // block_size)


@dataclass(frozen=True)
class SchedulerView:
    """One worker's state at one step, as a scheduler sees it."""

    step: int
    """The step the decision will apply at."""
    now_ms: float
    """Worker clock."""
    running: tuple[RequestView, ...]
    """Decoding, not paused."""
    paused: tuple[RequestView, ...]
    """Paused (KV kept, not decoding)."""
    queued: tuple[QueuedRequest, ...]
    """Waiting for prefill, in arrival order."""
    model: ModelSpec
    hardware: Hardware
    layer_compute_ms: tuple[float, ...]
    """Current per-layer compute profile."""
    h2d_gbps: float
    """Current effective link bandwidth."""
    tpot_ms: float
    """Current time per output token of the running batch (observed, else predicted)."""
    free_gpu_blocks: int
    """Free GPU KV blocks (reported by the worker, else estimated), in one-layer blocks."""
    policy: Policy
    limits: BatchLimits = UNLIMITED
    """The worker's batch limits (running requests; paused ones hold no slot)."""
    fetch_launch_ms: float = 0.0
    """Current host cost of one fetch launch (:mod:`controlplane.model.timeline`)."""
    held: frozenset[str] = frozenset()
    """Running requests not to pause (the worker drops their pauses: the decision builder would
    refuse a rotation-out of one)."""

    def evictable_blocks(self) -> int:
        """GPU blocks paused requests still hold (evicted layer by layer when needed, §3.4)."""
        bs = self.model.block_size
        return sum(r.blocks_per_layer(bs) * (r.gpu_layers or 0) for r in self.paused)


@dataclass(frozen=True)
class SchedulerDecision:
    """A scheduler's answer for one step."""

    admit: tuple[str, ...] = ()
    """Queued requests to admit for prefill, in order."""
    pause: tuple[str, ...] = ()
    """Running requests to rotate out (pause)."""
    resume: tuple[str, ...] = ()
    """Paused requests to rotate in (resumed only if the plan then includes them)."""
    min_gpu_layers: dict[str, int] = field(default_factory=dict)
    """Per admitted prefill, layers kept on the GPU after prefill (LayerKV Eq. 4; FCFS: the
    layers that fit, the rest offloaded at prefill)."""
    rotation: bool = False
    """The pauses are rotations: they make room for this decision's resumes and admissions
    (LVF), so a decision that resumes and admits nothing keeps them running. False: they stand
    on their own (LayerKV pauses a background request that makes the fitting ones late)."""

    @property
    def empty(self) -> bool:
        """True when the scheduler wants nothing changed."""
        return not (self.admit or self.pause or self.resume)


class Scheduler(Protocol):
    """Admission/rotation policy of one worker."""

    name: str

    def schedule(self, view: SchedulerView) -> SchedulerDecision: ...


def prompt_blocks(prompt_tokens: int, block_size: int) -> int:
    """Blocks per layer of a prompt: ceil(prompt_tokens / block_size)."""
    return -(-prompt_tokens // block_size)
