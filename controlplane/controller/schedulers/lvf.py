"""SuperInfer's Largest-VLT-First rotation (SuperInfer §4.2.2-4.2.3, Algorithm 1).

Virtual Lag Time (§4.2.2)::

    VLT = alpha * ReLU(t_now - t_last - beta_B * S_B)   rotary  (paused here)
          ReLU(t_now - t_arr - beta_F * S_F)            waiting (queued for prefill)
          -(t_now - t_run)                              running

The paper's text says "S_B and S_F are the TTFT and TBT SLO, respectively", but its equation
pairs S_B with rotary requests (measured from the last token) and S_F with waiting ones (measured
from arrival), and its sensitivity study (Fig. 19/20: beta_F delays new arrivals, beta_B delays
rotary resumption) confirms that pairing, so here ``S_B`` is the request's TBT SLO and ``S_F`` its
TTFT SLO. ``beta_B`` and ``beta_F`` may be negative (the paper suggests ``beta_B < 0``).

LVF (§4.2.3, Algorithm 1), per step, with transfer budget ``B_xfer`` and free GPU blocks
``B_HBM`` (block counts are one-layer blocks; a request's ``blk`` is its blocks in all layers):

1. Contention check: if ``B_HBM >= sum blk(waiting and rotary)`` everything waiting or rotary is
   prioritized and nothing is preempted (FCFS fallback).
2. Sort all requests by VLT, descending.
3. From the head, prioritize waiting/rotary requests with ``VLT >= 0`` whose ``blk`` fits the
   remaining ``B_left`` (initially ``B_HBM + B_xfer``). (Algorithm 1 line 8 tests only the VLT;
   a running request whose VLT is exactly 0 is already running, so only waiting/rotary ones are
   picked, as the text says.)
4. ``B_swap = B_xfer - B_left`` extra blocks are needed beyond the free ones: from the tail,
   preempt running requests with ``VLT < 0`` until ``B_swap <= 0``. A *held* request (its pause
   would be dropped, ``SchedulerView.held``) is passed over: the next one is preempted instead.

Prioritized waiting requests are admitted, prioritized rotary ones resumed, preempted running
ones paused (rotated out).
"""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.controller.schedulers.base import (
    SchedulerDecision,
    SchedulerView,
    prompt_blocks,
)


@dataclass(frozen=True)
class VltEntry:
    """One request in LVF's sorted list."""

    id: str
    """Request id."""
    kind: str
    """"running", "rotary" or "waiting"."""
    vlt_ms: float
    """Virtual Lag Time in ms."""
    blocks: int
    """blk(r): the request's KV blocks over all layers."""


def vlt_entries(view: SchedulerView) -> list[VltEntry]:
    """Every request's VLT (SuperInfer §4.2.2), sorted descending (ties: waiting/rotary first)."""
    p = view.policy.lvf
    layers, bs = view.model.layers, view.model.block_size
    now = view.now_ms
    out: list[VltEntry] = []
    for r in view.paused:
        lag = now - r.last_token_ms - p.beta_b * r.slo_tbt_ms
        out.append(
            VltEntry(r.id, "rotary", p.alpha * max(0.0, lag), r.blocks_per_layer(bs) * layers)
        )
    for q in view.queued:
        ttft = q.slo_ttft_ms if q.slo_ttft_ms is not None else view.policy.slo_ttft_ms
        lag = now - q.arrival_ms - p.beta_f * ttft
        out.append(
            VltEntry(q.id, "waiting", max(0.0, lag), prompt_blocks(q.prompt_tokens, bs) * layers)
        )
    for r in view.running:
        out.append(
            VltEntry(r.id, "running", -(now - r.run_since_ms), r.blocks_per_layer(bs) * layers)
        )
    order = {"rotary": 0, "waiting": 1, "running": 2}
    out.sort(key=lambda e: (-e.vlt_ms, order[e.kind], e.id))
    return out


class LvfScheduler:
    """Rotate requests between GPU and host by Largest-VLT-First (SuperInfer Algorithm 1)."""

    name = "lvf"

    def schedule(self, view: SchedulerView) -> SchedulerDecision:
        b_xfer = view.policy.lvf.transfer_budget_blocks
        b_hbm = max(0, view.free_gpu_blocks)
        entries = vlt_entries(view)
        inactive = [e for e in entries if e.kind != "running"]
        if not inactive:
            return SchedulerDecision()
        # Step 1: contention check -> FCFS fallback (everything waiting/rotary, nothing preempted).
        if b_hbm >= sum(e.blocks for e in inactive):
            waiting = {e.id for e in inactive if e.kind == "waiting"}
            admit = tuple(
                q.id
                for q in sorted(view.queued, key=lambda q: (q.arrival_ms, q.id))
                if q.id in waiting
            )
            resume = tuple(e.id for e in inactive if e.kind == "rotary")
            return SchedulerDecision(admit=admit, resume=resume)
        # Step 3: prioritize from the head within B_HBM + B_xfer.
        b_left = b_hbm + b_xfer
        prioritized: list[VltEntry] = []
        for e in entries:
            if e.kind != "running" and e.vlt_ms >= 0 and e.blocks <= b_left:
                prioritized.append(e)
                b_left -= e.blocks
        # Step 4: preempt from the tail until the extra blocks are freed.
        b_swap = b_xfer - b_left
        preempted: list[str] = []
        for e in reversed(entries):
            if b_swap <= 0:
                break
            if e.kind == "running" and e.vlt_ms < 0 and e.id not in view.held:
                preempted.append(e.id)
                b_swap -= e.blocks
        return SchedulerDecision(
            admit=tuple(e.id for e in prioritized if e.kind == "waiting"),
            pause=tuple(preempted),
            resume=tuple(e.id for e in prioritized if e.kind == "rotary"),
            rotation=True,
        )
