"""Parsing and reporting of `kvplane bench value` (:mod:`sglang_ext.tools.value_bench`):
bench_serving's output, the pool / step stats and SGLang's log summarised, the table and report."""

from __future__ import annotations

import json
import re
from typing import Any

from sglang_ext.tools.sglang_bench_report import find_key

METRICS: tuple[tuple[str, str], ...] = (
    ("completed", "completed"),
    ("duration", "duration_s"),
    ("total_input_tokens", "input_tokens"),
    ("total_output_tokens", "output_tokens"),
    ("request_throughput", "request_throughput"),
    ("output_throughput", "output_tokens_per_s"),
    ("mean_ttft_ms", "mean_ttft_ms"),
    ("median_ttft_ms", "median_ttft_ms"),
    ("p99_ttft_ms", "p99_ttft_ms"),
    ("mean_itl_ms", "mean_itl_ms"),
    ("median_itl_ms", "median_itl_ms"),
    ("p99_itl_ms", "p99_itl_ms"),
    ("mean_e2e_latency_ms", "mean_e2e_latency_ms"),
    ("concurrency", "concurrency"),
    ("max_concurrent_requests", "max_concurrent_requests"),
)
"""(bench_serving's result key, our name) of every figure kept from a run."""


def parse_bench_serving(text: str) -> dict[str, Any]:
    """The figures of the last result line of a bench_serving ``--output-file`` (JSONL; the
    client appends), plus the server's effective pool (``max_total_num_tokens``) when its
    ``server_info`` says. Raises ValueError when there is no result line."""
    record = None
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
    if not isinstance(record, dict) or "completed" not in record:
        raise ValueError("bench_serving wrote no result line")
    out: dict[str, Any] = {}
    for key, name in METRICS:
        value = record.get(key)
        out[name] = round(float(value), 3) if isinstance(value, int | float) and not isinstance(value, bool) else None
    for name in ("completed", "input_tokens", "output_tokens", "max_concurrent_requests"):
        if out[name] is not None:
            out[name] = int(out[name])
    out["max_total_num_tokens"] = find_key(record.get("server_info"), "max_total_num_tokens")
    return out


def pool_stats_summary(text: str) -> dict[str, Any] | None:
    """From the layered pool's per-forward stats lines (``$KVPLANE_POOL_STATS_FILE``): forwards,
    staged and overflow steps, the peak host fraction of live layer-KV, the device budget in
    layer-pages and the layer-pages fetched host -> device. None when there are no lines."""
    lines = []
    for raw in text.splitlines():
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "overflow_steps_total" in rec:
            lines.append(rec)
    if not lines:
        return None
    last = lines[-1]
    return {
        "forwards": len(lines),
        "staged_steps_total": int(last.get("staged_steps_total", 0)),
        "overflow_steps_total": int(last["overflow_steps_total"]),
        "peak_host_fraction": round(max(float(r.get("host_fraction", 0.0)) for r in lines), 3),
        "peak_live_layer_pages": max(int(r.get("live_layer_pages", 0)) for r in lines),
        "peak_batch_size": max(int(r.get("batch_size", 0)) for r in lines),
        "device_pages_total": int(last.get("device_pages_total", 0)),
        "fetched_layer_pages_total": int(last.get("fetched_layer_pages_total", 0)),
        "h2d_gb_total": round(int(last.get("h2d_bytes_total", 0)) / 1e9, 3),
        "recompute_steps": sum(1 for r in lines if r.get("recompute_tokens")),
        "recompute_tokens_total": sum(int(r.get("recompute_tokens", 0)) for r in lines),
    }


_RUNNING = re.compile(r"#running-req: (\d+)")
_NEW_SEQ = re.compile(r"#new-seq: (\d+)")


def peak_running_from_log(text: str) -> int | None:
    """The largest batch in SGLang's own log lines: ``#running-req`` of a decode line, running +
    ``#new-seq`` of a prefill line (decode lines are sampled: every ``--decode-log-interval``
    steps). None when the log has none."""
    peak = None
    for line in text.splitlines():
        running = _RUNNING.search(line)
        if running is None:
            continue
        new_seq = _NEW_SEQ.search(line) if "Prefill batch" in line else None
        n = int(running.group(1)) + (int(new_seq.group(1)) if new_seq else 0)
        peak = n if peak is None else max(peak, n)
    return peak


