"""Policies driven by the control plane's own :class:`SessionController` (synchronous mode).

The simulator is the worker: each step it sends a :class:`~controlplane.api.StepReport` and
applies the returned :class:`~controlplane.api.Decision` (admissions, pauses, resumes,
placements, LayerKV retained layers). Planning, triggers (batch change, expiry, profile
mismatch, starvation), pause victims, resume gating, deposits and the fcfs/layerkv schedulers
are the control plane's code.

Report numbering: report ``k`` describes the state after ``k`` engine steps; its decisions apply
to the next executed step (the controller's "one step ahead").

Names:

* ``orbitflow``: request-wise planner + pause + token deposit, FCFS admission (OrbitFlow);
  ``orbitflow-longest|shortest|random``: other pause-victim rules (Fig. 14c);
* ablations (Fig. 14a): ``batch-uniform`` (uniform planner, no pause, no deposit),
  ``request-wise`` (planner without SLO cap/pause, no deposit), ``request-wise+pause`` (planner
  with SLO cap and pause, no deposit);
* ``kvplane``: OrbitFlow placement + LayerKV admission (Eq. 1-4) + deposit pacing, with the
  served default's ``Policy.deposit_credit = False``: deposits earn no SLO-cap credit;
* diagnostics ``orbitflow-nocredit`` (OrbitFlow without the credit) and ``kvplane-credit``
  (kvplane with the paper's credit).

Planner: ``Planner(use_mip=False, exact_search=False)`` with a 60 s budget by default, so
decisions never depend on the wall clock (the controller's documented deterministic setup);
``planner="full"`` uses the default planner (CBC stage, branch and bound, budget = policy
fraction of the step) - realistic solver times, machine-dependent decisions.
"""

from __future__ import annotations

from collections.abc import Sequence

from controlplane.api import QueuedRequest, RequestState, StepReport, WorkerInfo
from controlplane.controller import BatchLimits, SessionController
from controlplane.model import Hardware, ModelSpec, Profile
from controlplane.planner import Planner
from controlplane.policy import LayerKVParams, Policy
from simulator.engine import StepInfo
from simulator.policies.base import BasePolicy
from simulator.policies.planners import NoDepositPlanner, NoPausePlanner, UniformPlanner
from simulator.profile import SimProfile
from simulator.state import Actions, EngineView
from simulator.trace import TraceRequest

PLANNER_MODES = ("deterministic", "full")


class _SolveObserver:
    """Collects the controller's planning calls and their wall time."""

    def __init__(self) -> None:
        self.calls = 0
        self.solve_ms = 0.0

    def on_trigger(self, worker_id: str, reason: str) -> None:
        return None

    def on_plan(self, worker_id: str, reason: str, solve_ms: float, feasible: bool) -> None:
        self.calls += 1
        self.solve_ms += solve_ms

    def on_pause(self, worker_id: str, request_id: str, reason: str) -> None:
        return None

    def on_resume(self, worker_id: str, request_id: str, reason: str) -> None:
        return None

    def on_error(self, worker_id: str, error: str) -> None:
        raise RuntimeError(f"control plane error in simulation: {error}")


