"""Shared pieces of simulator policies: defaults, FCFS admission, uniform candidates.

Uniform (batch-wide) placements use the control plane's distance-driven candidate set
(:func:`controlplane.planner.candidates.candidate_set`, OrbitFlow §3.3.2) with every request on the
same candidate, evaluated by the exact timeline :func:`controlplane.model.step_time_ms`.
"""

from __future__ import annotations

from collections.abc import Sequence

from controlplane.api import QueuedRequest
from controlplane.controller.batch_limits import BatchLimits
from controlplane.controller.schedulers import FcfsScheduler, RequestView, SchedulerView
from controlplane.model import Hardware, ModelSpec, step_time_ms
from controlplane.planner.candidates import candidate_set
from controlplane.policy import Policy
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
        self.model_spec = ModelSpec(profile.layers, profile.block_size, profile.block_bytes)
        self.hardware = Hardware(profile.gpu_kv_budget_blocks, profile.h2d_gbps)
        self.cp_policy = Policy(
            slo_tbt_ms=min((t.slo_tbt_ms for t in trace), default=200.0),
            slo_ttft_ms=min((t.slo_ttft_ms for t in trace), default=5000.0),
        )
        self._fcfs = FcfsScheduler()

    # ---- the control plane's schedulers -----------------------------------------------------
    def admissible_queue(self, view: EngineView) -> tuple[QueuedRequest, ...]:
        """The queue prefix the worker's own limits (batch size, token budget) could admit."""
        p = self.p
        hold = self.paused_hold_slot
        flight = list(view.running) + (list(view.paused) + list(view.swapped) if hold else [])
        n = len(flight)
        tokens = sum(r.context for r in flight)
        out: list[QueuedRequest] = []
        for q in view.queued:
            if n + 1 > p.max_batch_size or (tokens + q.context > p.token_budget and n > 0):
                break
            out.append(QueuedRequest(q.id, q.context, q.spec.arrival_ms, q.spec.slo_ttft_ms))
            n += 1
            tokens += q.context
        return tuple(out)

    @staticmethod
    def request_view(r: SimRequest, now_ms: float) -> RequestView:
        return RequestView(
            id=r.id,
            context_tokens=r.context,
            generated_tokens=r.generated,
            slo_tbt_ms=r.spec.slo_tbt_ms,
            first_seen_ms=r.admitted_ms if r.admitted_ms is not None else now_ms,
            run_since_ms=r.run_since_ms,
            last_token_ms=r.gen_ms[-1] if r.gen_ms else now_ms,
            deposit_tokens=r.deposit.balance if r.deposit is not None else 0,
            paused=r.state != "running",
            paused_steps=r.paused_steps,
            max_new_tokens=r.spec.output_tokens,
            gpu_layers=r.resident_layers(),
        )

    def scheduler_view(self, view: EngineView, *, tpot_ms: float, free_blocks: int,
                       policy: Policy | None = None) -> SchedulerView:
        now = view.now_ms
        return SchedulerView(
            step=view.step,
            now_ms=now,
            running=tuple(self.request_view(r, now) for r in view.running),
            paused=tuple(self.request_view(r, now) for r in view.paused + view.swapped),
            queued=self.admissible_queue(view),
            model=self.model_spec,
            hardware=self.hardware,
            layer_compute_ms=(self.p.layer_compute_ms(0),) * self.p.layers,
            fetch_launch_ms=self.p.fetch_launch_ms,
            h2d_gbps=self.p.h2d_gbps,
            tpot_ms=tpot_ms,
            free_gpu_blocks=free_blocks,
            policy=policy or self.cp_policy,
            limits=BatchLimits(self.p.max_batch_size, self.p.token_budget),
        )

    def free_blocks(self, view: EngineView) -> int:
        """GPU blocks nobody holds (paused layers count as held; the scheduler adds them back as
        evictable)."""
        held = sum(r.blocks(self.p) * r.resident_layers() for r in view.running + view.paused)
        return max(0, self.p.gpu_kv_budget_blocks - held)

    def fcfs_scheduler_admit(self, view: EngineView) -> tuple[list[str], dict[str, int]]:
        """The control plane's FCFS scheduler, exactly as the controller runs it: (admitted ids,
        layers each keeps on the GPU after prefill; the rest are offloaded at prefill)."""
        if not view.queued:
            return [], {}
        sv = self.scheduler_view(view, tpot_ms=view.last_step_ms,
                                 free_blocks=self.free_blocks(view))
        d = self._fcfs.schedule(sv)
        return list(d.admit), dict(d.min_gpu_layers)

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
        return step_time_ms([row] * len(blocks), blocks, [comp] * p.layers, p.h2d_blocks_per_ms,
                            launch_ms=p.fetch_launch_ms)

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
