"""The shipped Grafana dashboard, the PromQL subset that evaluates it and the PNG renderer (no
server: synthetic scrapes; the real-scrape checks are in test_metrics_server.py)."""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from sglang_ext.metric_spec import WORKER_METRICS, spec_named

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "helm" / "kvplane-controlplane" / "dashboards" / "kvplane-grafana.json"
_LABEL_VALUES = re.compile(r"label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*,\s*[a-zA-Z_]\w*\s*\)")


def _tool(name: str) -> ModuleType:
    """A module of tools/ (not a package), loaded once."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@functools.cache
def load_promql() -> ModuleType:
    return _tool("promql_subset")


def dashboard_metrics(dashboard: dict[str, Any]) -> set[str]:
    """Every sample name the dashboard's queries read: panel targets (parsed with the subset) and
    template variables (``label_values(metric, label)``)."""
    promql = load_promql()
    names: set[str] = set()
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            names |= promql.PromQLSubset(target["expr"], {"model_name": ".*"}).metrics()
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        text = query.get("query") if isinstance(query, dict) else query
        if var.get("type") == "query":
            match = _LABEL_VALUES.fullmatch(str(text).strip())
            assert match, f"template variable {var['name']}: unsupported query {text!r}"
            names.add(match.group(1))
    return names


def test_dashboard_queries_use_only_kvplane_metrics_of_the_table():
    """Every query parses in the supported subset and reads metrics of the metric table; every
    metric of the table has a panel."""
    dashboard = json.loads(DASHBOARD.read_text())
    used = dashboard_metrics(dashboard)
    specs = {spec_named(name).name for name in used}
    assert specs == {s.name for s in WORKER_METRICS}
    assert dashboard["uid"] == "kvplane-worker" and dashboard["title"] == "kvplane"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("query", [
    "avg(kvplane:host_kv_tokens)",
    "irate(kvplane:h2d_bytes_total[1m])",
    "kvplane:h2d_bytes_total offset 5m",
    "sum without (tp_rank) (kvplane:host_kv_tokens)",
    "kvplane:host_kv_tokens > 0",
    'kvplane:host_kv_tokens{tp_rank!="0"}',
    "sum(kvplane:host_kv_tokens{model_name=~\"$unknown\"})",
])
def test_queries_outside_the_subset_are_refused(query):
    """Negative control: forms the dashboard does not use are refused, naming the query."""
    promql = load_promql()
    with pytest.raises(promql.UnsupportedQuery, match=re.escape(repr(query))):
        promql.PromQLSubset(query, {"model_name": ".*"})


def _scrape(t: float, text: str) -> tuple[float, dict]:
    return t, load_promql().parse_samples(text)


SCRAPES = [
    _scrape(0.0, """
# TYPE kvplane:h2d_bytes_total counter
kvplane:h2d_bytes_total{tp_rank="0"} 100
kvplane:h2d_bytes_total{tp_rank="1"} 50
kvplane:host_kv_tokens{tp_rank="0"} 3
kvplane:stall_seconds_bucket{le="0.1",tp_rank="0"} 0
kvplane:stall_seconds_bucket{le="1.0",tp_rank="0"} 0
kvplane:stall_seconds_bucket{le="+Inf",tp_rank="0"} 0
kvplane:tbt_slo_requests_total{result="met"} 0
kvplane:tbt_slo_requests_total{result="missed"} 0
"""),
    _scrape(10.0, """
kvplane:h2d_bytes_total{tp_rank="0"} 300
kvplane:h2d_bytes_total{tp_rank="1"} 20
kvplane:host_kv_tokens{tp_rank="0"} 5
kvplane:stall_seconds_bucket{le="0.1",tp_rank="0"} 5
kvplane:stall_seconds_bucket{le="1.0",tp_rank="0"} 10
kvplane:stall_seconds_bucket{le="+Inf",tp_rank="0"} 10
kvplane:tbt_slo_requests_total{result="met"} 3
kvplane:tbt_slo_requests_total{result="missed"} 1
"""),
]


def test_subset_evaluates_rates_sums_ratios_and_quantiles():
    """Hand-computed values: per-second rate between scrapes (a counter reset counts from zero),
    sum by, a ratio of sums, Prometheus' linear interpolation inside the bucket."""
    promql = load_promql()

    def at(query: str) -> dict:
        return promql.PromQLSubset(query, {"model_name": ".*"}).evaluate(SCRAPES, 1)

    assert at("sum by (tp_rank) (rate(kvplane:h2d_bytes_total[1m]))") == {
        (("tp_rank", "0"),): 20.0, (("tp_rank", "1"),): 2.0,  # 200 B / 10 s; reset: 20 B / 10 s
    }
    assert at("sum(rate(kvplane:h2d_bytes_total[1m]))") == {(): 22.0}
    assert at('kvplane:host_kv_tokens{tp_rank=~"0|2"}') == {(("tp_rank", "0"),): 5.0}
    ratio = at('sum(rate(kvplane:tbt_slo_requests_total{result="met"}[5m])) / '
               "sum(rate(kvplane:tbt_slo_requests_total[5m]))")
    assert ratio[()] == pytest.approx(0.75) and list(ratio) == [()]
    p50 = at("histogram_quantile(0.5, sum by (le) (rate(kvplane:stall_seconds_bucket[1m])))")
    assert p50[()] == pytest.approx(0.1)  # rank 0.5 of 1/s lands at the top of the first bucket
    p75 = at("histogram_quantile(0.75, sum by (le) (rate(kvplane:stall_seconds_bucket[1m])))")
    assert p75[()] == pytest.approx(0.1 + 0.9 * 0.5)
    empty = promql.PromQLSubset("histogram_quantile(0.5, sum by (le) (rate(kvplane:stall_seconds_bucket[1m])))")
    assert math.isnan(empty.evaluate([SCRAPES[0], (5.0, SCRAPES[0][1])], 1)[()])


def test_renderer_draws_every_panel_to_a_png(tmp_path: Path):
    """The renderer writes a PNG with one plot per dashboard panel; panels whose metrics are in the
    scrapes get series, the others say so."""
    render = _tool("render_dashboard")
    dashboard = json.loads(DASHBOARD.read_text())
    out = tmp_path / "dash.png"
    drawn = render.render(dashboard, SCRAPES, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(drawn) == {p["title"] for p in dashboard["panels"] if p["type"] != "row"}
    assert drawn["Transfer bandwidth"] == 2 and drawn["SLO attainment"] == 1
    assert drawn["Plans"] == 0  # negative control: nothing of it in the synthetic scrapes


def test_readme_metric_table_is_the_generated_one():
    """The README's Monitoring table is exactly ``markdown_table()`` of the metric definitions and
    its dashboard picture exists (rendered by tools/render_dashboard.py, stated as not Grafana)."""
    readme = (REPO / "README.md").read_text()
    table = readme.split("<!-- metric-table:begin -->\n", 1)[1].split("<!-- metric-table:end -->", 1)[0]
    from sglang_ext.metric_spec import markdown_table

    assert table == markdown_table(), "regenerate with: python -m sglang_ext.metric_spec"
    assert "rendered by\n`tools/render_dashboard.py`" in readme and "**not Grafana**" in readme
    png = REPO / "docs" / "monitoring" / "kvplane-dashboard.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # negative control: a row edited by hand no longer matches
    assert table.replace("Bytes copied host -> device", "Bytes copied", 1) != markdown_table()
