"""LayerKV's SLO-aware scheduler (LayerKV §3.1, Eq. 1-4, Algorithm 1).

Admit queued prefills in arrival order as long as the decoding requests keep their TPOT SLO:

* Eq. 1, for each decoding request ``i``::

      T_allow_prefill^i = T_tpot^i * (N_past^i + N_future^i) - (T_past^i + T_future^i)

  ``T_tpot^i = tpot_margin * slo_tbt_ms`` (the TPOT target), ``N_past`` = tokens generated so
  far, ``T_past`` = time since the controller first saw it decoding (includes waiting),
  ``N_future`` = conservative remaining tokens: ``max(1, lower_bound - N_past)`` where the lower
  bound is ``output_len_lower_bound`` (capped by ``max_new_tokens`` when known) - the paper takes
  it from a length classifier's lower range bound; we take it from the policy - and
  ``T_future = current TPOT * N_future``.
* Eq. 2: admit ``q_1..q_n`` while ``sum_k T_prefill^{q_k} < min_i T_allow_prefill^i`` (no
  decoding request: no TPOT bound).
* Eq. 3: ``T_prefill = alpha * seqlen * (2 * n_param + 2 * seqlen * n_hidden) / FLOPS`` with
  ``alpha = prefill_correction``.
* Eq. 4: ``T_offload(x) = beta * seqlen * 2 (L - x) * d_head * n_heads * f_precision / PCIe_bw``;
  ``2 * d_head * n_heads * f_precision`` is the KV bytes of one token in one layer, i.e.
  ``block_bytes / block_size``, and the PCIe bandwidth is the profiled link bandwidth. The minimum
  GPU-retained layers ``x`` is the smallest integer with ``T_offload(x) <= T_prefill`` (so the
  offload hides under the prefill compute) -> ``Decision.min_gpu_layers``.

Memory (``variant="paper"``): an admitted prefill holds ``max(x, 1)`` of its layers on the GPU
(at least one layer is the send buffer the offload streams from), which must fit the free blocks.
The summed prompt tokens of one step are capped by ``max_prefill_tokens``; a head-of-queue prompt
longer than the cap is admitted alone (the engine chunks it) so it can never block the queue
forever.

The default ``variant="kvplane"`` (issue 15, the admission of the shipped ``kvplane`` policy)
changes five things and keeps Eq. 1-3 (Eq. 2's bound over the running requests whose TPOT target
is at least the all-resident step, the planner's floor: ``slo_cap.floor_ms``; one below it is late
whatever is admitted, and held every fitting prompt until it aged):

* **predicted slowdown**: the decode step the batch would run *with* the admitted prompt
  (:func:`predicted_step_ms`, the placement model with the KV that does not fit streamed over
  the link) must stay within ``tpot_margin * slo_tbt_ms`` (or not exceed the step the batch
  predicts without it), and ``T_future`` of Eq. 1 uses it instead of the current TPOT - Eq. 1-2
  alone over-admit when the admitted KV does not fit;
* **aging**: a prompt that has used :data:`AGING_FRACTION` of its TTFT SLO (waiting plus its
  own prefill) is admitted whatever the prediction and Eq. 2 say, so long prompts are never held
  behind short ones indefinitely when batch slots, not memory, bind;
* **memory and slots as OrbitFlow** (§5.1): the worker's batch limits bound admission, memory
  does not; the prompt keeps the layers that fit (never fewer than Eq. 4 would when they fit: a
  layer kept costs no transfer) and offloads the rest at prefill;
* **two classes** (the kvplane principle: never worse than a no-offload server for the
  requests it would serve, and serve the ones it rejects). A context longer than the GPU holds
  in every layer is *background*: a no-offload server rejects it, and every step it runs in
  streams part of its KV over the link, which slows the whole batch. A *fitting* prompt is
  admitted by Eq. 2 when it fits free memory, as a no-offload server would (the slowdown
  check has nothing to predict); when it does not fit (memory or batch limits), running
  background requests are paused, largest first, until it does (a paused request's GPU layers
  are evicted as needed, OrbitFlow §3.4); only then may it be admitted with offload, under the
  slowdown check above, or once aged. A background prompt never jumps a fitting prompt that waits
  and never blocks the queue; it is admitted when the batch limits allow and it does not make the
  fitting requests' steps late (predicted), or once aged. A running background request that
  makes the fitting requests' steps late is paused. On SGLang (no batch limits) the memory rule
  alone applies.
* **aging is a TTFT deadline, and it outranks the principle above**: an aged prompt (either
  class) that the batch limits block pauses running requests until it fits, background ones of
  any length first, then fitting ones, largest first in both groups (:func:`make_room_for_aged`
  inside ``_kvplane``); the pauses are undone when it still does not fit. A request that has its
  first token waits a few steps; one that has none would miss its TTFT SLO. The room pauses of
  fitting requests free beyond what the aged prompt takes stays theirs: a prompt that has not
  aged, and the refill, see the batch as if they still ran (``reserved``). The prefill stalls
  every decoding request anyway, and the refill below resumes the paused fitting requests after
  it (``benchmarks/results/sim/ttft-tail/``: the older rule, where an aged background prompt
  paused only longer background requests, left kvplane's P99 TTFT above orbitflow's on two of
  nine seeds).
* **refill**: a paused *fitting* request is resumed as soon as the batch limits have room for it
  and the predicted step with it stays within ``tpot_margin * slo_tbt_ms``, or within the step
  with every layer resident when that is slower (the planner's floor, ``slo_cap.cap_view``)
  (running background requests are paused, largest first, to make that so, as for a fitting
  prompt; undone when it still does not fit), not only after a finish: a no-offload server
  would be running it. Longest
  paused first, and the first that cannot run ends the refill (no overtaking); after this
  step's admissions (a paused request already has its first token, a queued one waits for its
  TTFT). The resumed batch is on time without deposit credit, so the planner's SLO cap has no
  reason to pause it again at the next window (the resume thrash of issue 15, finding 3, came
  from retrying plans that were feasible only with the credit). Background requests resume
  after a finish or by the starvation guard, as OrbitFlow's do (§3.4). Measured (issue 15,
  seed 7): without the refill, a fitting request paused by the planner or the starvation guard
  waited for a finish while one fitting request ran alone at 58 ms steps for 1174 s of
  the 7724 s run.

None of these pauses takes a *held* request (``SchedulerView.held``: the worker drops its pauses,
:mod:`~controlplane.controller.request_tracker`): the room it would free is not there. The next
one in the order is paused instead, or the prompt or the paused request waits.
"""

