"""HorizontalPodAutoscaler template (optional)."""

from __future__ import annotations

from tests.helm.conftest import FULLNAME


def test_absent_by_default(render):
    """No HPA unless enabled."""
    assert render().maybe("HorizontalPodAutoscaler") is None


def test_scales_the_deployment_on_cpu(render):
    """enabled targets this Deployment with min/max replicas and the CPU utilisation target."""
    hpa = render(
        {
            "autoscaling": {
                "enabled": True,
                "minReplicas": 2,
                "maxReplicas": 5,
                "targetCPUUtilizationPercentage": 60,
            }
        }
    ).one("HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": FULLNAME,
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 5)
    assert hpa["spec"]["metrics"] == [
        {
            "type": "Resource",
            "resource": {
                "name": "cpu",
                "target": {"type": "Utilization", "averageUtilization": 60},
            },
        }
    ]


def test_memory_metric_only(render):
    """A null CPU target and a memory target give a memory-only HPA."""
    hpa = render(
        {
            "autoscaling": {
                "enabled": True,
                "targetCPUUtilizationPercentage": None,
                "targetMemoryUtilizationPercentage": 80,
            }
        }
    ).one("HorizontalPodAutoscaler")
    assert [m["resource"]["name"] for m in hpa["spec"]["metrics"]] == ["memory"]


def test_min_above_max_is_an_error(render_error):
    """minReplicas > maxReplicas fails naming maxReplicas and both values."""
    err = render_error({"autoscaling": {"enabled": True, "minReplicas": 4, "maxReplicas": 2}})
    assert "autoscaling.maxReplicas: 2 is below autoscaling.minReplicas = 4" in err


def test_no_metric_is_an_error(render_error):
    """An HPA with neither target fails instead of rendering an HPA with no metrics."""
    err = render_error({"autoscaling": {"enabled": True, "targetCPUUtilizationPercentage": None}})
    assert "targetCPUUtilizationPercentage" in err
