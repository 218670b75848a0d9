"""Reporting of `kvplane bench pacing` (:mod:`sglang_ext.tools.pacing_bench`): the layered
server's per-step stats of one run summarised, and the Markdown results."""

from __future__ import annotations

import json
from typing import Any

from sglang_ext.tools.pacing_figures import BURST_GAP_MS, JITTER_TOLERANCE, REQUEST_GAP_SHARE
from sglang_ext.tools.value_report import step_stats_summary


def stats_slice_summary(text: str) -> dict[str, Any]:
    """The per-step stats lines written during one run (``$KVPLANE_STATS_FILE``, the part appended
    since the run started): :func:`~sglang_ext.tools.value_report.step_stats_summary` (steps,
    pause events, median / max step ms, ...) plus the peak share of live layer-KV on host."""
    out = step_stats_summary(text)
    host = []
    for raw in text.splitlines():
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("host_fraction"), int | float):
            host.append(float(rec["host_fraction"]))
    out["peak_host_fraction"] = round(max(host), 3) if host else None
    return out


def _fmt(x: Any, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, int):
        return str(x)
    return f"{x:.{digits}f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


FIGURE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("requests", "requests", "int"),
    ("gaps", "gaps", "int"),
    ("itl_p50_ms", "ITL p50 ms", "ms"),
    ("itl_p90_ms", "ITL p90 ms", "ms"),
    ("itl_p99_ms", "ITL p99 ms", "ms"),
    ("itl_max_ms", "ITL max ms", "ms"),
    ("itl_mean_ms", "ITL mean ms", "ms"),
    ("ttft_p50_ms", "TTFT p50 ms", "ms"),
    ("ttft_p99_ms", "TTFT p99 ms", "ms"),
    ("gap_attainment", "gaps <= SLO", "pct"),
    ("gap_attainment_tolerant", f"gaps <= SLO +{JITTER_TOLERANCE:.0%}", "pct"),
    ("request_attainment", f"requests >= {REQUEST_GAP_SHARE:.0%} gaps <= SLO", "pct"),
    ("burst_fraction", f"gaps < {BURST_GAP_MS:g} ms (burst)", "pct"),
    ("longest_gap_p50_ms", "longest gap p50 ms", "ms"),
    ("longest_gap_max_ms", "longest gap max ms", "ms"),
)


def _cell(value: Any, kind: str) -> str:
    if kind == "pct":
        return _pct(value)
    if kind == "int":
        return _fmt(value)
    return _fmt(value, 1)


def _server_cells(runs: list[dict[str, Any]], config: str, load: str) -> tuple[str, ...]:
    """Client seconds per round, pauses, peak host KV, median step ms per round and the load
    average of config's runs of ``load``."""
    mine = [r for r in runs if r["config"] == config and r["load"] == load]
    steps = [r["server_steps"] for r in mine if r.get("server_steps")]
    loads = [x for r in mine for x in r["load_avg_1m"]]
    load_text = f"{min(loads):.1f}-{max(loads):.1f}" if loads else "-"
    durations = [r["summary"].get("duration_s") for r in mine]
    duration_text = "/".join(_fmt(d) for d in durations) or "-"
    if not steps:
        return duration_text, "-", "-", "-", load_text
    pauses = sum(int(s.get("pauses") or 0) for s in steps)
    hosts = [s["peak_host_fraction"] for s in steps if s.get("peak_host_fraction") is not None]
    step_ms = [s["median_step_ms"] for s in steps if s.get("median_step_ms") is not None]
    return (
        duration_text,
        str(pauses),
        _pct(max(hosts)) if hosts else "-",
        "/".join(f"{x:.0f}" for x in step_ms) or "-",
        load_text,
    )


def figures_table(payload: dict[str, Any], load: str) -> list[str]:
    """One load's table: a row per server, pooled over rounds."""
    head = (
        "| server | "
        + " | ".join(c[1] for c in FIGURE_COLUMNS)
        + " | client s | pauses | peak host KV | step ms p50 | load 1m |"
    )
    lines = [head, "|" + "---|" * (len(FIGURE_COLUMNS) + 6)]
    for config, fig in (payload["figures"].get(load) or {}).items():
        cells = [_cell(fig.get(key), kind) for key, _, kind in FIGURE_COLUMNS]
        lines.append(f"| {config} | " + " | ".join(cells) + " | " + " | ".join(_server_cells(payload["runs"], config, load)) + " |")
    return lines


def markdown(payload: dict[str, Any]) -> str:
    """The results as Markdown."""
    m, s = payload["machine"], payload["settings"]
    lines = [
        f"# kvplane bench pacing — {m['device']}",
        "",
        f"Date: {payload['date']}. Host: {m['cpus']} CPUs; 1/5/15-minute load average "
        f"{'/'.join(f'{x:.2f}' for x in m['load_avg_start'])} at the start and "
        f"{'/'.join(f'{x:.2f}' for x in m['load_avg_end'])} at the end ({m['wall_s']:.0f} s wall). "
        f"Model: {payload['model']}.",
        "",
        f"Servers (after the CPU recipe `{' '.join(payload['cpu_args'])}`): `vanilla` = stock SGLang "
        "(kvplane installed, `--enable-layered-kv` off); `pacing-on` / `pacing-off` = "
        f"`--enable-layered-kv --kv-gpu-budget-tokens {s['budget_token_layers']} --kv-policy` "
        f"`{json.dumps(s['layered_policy'])}` with `--kv-pacing on` / `off`. Exact launch commands "
        "in the JSON.",
        "",
        f"Client: SGLang's own `python -m sglang.bench_serving --backend sglang --dataset-name "
        f"random-ids --output-details`, one run at a time, {s['repeat']} round(s), order rotated per "
        "round. Figures are computed from its per-request ITL and TTFT lists (what the client "
        f"received, after pacing), pooled over rounds; SLO = {s['slo_tbt_ms']:g} ms (the layered "
        "servers' TBT SLO, which is also the pacing interval).",
        "",
    ]
    for load in ("light", "heavy"):
        w = s["loads"][load]
        lines += [
            f"## {load} load",
            "",
            f"{w['text']}; peak KV {w['peak_token_layers']} token-layers vs the layered budget "
            f"{s['budget_token_layers']}.",
            "",
            *figures_table(payload, load),
            "",
        ]
    lines += [
        "Columns: ITL = gaps between tokens as the client received them; `gaps <= SLO` = share of "
        f"all gaps within the SLO (`+{JITTER_TOLERANCE:.0%}`: within the SLO plus "
        f"{JITTER_TOLERANCE:.0%}, as paced gaps sit exactly at the SLO on the server's clock and "
        f"arrive a few ms either side); `requests >= {REQUEST_GAP_SHARE:.0%}` = share of requests "
        f"with at least {REQUEST_GAP_SHARE:.0%} of their gaps within it; burst = share of gaps under "
        f"{BURST_GAP_MS:g} ms (tokens released together); longest gap = each request's longest "
        "gap (the longest stall its client saw), median and max over requests; client s = "
        "bench_serving's duration of each round's run; pauses / peak host KV / step ms = the "
        "layered server's per-step stats during the runs (step ms per round). The row "
        "`pacing-off, replayed paced` is not a server: it is the `pacing-off` runs' streams "
        "passed through the pacing rule itself (`TokenDeposit` at the SLO, what the server's pacer "
        "runs): what pacing does to the same generation, free of the noise between two runs.",
        "",
    ]
    notes = payload.get("notes") or []
    if notes:
        lines += ["## Notes", "", *(f"- {n}" for n in notes), ""]
    return "\n".join(lines)