from __future__ import annotations

import math

from controlplane.controller.schedulers.base import (
    RequestView,
    SchedulerDecision,
    SchedulerView,
    prompt_blocks,
)
from controlplane.controller.schedulers.step_predictor import predicted_step_ms
from controlplane.model import link_blocks_per_ms
from controlplane.planner.slo_cap import floor_ms
from controlplane.policy import LayerKVParams


def allow_prefill_ms(
    r: RequestView, view: SchedulerView, params: LayerKVParams, tpot_ms: float | None = None
) -> float:
    """LayerKV Eq. 1: prefill time request ``r`` can absorb and still meet its TPOT target
    (``tpot_ms``: the future TPOT; default the current one, as the paper)."""
    t_tpot = params.tpot_margin * r.slo_tbt_ms
    n_past = r.generated_tokens
    lower = params.output_len_lower_bound
    if r.max_new_tokens is not None:
        lower = min(lower, r.max_new_tokens)
    n_future = max(1, lower - n_past)
    t_past = max(0.0, view.now_ms - r.first_seen_ms)
    t_future = (view.tpot_ms if tpot_ms is None else tpot_ms) * n_future
    return t_tpot * (n_past + n_future) - (t_past + t_future)


def prefill_ms(prompt_tokens: int, params: LayerKVParams) -> float:
    """LayerKV Eq. 3: estimated prefill time (ms) of a prompt of ``prompt_tokens``."""
    flops = prompt_tokens * (2 * params.model_params + 2 * prompt_tokens * params.hidden_size)
    return 1e3 * params.prefill_correction * flops / (params.device_tflops * 1e12)


