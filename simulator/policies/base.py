"""Shared pieces of simulator policies: defaults, FCFS admission, uniform candidates.

Uniform (batch-wide) placements use the control plane's distance-driven candidate set
(:func:`controlplane.planner.candidates.candidate_set`, OrbitFlow §3.3.2) with every request on the
same candidate, evaluated by the exact timeline :func:`controlplane.model.step_time_ms`.
"""

from __future__ import annotations

from collections.abc import Sequence

from controlplane.model import step_time_ms
from controlplane.planner.candidates import candidate_set
from simulator.engine import StepInfo
from simulator.profile import SimProfile
from simulator.state import Actions, EngineView, SimRequest
from simulator.trace import TraceRequest


class BasePolicy:
    """Defaults: layered, no deposit, serialised swaps, paused requests hold their slot."""

    name = "base"
    layered = True
    deposit = False
    overlap_swaps = False
    paused_hold_slot = True

    def start(self, profile: SimProfile, trace: Sequence[TraceRequest]) -> None:
        self.p = profile
        self.cands = candidate_set(profile.layers)

    def decide(self, view: EngineView) -> Actions:  # pragma: no cover - abstract
        raise NotImplementedError

    def observe(self, view: EngineView, info: StepInfo) -> None:
        return None

    # ---- helpers ----------------------------------------------------------------------------
    def fcfs_admit(self, view: EngineView, *, per_request_units: int | None = None) -> list[str]:
        """Queued ids in order while batch size, token budget and (approximate) memory allow.

        Memory is checked with ``per_request_units`` layer-blocks per request block for the whole
        batch after admission (default: all offloaded = 1 staging layer), so that a feasible
        placement exists; the engine re-checks exactly.
        """
        p = self.p
        units = 1 if per_request_units is None else per_request_units
        flight = list(view.running) + (list(view.paused) + list(view.swapped)
                                       if self.paused_hold_slot else [])
        n = len(flight)
        tokens = sum(r.context for r in flight)
        blocks = sum(r.blocks(p) for r in view.running) * units + sum(
            r.blocks(p) * r.resident_layers() for r in view.paused)
        out: list[str] = []
        for q in view.queued:
            if n + 1 > p.max_batch_size or (tokens + q.context > p.token_budget and n > 0):
                break
            need = q.blocks(p) * units
            if blocks + need > p.gpu_kv_budget_blocks:
                break
            out.append(q.id)
            n += 1
            tokens += q.context
            blocks += need
        return out

    def uniform_memory(self, cand: int, blocks: Sequence[int]) -> int:
        return sum(blocks) * self.cands.mem_units[cand]

    def uniform_time(self, cand: int, blocks: Sequence[int]) -> float:
        p = self.p
        comp = p.layer_compute_ms(sum(blocks) * p.block_size)
        row = self.cands.rows[cand]
        return step_time_ms([row] * len(blocks), blocks, [comp] * p.layers, p.h2d_blocks_per_ms)

    def fewest_offload_fitting(self, blocks: Sequence[int], budget: int) -> int:
        """Index of the candidate with the fewest offloaded layers that fits ``budget``."""
        for c in range(self.cands.size):
            if self.uniform_memory(c, blocks) <= budget:
                return c
        return self.cands.size - 1

    def budget_for_running(self, view: EngineView) -> int:
        """GPU blocks available to running requests (paused ones' layers are evictable)."""
        return self.p.gpu_kv_budget_blocks

    @staticmethod
    def projected_blocks(p: SimProfile, reqs: Sequence[SimRequest]) -> list[int]:
        """Blocks per request at its final length (prompt + max_new_tokens)."""
        return [p.blocks(r.spec.prompt_tokens + r.spec.output_tokens) for r in reqs]
