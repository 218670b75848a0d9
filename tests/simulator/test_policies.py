"""Every registered policy runs a small trace to completion."""

import pytest

from simulator.metrics import compute_metrics
from simulator.policies import make_policy, policy_names
from tests.simulator.helpers import run, small_trace

REQUIRED = {"orbitflow", "batch-uniform", "request-wise", "request-wise+pause",
            "orbitflow-longest", "orbitflow-shortest", "orbitflow-random", "deepspeed",
            "flexgen", "flexgen+", "slo-aware", "dynamic-heuristic", "no-offload", "layerkv",
            "lvf", "ellm", "kvplane"}


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
