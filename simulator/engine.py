"""The discrete-event engine: continuous batching with layered KV offloading.

Events are request arrivals and step completions; the clock jumps to the next arrival when the
server is idle. Each step is either a **prefill step** (the admitted prompts, LayerKV Eq. 3 with
the layer-wise offload of Eq. 4 overlapped; running requests generate nothing, as in vLLM 0.6's
prefill-first scheduling) or a **decode step** (one token per running request; time from the exact
placement timeline :func:`controlplane.model.step_time_ms` with per-layer compute affine in the
batch's context tokens).

Mechanisms (all enforced here, whatever the policy asks):

* limits: ``max_batch_size`` requests and ``token_budget`` context tokens in flight; GPU blocks
  never above ``gpu_kv_budget_blocks`` (resident + one staging layer per offloading request +
  paused requests' not-yet-evicted layers);
* placement changes: a layer newly placed on the GPU is fetched through the staging slot in the
  step that installs it (the step runs with the *current* residency) and stays resident after;
  a layer moved to host is written back D2H, overlapped with the step (full-duplex link);
* admission (OrbitFlow §5.1): within the batch limits; a layered policy's prompt keeps the layers
  that fit and offloads the rest at prefill (:meth:`EngineMemory._make_room`);
* pause/resume with lazy layer eviction (OrbitFlow §3.4): a paused request keeps its GPU layers
  until the space is needed; then layers are evicted one at a time (their D2H overlapped with the
  next step, as demotions are: the step takes at least the write-back's time), before any
  running request's promotion is deferred; a paused request holds no batch slot unless the
  policy says so (``paused_hold_slot``), and a resume into a full batch is refused (counted);
* preemption: recompute (KV dropped, re-prefilled over prompt + generated tokens) or swap (all
  KV to host and back; serialised unless the policy overlaps swaps, as SuperInfer's DuplexKV;
  a policy with ``swap_out_ms(r)`` / ``swap_in_ms(r)`` prices the two transfers itself, as the
  HCache-like restoration does);
* token deposit (OrbitFlow §3.2) via the control plane's :class:`TokenDeposit` when the policy
  uses it: tokens are delivered at the SLO rate; metrics use delivery times;
* solver time: the policy's planning time is charged to the step only for the part that does not
  hide under the previous step (the planner runs one step ahead, OrbitFlow §3.3.2). With
  ``solver_time="model"`` the charge is ``profile.solver_model_ms`` per call (deterministic);
  ``"measured"`` charges the real planner's wall time (machine-dependent); ``"zero"`` none.
  Decisions never depend on the measured time, so runs are deterministic under a seed in
  ``model`` and ``zero`` modes.
* safety net: if a policy's placement would overflow GPU memory (stale plan, KV growth), the
  engine offloads more layers of the largest request (layered policies) or preempts the newest
  request by recompute (others), and counts it in ``forced_fallbacks``.
"""

from __future__ import annotations

from collections.abc import Sequence

from controlplane.controller.token_deposit import TokenDeposit
from controlplane.model import step_time_ms
from controlplane.planner.candidates import candidate_set
from simulator.engine_memory import EngineMemory
from simulator.engine_types import SOLVER_TIME_MODES, SimConfig, SimPolicy, SimResult, StepInfo
from simulator.profile import SimProfile
from simulator.state import (
    FINISHED,
    PAUSED,
    QUEUED,
    REJECTED,
    RUNNING,
    SWAPPED,
    Actions,
    EngineView,
    SimRequest,
)
from simulator.trace import TraceRequest

__all__ = ["SOLVER_TIME_MODES", "Engine", "SimConfig", "SimPolicy", "SimResult", "StepInfo",
           "even_rows"]

