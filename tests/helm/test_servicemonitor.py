"""ServiceMonitor template (optional; a Prometheus Operator CRD, so its structure is checked here
by hand instead of against the Kubernetes API schemas)."""

from __future__ import annotations


def test_absent_by_default(render):
    """No ServiceMonitor unless enabled (the CRD may not exist in the cluster)."""
    assert render().maybe("ServiceMonitor") is None


def test_scrapes_the_metrics_port(render):
    """enabled scrapes /metrics on the Service's metrics port at the configured interval."""
    r = render(
        {
            "serviceMonitor": {
                "enabled": True,
                "interval": "15s",
                "scrapeTimeout": "5s",
                "labels": {"release": "prometheus"},
            }
        }
    )
    sm = r.one("ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    assert sm["metadata"]["namespace"] == "serving"
    assert set(sm["spec"]) == {"selector", "namespaceSelector", "endpoints"}
    assert sm["spec"]["endpoints"] == [
        {
            "port": "metrics",
            "path": "/metrics",
            "scheme": "http",
            "interval": "15s",
            "scrapeTimeout": "5s",
        }
    ]
    assert sm["spec"]["namespaceSelector"] == {"matchNames": ["serving"]}
    svc = r.one("Service")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert "metrics" in {p["name"] for p in svc["spec"]["ports"]}


def test_other_namespace(render):
    """serviceMonitor.namespace places it next to Prometheus while selecting the release namespace."""
    sm = render({"serviceMonitor": {"enabled": True, "namespace": "monitoring"}}).one(
        "ServiceMonitor"
    )
    assert sm["metadata"]["namespace"] == "monitoring"
    assert sm["spec"]["namespaceSelector"] == {"matchNames": ["serving"]}


def test_bad_interval_rejected(render_error):
    """A scrape interval that is not a Prometheus duration is rejected naming the field."""
    assert "serviceMonitor.interval" in render_error(
        {"serviceMonitor": {"enabled": True, "interval": "often"}}
    )
