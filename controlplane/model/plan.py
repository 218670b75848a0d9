"""A placement plan: the planner's answer and the data plane's instruction.

Plan JSON (``kvplane plan`` output)::

    {"feasible", "paused", "placements": {id: [1|0 per layer]}, "predicted_step_ms",
     "window_steps", "resident_blocks", "staging_blocks", "solver", "solve_ms",
     "expiry_step" (when the caller gave the current step),
     "recompute_blocks": {id: u}, "recompute_layers": {id: k}, "transient_blocks"
     (these three only when some running request recomputes; issue 16, docs/recompute.md)}
"""

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
    """GPU staging blocks at the end of the window: one slot per fetching request holding every
    block it fetches in some layer (``b_r`` without recompute; with it ``(b_r - u_r)`` when a
    layer is offloaded plus ``u_r`` when ``k_r < L``, as the served core reserves it)."""
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
    recompute_blocks: dict[str, int] = field(default_factory=dict)
    """``u_r`` per running request with an uncached prefix (keyed like ``placements``; only
    requests with ``u_r > 0``): its first ``u_r`` blocks are not cached in any layer."""
    recompute_layers: dict[str, int] = field(default_factory=dict)
    """``k_r`` for the same requests: layers ``< k_r`` recompute the prefix every step, layers
    ``>= k_r`` fetch it from host memory (``k = L`` pure recompute, ``k = 0`` pure fetch)."""
    transient_blocks: int = 0
    """GPU blocks for recomputed prefixes, ``sum_r u_r [k_r > 0]`` (one layer each, reused
    layer after layer); resident + staging + transient fit the budget."""

    def places_like(self, other: Plan) -> bool:
        """Both plans put every request's layers (and recomputed prefix) in the same place: a
        worker switching from one to the other moves nothing."""
        return (self.placements == other.placements and self.recompute_blocks == other.recompute_blocks
                and self.recompute_layers == other.recompute_layers)

    def all_gpu(self) -> bool:
        """Every layer of every placed request stays on the GPU and no prefix is recomputed (a
        worker running this plan moves nothing; requests it does not place run all-GPU)."""
        return not self.recompute_blocks and all(all(row) for row in self.placements.values())

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
        if self.recompute_blocks:
            out["recompute_blocks"] = dict(self.recompute_blocks)
            out["recompute_layers"] = dict(self.recompute_layers)
            out["transient_blocks"] = self.transient_blocks
        return out
