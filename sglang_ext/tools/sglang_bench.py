"""`kvplane bench sglang`: SGLang tokens/s with and without ``--enable-layered-kv``.

Three servers on the tiny local model (CPU recipe of ``sglang_ext/testing/server.py``), started
together and kept up; the demo's mixed workload (``sglang_ext/tools/workload.py``: streaming and
non-streaming, completions and chat) runs on one server at a time in interleaved rounds (a
warm-up round, then ``--repeat`` measured rounds, order rotated), so drifting load on a shared
host hits every configuration alike:

* ``vanilla``: kvplane installed, flag off (``--disable-overlap-schedule`` too, so the baseline
  runs the same scheduler loop the flag requires);
* ``layered``: ``--enable-layered-kv`` with the default device budget (everything fits: nothing
  offloaded) -- the plugin's overhead; target <= 5%;
* ``layered-offload``: ``--enable-layered-kv --kv-gpu-budget-tokens N`` (forced offloading and
  pauses).

Figure: output tokens / wall seconds of a workload run (median over repeats). Also recorded:
the host's load average around each run (the machine may be shared), and from the per-step
stats of the layered servers the peak fraction of live layer-KV on host (0 for ``layered``).
Results: JSON + Markdown under ``benchmarks/results/sglang/`` named after the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path("benchmarks/results/sglang")
OVERHEAD_TARGET_PCT = 5.0


@dataclass(frozen=True)
class ConfigResult:
    """One server configuration's throughput."""

    name: str
    """vanilla, layered or layered-offload."""
    flags: tuple[str, ...]
    """Extra launch flags after the CPU recipe."""
    startup_s: float
    """Launch to healthy."""
    tokens_per_s: tuple[float, ...]
    """Output tokens / wall s of each measured workload run."""
    median_tokens_per_s: float
    """Median of ``tokens_per_s``."""
    output_tokens: int
    """Output tokens of one workload run."""
    failed_requests: int
    """Requests that did not complete, over all runs."""
    load_avg_1m: tuple[float, float]
    """Lowest and highest 1-minute load average seen at the start of a measured run."""
    steps: int
    """Scheduler steps in the per-step stats (layered configs; 0 otherwise)."""
    peak_host_fraction: float | None
    """Peak fraction of live layer-KV on host (layered configs)."""
    pauses: int
    """Pause events (layered configs)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeat", type=int, default=3, help="measured workload runs per server")
    parser.add_argument(
        "--offload-budget-tokens",
        type=int,
        default=2048,
        help="--kv-gpu-budget-tokens of layered-offload",
    )
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--configs", default="vanilla,layered,layered-offload", help="comma list of configurations"
    )
    parser.add_argument("--startup-timeout-s", type=float, default=400.0)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _configs(args: argparse.Namespace) -> dict[str, tuple[str, ...]]:
    from sglang_ext.tools.workload import SHARED_HOST_ARGS

    base = (*SHARED_HOST_ARGS, "--disable-overlap-schedule")
    all_configs = {
        "vanilla": base,
        "layered": (*base, "--enable-layered-kv"),
        "layered-offload": (
            *base,
            "--enable-layered-kv",
            "--kv-gpu-budget-tokens",
            str(args.offload_budget_tokens),
        ),
    }
    chosen = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in all_configs]
    if unknown or not chosen:
        raise ValueError(
            f"--configs={args.configs!r}: unknown {unknown}; allowed {sorted(all_configs)}"
        )
    return {c: all_configs[c] for c in chosen}


def _stats_summary(path: Path) -> tuple[int, float | None, int]:
    if not path.exists():
        return 0, None, 0
    steps, host, pauses = 0, [], 0
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        steps += 1
        if isinstance(rec.get("host_fraction"), int | float):
            host.append(float(rec["host_fraction"]))
        pauses += len(rec.get("paused_now") or [])
    return steps, (max(host) if host else None), pauses


def measure_all(
    configs: dict[str, tuple[str, ...]], model_dir: Path, workdir: Path, args: argparse.Namespace
) -> list[ConfigResult]:
    """Start every configuration's server (in parallel), then run the workload in interleaved
    rounds -- a warm-up round, then ``args.repeat`` measured rounds, the order rotated each round
    -- so load drift on a shared host hits every configuration alike; stop them all."""
    from sglang_ext.testing.server import SGLangServer
    from sglang_ext.tools.workload import mixed_workload, run_workload

    servers: dict[str, SGLangServer] = {}
    for name, flags in configs.items():
        stats = workdir / f"{name}-stats.jsonl"
        stats.unlink(missing_ok=True)
        servers[name] = SGLangServer(
            model_dir,
            log_path=workdir / f"{name}.log",
            extra_args=flags,
            env={"KVPLANE_STATS_FILE": str(stats)},
            startup_timeout_s=args.startup_timeout_s,
        )
    startup_s: dict[str, float] = {}
    errors: dict[str, BaseException] = {}

    def start(name: str) -> None:
        t0 = time.monotonic()
        try:
            servers[name].start()
        except BaseException as exc:  # reported below, after every start finished
            errors[name] = exc
        startup_s[name] = time.monotonic() - t0

    threads = [threading.Thread(target=start, args=(n,)) for n in servers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    rates: dict[str, list[float]] = {n: [] for n in servers}
    failed = dict.fromkeys(servers, 0)
    tokens = dict.fromkeys(servers, 0)
    load: dict[str, list[float]] = {n: [] for n in servers}
    try:
        if errors:
            raise RuntimeError(f"server(s) failed to start: {errors}")
        names = list(servers)
        for round_ in range(args.repeat + 1):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            for name in order:
                load_before = os.getloadavg()[0]
                t = time.monotonic()
                results = run_workload(servers[name].base_url, mixed_workload(), timeout_s=300.0)
                wall = time.monotonic() - t
                if round_ == 0:
                    continue  # warm-up
                tokens[name] = sum(r.completion_tokens for r in results)
                failed[name] += sum(not r.ok for r in results)
                rates[name].append(tokens[name] / wall)
                load[name].append(load_before)
                print(
                    f"[bench sglang] round {round_} {name}: {tokens[name] / wall:.2f} tokens/s "
                    f"(load {load_before:.1f})",
                    flush=True,
                )
    finally:
        for server in servers.values():
            server.stop()
    out = []
    for name, flags in configs.items():
        steps, host, pauses = _stats_summary(workdir / f"{name}-stats.jsonl")
        out.append(
            ConfigResult(
                name,
                flags,
                round(startup_s[name], 1),
                tuple(round(r, 2) for r in rates[name]),
                round(statistics.median(rates[name]), 2),
                tokens[name],
                failed[name],
                (round(min(load[name]), 2), round(max(load[name]), 2)),
                steps,
                None if host is None else round(host, 3),
                pauses,
            )
        )
    return out


def _markdown(payload: dict[str, Any]) -> str:
    lines = [
        f"# kvplane bench sglang — {payload['device']}",
        "",
        f"Date: {payload['date']}. Model: {payload['model']}. Workload: {payload['workload']} "
        f"(warm-up + {payload['repeat']} measured runs per server, median).",
        f"CPU recipe: `{' '.join(payload['cpu_args'])}`. Host: {payload['cpus']} CPUs, shared "
        "machine (load average recorded per configuration).",
        "",
        "| config | flags | tokens/s (median) | runs | failed | load avg 1m min/max | peak host KV | pauses |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in payload["results"]:
        host = "-" if r["peak_host_fraction"] is None else f"{r['peak_host_fraction']:.0%}"
        lines.append(
            f"| {r['name']} | `{' '.join(r['flags'])}` | {r['median_tokens_per_s']:.2f} | "
            f"{', '.join(f'{x:.2f}' for x in r['tokens_per_s'])} | {r['failed_requests']} | "
            f"{r['load_avg_1m'][0]:.1f} / {r['load_avg_1m'][1]:.1f} | {host} | {r['pauses']} |"
        )
    lines.append("")
    for key, text in (
        ("overhead_pct", "layered (nothing offloaded) vs vanilla"),
        ("offload_overhead_pct", "layered-offload vs vanilla"),
    ):
        if payload.get(key) is not None:
            lines.append(
                f"- Overhead {text}: **{payload[key]:+.1f}%** (throughput loss; target <= {OVERHEAD_TARGET_PCT:g}% for nothing offloaded)."
            )
    if payload.get("note"):
        lines += ["", payload["note"]]
    return "\n".join(lines) + "\n"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def run(args: argparse.Namespace) -> int:
    try:
        configs = _configs(args)
        if args.repeat < 1:
            raise ValueError(f"--repeat={args.repeat} is out of range [1, inf)")
        if args.offload_budget_tokens < 1:
            raise ValueError(
                f"--offload-budget-tokens={args.offload_budget_tokens} is out of range [1, inf)"
            )
    except ValueError as exc:
        print(f"kvplane bench sglang: {exc}")
        return 2
    from sglang_ext.testing.server import CPU_ARGS
    from sglang_ext.testing.tiny_model import TinyModelSpec, build_tiny_model
    from sglang_ext.tools.workload import mixed_workload

    device = f"CPU: {_cpu_model()}"
    with tempfile.TemporaryDirectory(prefix="kvplane-bench-sglang-") as tmp:
        workdir = Path(tmp)
        model_dir = build_tiny_model(workdir / "model", TinyModelSpec())
        print(
            f"[bench sglang] launching {', '.join(configs)} (in parallel; CPU start-up takes minutes) ...",
            flush=True,
        )
        results = measure_all(configs, model_dir, workdir, args)
        for res in results:
            print(
                f"[bench sglang] {res.name}: median {res.median_tokens_per_s:.2f} tokens/s (runs {res.tokens_per_s}, "
                f"load {res.load_avg_1m}, peak host KV {res.peak_host_fraction}, pauses {res.pauses})",
                flush=True,
            )
    by = {r.name: r for r in results}

    def overhead(name: str) -> float | None:
        if "vanilla" not in by or name not in by or by["vanilla"].median_tokens_per_s <= 0:
            return None
        return round(
            100.0 * (1 - by[name].median_tokens_per_s / by["vanilla"].median_tokens_per_s), 2
        )

    workload = mixed_workload()
    payload: dict[str, Any] = {
        "bench": "sglang",
        "device": device,
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": str(TinyModelSpec()),
        "cpu_args": list(CPU_ARGS),
        "workload": f"{len(workload)} requests, {sum(s.max_tokens for s in workload)} output tokens "
        f"({sum(s.stream for s in workload)} streaming)",
        "repeat": args.repeat,
        "results": [asdict(r) for r in results],
        "overhead_pct": overhead("layered"),
        "offload_overhead_pct": overhead("layered-offload"),
        "overhead_target_pct": OVERHEAD_TARGET_PCT,
    }
    for key, label in (
        ("overhead_pct", "layered vs vanilla"),
        ("offload_overhead_pct", "layered-offload vs vanilla"),
    ):
        if payload[key] is not None:
            print(f"[bench sglang] overhead {label}: {payload[key]:+.1f}% on {device}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"sglang-{_slug(device.removeprefix('CPU: '))}"
    (args.out_dir / f"{stem}.json").write_text(json.dumps(payload, indent=2) + "\n")
    (args.out_dir / f"{stem}.md").write_text(_markdown(payload))
    print(f"[bench sglang] wrote {args.out_dir / stem}.json and .md")
    return 0 if all(r.failed_requests == 0 for r in results) else 1
