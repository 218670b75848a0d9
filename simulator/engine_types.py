"""The engine's configuration, step record, result and the policy protocol."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from simulator.profile import SimProfile
from simulator.state import Actions, EngineView, SimRequest
from simulator.trace import TraceRequest

SOLVER_TIME_MODES = ("model", "measured", "zero")


@dataclass(frozen=True)
class SimConfig:
    """Engine settings (limits come from the profile)."""

    solver_time: str = "model"
    """How planner time is charged: model, measured, zero."""
    max_steps: int = 20_000_000
    """Safety stop."""
    record_steps: bool = False
    """Keep a per-step record (for tests and plots)."""

    def __post_init__(self) -> None:
        if self.solver_time not in SOLVER_TIME_MODES:
            raise ValueError(
                f"solver_time: {self.solver_time!r} is not one of {SOLVER_TIME_MODES}"
            )
        if not isinstance(self.max_steps, int) or self.max_steps < 1:
            raise ValueError(f"max_steps: {self.max_steps!r} is out of range (allowed >= 1)")


@dataclass(frozen=True)
class StepInfo:
    """What happened in one step (given to the policy afterwards and optionally recorded)."""

    step: int
    """Step index."""
    start_ms: float
    """Clock at the step start."""
    dur_ms: float
    """Step duration including charged solver time and exposed transfers."""
    kind: str
    """"prefill" or "decode"."""
    rows: dict[str, tuple[int, ...]]
    """Placement each decoding request ran with (decode steps)."""
    layer_compute_ms: float
    """Per-layer compute of this step (decode steps)."""
    used_blocks: int
    """Peak GPU KV blocks held during the step."""
    solver_charged_ms: float
    """Solver time added to this step."""
    finished: tuple[str, ...]
    """Requests that finished in this step."""
    tokens: int
    """Tokens generated in this step."""


class SimPolicy(Protocol):
    """A serving policy: decides at each step boundary; the engine executes."""

    name: str
    layered: bool
    """True: per-layer placements; prefill keeps LayerKV's Eq. 4 minimum layers by default."""
    deposit: bool
    """True: tokens go through the token deposit (OrbitFlow §3.2)."""
    overlap_swaps: bool
    """True: swap transfers overlap with the step (SuperInfer DuplexKV), else serialised."""
    paused_hold_slot: bool
    """True: paused/swapped requests count toward max_batch_size and token_budget."""

    def start(self, profile: SimProfile, trace: Sequence[TraceRequest]) -> None: ...

    def decide(self, view: EngineView) -> Actions: ...

    def observe(self, view: EngineView, info: StepInfo) -> None:
        """After a step; ``view`` is the pre-step view (the step's outcome is ``info``)."""


@dataclass
class SimResult:
    """Raw outcome of one run (see :mod:`simulator.metrics` for the summary)."""

    policy: str
    profile: SimProfile
    requests: list[SimRequest]
    sim_ms: float = 0.0
    steps: int = 0
    decode_steps: int = 0
    prefill_steps: int = 0
    decode_ms: float = 0.0
    """Total time of decode steps."""
    kv_block_ms: float = 0.0
    """Integral of used GPU blocks over time (block*ms)."""
    max_used_blocks: int = 0
    solver_ms: float = 0.0
    """Total planner time (as charged by the configured mode, before hiding)."""
    solver_charged_ms: float = 0.0
    """Planner time that could not hide and was added to steps."""
    solver_calls: int = 0
    forced_fallbacks: int = 0
    evicted_blocks: int = 0
    """Blocks evicted lazily from paused requests."""
    resume_refusals: int = 0
    """Resumes the engine refused because the batch was full (a paused request holds no slot)."""
    admission_demoted_blocks: int = 0
    """Running requests' blocks written back so that an admitted prompt's staging layer fits."""
    worker_admissions: int = 0
    """Head-of-queue admissions the engine made because the server was idle (liveness)."""
    step_log: list[StepInfo] = field(default_factory=list)
