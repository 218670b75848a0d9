"""Shared harness for the controller tests: a minimal worker loop driving a real session.

Not a fake of anything the control plane owns: it plays the worker's part (decode one token per
running request per step, apply pause/resume decisions, report) so the tests exercise the real
SessionController, the real Planner and CBC.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from controlplane.api import Decision, QueuedRequest, RequestState, StepReport, WorkerInfo
from controlplane.controller import SessionController
from controlplane.model import Hardware, ModelSpec, Profile

MODEL = ModelSpec(layers=4, block_size=16, block_bytes=4096)
PROFILE = Profile(layer_compute_ms=(1.0, 1.0, 1.0, 1.0))


def worker_info(
    budget_blocks: int = 10_000, h2d_gbps: float = 100.0, scheduler: str | None = None
) -> WorkerInfo:
    return WorkerInfo(
        worker_id="w0",
        model=MODEL,
        hardware=Hardware(gpu_kv_budget_blocks=budget_blocks, h2d_gbps=h2d_gbps),
        profile=PROFILE,
        scheduler=scheduler,
    )


@dataclass
class WorkerLoop:
    """Plays a worker: one token per running request per step, applies decisions, reports."""

    session: SessionController
    step_ms: float = 10.0
    step: int = 0
    now_ms: float = 0.0
    ctx: dict[str, int] = field(default_factory=dict)
    gen: dict[str, int] = field(default_factory=dict)
    paused: set[str] = field(default_factory=set)
    queued: list[QueuedRequest] = field(default_factory=list)
    to_finish: list[str] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    auto_admit: bool = True
    free_gpu_blocks: int | None = None
    max_new: dict[str, int] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)
    """Pauses dropped since the last report (``StepReport.pauses_dropped``)."""

    def add(self, rid: str, context_tokens: int, max_new_tokens: int | None = None) -> None:
        self.ctx[rid] = context_tokens
        self.gen[rid] = 1
        if max_new_tokens is not None:
            self.max_new[rid] = max_new_tokens

    def finish(self, rid: str) -> None:
        self.ctx.pop(rid)
        self.gen.pop(rid)
        self.paused.discard(rid)
        self.to_finish.append(rid)

    def report(
        self,
        *,
        observed_step_ms: float | None = None,
        layer_compute_ms: Sequence[float] | None = None,
        h2d_gbps: float | None = None,
        advance: bool = True,
    ) -> list[Decision]:
        self.step += 1
        self.now_ms += self.step_ms
        if advance:
            for rid in self.ctx:
                if rid not in self.paused:
                    self.ctx[rid] += 1
                    self.gen[rid] += 1
        rep = StepReport(
            step=self.step,
            now_ms=self.now_ms,
            running=tuple(
                RequestState(rid, self.ctx[rid], self.gen[rid], paused=rid in self.paused,
                             max_new_tokens=self.max_new.get(rid))
                for rid in self.ctx
            ),
            queued=tuple(self.queued),
            observed_step_ms=observed_step_ms,
            layer_compute_ms=None if layer_compute_ms is None else tuple(layer_compute_ms),
            h2d_gbps=h2d_gbps,
            finished=tuple(self.to_finish),
            free_gpu_blocks=self.free_gpu_blocks,
            pauses_dropped=tuple(self.dropped),
        )
        self.to_finish = []
        self.dropped = []
        out = self.session.report(rep)
        self.apply(out)
        return out

    def apply(self, decisions: list[Decision]) -> None:
        for d in decisions:
            self.paused.update(rid for rid in d.pause if rid in self.ctx)
            self.paused.difference_update(d.resume)
            admitted = set(d.admit) if self.auto_admit else set()
            for q in [q for q in self.queued if q.id in admitted]:
                self.queued.remove(q)
                self.add(q.id, q.prompt_tokens + 1)
        self.decisions.extend(decisions)
