"""The tunable, versioned policy of the control plane (the policy-tuning API's subject).

One frozen dataclass per component; every field validated in ``__post_init__`` with a
:class:`~controlplane.model.SchemaError` naming the field and its allowed range. ``from_dict``
accepts a partial mapping (unknown keys are rejected) so a policy file or an update can name only
what it changes; :meth:`Policy.merged` applies such an update.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from controlplane.model.batch import PlanPolicy, SchemaError, shown

SCHEDULERS = ("fcfs", "layerkv", "lvf")
VICTIM_RULES = ("largest", "longest", "shortest", "random", "lost-first")


def _check_range(path: str, value: float, lo: float, hi: float, *, open_lo: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SchemaError(path, f"expected a number, got {shown(value)}")
    bad_lo = value <= lo if open_lo else value < lo
    if bad_lo or value > hi or value != value:
        left = "(" if open_lo else "["
        raise SchemaError(path, f"{shown(value)} is out of range (allowed {left}{lo}, {hi}])")


def _check_int(path: str, value: int, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SchemaError(path, f"expected an integer, got {shown(value)}")
    if not lo <= value <= hi:
        raise SchemaError(path, f"{shown(value)} is out of range (allowed [{lo}, {hi}])")


@dataclass(frozen=True)
class LayerKVParams:
    """LayerKV §3.1 admission (Eq. 1-4)."""

    ttft_slo_ms: float = 0.0
    """TTFT target for queued prefills that carry no TTFT SLO of their own; 0 (the default): the
    policy's ``slo_ttft_ms``, as every other consumer of the default reads it."""
    tpot_margin: float = 0.9
    """Admission keeps predicted decode TPOT below ``tpot_margin * slo_tbt_ms`` (T_tpot of Eq. 1)."""
    max_prefill_tokens: int = 8192
    """Largest prefill chunk admitted in one step."""
    output_len_lower_bound: int = 0
    """Lower bound of the predicted output length (N_future of Eq. 1 = max(1, bound - N_past))."""
    prefill_correction: float = 1.0
    """Empirical correction alpha of Eq. 3 (prefill time)."""
    offload_correction: float = 1.0
    """Empirical correction beta of Eq. 4 (offload time)."""
    model_params: float = 8e9
    """n_param of Eq. 3: the served model's parameter count."""
    hidden_size: int = 4096
    """n_hidden of Eq. 3: the served model's hidden size."""
    device_tflops: float = 400.0
    """FLOP per second of the device in Eq. 3, in TFLOP/s."""

    def __post_init__(self) -> None:
        _check_range("layerkv.ttft_slo_ms", self.ttft_slo_ms, 0.0, 1e7)
        _check_range("layerkv.tpot_margin", self.tpot_margin, 0.0, 1.0, open_lo=True)
        _check_int("layerkv.max_prefill_tokens", self.max_prefill_tokens, 1, 1 << 24)
        _check_int(
            "layerkv.output_len_lower_bound", self.output_len_lower_bound, 0, 1 << 24
        )
        for name in ("prefill_correction", "offload_correction"):
            _check_range(f"layerkv.{name}", getattr(self, name), 0.0, 1e6, open_lo=True)
        _check_range("layerkv.model_params", self.model_params, 0.0, 1e15, open_lo=True)
        _check_int("layerkv.hidden_size", self.hidden_size, 1, 1 << 24)
        _check_range("layerkv.device_tflops", self.device_tflops, 0.0, 1e6, open_lo=True)


@dataclass(frozen=True)
class LVFParams:
    """SuperInfer §4.2 Virtual Lag Time (VLT) and Largest-VLT-First rotation."""

    alpha: float = 1.0
    """Sensitivity weight of rotary (paused) requests' VLT (TBT vs TTFT); >= 0."""
    beta_b: float = 0.5
    """Tolerance of rotary requests, in TBT SLOs since their last token (may be negative)."""
    beta_f: float = 0.5
    """Tolerance of waiting requests, in TTFT SLOs since their arrival (may be negative)."""
    transfer_budget_blocks: int = 4096
    """B_xfer: one-layer blocks the rotation may swap in per step beyond the free GPU blocks."""

    def __post_init__(self) -> None:
        _check_range("lvf.alpha", self.alpha, 0.0, 1e6)
        for name in ("beta_b", "beta_f"):
            _check_range(f"lvf.{name}", getattr(self, name), -1e6, 1e6)
        _check_int(
            "lvf.transfer_budget_blocks", self.transfer_budget_blocks, 0, 1 << 30
        )


