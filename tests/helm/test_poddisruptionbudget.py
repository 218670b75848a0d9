"""PodDisruptionBudget template (optional)."""

from __future__ import annotations

import pytest


def test_absent_by_default(render):
    """No PodDisruptionBudget unless enabled."""
    assert render().maybe("PodDisruptionBudget") is None


def test_min_available(render):
    """enabled renders minAvailable and selects the Deployment's pods."""
    r = render({"replicaCount": 2, "podDisruptionBudget": {"enabled": True, "minAvailable": 1}})
    pdb = r.one("PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"]["minAvailable"] == 1
    assert "maxUnavailable" not in pdb["spec"]
    pods = r.one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pods.items()


def test_max_unavailable_percentage(render):
    """maxUnavailable (with minAvailable null) is rendered instead, percentages allowed."""
    pdb = render(
        {"podDisruptionBudget": {"enabled": True, "minAvailable": None, "maxUnavailable": "50%"}}
    ).one("PodDisruptionBudget")
    assert pdb["spec"] == {**pdb["spec"], "maxUnavailable": "50%"}
    assert "minAvailable" not in pdb["spec"]


def test_both_set_is_an_error(render_error):
    """Setting minAvailable and maxUnavailable together fails with a message naming both."""
    err = render_error(
        {"podDisruptionBudget": {"enabled": True, "minAvailable": 1, "maxUnavailable": 1}}
    )
    assert "minAvailable" in err and "maxUnavailable" in err


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"podDisruptionBudget": {"enabled": True, "minAvailable": 1}},
         "podDisruptionBudget.minAvailable: 1 is not below replicaCount = 1"),
        ({"replicaCount": 3, "podDisruptionBudget": {"enabled": True, "minAvailable": 3}},
         "podDisruptionBudget.minAvailable: 3 is not below replicaCount = 3"),
        ({"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 4},
          "podDisruptionBudget": {"enabled": True, "minAvailable": 2}},
         "podDisruptionBudget.minAvailable: 2 is not below autoscaling.minReplicas = 2"),
        ({"replicaCount": 2, "podDisruptionBudget": {"enabled": True, "minAvailable": "100%"}},
         'podDisruptionBudget.minAvailable: "100%" of replicaCount = 2 rounds up to 2 pods'),
        # Kubernetes rounds a percentage up: 50% of 1 is 1 pod, 60% of 2 is 2 (Helm review, session 64)
        ({"podDisruptionBudget": {"enabled": True, "minAvailable": "50%"}},
         'podDisruptionBudget.minAvailable: "50%" of replicaCount = 1 rounds up to 1 pods'),
        ({"replicaCount": 2, "podDisruptionBudget": {"enabled": True, "minAvailable": "60%"}},
         'podDisruptionBudget.minAvailable: "60%" of replicaCount = 2 rounds up to 2 pods'),
        ({"replicaCount": 2, "podDisruptionBudget": {"enabled": True, "minAvailable": None, "maxUnavailable": 0}},
         "podDisruptionBudget.maxUnavailable: 0 lets no pod be evicted"),
    ],
)
def test_a_budget_that_blocks_every_eviction_is_refused(render_error, values, message):
    """A PDB that allows no disruption makes every node drain wait for ever: refused at render,
    naming the fields."""
    assert message in render_error(values)


def test_a_budget_that_allows_one_eviction_renders(render):
    """Control: two replicas with minAvailable 1, or maxUnavailable 1 on one replica."""
    assert render({"replicaCount": 2, "podDisruptionBudget": {"enabled": True}}).one("PodDisruptionBudget")
    one = {"podDisruptionBudget": {"enabled": True, "minAvailable": None, "maxUnavailable": 1}}
    assert render(one).one("PodDisruptionBudget")["spec"]["maxUnavailable"] == 1