class ControlledPolicy(BasePolicy):
    """One SessionController per run; see the module docstring for the variants."""

    paused_hold_slot = False
    """A paused request is out of the batch (OrbitFlow §3.4); the controller resumes it when the
    batch limits have room."""

    def __init__(
        self,
        name: str,
        *,
        scheduler: str = "fcfs",
        planner: str = "request-wise",
        deposit: bool = True,
        victim_rule: str = "largest",
        planner_mode: str = "deterministic",
        deposit_credit: bool = True,
        known_launch_ms: float | None = None,
    ) -> None:
        """``known_launch_ms``: the launch cost the worker's profile starts the controller with
        (None: the simulated truth, as a ``kvplane gpu-check``-fitted ``--kv-profile`` gives it;
        the controller keeps learning it either way)."""
        if planner not in ("uniform", "request-wise", "request-wise+pause"):
            raise ValueError(f"planner: {planner!r} is not one of uniform, request-wise, "
                             "request-wise+pause")
        if planner_mode not in PLANNER_MODES:
            raise ValueError(f"planner_mode: {planner_mode!r} is not one of {PLANNER_MODES}")
        self.name = name
        self.scheduler = scheduler
        self.planner_kind = planner
        self.deposit = deposit
        self.victim_rule = victim_rule
        self.planner_mode = planner_mode
        self.deposit_credit = deposit_credit
        self.known_launch_ms = known_launch_ms
        self.session: SessionController | None = None

    def start(self, profile: SimProfile, trace: Sequence[TraceRequest]) -> None:
        super().start(profile, trace)
        p = profile
        slo = min((t.slo_tbt_ms for t in trace), default=200.0)
        ttft = min((t.slo_ttft_ms for t in trace), default=5000.0)
        self.policy = Policy(
            slo_tbt_ms=slo,
            slo_ttft_ms=ttft,
            scheduler=self.scheduler,
            victim_rule=self.victim_rule,
            deposit_credit=self.deposit_credit,
            layerkv=LayerKVParams(
                model_params=p.n_params,
                # LayerKV Eq. 3 with n_hidden read as L*h, as the simulator's prefill model.
                hidden_size=p.layers * p.hidden,
                device_tflops=p.prefill_tflops,
                prefill_correction=p.prefill_alpha,
                offload_correction=p.offload_beta,
                # LayerKV predicts the output length; the trace's max_new_tokens is an oracle
                # predictor (the scheduler caps the lower bound by max_new_tokens).
                output_len_lower_bound=1 << 24,
            ),
        )
        full = self.planner_mode == "full"
        base = Planner() if full else Planner(use_mip=False, exact_search=False)
        planner = {
            "uniform": UniformPlanner(),
            "request-wise": NoPausePlanner(base),
            "request-wise+pause": base if self.deposit else NoDepositPlanner(base),
        }[self.planner_kind]
        worker = WorkerInfo(
            worker_id="sim",
            model=ModelSpec(p.layers, p.block_size, p.block_bytes),
            hardware=Hardware(p.gpu_kv_budget_blocks, p.h2d_gbps),
            profile=Profile((p.layer_compute_ms(0),) * p.layers, None,
                            p.fetch_launch_ms if self.known_launch_ms is None else self.known_launch_ms),
            scheduler=self.scheduler,
        )
        self.obs = _SolveObserver()
        self.session = SessionController(
            worker,
            policy_source=lambda: self.policy,
            planner=planner,
            synchronous=True,
            observer=self.obs,
            time_budget_ms=None if full else 60_000.0,
            batch_limits=BatchLimits(p.max_batch_size, p.token_budget),
        )
        self._last_info: StepInfo | None = None
        self._finished: list[str] = []
        self._reported_step = -1

    def decide(self, view: EngineView) -> Actions:
        assert self.session is not None
        act = Actions()
        if view.step == self._reported_step:
            return act  # already reported this state (engine retry without progress)
        self._reported_step = view.step
        p = self.p
        info = self._last_info
        decode = info is not None and info.kind == "decode" and info.tokens > 0
        running = tuple(
            RequestState(r.id, r.context, r.generated, r.spec.slo_tbt_ms, False,
                          r.resident_layers(), r.spec.output_tokens)
            for r in view.running
        ) + tuple(
            RequestState(r.id, r.context, r.generated, r.spec.slo_tbt_ms, True,
                          r.resident_layers(), r.spec.output_tokens)
            for r in view.paused
        )
        # Paused requests' resident layers are reported (RequestState.gpu_layers) and count as
        # held: free_gpu_blocks is what nobody holds; the scheduler adds the paused layers back
        # as evictable (OrbitFlow §3.4), and the engine evicts them before starving a running
        # request's promotions.
        held = sum(r.blocks(p) * r.resident_layers() for r in view.running + view.paused)
        report = StepReport(
            step=view.step,
            now_ms=view.now_ms,
            running=running,
            # The whole queue: the controller applies the batch limits itself (BatchLimits), so
            # it sees a head the limits block (LayerKV's aging rotation needs it).
            queued=tuple(QueuedRequest(q.id, q.context, q.spec.arrival_ms, q.spec.slo_ttft_ms)
                         for q in view.queued),
            # The worker knows which part of the step waited for the plan: report the step
            # itself, so a solver stall never feeds back into the profile-mismatch trigger.
            observed_step_ms=(info.dur_ms - info.solver_charged_ms) if decode else None,
            layer_compute_ms=(info.layer_compute_ms,) * p.layers if decode else None,
            h2d_gbps=p.h2d_gbps,
            finished=tuple(self._finished),
            free_gpu_blocks=max(0, p.gpu_kv_budget_blocks - held),
        )
        self._finished = []
        calls0, ms0 = self.obs.calls, self.obs.solve_ms
        decisions = self.session.report(report)
        act.solver_calls = self.obs.calls - calls0
        act.solver_ms = self.obs.solve_ms - ms0
        for d in decisions:
            act.pause.extend(d.pause)
            act.resume.extend(d.resume)
            act.admit.extend(d.admit)
            act.gpu_layers.update(d.min_gpu_layers)
            act.placements.update(d.plan.placements)
        # Admissions keep the layers the scheduler chose (FCFS: what fits, the rest offloaded
        # at prefill; LayerKV: Eq. 4's minimum) until the next plan places them.
        for rid in act.admit:
            act.gpu_layers.setdefault(rid, p.layers)
        return act

    def observe(self, view: EngineView, info: StepInfo) -> None:
        self._last_info = info
        self._finished.extend(info.finished)


