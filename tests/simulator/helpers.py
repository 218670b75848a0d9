"""Small traces and runs shared by the simulator tests."""

from __future__ import annotations

from simulator.engine import Engine, SimConfig, SimResult
from simulator.policies import make_policy
from simulator.profile import SimProfile, load_profile
from simulator.trace import TraceRequest, TraceSpec, generate_trace

A5000 = "llama3-8b-a5000-pcie3"


def small_trace(n: int = 5, seed: int = 1, rate: float = 3.0, scale: float = 1.5,
                workload: str = "orbitflow-32k") -> tuple[SimProfile, list[TraceRequest]]:
    prof = load_profile(A5000)
    spec = TraceSpec(workload, n, rate, slo_scale=scale, seed=seed, output_scale=0.08)
    return prof, generate_trace(spec, prof)


def run(policy: str, prof: SimProfile, trace: list[TraceRequest], **cfg) -> SimResult:  # noqa: ANN003
    return Engine(prof, trace, make_policy(policy), SimConfig(record_steps=True, **cfg)).run()
