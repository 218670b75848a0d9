"""A placement plan: the planner's answer and the data plane's instruction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Plan:
    """The placement for one batch, valid for ``window_steps`` decode steps."""

    feasible: bool
    """True when every non-paused request fits memory and the SLO cap."""
    paused: tuple[str, ...]
    """Ids of requests to pause (in the order they were chosen as victims)."""
    placements: dict[str, tuple[int, ...]]
    """Per running request, 1 (GPU) / 0 (host) per layer."""
    predicted_step_ms: float
    """Exact-model time of the window's *last* decode step: every running request's KV sized at
    ``context_tokens + window_steps`` tokens, i.e. ``ceil((context_tokens + Δ) / block_size)``
    blocks per layer (``context_tokens`` already counts the token being decoded now). The plan is
    computed one step ahead and must hold for Δ steps, so it is sized for the largest KV of the
    window (OrbitFlow §3.3.2): for Δ = 1 that is context + 1, the step ahead; for larger windows
    it is the step Δ ahead, and earlier steps of the window run with fewer blocks. 0.0 when no
    request runs."""
    window_steps: int
    """Decode window Δ: the plan expires after this many steps."""
    resident_blocks: int
    """GPU blocks kept resident at the end of the window."""
    staging_blocks: int
    """GPU staging blocks (one layer per offloading request) at the end of the window."""
    solver: str
    """Which search produced the plan: "exact" when it is proved optimal over the candidate
    space, "trivial" when everything fits on the GPU, otherwise the stage that found it (e.g.
    "uniform", "mixed", "resident", "greedy", "warm", "mip", "bnb", with "+local"/"+fill");
    "empty" or "all-paused" when no request runs."""
    solve_ms: float
    """Wall-clock planning time."""
    expiry_step: int | None = None
    """Absolute step at which the plan expires, when the caller gave the current step."""
    extras: dict[str, Any] = field(default_factory=dict)
    """Optional diagnostics (not part of the schema)."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "feasible": self.feasible,
            "paused": list(self.paused),
            "placements": {k: list(v) for k, v in self.placements.items()},
            "predicted_step_ms": self.predicted_step_ms,
            "window_steps": self.window_steps,
            "resident_blocks": self.resident_blocks,
            "staging_blocks": self.staging_blocks,
            "solver": self.solver,
            "solve_ms": self.solve_ms,
        }
        if self.expiry_step is not None:
            out["expiry_step"] = self.expiry_step
        return out