def even_rows(layers: int, gpu_layers: int) -> tuple[int, ...]:
    """A row keeping ``gpu_layers`` layers on the GPU, offloaded ones spread evenly (LayerKV
    §3.1.1; equals a distance-driven candidate when the count matches one)."""
    gpu_layers = max(0, min(layers, gpu_layers))
    off = layers - gpu_layers
    row = [1] * layers
    for i in range(off):
        row[(i * layers) // off] = 0 if off else 1
    return tuple(row)


class Engine(EngineMemory):
    """Runs one policy over one trace on one profile."""

    def __init__(
        self,
        profile: SimProfile,
        trace: Sequence[TraceRequest],
        policy: SimPolicy,
        config: SimConfig | None = None,
    ) -> None:
        self.p = profile
        self.policy = policy
        self.cfg = config or SimConfig()
        self.trace = sorted(trace, key=lambda r: (r.arrival_ms, r.id))
        self.reqs = {t.id: SimRequest(t) for t in self.trace}
        if len(self.reqs) != len(self.trace):
            raise ValueError("trace: duplicate request ids")
        self.now = 0.0
        self.step = 0
        self.last_step_ms = 0.0
        self.queue: list[SimRequest] = []
        self.running: list[SimRequest] = []
        self.paused: list[SimRequest] = []
        self.swapped: list[SimRequest] = []
        self.res = SimResult(policy.name, profile, [self.reqs[t.id] for t in self.trace])
        self._cache: dict[tuple, float] = {}
        self._cands = candidate_set(profile.layers)
        self._full = (1,) * profile.layers
        self._evict_due = 0
        """Blocks evicted from paused requests since the last step: written back D2H during the
        next step, overlapped with it as demotions are (:meth:`EngineMemory._evict_paused`)."""

    # ---- memory ----------------------------------------------------------------------------
    def _view(self) -> EngineView:
        return EngineView(
            self.step, self.now, self.p, tuple(self.queue), tuple(self.running),
            tuple(self.paused), tuple(self.swapped),
            self.p.gpu_kv_budget_blocks - self.used_blocks(), self.last_step_ms,
        )

    # ---- actions ---------------------------------------------------------------------------
    def _limits_ok(self, r: SimRequest, admitted: list[SimRequest]) -> bool:
        hold = self.policy.paused_hold_slot
        flight = self.running + admitted + ((self.paused + self.swapped) if hold else [])
        if len(flight) + 1 > self.p.max_batch_size:
            return False
        tokens = sum(x.context for x in flight) + r.context
        return tokens <= self.p.token_budget or not flight

    def _apply(self, act: Actions) -> tuple[list[SimRequest], float, float]:
        """Apply decisions; returns (admitted, serial_ms, overlapped_ms) transfer costs."""
        serial_ms = 0.0
        out_ms_total = in_ms_total = 0.0  # overlapped swaps per direction (full duplex)
        by_id = self.reqs
        d2h = self.p.d2h_blocks_per_ms
        h2d = self.p.h2d_blocks_per_ms
        for rid in act.preempt_recompute:
            r = by_id.get(rid)
            if r is None or r.state != RUNNING:
                continue
            self.running.remove(r)
            r.state, r.resident, r.has_kv, r.target = QUEUED, None, False, None
            r.preemptions += 1
            self.queue.insert(0, r)
        for rid in act.preempt_swap:
            r = by_id.get(rid)
            if r is None or r.state != RUNNING:
                continue
            out_ms = getattr(self.policy, "swap_out_ms", None)  # e.g. HCache's own cost
            cost = out_ms(r) if out_ms is not None else self._held(r) / d2h
            if self.policy.overlap_swaps:
                out_ms_total += cost
            else:
                serial_ms += cost
            self.running.remove(r)
            r.state, r.resident, r.target = SWAPPED, None, None
            r.preemptions += 1
            self.swapped.append(r)
        for rid in act.pause:
            r = by_id.get(rid)
            if r is None or r.state != RUNNING:
                continue
            self.running.remove(r)
            r.state = PAUSED
            r.pauses += 1
            r.paused_steps = 0
            self.paused.append(r)
        for rid in act.resume:
            r = by_id.get(rid)
            if r is None or r.state not in (PAUSED, SWAPPED):
                continue
            if r.state == SWAPPED:
                # Swap-in needs the full KV on the GPU before the request can decode.
                need = r.blocks(self.p) * self.p.layers
                free = self.p.gpu_kv_budget_blocks - self.used_blocks()
                if need > free:
                    _, missing = self._evict_paused(need - free)
                    if missing > 0:
                        continue
                in_ms = getattr(self.policy, "swap_in_ms", None)
                cost = in_ms(r) if in_ms is not None else need / h2d
                if self.policy.overlap_swaps:
                    in_ms_total += cost
                else:
                    serial_ms += cost
                self.swapped.remove(r)
                r.resident = self._full
                r.target = self._full
            else:
                if not self.policy.paused_hold_slot and not self._limits_ok(r, []):
                    self.res.resume_refusals += 1  # the batch is full: stays paused
                    continue
                self.paused.remove(r)
                r.target = r.resident if r.resident is not None else tuple([0] * self.p.layers)
            r.state = RUNNING
            r.run_since_ms = self.now
            self.running.append(r)
        for rid, row in act.placements.items():
            r = by_id.get(rid)
            if r is not None and r.state == RUNNING:
                if len(row) != self.p.layers:
                    raise ValueError(f"placement[{rid}]: {len(row)} layers, expected {self.p.layers}")
                r.target = tuple(row)
        for rid, ratio in act.uncached_ratio.items():
            r = by_id.get(rid)
            if r is not None:
                r.uncached_ratio = min(max(float(ratio), 0.0), 0.95)
        admitted: list[SimRequest] = []
        for rid in act.admit:
            r = by_id.get(rid)
            if r is None or r.state != QUEUED or r.spec.arrival_ms > self.now:
                continue
            if not self._limits_ok(r, admitted):
                break
            gpu_layers = act.gpu_layers.get(rid)
            if gpu_layers is None:
                gpu_layers = (
                    self.p.min_gpu_layers(r.context) if self.policy.layered else self.p.layers
                )
            gpu_layers = max(0, min(self.p.layers, int(gpu_layers)))
            if not self.policy.layered:
                gpu_layers = self.p.layers
            b = self._kvb(r)
            pending = sum(
                self._kvb(x) * ((x.min_gpu_layers or 0) + (x.min_gpu_layers != self.p.layers))
                for x in admitted)
            gpu_layers, extra_ms = self._make_room(b, gpu_layers, pending)
            if gpu_layers is None:
                break
            serial_ms += extra_ms
            r.min_gpu_layers = gpu_layers
            r.resident = self._row_for(gpu_layers)
            r.target = r.resident
            admitted.append(r)
        for r in admitted:
            self.queue.remove(r)
        # SuperInfer §4.3 (DuplexKV): swap-outs (D2H) and swap-ins (H2D) run at once on the
        # full-duplex link, so the overlapped transfers take the longer direction, not the sum.
        return admitted, serial_ms, max(out_ms_total, in_ms_total)

    def _row_for(self, gpu_layers: int) -> tuple[int, ...]:
        """The distance-driven candidate row with this many GPU layers, else an even spread."""
        for row in self._cands.rows:
            if sum(row) == gpu_layers:
                return row
        return even_rows(self.p.layers, gpu_layers)

    # ---- steps -----------------------------------------------------------------------------
    def _deliver(self, r: SimRequest, at_ms: float, finish: bool) -> None:
        if r.deposit is None:
            r.deliver_ms.append(at_ms)
            r.burst.append(False)
            return
        out = r.deposit.generate(at_ms)
        if finish:
            out += r.deposit.finish(at_ms)
        for d in out:
            r.deliver_ms.append(d.delivered_ms)
            r.burst.append(d.burst)

    def _token(self, r: SimRequest, at_ms: float, finished: list[str], step_ms: float) -> None:
        r.gen_ms.append(at_ms)
        r.step_ms.append(step_ms)
        r.generated += 1
        done = r.generated >= r.spec.output_tokens
        self._deliver(r, at_ms, done)
        if done:
            r.state = FINISHED
            r.finish_ms = at_ms
            r.resident = None
            r.target = None
            finished.append(r.id)

    def _prefill_step(self, admitted: list[SimRequest], extra_ms: float) -> StepInfo:
        dur = extra_ms
        for r in admitted:
            dur += self.p.prefill_step_ms(r.context, r.min_gpu_layers or 0)
        dur = max(dur, self._evict_due / self.p.d2h_blocks_per_ms)  # paused layers dropped for it
        self._evict_due = 0
        # The admitted prompts are not running yet: their resident layers, plus a staging slot
        # for the layers offloaded at prefill (as admission's ``pending`` counts them).
        used = self.used_blocks() + sum(
            self._held(r) + (self._kvb(r) if (r.min_gpu_layers or 0) < self.p.layers else 0)
            for r in admitted
        )
        start = self.now
        end = start + dur
        finished: list[str] = []
        for r in admitted:
            if r.admitted_ms is None:
                r.admitted_ms = start
                if self.policy.deposit:
                    r.deposit = TokenDeposit(r.spec.slo_tbt_ms)
            r.has_kv = True
            r.state = RUNNING
            r.run_since_ms = end
            self.running.append(r)
            self._token(r, end, finished, dur)
        self.running = [r for r in self.running if r.state == RUNNING]
        return StepInfo(self.step, start, dur, "prefill", {}, 0.0, used, 0.0, tuple(finished),
                        len(admitted))

    def _decode_step(self, extra_serial_ms: float, extra_overlap_ms: float,
                     solver_ms: float) -> StepInfo:
        p = self.p
        self._force_fit()
        union_peak, demote_peak = self._peaks()
        demote_first = union_peak > p.gpu_kv_budget_blocks
        used = demote_peak if demote_first else union_peak
        start = self.now
        evicted, self._evict_due = self._evict_due, 0  # the paused layers dropped for this step
        if not self.running:
            return StepInfo(self.step, start, max(extra_serial_ms, evicted / p.d2h_blocks_per_ms), "decode", {},
                            0.0, used, 0.0, (), 0)
        rows: list[tuple[int, ...]] = []
        blocks: list[int] = []
        demoted = evicted
        recompute_ms = 0.0
        for r in self.running:
            cur = r.resident if r.resident is not None else tuple([0] * p.layers)
            b = r.blocks(p)
            rows.append(self._rows(r, demote_first))
            blocks.append(b)
            tgt = r.target or cur
            demoted += b * sum(1 for a, t in zip(cur, tgt, strict=True) if a and not t)
            if r.uncached_ratio > 0:
                recompute_ms += self._ellm_recompute_ms(r)
        batch_tokens = sum(blocks) * p.block_size
        comp = p.layer_compute_ms(batch_tokens)
        key = (tuple(rows), tuple(blocks))
        t = self._cache.get(key)
        if t is None:
            t = step_time_ms(rows, blocks, [comp] * p.layers, p.h2d_blocks_per_ms, launch_ms=p.fetch_launch_ms)
            if len(self._cache) > 200_000:
                self._cache.clear()
            self._cache[key] = t
        t += recompute_ms
        if demote_first:
            extra_serial_ms += demoted / p.d2h_blocks_per_ms
            demoted = 0
        t = max(t, demoted / p.d2h_blocks_per_ms, extra_overlap_ms)
        charged = max(0.0, solver_ms - self.last_step_ms)
        dur = t + extra_serial_ms + charged
        end = start + dur
        finished: list[str] = []
        ran = {r.id: row for r, row in zip(self.running, rows, strict=True)}
        for r in list(self.running):
            r.resident = r.target or r.resident
            self._token(r, end, finished, dur)
        self.running = [r for r in self.running if r.state == RUNNING]
        return StepInfo(self.step, start, dur, "decode", ran, comp, used, charged,
                        tuple(finished), len(ran))

    def _ellm_recompute_ms(self, r: SimRequest) -> float:
        """eLLM Eq. 2: recomputation FLOPs of the uncached prefix, on the prefill FLOP rate."""
        p = self.p
        s = r.context
        rs = s * r.uncached_ratio
        flops = 24 * p.hidden**2 * p.layers * rs + 4 * p.hidden * p.layers * rs**2 \
            + 2 * p.hidden * p.vocab * rs
        return p.prefill_alpha * flops / (p.prefill_tflops * 1e12) * 1e3

    # ---- main loop -------------------------------------------------------------------------
    def run(self) -> SimResult:
        p = self.p
        self.policy.start(p, self.trace)
        arrivals = list(self.trace)
        ai = 0
        res = self.res
        cfg = self.cfg
        spins = 0
        while True:
            while ai < len(arrivals) and arrivals[ai].arrival_ms <= self.now:
                r = self.reqs[arrivals[ai].id]
                ai += 1
                if r.spec.prompt_tokens + r.spec.output_tokens > self._max_tokens_ever():
                    # As vLLM/SGLang reject prompt + max_tokens beyond max_model_len.
                    r.state = REJECTED
                    continue
                self.queue.append(r)
            if not (self.queue or self.running or self.paused or self.swapped):
                if ai >= len(arrivals):
                    break
                self.now = arrivals[ai].arrival_ms
                continue
            if self.step >= cfg.max_steps:
                raise RuntimeError(f"simulation exceeded max_steps = {cfg.max_steps}")
            spins += 1
            if spins > 1000:
                raise RuntimeError(f"policy {self.policy.name} made no progress at step {self.step}")
            view = self._view()
            act = self.policy.decide(view)
            solver_ms = {"model": p.solver_model_ms * act.solver_calls,
                         "measured": act.solver_ms, "zero": 0.0}[cfg.solver_time]
            res.solver_ms += solver_ms
            res.solver_calls += act.solver_calls
            admitted, serial_ms, overlap_ms = self._apply(act)
            if (not admitted and not self.running and not self.paused and not self.swapped
                    and self.queue and not act.admit):
                # Worker liveness rule: an idle worker with a queue admits its head (SGLang
                # would chunk a prompt its scheduler cannot place whole). Counted.
                admitted, _, _ = self._apply(Actions(admit=[self.queue[0].id]))
                res.worker_admissions += len(admitted)
            if admitted:
                info = self._prefill_step(admitted, serial_ms + overlap_ms)
                res.prefill_steps += 1
            elif self.running:
                info = self._decode_step(serial_ms, overlap_ms, solver_ms)
                res.decode_steps += 1
                res.decode_ms += info.dur_ms
                res.solver_charged_ms += info.solver_charged_ms
            else:
                # Nothing can run: wait for the next arrival (or a policy-side change).
                nxt = arrivals[ai].arrival_ms if ai < len(arrivals) else None
                if nxt is None:
                    if self.paused or self.swapped:
                        # Resume the oldest: policies must not strand requests.
                        self._rescue()
                        continue
                    if self.queue:
                        for r in list(self.queue):
                            if not self._can_ever_admit(r):
                                self.queue.remove(r)
                                r.state = REJECTED
                        if self.queue:
                            self._rescue()
                        continue
                    break
                info = StepInfo(self.step, self.now, max(0.0, nxt - self.now), "idle", {}, 0.0,
                                self.used_blocks(), 0.0, (), 0)
            res.max_used_blocks = max(res.max_used_blocks, info.used_blocks)
            res.kv_block_ms += info.used_blocks * info.dur_ms
            self.now += info.dur_ms
            self.last_step_ms = info.dur_ms if info.kind != "idle" else 0.0
            for r in self.paused:
                r.paused_steps += 1
            self.step += 1
            res.steps += 1
            spins = 0
            if cfg.record_steps:
                res.step_log.append(info)
            self.policy.observe(view, info)
        res.sim_ms = self.now
        return res

    def _max_tokens_ever(self) -> int:
        custom = getattr(self.policy, "max_tokens", None)
        if custom is not None:
            return int(custom(self.p))
        if self.policy.layered:
            # Everything offloaded: one staging layer must fit.
            return min(self.p.token_budget, self.p.gpu_kv_budget_blocks * self.p.block_size)
        return min(self.p.token_budget, self.p.gpu_tokens_all_layers)

    def _can_ever_admit(self, r: SimRequest) -> bool:
        return r.spec.prompt_tokens + r.spec.output_tokens <= self._max_tokens_ever()

    def _rescue(self) -> None:
        """Last resort when a policy leaves the server idle with work left: run the oldest
        stranded request (counted as a forced fallback)."""
        self.res.forced_fallbacks += 1
        if self.paused:
            r = self.paused.pop(0)
            r.state = RUNNING
            r.target = r.resident or tuple([0] * self.p.layers)
            if not self.policy.layered:
                r.target = self._full
            self.running.append(r)
            return
        if self.swapped:
            r = self.swapped.pop(0)
            self._evict_paused(r.blocks(self.p) * self.p.layers)
            r.state, r.resident, r.target = RUNNING, self._full, self._full
            self.running.append(r)
            return
        act = Actions(admit=[self.queue[0].id])
        admitted, _, _ = self._apply(act)
        if admitted:
            info = self._prefill_step(admitted, 0.0)
            self.res.prefill_steps += 1
            self.now += info.dur_ms
            self.step += 1
            self.res.steps += 1
        else:
            r = self.queue.pop(0)
            r.state = REJECTED
