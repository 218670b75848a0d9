"""Trace generation and JSONL I/O."""

import json
import statistics

import pytest

from simulator.profile import load_profile
from simulator.trace import TraceSpec, generate_trace, load_trace, save_trace

PROF = load_profile("llama3-8b-a5000-pcie3")


def test_generation_is_deterministic_under_a_seed():
    """The same spec gives the same trace; another seed gives another one."""
    a = generate_trace(TraceSpec(n_requests=30, seed=4), PROF)
    b = generate_trace(TraceSpec(n_requests=30, seed=4), PROF)
    c = generate_trace(TraceSpec(n_requests=30, seed=5), PROF)
    assert a == b
    assert a != c


@pytest.mark.parametrize("workload,max_total", [("orbitflow-32k", 32768), ("orbitflow-128k", 131072)])
def test_long_context_bins_respect_their_cap(workload, max_total):
    """OrbitFlow bins never exceed their context cap (prompt + output)."""
    tr = generate_trace(TraceSpec(workload, 300, seed=1), PROF)
    assert max(r.prompt_tokens + r.output_tokens for r in tr) <= max_total


def test_slo_is_scaled_profile_base():
    """TBT SLO = scale x decode latency of the longest all-resident request (OrbitFlow §5.1)."""
    tr = generate_trace(TraceSpec(n_requests=3, slo_scale=2.5), PROF)
    assert tr[0].slo_tbt_ms == pytest.approx(2.5 * PROF.base_tbt_slo_ms(), rel=1e-4)


def test_gamma_arrivals_have_the_requested_cv():
    """Gamma inter-arrival gaps reach the requested coefficient of variation."""
    tr = generate_trace(TraceSpec("sharegpt", 4000, 60.0, "gamma", cv=3.0, seed=2), PROF)
    gaps = [b.arrival_ms - a.arrival_ms for a, b in zip(tr, tr[1:], strict=False)]
    cv = statistics.pstdev(gaps) / statistics.mean(gaps)
    assert 2.5 < cv < 3.5
    assert statistics.mean(gaps) == pytest.approx(1000.0, rel=0.15)


def test_jsonl_round_trip(tmp_path):
    """A saved trace loads back identical (the meta line is skipped)."""
    tr = generate_trace(TraceSpec(n_requests=10, seed=3), PROF)
    path = tmp_path / "t.jsonl"
    save_trace(tr, path, meta={"seed": 3})
    assert load_trace(path) == tr


def test_bad_user_trace_names_line_and_field(tmp_path):
    """A malformed user trace fails with the line and the field."""
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"id": "a", "arrival_ms": 0, "prompt_tokens": 0,
                                "output_tokens": 5, "slo_ttft_ms": 1, "slo_tbt_ms": 1}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: .*prompt_tokens"):
        load_trace(path)


def test_spec_validation_names_the_field():
    """Out-of-range spec fields raise ValueError naming them."""
    with pytest.raises(ValueError, match="workload"):
        TraceSpec(workload="nope")
    with pytest.raises(ValueError, match="rate_per_min"):
        TraceSpec(rate_per_min=0)
