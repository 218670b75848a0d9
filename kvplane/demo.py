"""`kvplane demo` -- the main job: real SGLang + kvplane on a tiny local model, end to end.

1. Build the tiny random-weight Llama model and its locally trained tokenizer (nothing is
   downloaded; ``sglang_ext/testing/tiny_model.py``).
2. Launch ``python -m sglang.launch_server`` on CPU with ``--enable-layered-kv``, the embedded
   control plane and a device KV budget (``--kv-gpu-budget-tokens``) small enough that most
   layer-KV lives in host memory and the planner pauses requests.
3. Send a short mixed workload through the OpenAI-compatible API (streaming and non-streaming,
   completions and chat, short and long prompts; ``sglang_ext/tools/workload.py``).
4. Print what happened: placements over time (per step, layers on device per request, compact:
   only steps where something changed), pauses and resumes, device pages used, TTFT and TBT per
   request and their attainment against the SLOs; then tear everything down.

The per-step record comes from the scheduler hooks (``$KVPLANE_STATS_FILE``, one JSON line per
step). Where a piece is not active (no stats, layered pool not swapped in, no budget flag) the
demo says so and prints what it has.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SUMMARY_HEADER = "=== kvplane demo summary ==="
"""Printed before the final summary (tests look for it)."""
DEFAULT_BUDGET_TOKENS = 640
"""Device KV budget in token-layers: well below the workload's peak (~4 layers x 1k tokens) and
below one layer of every running request at the peak, so the planner must offload most layer-KV
and pause a request (memory), resuming it when room returns."""
TBT_JITTER = 1.1
"""A streamed gap counts as on time when <= TBT_JITTER x SLO (timer and HTTP jitter)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workdir", type=Path, default=None, help="keep model, logs, stats here")
    parser.add_argument(
        "--budget-tokens",
        type=int,
        default=DEFAULT_BUDGET_TOKENS,
        help="device KV budget in token-layers (--kv-gpu-budget-tokens)",
    )
    parser.add_argument(
        "--policy", type=Path, default=None, help="kvplane policy file (--kv-policy)"
    )
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    parser.add_argument("--request-timeout-s", type=float, default=120.0)
    parser.add_argument("--max-step-lines", type=int, default=40, help="placement lines to print")
    parser.add_argument("--json", type=Path, default=None, help="also write the summary as JSON")


def _check_args(args: argparse.Namespace) -> None:
    if args.budget_tokens < 1:
        raise ValueError(f"--budget-tokens={args.budget_tokens} is out of range [1, inf)")
    for name in ("startup_timeout_s", "request_timeout_s"):
        value = getattr(args, name)
        if not value > 0:
            raise ValueError(f"--{name.replace('_', '-')}={value} is out of range (0, inf)")
    if args.max_step_lines < 1:
        raise ValueError(f"--max-step-lines={args.max_step_lines} is out of range [1, inf)")
    if args.policy is not None and not args.policy.is_file():
        raise ValueError(f"--policy={str(args.policy)!r}: no such file")
    from kvplane.output_path import output_path_error

    for flag, path, directory in (("--json", args.json, False), ("--workdir", args.workdir, True)):
        problem = None if path is None else output_path_error(path, flag, directory=directory)
        if problem:
            raise ValueError(problem)


def _policy(path: Path | None) -> Any:
    from controlplane.policy import Policy
    from controlplane.policy_store import load_policy_file

    return load_policy_file(path) if path is not None else Policy()


def _launch_flags(args: argparse.Namespace, notes: list[str]) -> list[str]:
    from sglang_ext.args import LayeredKVArgs
    from sglang_ext.tools.workload import SHARED_HOST_ARGS

    flags = [
        *SHARED_HOST_ARGS,
        "--enable-layered-kv",
        "--disable-overlap-schedule",
        "--kv-pacing",
        "on",
    ]
    known = {f.name for f in dataclasses.fields(LayeredKVArgs)}
    if "kv_gpu_budget_tokens" in known:
        flags += ["--kv-gpu-budget-tokens", str(args.budget_tokens)]
    else:
        notes.append("--kv-gpu-budget-tokens is not available yet: offloading is not forced")
    if args.policy is not None:
        flags += ["--kv-policy", str(args.policy)]
    return flags


