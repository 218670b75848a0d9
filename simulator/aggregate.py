"""Seed aggregation for reproduce tables and plots: mean and spread per (experiment point,
policy) over the seeds of that point (issue 15: >= 3 seeds per point, spread shown)."""

from __future__ import annotations

import math
import statistics
from typing import Any

Row = dict[str, Any]

METRICS = (
    "tbt_attainment", "tbt_attainment_authors", "tpot_attainment", "ttft_attainment",
    "tbt_p99_ms", "ttft_p99_ms", "throughput_req_per_min", "slo_goodput_req_per_min",
    "slo_ok", "slo_goodput_tpot_req_per_min", "slo_ok_tpot", "rejected", "kv_util_mean", "pauses", "forced_fallbacks",
    "solver_calls_per_request", "solver_time_share", "solver_step_share", "solver_charged_ms",
    "ttft_mean_ms", "throughput_tok_per_s", "preemptions",
)
"""Metrics aggregated (others are taken from the first seed)."""


def group_keys(rows: list[Row]) -> list[str]:
    """The tags that identify a point (the seed is what is aggregated over)."""
    return [k for k in ("slo_scale", "rate_per_min", "rate_per_s", "workload", "relative_load")
            if any(k in r for r in rows)]


def aggregate(rows: list[Row]) -> list[Row]:
    """One row per (point, policy) in first-seen order: each metric's mean, plus
    ``<metric>_sd`` (sample standard deviation, 0 for one seed), ``_min``, ``_max`` and
    ``seeds``."""
    keys = group_keys(rows)
    groups: dict[tuple, list[Row]] = {}
    for r in rows:
        groups.setdefault(tuple(r.get(k) for k in keys) + (r["policy"],), []).append(r)
    out: list[Row] = []
    for members in groups.values():
        agg: Row = {k: members[0].get(k) for k in keys}
        agg["policy"] = members[0]["policy"]
        agg["seeds"] = len(members)
        for m in METRICS:
            vals = [r[m] for r in members if isinstance(r.get(m), int | float)
                    and not (isinstance(r[m], float) and math.isnan(r[m]))]
            if not vals:
                agg[m] = None
                continue
            agg[m] = sum(vals) / len(vals)
            agg[f"{m}_sd"] = statistics.stdev(vals) if len(vals) > 1 else 0.0
            agg[f"{m}_min"] = min(vals)
            agg[f"{m}_max"] = max(vals)
        out.append(agg)
    return out


def fmt_spread(row: Row, key: str, *, pct: bool = False, nd: int = 1) -> str:
    """``mean ± sd`` (percent points when ``pct``), or the mean alone for one seed."""
    v = row.get(key)
    if v is None:
        return "n/a"
    sd = row.get(f"{key}_sd", 0.0) or 0.0
    scale = 100.0 if pct else 1.0
    unit = "%" if pct else ""
    if row.get("seeds", 1) > 1:
        return f"{scale * v:.{nd}f}{unit} ± {scale * sd:.{nd}f}"
    return f"{scale * v:.{nd}f}{unit}"