def min_gpu_layers(prompt_tokens: int, view: SchedulerView, params: LayerKVParams) -> int:
    """LayerKV Eq. 4: fewest layers to keep on the GPU so offloading hides under the prefill."""
    layers = view.model.layers
    bytes_per_token_layer = view.model.block_bytes / view.model.block_size
    bw_bytes_per_ms = link_blocks_per_ms(view.h2d_gbps, 1)
    per_layer_ms = (
        params.offload_correction * prompt_tokens * bytes_per_token_layer / bw_bytes_per_ms
    )
    if per_layer_ms <= 0:
        return 0
    hideable = math.floor(prefill_ms(prompt_tokens, params) / per_layer_ms + 1e-9)
    return max(0, min(layers, layers - hideable))


VARIANTS = ("kvplane", "paper")
AGING_FRACTION = 0.5
"""kvplane variant: a prompt that has used this fraction of its TTFT SLO (waiting plus its own
prefill) is admitted whatever the slowdown prediction and Eq. 2 say (a module constant, not a
policy field: the policy's wire format is not this issue's to change)."""


class LayerKVScheduler:
    """Admit prefills while every decoding request keeps its TPOT SLO (LayerKV Algorithm 1);
    ``variant`` selects the paper's rule or kvplane's (see the module docstring)."""

    name = "layerkv"

    def __init__(self, variant: str = "kvplane") -> None:
        if variant not in VARIANTS:
            raise ValueError(f"variant: {variant!r} is not one of {VARIANTS}")
        self.variant = variant

    def schedule(self, view: SchedulerView) -> SchedulerDecision:
        if self.variant == "paper":
            return self._paper(view)
        return self._kvplane(view)

    def _paper(self, view: SchedulerView) -> SchedulerDecision:
        params = view.policy.layerkv
        # Eq. 2's right-hand side: the tightest decoding request bounds the prefill time.
        bound_ms = min((allow_prefill_ms(r, view, params) for r in view.running), default=math.inf)
        free = view.free_gpu_blocks
        spent_ms = 0.0
        tokens = 0
        admit: list[str] = []
        retained: dict[str, int] = {}
        for q in sorted(view.queued, key=lambda q: (q.arrival_ms, q.id)):
            t_prefill = prefill_ms(q.prompt_tokens, params)
            if not spent_ms + t_prefill < bound_ms:  # Eq. 2 (strict)
                break
            if admit and tokens + q.prompt_tokens > params.max_prefill_tokens:
                break
            x = min_gpu_layers(q.prompt_tokens, view, params)
            need = max(x, 1) * prompt_blocks(q.prompt_tokens, view.model.block_size)
            if need > free:
                break
            free -= need
            spent_ms += t_prefill
            tokens += q.prompt_tokens
            admit.append(q.id)
            retained[q.id] = x
        return SchedulerDecision(admit=tuple(admit), min_gpu_layers=retained)

    def _kvplane(self, view: SchedulerView) -> SchedulerDecision:
        params = view.policy.layerkv
        layers, bs = view.model.layers, view.model.block_size
        h2d_blocks_per_ms = link_blocks_per_ms(view.h2d_gbps, view.model.block_bytes)
        budget = view.hardware.gpu_kv_budget_blocks
        capacity = budget // layers * bs  # tokens whose KV fits the GPU in every layer

        def oversize(tokens: int) -> bool:
            """A no-offload server would reject this context: it cannot fit the GPU at all."""
            return tokens > capacity

        def step_ms(blocks: list[int]) -> float:
            return predicted_step_ms(blocks, budget, view.layer_compute_ms, h2d_blocks_per_ms,
                                     view.fetch_launch_ms)

        running = list(view.running)
        batch = [r.blocks_per_layer(bs) for r in running]  # blocks per layer, next step's batch
        n = len(running)
        in_batch_tokens = sum(r.context_tokens for r in running)
        fitting_in_batch = sum(1 for r in running if not oversize(r.context_tokens))
        free = view.free_gpu_blocks + view.evictable_blocks()
        floor = floor_ms(view.layer_compute_ms)  # an SLO below it is met at it, as in the planner's cap
        target = max(floor, params.tpot_margin * min(
            [r.slo_tbt_ms for r in running] + [view.policy.slo_tbt_ms]))
        rotate: list[str] = []

        def eq2_bound(step: float) -> float:
            """Eq. 2's bound (Eq. 1 at the predicted TPOT ``step``) over the running requests whose
            TPOT target the GPU can meet: one below the all-resident step (``floor``) is late
            whatever is admitted, so it holds no prompt back (as in the planner's cap)."""
            return min((allow_prefill_ms(r, view, params, step) for r in running
                        if params.tpot_margin * r.slo_tbt_ms >= floor), default=math.inf)

        def rotate_out(v: RequestView) -> None:
            nonlocal n, in_batch_tokens, free
            rotate.append(v.id)
            running.remove(v)
            batch.remove(v.blocks_per_layer(bs))
            n -= 1
            in_batch_tokens -= v.context_tokens
            gpu_layers = layers if v.gpu_layers is None else v.gpu_layers
            free += v.blocks_per_layer(bs) * gpu_layers  # evictable once paused (§3.4)

        def background() -> list[RequestView]:
            """Running oversize requests, largest first (the rotation order); never a held one
            (``view.held``: the worker drops its pause, so the room it would free is not there,
            and a prompt admitted or a request resumed for it overfilled the batch)."""
            return sorted((r for r in running if oversize(r.context_tokens) and r.id not in view.held),
                          key=lambda r: (-r.context_tokens, r.id))

        def fitting_running() -> list[RequestView]:
            """Running fitting requests, largest first (rotated out only for an aged prompt);
            never a held one."""
            return sorted((r for r in running if not oversize(r.context_tokens) and r.id not in view.held),
                          key=lambda r: (-r.context_tokens, r.id))

        reserved = [0, 0, 0]
        """Fitting requests paused for aged prompts: requests, tokens, GPU blocks. A prompt that has
        not aged (and the refill) sees the batch as if they still ran: room they free beyond what
        the aged prompt takes is not for requests their pause was not for."""

        def fits(prompt_tokens: int, aged_: bool) -> bool:
            """The batch limits admit a prompt (a request) of ``prompt_tokens`` now."""
            r_n, r_tok = (0, 0) if aged_ else (reserved[0], reserved[1])
            return view.limits.admits(n + r_n, in_batch_tokens + r_tok, prompt_tokens)

        def free_for(aged_: bool) -> int:
            return free if aged_ else free - reserved[2]

        def make_room_for_aged(prompt_tokens: int) -> int:
            """Aging is a TTFT deadline: an aged prompt outranks requests that already have their
            first token. Pause running background requests (any length), then fitting ones, largest
            first, until the batch limits admit it; returns the fitting requests paused (held in
            ``reserved``)."""
            paused_fitting = 0
            for v in background() + fitting_running():
                if view.limits.admits(n, in_batch_tokens, prompt_tokens):
                    break
                if not oversize(v.context_tokens):
                    paused_fitting += 1
                    reserved[0] += 1
                    reserved[1] += v.context_tokens
                    before = free
                    rotate_out(v)
                    reserved[2] += free - before
                else:
                    rotate_out(v)
            return paused_fitting

        def snapshot() -> tuple:
            """The batch being built, to :func:`restore` when pauses admit nothing after all."""
            return (list(running), list(batch), n, in_batch_tokens, free, len(rotate), fitting_in_batch,
                    list(reserved))

        def restore(state: tuple) -> None:
            nonlocal running, batch, n, in_batch_tokens, free, fitting_in_batch
            running, batch, n, in_batch_tokens, free, kept, fitting_in_batch, reserved[:] = state
            del rotate[kept:]

        # Background requests never make the requests a no-offload server would serve late.
        if fitting_in_batch:
            for v in background():
                if step_ms(batch) <= target:
                    break
                rotate_out(v)
        spent_ms = 0.0
        tokens = 0
        admit: list[str] = []
        retained: dict[str, int] = {}
        for q in sorted(view.queued, key=lambda q: (q.arrival_ms, q.id)):
            t_prefill = prefill_ms(q.prompt_tokens, params)
            ttft = q.slo_ttft_ms if q.slo_ttft_ms is not None else (params.ttft_slo_ms or view.policy.slo_ttft_ms)
            aged = view.now_ms - q.arrival_ms + t_prefill >= AGING_FRACTION * ttft
            b = prompt_blocks(q.prompt_tokens, bs)
            if oversize(q.prompt_tokens):
                if admit and tokens + q.prompt_tokens > params.max_prefill_tokens:
                    continue  # before making room: nothing is paused for a prompt not admitted
                if aged and not view.limits.admits(n, in_batch_tokens, q.prompt_tokens):
                    undo = snapshot()
                    fitting_in_batch -= make_room_for_aged(q.prompt_tokens)
                    if not view.limits.admits(n, in_batch_tokens, q.prompt_tokens):
                        restore(undo)
                if not fits(q.prompt_tokens, aged):
                    continue  # skipped, not waited for: it never blocks the queue
                if running and not aged:  # Eq. 2, and no late steps for fitting requests
                    step = step_ms(batch + [b])
                    if (fitting_in_batch and step > target) or not spent_ms + t_prefill < eq2_bound(step):
                        continue
            else:
                # Make room the way a no-offload server's memory would have: pause background
                # requests (largest first) until the prompt fits memory and the batch limits;
                # undone below when the prompt is held after all.
                undo = snapshot()
                for v in background():
                    if b * layers <= free_for(aged) and fits(q.prompt_tokens, aged):
                        break
                    rotate_out(v)
                if aged:
                    fitting_in_batch -= make_room_for_aged(q.prompt_tokens)
                held = not fits(q.prompt_tokens, aged) or bool(
                    admit and tokens + q.prompt_tokens > params.max_prefill_tokens)
                if not held and running and not aged:
                    # Eq. 2 with the predicted TPOT; a prompt that does not fit memory is
                    # admitted with offload only when the steps stay on time.
                    step = step_ms(batch + [b])
                    late = b * layers > free_for(aged) and step > max(target, step_ms(batch))
                    held = late or not spent_ms + t_prefill < eq2_bound(step)
                if held:
                    restore(undo)
                    break  # FCFS: nothing behind a held fitting prompt jumps it
                fitting_in_batch += 1
            avail = free_for(aged)  # what this prompt may take (the rest stays reserved)
            keep = layers if b * layers <= avail else max(0, avail // b - 1)
            free = max(0, free - b * (keep + (0 if keep == layers else 1)))
            batch.append(b)
            n += 1
            in_batch_tokens += q.prompt_tokens
            spent_ms += t_prefill
            tokens += q.prompt_tokens
            admit.append(q.id)
            retained[q.id] = keep
        # Refill: a paused fitting request runs again as soon as the batch limits have room for
        # it and the predicted step with it is on time (background requests make room, as for a
        # fitting prompt), not only after a finish. Longest-paused first; the first that cannot
        # run ends the refill (no overtaking). On time without deposit credit, so the planner's
        # SLO cap has no reason to pause it again at the next window (no resume thrash).
        resume: list[str] = []
        for p in sorted((p for p in view.paused if not oversize(p.context_tokens)),
                        key=lambda p: (-p.paused_steps, p.id)):
            b = p.blocks_per_layer(bs)
            on_time = max(floor, min(target, params.tpot_margin * p.slo_tbt_ms))
            undo = snapshot()
            for v in background():
                if fits(p.context_tokens, False) and step_ms(batch + [b]) <= on_time:
                    break
                rotate_out(v)
            if not (fits(p.context_tokens, False) and step_ms(batch + [b]) <= on_time):
                restore(undo)
                break
            resume.append(p.id)
            batch.append(b)
            n += 1
            in_batch_tokens += p.context_tokens
        return SchedulerDecision(admit=tuple(admit), min_gpu_layers=retained, pause=tuple(rotate),
                                 resume=tuple(resume))
