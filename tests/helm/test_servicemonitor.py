"""ServiceMonitor template (optional; a Prometheus Operator CRD, so its structure is checked here
by hand instead of against the Kubernetes API schemas)."""

from __future__ import annotations

import pytest


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


@pytest.mark.parametrize(
    ("interval", "timeout"),
    [("30s", "31s"), ("10s", "1m"), ("1m", "1m500ms"), ("500ms", "1s"), ("1h", "1h1m"), ("1m05s", "1m09s"),
     ("08s", "09s")],
)
def test_a_scrape_timeout_longer_than_the_interval_is_refused(render_error, interval, timeout):
    """Prometheus refuses scrape_timeout > scrape_interval and the Operator then skips the whole
    ServiceMonitor without a word; the chart refuses it naming both values (durations compared in
    milliseconds, numbers decimal: the first version read "09" as 0 and passed 1m09s over 1m05s).
    Negative control: the old chart rendered every case."""
    err = render_error({"serviceMonitor": {"enabled": True, "interval": interval, "scrapeTimeout": timeout}})
    assert f'serviceMonitor.scrapeTimeout: "{timeout}" is longer than serviceMonitor.interval = "{interval}"' in err


@pytest.mark.parametrize(
    ("interval", "timeout"),
    [("30s", "30s"), ("1m", "60s"), ("1m", "59s"), ("1h", "59m59s"), ("2s", "1500ms"), ("1m30s", "1m"),
     ("08s", "5s"), ("1m", "09s"), ("010s", "9s")],
)
def test_a_scrape_timeout_at_most_the_interval_renders(render, interval, timeout):
    """Control of the refusal: equal (also in other units) and shorter timeouts render; leading
    zeros read as decimal, as Prometheus reads them (Sprig's ``int64`` took "010" for octal 8 and
    refused "08s" as zero: the deploy fixes' review, session 87)."""
    sm = render({"serviceMonitor": {"enabled": True, "interval": interval, "scrapeTimeout": timeout}}).one("ServiceMonitor")
    assert sm["spec"]["endpoints"][0]["interval"] == interval and sm["spec"]["endpoints"][0]["scrapeTimeout"] == timeout


@pytest.mark.parametrize(
    ("field", "value"), [("interval", "0s"), ("scrapeTimeout", "0ms"), ("interval", "30s1m"), ("scrapeTimeout", "1d")]
)
def test_a_zero_or_unordered_duration_is_refused(render_error, field, value):
    """A zero duration, units out of order (Prometheus' parser refuses 30s1m) or an unsupported unit
    is refused naming the field."""
    values = {"enabled": True, "interval": "1h", "scrapeTimeout": "10s", field: value}
    assert f"serviceMonitor.{field}" in render_error({"serviceMonitor": values})
