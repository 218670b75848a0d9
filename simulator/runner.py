"""Run one simulation from plain, picklable arguments (used by the CLI, sweeps and reproduce)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from simulator.engine import Engine, SimConfig
from simulator.metrics import RunMetrics, compute_metrics
from simulator.policies import make_policy
from simulator.profile import SimProfile, load_profile
from simulator.trace import TraceRequest, TraceSpec, generate_trace


@dataclass(frozen=True)
class RunSpec:
    """Everything one run depends on."""

    policy: str
    """Policy name."""
    profile: str = "llama3-8b-a5000-pcie3"
    """Preset name or profile file."""
    profile_overrides: dict[str, Any] = field(default_factory=dict)
    """Profile fields to override (e.g. max_batch_size)."""
    trace: TraceSpec | None = None
    """Generated trace (mutually exclusive with ``requests``)."""
    requests: tuple[TraceRequest, ...] = ()
    """Explicit trace."""
    solver_time: str = "model"
    """Engine solver-time mode."""
    planner_mode: str = "deterministic"
    """Controlled policies: deterministic or full planner."""
    tags: dict[str, Any] = field(default_factory=dict)
    """Free-form labels copied to the result (rate, slo_scale, ...)."""


def resolve_profile(spec: RunSpec) -> SimProfile:
    prof = load_profile(spec.profile)
    return prof.with_changes(**spec.profile_overrides) if spec.profile_overrides else prof


def resolve_trace(spec: RunSpec, profile: SimProfile) -> Sequence[TraceRequest]:
    if spec.requests:
        return spec.requests
    if spec.trace is None:
        raise ValueError("run: either a trace spec or explicit requests is required")
    return generate_trace(spec.trace, profile)


def run_spec(spec: RunSpec) -> tuple[RunMetrics, float]:
    """(metrics, wall seconds) of one run."""
    from simulator.logs import quiet

    quiet()
    t0 = time.perf_counter()
    profile = resolve_profile(spec)
    trace = resolve_trace(spec, profile)
    kwargs = {}
    if spec.planner_mode != "deterministic":
        kwargs["planner_mode"] = spec.planner_mode
    policy = make_policy(spec.policy, **kwargs)
    res = Engine(profile, trace, policy, SimConfig(solver_time=spec.solver_time)).run()
    return compute_metrics(res, deposit=policy.deposit), time.perf_counter() - t0


def run_spec_dict(spec: RunSpec) -> dict[str, Any]:
    """:func:`run_spec` flattened to a JSON-able dict with the spec's tags."""
    m, wall = run_spec(spec)
    return {**spec.tags, "policy": spec.policy, "wall_s": round(wall, 3), **m.to_dict()}


def spec_key(spec: RunSpec) -> tuple:
    """Identity of a run (tags excluded): equal keys give equal results (deterministic modes)."""
    return (spec.policy, spec.profile, tuple(sorted(spec.profile_overrides.items())), spec.trace,
            spec.requests, spec.solver_time, spec.planner_mode)


def run_many(specs: Sequence[RunSpec], jobs: int = 1, progress=None) -> list[dict[str, Any]]:  # noqa: ANN001
    """Run specs (in ``jobs`` processes when > 1), results in input order."""
    out: list[dict[str, Any] | None] = [None] * len(specs)
    if jobs <= 1:
        for i, s in enumerate(specs):
            out[i] = run_spec_dict(s)
            if progress:
                progress(i + 1, len(specs), out[i])
        return [o for o in out if o is not None]
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    with ctx.Pool(jobs) as pool:
        done = 0
        for i, res in pool.imap_unordered(_indexed, list(enumerate(specs))):
            out[i] = res
            done += 1
            if progress:
                progress(done, len(specs), res)
    return [o for o in out if o is not None]


def _indexed(item: tuple[int, RunSpec]) -> tuple[int, dict[str, Any]]:
    i, spec = item
    return i, run_spec_dict(spec)
