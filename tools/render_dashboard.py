"""Render kvplane's Grafana dashboard to a PNG from real ``/metrics`` scrapes (no Grafana here).

The README's dashboard picture is made by this script, not by Grafana: it scrapes a running
layered SGLang server (``--enable-layered-kv --enable-metrics``) a few times while a workload
runs, evaluates every panel's queries over the scrapes with
:class:`promql_subset.PromQLSubset` (rates between consecutive scrapes; the dashboard's other
forms exactly; anything else is refused), and draws the panels in the dashboard's grid order with
matplotlib. Usage::

    python tools/render_dashboard.py --tiny --out docs/monitoring/kvplane-dashboard.png
    python tools/render_dashboard.py --url http://127.0.0.1:30000 --out dash.png [--workload 24]

``--tiny`` builds the tiny random-weight model, launches a layered server on it with a small
device budget (most KV on host, pauses) and ``--enable-metrics``, and stops it afterwards.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from promql_subset import PromQLSubset, Samples, parse_samples  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "helm" / "kvplane-controlplane" / "dashboards" / "kvplane-grafana.json"
VARIABLES = {"model_name": ".*", "datasource": "prometheus"}
"""Grafana template variables as the renderer resolves them (every model)."""
TINY_FLAGS = ("--enable-layered-kv", "--enable-metrics", "--kv-scheduler", "layerkv", "--kv-gpu-budget-tokens", "96",
              "--mem-fraction-static", "0.3")
TINY_POLICY = {"max_paused_steps": 6, "window_min": 2, "window_max": 4}
PROMPTS = tuple(f"{head} {i}" for i in range(6) for head in (
    "The quick brown fox", "A cache keeps recent data", "Time to first token", "Once upon a time"))


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """The dashboard's graph panels (rows skipped), in grid order."""
    found = [p for p in dashboard["panels"] if p.get("type") != "row"]
    return sorted(found, key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))


def queries(dashboard: dict[str, Any]) -> list[str]:
    """Every panel query (``expr``) of the dashboard."""
    return [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]


def scrape(url: str, timeout_s: float = 30.0) -> Samples:
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout_s) as resp:
        return parse_samples(resp.read().decode())


def scrape_during(url: str, workload: Callable[[], None], *, scrapes: int, interval_s: float) -> list[tuple[float, Samples]]:
    """Scrape ``scrapes`` times, ``interval_s`` apart, while ``workload`` runs in a thread (it is
    started after the first scrape and joined at the end)."""
    out = [(time.monotonic(), scrape(url))]
    thread = threading.Thread(target=workload, daemon=True)
    thread.start()
    for _ in range(scrapes - 1):
        time.sleep(interval_s)
        out.append((time.monotonic(), scrape(url)))
    thread.join(timeout=600)
    return out


def generate_workload(url: str, prompts: Sequence[str], max_new_tokens: int, waves: int) -> Callable[[], None]:
    """``waves`` rounds of concurrent greedy /generate calls, one per prompt."""

    def post(prompt: str) -> None:
        body = json.dumps({"text": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}})
        req = urllib.request.Request(url.rstrip("/") + "/generate", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=600).read()

    def run() -> None:
        for _ in range(waves):
            threads = [threading.Thread(target=post, args=(p,)) for p in prompts]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

    return run


def render(dashboard: dict[str, Any], scrapes: Sequence[tuple[float, Samples]], out: Path,
           note: str = "") -> dict[str, int]:
    """Draw every panel from ``scrapes`` into ``out`` (PNG); returns the series drawn per panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = panels(dashboard)
    cols = 3
    rows = math.ceil(len(shown) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.0 * cols, 3.2 * rows), squeeze=False)
    t0 = scrapes[0][0]
    drawn: dict[str, int] = {}
    for ax, panel in zip(axes.flat, shown, strict=False):
        count = 0
        for target in panel.get("targets", []):
            query = PromQLSubset(target["expr"], VARIABLES)
            for labels, points in sorted(query.series(scrapes).items()):
                xs = [t - t0 for t, v in points if not math.isnan(v)]
                ys = [v for _, v in points if not math.isnan(v)]
                if not xs:
                    continue
                legend = target.get("legendFormat", "") or target["expr"]
                for key, val in labels:
                    legend = legend.replace("{{" + key + "}}", val)
                ax.plot(xs, ys, marker=".", linewidth=1.2, label=legend)
                count += 1
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "")
        ax.set_title(f"{panel['title']}" + (f"  [{unit}]" if unit and unit != "short" else ""), fontsize=10)
        ax.set_xlabel("seconds since first scrape", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        if count:
            ax.legend(fontsize=7, loc="upper left")
        else:
            ax.text(0.5, 0.5, "no data in these scrapes", ha="center", va="center", transform=ax.transAxes,
                    fontsize=9, color="grey")
        drawn[panel["title"]] = count
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    fig.suptitle(f"{dashboard.get('title', 'dashboard')} -- rendered by tools/render_dashboard.py from "
                 f"{len(scrapes)} scrapes of SGLang's /metrics (not Grafana){note}", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return drawn


def _run_tiny(dashboard_path: Path, out: Path, scrapes: int, interval_s: float, waves: int) -> dict[str, int]:
    from sglang_ext.testing.server import SGLangServer
    from sglang_ext.testing.tiny_model import TinyModelSpec, build_tiny_model

    with tempfile.TemporaryDirectory(prefix="kvplane-dashboard-") as tmp:
        root = Path(tmp)
        model = build_tiny_model(root / "model", TinyModelSpec())
        policy = root / "policy.json"
        policy.write_text(json.dumps(TINY_POLICY))
        server = SGLangServer(model, log_path=root / "server.log",
                              extra_args=[*TINY_FLAGS, "--kv-policy", str(policy)], startup_timeout_s=900)
        server.start()
        try:
            got = scrape_during(server.base_url, generate_workload(server.base_url, PROMPTS, 12, waves),
                                scrapes=scrapes, interval_s=interval_s)
        finally:
            server.stop()
    dashboard = json.loads(dashboard_path.read_text())
    return render(dashboard, got, out, note=" -- tiny random-weight model on CPU, 96 token-layer device budget")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running layered server started with --enable-metrics")
    where.add_argument("--tiny", action="store_true", help="launch a layered server on the tiny model")
    parser.add_argument("--out", type=Path, required=True, help="PNG to write")
    parser.add_argument("--dashboard", type=Path, default=DASHBOARD)
    parser.add_argument("--scrapes", type=int, default=14, help="scrapes taken (>= 2)")
    parser.add_argument("--interval-s", type=float, default=3.0, help="seconds between scrapes (> 0)")
    parser.add_argument("--waves", type=int, default=4, help="rounds of concurrent requests")
    args = parser.parse_args(argv)
    if args.scrapes < 2 or args.interval_s <= 0 or args.waves < 1:
        parser.error(f"--scrapes {args.scrapes} (>= 2), --interval-s {args.interval_s} (> 0), "
                     f"--waves {args.waves} (>= 1)")
    if args.tiny:
        drawn = _run_tiny(args.dashboard, args.out, args.scrapes, args.interval_s, args.waves)
    else:
        got = scrape_during(args.url, generate_workload(args.url, PROMPTS, 12, args.waves),
                            scrapes=args.scrapes, interval_s=args.interval_s)
        drawn = render(json.loads(args.dashboard.read_text()), got, args.out)
    print(json.dumps({"out": str(args.out), "series_per_panel": drawn}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
