"""PodDisruptionBudget template (optional)."""

from __future__ import annotations


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