def read_stats(path: Path) -> list[dict]:
    """The per-step records the scheduler hooks wrote (skips a torn last line)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _step_line(rec: dict, names: dict[str, str]) -> tuple[str, str]:
    """(signature, rendered line) of one step; signature excludes timings and counters."""
    layers = rec.get("layers") or "?"
    gpu = rec.get("gpu_layers") or {}
    parts = [f"{names.get(r, r)}:{gpu.get(r, '?')}/{layers}" for r in rec.get("running", [])]
    parts += [f"{names.get(r, r)}:P" for r in rec.get("paused", [])]
    events = []
    if rec.get("paused_now"):
        events.append("pause " + ",".join(names.get(r, r) for r in rec["paused_now"]))
    if rec.get("resumed_now"):
        events.append("resume " + ",".join(names.get(r, r) for r in rec["resumed_now"]))
    if rec.get("fallback"):
        events.append("fallback")
    signature = " ".join(parts) + "|" + ";".join(events)
    used, total, host = (
        rec.get("device_pages_used"),
        rec.get("device_pages_total"),
        rec.get("host_fraction"),
    )
    dev = f"dev {used}/{total}" if used is not None else "dev ?"
    hostp = f"host {100 * host:3.0f}%" if isinstance(host, int | float) else "host ?"
    step_ms = rec.get("step_ms")
    timing = f"{step_ms:7.1f}ms" if isinstance(step_ms, int | float) else "      ?  "
    short = (rec.get("delta") or {}).get("shortfall_layer_pages")
    line = (
        f"  step {rec.get('step', '?'):>4} {str(rec.get('mode', '?'))[:6]:<6} {timing}  "
        f"{' '.join(parts) or '(idle)':<48} {dev:<14} {hostp}"
        + (f"  [{'; '.join(events)}]" if events else "")
        + (f"  (short {short} layer-pages: planned layers not on device yet)" if short else "")
    )
    return signature, line


def placement_lines(records: Sequence[dict], max_lines: int) -> list[str]:
    """One line per step whose placement or events changed (the rest are counted, not shown)."""
    names: dict[str, str] = {}
    shown: list[str] = []
    last_parts = None
    skipped = 0
    for rec in records:
        if any(
            str(r).startswith("HEALTH_CHECK")
            for r in rec.get("running", []) + rec.get("finished", [])
        ):
            continue
        sig, line = _step_line(rec, names)
        parts, events = sig.split("|", 1)
        if parts == last_parts and not events:
            skipped += 1
            continue
        last_parts = parts
        shown.append(line)
    if len(shown) > max_lines:
        keep = max_lines // 2
        shown = shown[:keep] + [f"  ... {len(shown) - 2 * keep} more changes ..."] + shown[-keep:]
    if skipped:
        shown.append(f"  ({skipped} steps with an unchanged placement not shown)")
    return shown


def request_rows(results: Sequence[Any], slo_tbt_ms: float, slo_ttft_ms: float) -> list[dict]:
    """Per-request TTFT/TBT and attainment against the SLOs."""
    rows = []
    for res in results:
        spec = res.spec
        slo = spec.slo_tbt_ms or slo_tbt_ms
        gaps = res.gaps_ms
        row: dict[str, Any] = {
            "name": spec.name,
            "kind": ("stream" if spec.stream else "full") + ("/chat" if spec.chat else ""),
            "ok": res.ok,
            "error": res.error,
            "prompt_tokens": res.prompt_tokens,
            "completion_tokens": res.completion_tokens,
            "e2e_ms": round(res.e2e_ms, 1),
            "slo_tbt_ms": slo,
            "ttft_ms": None if res.ttft_ms is None else round(res.ttft_ms, 1),
            "tbt_p50_ms": round(statistics.median(gaps), 1) if gaps else None,
            "tbt_max_ms": round(max(gaps), 1) if gaps else None,
            "ttft_met": None,
            "tbt_attainment": None,
        }
        if spec.stream and res.ok:
            row["ttft_met"] = res.ttft_ms is not None and res.ttft_ms <= slo_ttft_ms
            if gaps:
                row["tbt_attainment"] = round(
                    sum(g <= slo * TBT_JITTER for g in gaps) / len(gaps), 3
                )
        elif res.ok:
            bound = slo_ttft_ms + max(0, res.completion_tokens - 1) * slo
            row["e2e_bound_ms"] = bound
            row["ttft_met"] = res.e2e_ms <= bound
        rows.append(row)
    return rows


def _fmt(value: Any, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def _paced(flags: Sequence[str]) -> bool:
    """Whether the launch turned streaming pacing on (``--kv-pacing on``)."""
    return any(a == "--kv-pacing" and b == "on" for a, b in zip(flags, flags[1:], strict=False))


def print_summary(summary: dict) -> None:
    print(SUMMARY_HEADER)
    print(f"model: {summary['model']}  device: {summary['device']}")
    flags = summary["launch_flags"]
    print(f"launch: {' '.join(flags)}")
    if "--kv-control-plane" not in flags:
        print("control plane: embedded in the scheduler (the default; --kv-control-plane grpc://HOST:PORT for kvplane serve)")
    print(
        f"SLOs: TBT {summary['slo_tbt_ms']:g} ms (policy default; per-request overrides below), "
        f"TTFT {summary['slo_ttft_ms']:g} ms"
    )
    for note in summary["notes"]:
        print(f"note: {note}")
    print("\nplacements over time (request:layers planned on device/total, P = paused; dev, host: "
          "measured in the pool):")
    for line in summary["placement_lines"] or ["  (no per-step stats)"]:
        print(line)
    print("\npauses / resumes:")
    for ev in summary["events"] or []:
        print(f"  step {ev['step']:>4}: {ev['what']} {', '.join(ev['requests'])}")
    if not summary["events"]:
        print("  (none)")
    pool = summary["pool"]
    print(
        f"\ndevice pages: peak {_fmt(pool['peak_device_pages_used'])}/{_fmt(pool['device_pages_total'])}, "
        f"peak host fraction of live layer-KV {_fmt(pool['peak_host_fraction'], '.0%')}, "
        f"steps {pool['steps']}, control-plane fallback steps {pool['fallback_steps']}"
    )
    print("\nrequests (TTFT/TBT as the client saw them; TBT on time when <= 1.1 x SLO):")
    print(
        f"  {'name':<8} {'kind':<12} {'in':>4} {'out':>4} {'TTFT ms':>8} {'TBT p50':>8} "
        f"{'TBT max':>8} {'TBT SLO':>7} {'TTFT ok':>7} {'TBT att':>7} {'e2e ms':>8}"
    )
    for r in summary["requests"]:
        ttft_ok = "-" if r["ttft_met"] is None else ("yes" if r["ttft_met"] else "NO")
        att = "-" if r["tbt_attainment"] is None else f"{r['tbt_attainment']:.0%}"
        print(
            f"  {r['name']:<8} {r['kind']:<12} {r['prompt_tokens']:>4} {r['completion_tokens']:>4} "
            f"{_fmt(r['ttft_ms'], '8.0f'):>8} {_fmt(r['tbt_p50_ms'], '8.0f'):>8} "
            f"{_fmt(r['tbt_max_ms'], '8.0f'):>8} {r['slo_tbt_ms']:>7g} {ttft_ok:>7} {att:>7} "
            f"{r['e2e_ms']:>8.0f}" + (f"  ERROR {r['error']}" if not r["ok"] else "")
        )
    print("  (non-streaming rows: 'TTFT ok' checks e2e <= TTFT SLO + (out-1) x TBT SLO)")
    if _paced(flags):
        print("  (streams are paced, --kv-pacing on: while tokens are held back at most one goes out per SLO\n"
              "   interval, and the rest arrive in one burst at the end -- its ~0 ms gaps make TBT p50 ~0)")
    print(f"\nall requests completed: {summary['all_ok']}; wall time {summary['wall_s']:.0f} s")


def summarize_stats(records: Sequence[dict], notes: list[str]) -> tuple[dict, list[dict]]:
    """Pool figures and pause/resume events from the per-step records."""
    pool = {
        "steps": len(records),
        "device_pages_total": None,
        "peak_device_pages_used": None,
        "peak_host_fraction": None,
        "fallback_steps": 0,
    }
    events: list[dict] = []
    if not records:
        notes.append(
            "no per-step stats: the kvplane scheduler hooks are not active in this build "
            "(placements and pauses cannot be shown)"
        )
        return pool, events
    if not any(r.get("layered_pool") for r in records):
        notes.append("layered KV pool not active: layers on device per request are not reported")
    used = [r["device_pages_used"] for r in records if isinstance(r.get("device_pages_used"), int)]
    host = [r["host_fraction"] for r in records if isinstance(r.get("host_fraction"), int | float)]
    totals = [
        r["device_pages_total"] for r in records if isinstance(r.get("device_pages_total"), int)
    ]
    pool["peak_device_pages_used"] = max(used) if used else None
    pool["peak_host_fraction"] = max(host) if host else None
    pool["device_pages_total"] = totals[-1] if totals else None
    pool["fallback_steps"] = sum(bool(r.get("fallback")) for r in records)
    for rec in records:
        for key, what in (("paused_now", "pause"), ("resumed_now", "resume")):
            if rec.get(key):
                events.append({"step": rec.get("step"), "what": what, "requests": list(rec[key])})
    return pool, events


def run(args: argparse.Namespace) -> int:
    try:
        _check_args(args)
        policy = _policy(args.policy)
    except Exception as exc:  # bad flag or policy file: say which
        print(f"kvplane demo: {exc}", file=sys.stderr)
        return 2
    from sglang_ext.testing.server import ServerError, SGLangServer
    from sglang_ext.testing.tiny_model import TinyModelSpec, build_tiny_model
    from sglang_ext.tools.workload import mixed_workload, run_workload

    started = time.monotonic()
    own_dir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="kvplane-demo-")) if own_dir else args.workdir
    notes: list[str] = []
    try:
        print(f"[demo] building the tiny model in {workdir} ...", flush=True)
        model_dir = build_tiny_model(workdir / "model", TinyModelSpec())
        stats_path = workdir / "stats.jsonl"
        stats_path.unlink(missing_ok=True)
        flags = _launch_flags(args, notes)
        server = SGLangServer(
            model_dir,
            log_path=workdir / "server.log",
            extra_args=flags,
            env={"KVPLANE_STATS_FILE": str(stats_path)},
            startup_timeout_s=args.startup_timeout_s,
        )
        print(
            f"[demo] launching SGLang: {' '.join(flags)} (CPU; this takes a while) ...", flush=True
        )
        try:
            server.start()
        except ServerError as exc:
            print(f"kvplane demo: SGLang did not start: {exc}", file=sys.stderr)
            return 1
        try:
            print(f"[demo] serving on {server.base_url}; sending the workload ...", flush=True)
            results = run_workload(
                server.base_url, mixed_workload(), timeout_s=args.request_timeout_s
            )
        finally:
            print("[demo] stopping SGLang ...", flush=True)
            server.stop()
        records = read_stats(stats_path)
        pool, events = summarize_stats(records, notes)
        rows = request_rows(results, policy.slo_tbt_ms, policy.slo_ttft_ms)
        summary = {
            "model": _model_line(TinyModelSpec()),
            "device": _cpu_name(),
            "launch_flags": flags,
            "slo_tbt_ms": policy.slo_tbt_ms,
            "slo_ttft_ms": policy.slo_ttft_ms,
            "notes": notes,
            "placement_lines": placement_lines(records, args.max_step_lines),
            "events": events,
            "pool": pool,
            "requests": rows,
            "all_ok": all(r["ok"] for r in rows),
            "wall_s": time.monotonic() - started,
        }
        print_summary(summary)
        if args.json is not None:
            args.json.write_text(json.dumps(summary, indent=2, sort_keys=True))
            print(f"summary written to {args.json}")
        if own_dir:
            print(f"(model, server log and per-step stats were in {workdir}, deleted now: "
                  "--workdir DIR keeps them, --json FILE writes this summary)")
        else:
            print(f"model, server log (server.log) and per-step stats (stats.jsonl) are in {workdir}")
        return 0 if summary["all_ok"] else 1
    finally:
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)


def _model_line(spec: Any) -> str:
    return (
        f"tiny Llama (random weights, local tokenizer): {spec.num_hidden_layers} layers, hidden "
        f"{spec.hidden_size}, {spec.num_attention_heads} heads ({spec.num_key_value_heads} KV), "
        f"vocab {spec.vocab_size}"
    )


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return "CPU: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return "CPU: " + (platform.processor() or "unknown")