def _variants() -> dict:
    out = {
        "orbitflow": lambda: ControlledPolicy("orbitflow", planner="request-wise+pause"),
        "batch-uniform": lambda: ControlledPolicy("batch-uniform", planner="uniform",
                                                  deposit=False),
        "request-wise": lambda: ControlledPolicy("request-wise", planner="request-wise",
                                                 deposit=False),
        "request-wise+pause": lambda: ControlledPolicy("request-wise+pause",
                                                       planner="request-wise+pause",
                                                       deposit=False),
        # Diagnostic: deposit pacing for delivery, but a planner that takes no SLO-cap credit
        # from deposits (see simulator/README.md, "findings").
        "orbitflow-nocredit": lambda: ControlledPolicy("orbitflow-nocredit",
                                                       planner="request-wise+pause",
                                                       deposit_credit=False),
        # kvplane's default policy (controlplane.policy.Policy): victim_rule "lost-first" (requests
        # whose TPOT SLO is already lost are paused first; the starvation guard pauses only those)
        "kvplane-credit": lambda: ControlledPolicy("kvplane-credit",
                                                   planner="request-wise+pause",
                                                   scheduler="layerkv", deposit_credit=True,
                                                   victim_rule="lost-first"),
        "kvplane": lambda: ControlledPolicy("kvplane", planner="request-wise+pause",
                                            scheduler="layerkv", deposit_credit=False,
                                            victim_rule="lost-first"),
        # The plugin's default (`--kv-scheduler fcfs`): kvplane with SGLang's own admission.
        "kvplane-fcfs": lambda: ControlledPolicy("kvplane-fcfs", planner="request-wise+pause",
                                                 scheduler="fcfs", deposit_credit=False,
                                                 victim_rule="lost-first"),
        # served-admission: the same under the victim rule that was the default before session 89
        # (OrbitFlow's "largest"), for comparison.
        "kvplane-fcfs-largest": lambda: ControlledPolicy("kvplane-fcfs-largest",
                                                         planner="request-wise+pause",
                                                         scheduler="fcfs", deposit_credit=False),
        "kvplane-largest": lambda: ControlledPolicy("kvplane-largest", planner="request-wise+pause",
                                                    scheduler="layerkv", deposit_credit=False),
    }
    for rule in ("longest", "shortest", "random"):
        out[f"orbitflow-{rule}"] = (
            lambda rule=rule: ControlledPolicy(f"orbitflow-{rule}", planner="request-wise+pause",
                                               victim_rule=rule))
    return out


CONTROLLED = _variants()