@dataclass(frozen=True)
class Policy:
    """Everything an operator may tune live. ``version`` increases with every accepted update."""

    version: int = 1
    """Monotonic version; assigned by the store, not by the writer."""
    slo_tbt_ms: float = 200.0
    """Default time-between-tokens SLO for requests that carry none."""
    slo_ttft_ms: float = 5000.0
    """Default time-to-first-token SLO for requests that carry none."""
    alpha: float = 1.0
    """Cap on summed late fractions per window (OrbitFlow §3.3.1)."""
    window_min: int = 4
    """Smallest decode window Δ (steps)."""
    window_max: int = 64
    """Largest decode window Δ (steps)."""
    mismatch_threshold: float = 0.2
    """Re-plan when |observed - predicted| / predicted exceeds this (OrbitFlow §3.4)."""
    ewma_factor: float = 0.3
    """Weight of a new observation in the profile EWMA."""
    victim_rule: str = "lost-first"
    """Pause victim: largest blocks+deposit (OrbitFlow §3.4's rule), longest, shortest, random;
    lost-first (the default since session 89): largest, but requests whose TPOT SLO is provably
    lost go first, and the starvation guard pauses only those
    (:func:`controlplane.controller.victims.tpot_lost`) until a request has waited
    ``HARD_BOUND_FACTOR`` (4) x ``max_paused_steps`` (:mod:`controlplane.controller.lost_first`).
    In the simulator its goodput within TTFT and TPOT SLOs is at least ``largest``'s on all 90
    runs of ``served-admission``'s load (two admissions, nine seeds, three rates, three SLO
    scales; ``benchmarks/results/sim/README.md``), at a longer tail for the requests given up on
    (TPOT P99 median 1.4-2.7x)."""
    max_paused_steps: int = 2000
    """Starvation guard: a request paused this long is resumed first (or others are paused)."""
    solve_budget_fraction: float = 0.25
    """Planner time budget as a fraction of the predicted step."""
    scheduler: str = "fcfs"
    """Admission/rotation policy: fcfs, layerkv, lvf."""
    max_recompute_ratio: float = 0.0
    """Largest uncached prefix the planner may recompute, as a fraction of a request's blocks
    (eLLM's uncached ratio, issue 16, ``docs/recompute.md``); in [0, 1), 0 = off. Offered only
    when the profile also measures ``recompute_ms_per_token``."""
    deposit_credit: bool = False
    """Whether token deposits mask late steps in the planner's SLO cap (OrbitFlow §3.3.1 with
    §3.2: true is the paper's rule). kvplane's default is false: measured in the simulator, the
    credit keeps requests in plans slower than their SLO until their deposits drain, and SLO
    goodput falls (``controlplane/planner/README.md``, "Deposit credit"). Deposits still pace
    delivery and weigh in the victim rule."""
    layerkv: LayerKVParams = field(default_factory=LayerKVParams)
    lvf: LVFParams = field(default_factory=LVFParams)

    def __post_init__(self) -> None:
        _check_int("version", self.version, 1, 1 << 62)
        _check_range("slo_tbt_ms", self.slo_tbt_ms, 0.0, 1e7, open_lo=True)
        _check_range("slo_ttft_ms", self.slo_ttft_ms, 0.0, 1e8, open_lo=True)
        _check_range("alpha", self.alpha, 0.0, 1e6)
        _check_int("window_min", self.window_min, 1, 1_000_000)
        _check_int("window_max", self.window_max, 1, 1_000_000)
        if self.window_max < self.window_min:
            raise SchemaError(
                "window_max", f"{self.window_max} is below window_min = {self.window_min}"
            )
        _check_range("mismatch_threshold", self.mismatch_threshold, 0.0, 100.0, open_lo=True)
        _check_range("ewma_factor", self.ewma_factor, 0.0, 1.0, open_lo=True)
        if self.victim_rule not in VICTIM_RULES:
            raise SchemaError("victim_rule", f"{shown(self.victim_rule)} is not one of {VICTIM_RULES}")
        _check_int("max_paused_steps", self.max_paused_steps, 1, 1 << 30)
        _check_range("solve_budget_fraction", self.solve_budget_fraction, 0.0, 10.0, open_lo=True)
        if self.scheduler not in SCHEDULERS:
            raise SchemaError("scheduler", f"{shown(self.scheduler)} is not one of {SCHEDULERS}")
        ratio = self.max_recompute_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, int | float):
            raise SchemaError("max_recompute_ratio", f"expected a number, got {shown(ratio)}")
        if not 0.0 <= ratio < 1.0:  # NaN fails too
            raise SchemaError("max_recompute_ratio", f"{ratio} is out of range (allowed [0.0, 1.0))")
        if not isinstance(self.deposit_credit, bool):
            raise SchemaError("deposit_credit", f"expected true or false, got {shown(self.deposit_credit)}")

    @property
    def plan_policy(self) -> PlanPolicy:
        """The planner's part of the policy."""
        return PlanPolicy(
            alpha=self.alpha,
            window_min=self.window_min,
            window_max=self.window_max,
            max_recompute_ratio=self.max_recompute_ratio,
            deposit_credit=self.deposit_credit,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Policy:
        """A full policy from a (possibly partial) mapping; missing fields take defaults."""
        return cls().merged(d, keep_version=False)

    def merged(self, changes: Mapping[str, Any], *, keep_version: bool = True) -> Policy:
        """This policy with ``changes`` applied (validated). Version is kept, not bumped."""
        if not isinstance(changes, Mapping):
            raise SchemaError("policy", f"expected an object, got {type(changes).__name__}")
        known = {f.name for f in dataclasses.fields(self)}
        values: dict[str, Any] = {}
        for key, value in changes.items():
            if key not in known:
                raise SchemaError(shown(key, bare=True), f"unknown policy field (allowed: {sorted(known)})")
            if key == "version" and keep_version:
                continue
            if key == "layerkv":
                value = _merge_params(self.layerkv, value, "layerkv")
            elif key == "lvf":
                value = _merge_params(self.lvf, value, "lvf")
            values[key] = value
        try:
            return dataclasses.replace(self, **values)
        except TypeError as exc:  # pragma: no cover - guarded by the known-field check
            raise SchemaError("policy", str(exc)) from exc


def _merge_params(current: Any, changes: Any, path: str) -> Any:
    if isinstance(changes, type(current)):
        return changes
    if not isinstance(changes, Mapping):
        raise SchemaError(path, f"expected an object, got {type(changes).__name__}")
    known = {f.name for f in dataclasses.fields(current)}
    for key in changes:
        if key not in known:
            raise SchemaError(f"{path}.{shown(key, bare=True)}", f"unknown field (allowed: {sorted(known)})")
    return dataclasses.replace(current, **dict(changes))
