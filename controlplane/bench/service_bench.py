"""`kvplane bench service`: control-plane decisions/s and p50/p99 decision latency.

Starts `kvplane serve` as a subprocess on loopback (its own process, so the load generator does
not share its interpreter lock), then for each worker count runs a closed-loop load (every report
changes the batch, the worker waits for the decision before its next step): decisions/s is the
service's throughput, latency is report-sent to decision-received on the worker. Output states
the machine; results go to ``benchmarks/results/service/service_<machine>.{json,md}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import grpc

from controlplane.bench.service_load import LoadResult, LoadSpec, run_load
from controlplane.service.client import parse_target
from controlplane.service.ports import free_port

DEFAULT_OUT = Path("benchmarks/results/service")


def machine() -> str:
    """CPU model, core count and OS of this machine, for result labels."""
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {cores} cores ({platform.system()} {platform.machine()}; CPU only, no GPU used)"


def _slug(text: str) -> str:
    text = re.sub(r"\((r|tm)\)", "", text.lower())
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-")[:60]


class ServeSubprocess:
    """`kvplane serve` on a free loopback port, started and health-checked."""

    def __init__(self, log_path: Path) -> None:
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        self._log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServeSubprocess:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with open(self._log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvplane.cli", "serve", "--listen", self.target,
                 "--log-level", "warning", "--max-sessions", "64"],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 60
        with grpc.insecure_channel(self.target) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"kvplane serve exited: {self._log_path.read_text()}")
                try:
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    return self
                except grpc.RpcError:
                    if time.monotonic() > deadline:
                        raise RuntimeError("kvplane serve did not become healthy in 60 s") from None
                    time.sleep(0.1)

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", default="1,8,32", help="comma-separated worker counts")
    parser.add_argument("--duration-s", type=float, default=10.0, help="load time per worker count")
    parser.add_argument("--rates", default="0,100", help="comma-separated report rates per worker in Hz; 0 = closed loop")
    parser.add_argument("--change-every-steps", type=int, default=20, help="open loop: a request finishes and one arrives every N steps (closed loop: every step)")
    parser.add_argument("--target", default=None, help="use a running service at HOST:PORT instead of starting one")
    parser.add_argument("--connect-timeout-s", type=float, default=30.0,
                        help="how long each worker session may take to connect before the run fails")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results directory")
    parser.add_argument("--no-save", action="store_true", help="print only")


def _markdown(where: str, results: list[LoadResult], spec_note: str) -> str:
    lines = [
        "# kvplane bench service",
        "",
        f"Machine: {where}",
        "",
        spec_note,
        "",
        "| workers | mode | decisions/s | p50 latency ms | p99 latency ms | max ms | solve p50 ms | reports | dropped | errors |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.workers} | {r.mode} | {r.decisions_per_s:.0f} | {r.latency_p50_ms:.2f} | "
            f"{r.latency_p99_ms:.2f} | {r.latency_max_ms:.2f} | {r.solve_p50_ms:.2f} | "
            f"{r.reports_sent} | {r.reports_dropped} | {r.worker_errors} |"
        )
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    try:
        counts = [int(x) for x in str(args.workers).split(",") if x.strip()]
        rates = [float(x) for x in str(args.rates).split(",") if x.strip()]
        specs = [
            LoadSpec(
                workers=n,
                duration_s=args.duration_s,
                rate_hz=rate,
                change_every_steps=1 if rate == 0 else args.change_every_steps,
            )
            for rate in rates
            for n in counts
        ]
        if args.target:
            parse_target(args.target)
        if not 0 < args.connect_timeout_s <= 3600:
            raise ValueError(f"--connect-timeout-s {args.connect_timeout_s:g} is out of range (0, 3600]")
    except ValueError as exc:
        print(f"kvplane bench service: {exc}", file=sys.stderr)
        return 2
    from controlplane.cli.serve_cmd import configure_logging

    configure_logging("warning")  # the table is the output; client events only when they matter
    where = machine()
    load_before = os.getloadavg()[0]
    print(f"kvplane bench service on {where} (1-min load average {load_before:.1f})", flush=True)
    results: list[LoadResult] = []
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"kvplane-bench-serve-{os.getpid()}.log"

    def one(target: str, spec: LoadSpec) -> None:
        r = run_load(target, spec, connect_timeout_s=args.connect_timeout_s)
        results.append(r)
        print(
            f"workers={r.workers:3d} {r.mode}: {r.decisions_per_s:8.0f} decisions/s  "
            f"p50={r.latency_p50_ms:.2f} ms  p99={r.latency_p99_ms:.2f} ms  "
            f"solve p50={r.solve_p50_ms:.2f} ms  (reports={r.reports_sent}, errors={r.worker_errors})",
            flush=True,
        )

    if args.target:
        try:
            for spec in specs:
                one(args.target, spec)
        except RuntimeError as exc:  # the service is not there (or went away mid-run)
            print(f"kvplane bench service: --target {args.target}: {exc}", file=sys.stderr)
            return 1
    else:
        for spec in specs:  # a fresh server per worker count: runs do not inherit state
            with ServeSubprocess(log_path) as server:
                one(server.target, spec)
    spec_note = (
        f"Load: {specs[0].requests_per_worker} requests x {specs[0].layers} layers per worker, "
        f"GPU budget {specs[0].budget_fraction:.0%} of full residency (offloading needed), "
        f"{args.duration_s:g} s per row. closed-loop: every report changes the batch (a request "
        "finishes, one arrives) and the worker waits for the decision before its next step, so "
        "decisions/s is the service's throughput. open-loop@R: each worker reports at R Hz like a "
        f"real one, the batch changing every {args.change_every_steps} steps. Latency is report "
        "sent -> decision received, on the worker. Server: `kvplane serve` subprocess on "
        "loopback, load generator in one separate process (same machine, shared cores)."
    )
    if not args.no_save:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = args.out / f"service_{_slug(where.split(' (')[0])}"
        payload = {
            "bench": "service",
            "machine": where,
            "python": platform.python_version(),
            "grpc": grpc.__version__,
            "note": spec_note,
            "load_avg_1m_before": load_before,
            "load_avg_1m_after": os.getloadavg()[0],
            "results": [dataclasses.asdict(r) for r in results],
        }
        stem.with_suffix(".json").write_text(json.dumps(payload, indent=2) + "\n")
        note = spec_note + (
            f" The machine is shared: 1-min load average {load_before:.1f} before the run, "
            f"{os.getloadavg()[0]:.1f} after."
        )
        stem.with_suffix(".md").write_text(_markdown(where, results, note))
        print(f"wrote {stem}.json and {stem}.md")
    return 0 if all(r.worker_errors == 0 for r in results) else 1
