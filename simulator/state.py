"""Engine-side state of one request and the read-only view policies decide on."""

from __future__ import annotations

from dataclasses import dataclass, field

from controlplane.controller.token_deposit import TokenDeposit
from simulator.profile import SimProfile
from simulator.trace import TraceRequest

QUEUED, RUNNING, PAUSED, SWAPPED, FINISHED, REJECTED = (
    "queued", "running", "paused", "swapped", "finished", "rejected",
)


@dataclass(eq=False)
class SimRequest:
    """Mutable per-request state owned by the engine (policies read it through the view)."""

    spec: TraceRequest
    state: str = QUEUED
    generated: int = 0
    """Output tokens generated so far."""
    resident: tuple[int, ...] | None = None
    """Per layer 1 when this request's KV of that layer is on the GPU; None = no KV on GPU."""
    has_kv: bool = False
    """True once the prompt KV exists (GPU or host); False after a recompute preemption."""
    target: tuple[int, ...] | None = None
    """Placement the policy wants while running (1 GPU / 0 host per layer)."""
    uncached_ratio: float = 0.0
    """eLLM: fraction of context tokens whose KV is dropped and recomputed each step."""
    deposit: TokenDeposit | None = None
    gen_ms: list[float] = field(default_factory=list)
    """Generation time of each output token."""
    step_ms: list[float] = field(default_factory=list)
    """Duration of the step each output token was generated in (OrbitFlow's TBT axis)."""
    deliver_ms: list[float] = field(default_factory=list)
    """Delivery time of each output token (== gen_ms without a deposit)."""
    burst: list[bool] = field(default_factory=list)
    """Per delivered token: delivered by the finish burst."""
    admitted_ms: float | None = None
    run_since_ms: float = 0.0
    finish_ms: float | None = None
    pauses: int = 0
    preemptions: int = 0
    paused_steps: int = 0
    min_gpu_layers: int | None = None
    """LayerKV Eq. 4 retained layers chosen at admission."""

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def context(self) -> int:
        """Tokens whose KV the request holds (prompt + generated)."""
        return self.spec.prompt_tokens + self.generated

    @property
    def remaining(self) -> int:
        return self.spec.output_tokens - self.generated

    def blocks(self, profile: SimProfile) -> int:
        return profile.blocks(self.context)

    def resident_layers(self) -> int:
        return 0 if self.resident is None else sum(self.resident)


@dataclass(frozen=True)
class EngineView:
    """What a policy sees at a step boundary (requests are live objects: do not mutate)."""

    step: int
    now_ms: float
    profile: SimProfile
    queued: tuple[SimRequest, ...]
    """Arrived, waiting for (re-)prefill, in arrival order (recompute-preempted first)."""
    running: tuple[SimRequest, ...]
    paused: tuple[SimRequest, ...]
    swapped: tuple[SimRequest, ...]
    free_blocks: int
    """GPU blocks not held by any request (paused requests' resident layers count as held)."""
    last_step_ms: float
    """Duration of the previous step (0 before the first)."""

    @property
    def in_flight(self) -> int:
        return len(self.running) + len(self.paused) + len(self.swapped)

    @property
    def in_flight_tokens(self) -> int:
        return sum(r.context for r in self.running + self.paused + self.swapped)


@dataclass
class Actions:
    """A policy's decisions for the next step (the engine enforces the hard limits)."""

    admit: list[str] = field(default_factory=list)
    """Queued ids to prefill, in order (admitted while batch size, token budget, memory allow)."""
    gpu_layers: dict[str, int] = field(default_factory=dict)
    """Per admitted id, layers to keep on the GPU after prefill (default: policy.layered ?
    LayerKV Eq. 4 minimum : all)."""
    pause: list[str] = field(default_factory=list)
    """Running ids to pause (KV kept; lazily evicted layer by layer when memory is needed)."""
    resume: list[str] = field(default_factory=list)
    """Paused or swapped ids to run again (swapped ones are swapped in, full KV)."""
    preempt_recompute: list[str] = field(default_factory=list)
    """Running ids to preempt by dropping their KV (re-prefilled later)."""
    preempt_swap: list[str] = field(default_factory=list)
    """Running ids to preempt by swapping all their KV to host."""
    placements: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Per running id, the placement row (1 GPU / 0 host per layer)."""
    uncached_ratio: dict[str, float] = field(default_factory=dict)
    """eLLM: per running id, uncached token ratio r."""
    solver_ms: float = 0.0
    """Planner time spent deciding this step (charged when it cannot hide under a step)."""
    solver_calls: int = 0