def step_stats_summary(text: str) -> dict[str, Any]:
    """From the scheduler's per-step stats (``$KVPLANE_STATS_FILE``): steps, pause events,
    requests kvplane's admission held back (last ``held_total``), fallback steps, and the
    median and max step time."""
    steps: list[dict[str, Any]] = []
    for raw in text.splitlines():
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            steps.append(rec)
    times = sorted(float(r["step_ms"]) for r in steps if isinstance(r.get("step_ms"), int | float))
    return {
        "steps": len(steps),
        "pauses": sum(len(r.get("paused_now") or []) for r in steps),
        "admission_held_total": max((int(r.get("held_total") or 0) for r in steps), default=0),
        "fallback_steps": max((int(r.get("fallback_steps") or 0) for r in steps), default=0),
        "median_step_ms": round(times[len(times) // 2], 2) if times else None,
        "max_step_ms": round(times[-1], 2) if times else None,
    }


def _fmt(x: Any, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, int):
        return str(x)
    return f"{x:.{digits}f}"


TABLE_COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("completed", "completed", 0),
    ("request_throughput", "req/s", 3),
    ("output_tokens_per_s", "output tok/s", 1),
    ("mean_ttft_ms", "TTFT mean ms", 0),
    ("median_ttft_ms", "TTFT p50 ms", 0),
    ("p99_ttft_ms", "TTFT p99 ms", 0),
    ("mean_itl_ms", "ITL mean ms", 1),
    ("median_itl_ms", "ITL p50 ms", 1),
    ("p99_itl_ms", "ITL p99 ms", 1),
    ("max_concurrent_requests", "client peak in flight", 0),
    ("max_total_num_tokens", "KV pool tokens", 0),
)


def table(payload: dict[str, Any]) -> list[str]:
    """The per-run Markdown table."""
    head = "| server | round | " + " | ".join(c[1] for c in TABLE_COLUMNS) + " | load 1m |"
    lines = [head, "|" + "---|" * (len(TABLE_COLUMNS) + 3)]
    for r in payload["runs"]:
        m = r["metrics"]
        cells = [_fmt(m.get(key), digits) for key, _, digits in TABLE_COLUMNS]
        lines.append(f"| {r['config']} | {r['round']} | " + " | ".join(cells) + f" | {r['load_avg_1m']:.1f} |")
    return lines


def _pool_lines(label: str, pool: dict[str, Any]) -> list[str]:
    """One paragraph on a layered server's pool and scheduler over its life."""
    recomputed = ""
    if pool.get("recompute_steps"):
        recomputed = (f"; {pool['recompute_steps']} forwards recomputed a prefix "
                      f"({pool.get('recompute_tokens_total', 0)} token-steps)")
    return [
        f"{label} over the server's life (warm-up included): {pool.get('forwards', 0)} forwards, "
        f"{pool.get('staged_steps_total', '-')} staged, **{pool.get('overflow_steps_total', '-')} overflow**; "
        f"device budget {pool.get('device_pages_total', '-')} layer-pages; peak batch "
        f"{pool.get('peak_batch_size', '-')}, peak live layer-pages {pool.get('peak_live_layer_pages', '-')}, "
        f"peak host fraction of live layer-KV {pool.get('peak_host_fraction', '-')}; "
        f"{pool.get('fetched_layer_pages_total', '-')} layer-pages fetched ({pool.get('h2d_gb_total', '-')} GB "
        f"H2D){recomputed}; scheduler steps {pool.get('steps', '-')} (median {pool.get('median_step_ms', '-')} ms, "
        f"max {pool.get('max_step_ms', '-')} ms), {pool.get('pauses', 0)} pauses, "
        f"{pool.get('admission_held_total', 0)} admission holds, {pool.get('fallback_steps', 0)} "
        "control-plane fallback steps.",
        "",
    ]


def markdown(payload: dict[str, Any]) -> str:
    b, w = payload["budget"], payload["workload"]
    lines = [
        f"# kvplane bench value — {payload['device']}",
        "",
        f"Date: {payload['date']}. Host: {payload['cpus']} CPUs, shared with other jobs (noisy). "
        f"Model: {payload['model']}.",
        "",
        f"Same device KV budget B = {b['token_layers']} token-layers ({b['layers']} layers): "
        f"`vanilla` = stock SGLang with `--max-total-tokens {b['vanilla_max_total_tokens']}` (B/L: "
        f"every layer of a token on the device); `layered` = `--enable-layered-kv "
        f"--kv-gpu-budget-tokens {b['token_layers']} --max-total-tokens {b['layered_max_total_tokens']}` "
        f"({b['slot_factor']:g}x the slots, the host holds every layer; B >= slot space + page, so "
        f"every batch can be staged). Layered policy `{json.dumps(payload['layered_policy'])}`, "
        f"`--kv-pacing {payload.get('layered_pacing', 'on')}`.",
        "",
        f"Workload: {w['text']}. Client: SGLang's own `sglang.bench_serving` (figures as it reports them).",
        "",
        *table(payload),
        "",
    ]
    peak = payload.get("server_peak_running_requests") or {}
    if peak:
        lines.append(
            "Largest batch in each server's own log over its life (`#running-req`, decode lines "
            "sampled every 40 steps): " + ", ".join(f"{k} {v}" for k, v in peak.items()) + "."
        )
        lines.append("")
    rec = payload.get("recompute")
    if rec:
        lines.append(
            f"`layered-recompute` = `layered` plus `--kv-recompute-ratio {rec['ratio']:g}`"
            + (f" `--kv-recompute-layers {rec['layers']}`" if rec.get("layers") is not None else "")
            + " (eLLM: each decoding request's first ratio x prompt tokens stay off the device and are "
            "recomputed in every decode step's forward; docs/recompute.md)."
        )
        lines.append("")
    for key, label in (("layered_pool", "Layered pool"), ("layered_recompute_pool", "Layered-recompute pool")):
        pool = payload.get(key)
        if pool:
            lines += _pool_lines(label, pool)
    lines += ["Commands (ports are picked per run; the model directory is a temporary tiny-model build):", ""]
    lines.append(f"- CPU recipe (`sglang_ext/testing/server.py` CPU_ARGS, before the flags): `{' '.join(payload['cpu_args'])}`")
    for name, cmd in payload["launch_commands"].items():
        lines.append(f"- {name} server: `{' '.join(cmd)}`")
    seen = set()
    for r in payload["runs"]:
        if r["config"] not in seen:
            seen.add(r["config"])
            lines.append(f"- {r['config']} client: `{' '.join(r['command'])}`")
    code = payload.get("code")
    if code:
        modified = ", ".join(code.get("modified") or []) or "none"
        lines += ["", f"Code: HEAD {code.get('head')}; files modified in the working tree when measured: {modified}."]
    for note in payload.get("notes", []):
        lines += ["", note]
    return "\n".join(lines) + "\n"
