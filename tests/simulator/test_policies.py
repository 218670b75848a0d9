"""Every registered policy runs a small trace to completion."""

import pytest

from simulator.metrics import compute_metrics
from simulator.policies import make_policy, policy_names
from tests.simulator.helpers import run, small_trace

REQUIRED = {"orbitflow", "batch-uniform", "request-wise", "request-wise+pause",
            "orbitflow-longest", "orbitflow-shortest", "orbitflow-random", "deepspeed",
            "flexgen", "flexgen+", "slo-aware", "dynamic-heuristic", "no-offload", "layerkv",
            "lvf", "ellm", "kvplane", "flexgen-authors", "selectn", "distn-single"}


def test_registry_has_every_issue_policy():
    """All policies the issue names are selectable by name."""
    assert REQUIRED <= set(policy_names())


def test_unknown_policy_names_the_choices():
    """An unknown name is a ValueError listing the allowed names."""
    with pytest.raises(ValueError, match="orbitflow"):
        make_policy("nope")


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_policy_runs_small_trace(name):
    """The policy finishes every admissible request of a small trace."""
    prof, trace = small_trace(n=4, seed=11, rate=4.0)
    m = compute_metrics(run(name, prof, trace))
    assert m.finished + m.rejected == 4
    assert m.finished >= 1
    assert 0.0 <= m.tbt_attainment <= 1.0


def test_deepspeed_offloads_everything():
    """DeepSpeed-Inference keeps no layer resident after a request's first decode step (the
    prefill reserved the whole prompt; the first step demotes it)."""
    prof, trace = small_trace(n=3, seed=1)
    res = run("deepspeed", prof, trace)
    seen: dict[str, int] = {}
    for s in res.step_log:
        for rid, row in s.rows.items():
            seen[rid] = seen.get(rid, 0) + 1
            if seen[rid] > 1:
                assert sum(row) == 0
    assert seen


@pytest.mark.parametrize("name", ["flexgen-authors", "distn-single"])
def test_authors_baselines_offload_at_most_16_layers(name):
    """The authors-faithful FlexGen and DistNSingle never offload more than 16 of 32 layers;
    negative control: deepspeed (ours) offloads all 32."""
    prof, trace = small_trace(n=6, seed=2, rate=6.0)
    for pol, cap in ((name, 16), ("deepspeed", 32)):
        res = run(pol, prof, trace)
        offloaded = [32 - sum(row) for s in res.step_log for row in s.rows.values()]
        assert offloaded and max(offloaded) <= cap
        if pol == "deepspeed":
            assert max(offloaded) == 32


def test_flexgen_authors_pads_to_the_trace_average():
    """flexgen-authors keeps one candidate for the whole run (static), chosen for 4 requests
    of the trace's average length: every decode step uses the same row."""
    prof, trace = small_trace(n=6, seed=2, rate=6.0)
    res = run("flexgen-authors", prof, trace)
    seen: dict[str, int] = {}
    rows = set()
    for s in res.step_log:
        for rid, row in s.rows.items():
            seen[rid] = seen.get(rid, 0) + 1
            if seen[rid] > 1:  # the first step runs with the prefill's residency
                rows.add(row)
    assert len(rows) == 1 and res.forced_fallbacks == 0
