"""`kvplane bench pacing`: what ``--kv-pacing on|off`` does to what a streaming client sees.

With ``--kv-pacing on`` kvplane releases a stream's tokens at one per TBT-SLO interval while its
token deposit is non-empty (OrbitFlow §3.2, :mod:`sglang_ext.pacing`), and the rest in one burst
when the request finishes. This bench measures it where the client is, with **SGLang's own
client** (``python -m sglang.bench_serving --backend sglang --dataset-name random-ids
--output-details``: per-request TTFT and inter-token latencies) against three servers on the tiny
random-weight model (CPU recipe of ``sglang_ext/testing/server.py`` plus the shared-host flags):

* ``vanilla``: stock SGLang (kvplane installed, ``--enable-layered-kv`` off) -- the reference;
* ``pacing-on`` / ``pacing-off``: ``--enable-layered-kv --kv-pacing on|off``, the same device KV
  budget (``--kv-gpu-budget-tokens``) and the same policy (the default one, TBT SLO
  ``--slo-tbt-ms``, by default the policy's default).

Two loads, each run on every server in turn (rounds rotate the order; the host is shared):

* ``light``: a few concurrent streams whose KV fits the device budget (checked here, and the
  per-step stats of each run show whether anything went to host or was paused);
* ``heavy``: many concurrent streams whose KV is several times the budget, so kvplane offloads
  and pauses requests.

From each run's per-request lists (:class:`~sglang_ext.tools.pacing_figures.PacingFigures`):
ITL p50/p90/p99/max, TTFT, the fraction of gaps within the SLO and of requests with >= 90% of
their gaps within it, the burst fraction and each request's longest gap; the layered servers'
per-step stats (``$KVPLANE_STATS_FILE``, sliced per run) give the pauses, peak host KV share and
step times behind them. Results: ``benchmarks/results/sglang/pacing-<machine>.{json,md}`` with
the machine (CPU, cores, load average at start and end) and every setting.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from sglang_ext.tools.pacing_figures import (
    PacingFigures,
    completed_requests,
    last_record,
    replay_paced,
)
from sglang_ext.tools.pacing_report import markdown, stats_slice_summary
from sglang_ext.tools.value_bench import (
    Workload,
    _rotations,
    _run_client,
    bench_serving_command,
    code_state,
)
from sglang_ext.tools.value_report import parse_bench_serving
from sglang_ext.tools.workload import SHARED_HOST_ARGS

DEFAULT_OUT = Path("benchmarks/results/sglang")
CONFIGS = ("vanilla", "pacing-on", "pacing-off")
REPLAY = "pacing-off, replayed paced"
"""Figures of the ``pacing-off`` runs' streams passed through the pacing rule
(:func:`~sglang_ext.tools.pacing_figures.replay_paced`): pacing's effect on the same generation."""
LOADS = ("light", "heavy")
TINY_LAYERS = 4
"""Decoder layers of the tiny model (``TinyModelSpec().num_hidden_layers``): token-layers per token."""
LIGHT = Workload(num_prompts=6, input_len=16, output_len=48, range_ratio=1.0, max_concurrency=2, seed=1)
"""Default light load: 2 streams at a time, 6 requests, 16 in / 48 out (512 token-layers at
most: half the default budget)."""
HEAVY = Workload(num_prompts=12, input_len=192, output_len=80, range_ratio=1.0, max_concurrency=8, seed=2)
"""Default heavy load: 8 streams at a time, 12 requests, 192 in / 80 out (8,704 token-layers at
most: 8.5x the default budget)."""
DEFAULT_BUDGET_TOKEN_LAYERS = 1024
"""The heavy load was offloaded but not paused at 4,096 token-layers (80-88% of its KV on host),
paused once at 2,048 and about once a request (11-13 pauses) at 1,024."""


def _default_slo_tbt_ms() -> float:
    from controlplane.policy import Policy

    return Policy().slo_tbt_ms


@dataclass(frozen=True)
class PacingBenchConfig:
    """Every setting of one `kvplane bench pacing` run (validated)."""

    slo_tbt_ms: float
    """Policy TBT SLO of the layered servers: the pacing interval and the attainment threshold."""
    budget_token_layers: int
    """``--kv-gpu-budget-tokens`` of both layered servers (token-layers)."""
    light: Workload
    """Light load: its peak KV must fit half the budget (a first run with the light load at
    exactly the budget had half of its live KV on host)."""
    heavy: Workload
    """Heavy load: its peak KV must exceed the budget (kvplane offloads and pauses)."""
    layers: int = TINY_LAYERS
    """Decoder layers of the model."""
    repeat: int = 1
    """Rounds; each runs both loads on every server (order rotated)."""

    def __post_init__(self) -> None:
        if not 0 < self.slo_tbt_ms <= 1e7:
            raise ValueError(f"--slo-tbt-ms={self.slo_tbt_ms:g} is out of range (0, 1e7]")
        if self.budget_token_layers < 1:
            raise ValueError(f"--budget-token-layers={self.budget_token_layers} is out of range [1, inf)")
        if not 1 <= self.repeat <= 20:
            raise ValueError(f"--repeat={self.repeat} is out of range [1, 20]")
        self.light.check()
        self.heavy.check()
        if 2 * self.peak_token_layers(self.light) > self.budget_token_layers:
            raise ValueError(
                f"light load needs up to {self.peak_token_layers(self.light)} token-layers "
                f"(--light-concurrency x (input + output) x {self.layers} layers) > half of "
                f"--budget-token-layers={self.budget_token_layers}: it would not be light "
                "(lower its concurrency or lengths, or raise the budget)"
            )
        if self.peak_token_layers(self.heavy) <= self.budget_token_layers:
            raise ValueError(
                f"heavy load needs at most {self.peak_token_layers(self.heavy)} token-layers <= "
                f"--budget-token-layers={self.budget_token_layers}: nothing would be offloaded "
                "(raise its concurrency or lengths, or lower the budget)"
            )

    def peak_token_layers(self, load: Workload) -> int:
        """The most KV ``load`` can hold at once: concurrency x (input + output) x layers."""
        streams = min(load.max_concurrency, load.num_prompts)
        return streams * (load.input_len + load.output_len) * self.layers

    def workload(self, load: str) -> Workload:
        """The workload of ``load`` (light or heavy)."""
        if load not in LOADS:
            raise ValueError(f"load: {load!r}; allowed {list(LOADS)}")
        return self.light if load == "light" else self.heavy


def server_flags(budget_token_layers: int, policy_file: Path) -> dict[str, tuple[str, ...]]:
    """Each server's flags after the CPU recipe: ``vanilla`` adds only the shared-host flags;
    the layered two differ only in ``--kv-pacing``."""
    base = tuple(SHARED_HOST_ARGS)
    layered = (
        *base, "--enable-layered-kv", "--kv-policy", str(policy_file),
        "--kv-gpu-budget-tokens", str(budget_token_layers),
    )  # fmt: skip
    return {
        "vanilla": base,
        "pacing-on": (*layered, "--kv-pacing", "on"),
        "pacing-off": (*layered, "--kv-pacing", "off"),
    }


def client_command(workload: Workload, port: int, model_dir: Path, output_file: Path) -> list[str]:
    """bench_serving (value bench's command) with per-request details (``--output-details``)."""
    return [*bench_serving_command(workload, port, model_dir, output_file), "--output-details"]


@dataclass(frozen=True)
class PacingRun:
    """One bench_serving run of one load against one server."""

    config: str
    load: str
    round: int
    figures: dict[str, Any] | None
    """:class:`PacingFigures` as a dict; None when the client wrote no result."""
    summary: dict[str, Any]
    """bench_serving's own summary figures (throughput, e2e latency, ...)."""
    server_steps: dict[str, Any] | None
    """The layered server's per-step stats during the run (pauses, peak host KV, step ms)."""
    load_avg_1m: tuple[float, float]
    """1-minute load average at the start and end of the run."""
    command: tuple[str, ...]
    returncode: int
    itls_s: tuple[tuple[float, ...], ...] = ()
    """Per-request ITL lists (s) of the completed requests (pooled over rounds; not written)."""
    ttfts_s: tuple[float, ...] = ()


def _load_avg() -> tuple[float, float, float]:
    one, five, fifteen = os.getloadavg()
    return round(one, 2), round(five, 2), round(fifteen, 2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--slo-tbt-ms",
        type=float,
        default=None,
        help="policy TBT SLO of the layered servers (the pacing interval; default: the policy's "
        "default slo_tbt_ms)",
    )
    parser.add_argument("--budget-token-layers", type=int, default=DEFAULT_BUDGET_TOKEN_LAYERS,
                        help="--kv-gpu-budget-tokens of the layered servers (token-layers)")
    for name, w in (("light", LIGHT), ("heavy", HEAVY)):
        parser.add_argument(f"--{name}-prompts", type=int, default=w.num_prompts)
        parser.add_argument(f"--{name}-concurrency", type=int, default=w.max_concurrency)
        parser.add_argument(f"--{name}-input-len", type=int, default=w.input_len)
        parser.add_argument(f"--{name}-output-len", type=int, default=w.output_len)
    parser.add_argument(
        "--repeat",
        type=int,
        default=PacingBenchConfig.repeat,
        help="rounds, each running both loads on every server, order rotated (one round: about 4 "
        "min on an idle 2-core host, 9 under load 6-8)",
    )
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    parser.add_argument("--client-timeout-s", type=float, default=600.0)
    parser.add_argument("--startup-timeout-s", type=float, default=600.0)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--keep-dir", type=Path, default=None,
                        help="copy server logs, bench_serving outputs and step stats here")
    parser.add_argument("--note", default="", help="a sentence added to the results")


def config_from_args(args: argparse.Namespace) -> PacingBenchConfig:
    """The validated settings (ValueError naming the flag)."""

    def load(name: str, base: Workload) -> Workload:
        return replace(
            base,
            num_prompts=getattr(args, f"{name}_prompts"),
            max_concurrency=getattr(args, f"{name}_concurrency"),
            input_len=getattr(args, f"{name}_input_len"),
            output_len=getattr(args, f"{name}_output_len"),
        )

    slo = _default_slo_tbt_ms() if args.slo_tbt_ms is None else float(args.slo_tbt_ms)
    return PacingBenchConfig(
        slo, args.budget_token_layers, load("light", LIGHT), load("heavy", HEAVY), repeat=args.repeat
    )


def chosen_configs(text: str) -> list[str]:
    """The ``--configs`` list in :data:`CONFIGS` order; ValueError on an unknown or empty one."""
    chosen = {c.strip() for c in text.split(",") if c.strip()}
    unknown = sorted(chosen - set(CONFIGS))
    if unknown or not chosen:
        raise ValueError(f"--configs={text!r}: unknown {unknown}; allowed {list(CONFIGS)}")
    return [c for c in CONFIGS if c in chosen]


def pooled_figures(runs: list[PacingRun], slo_tbt_ms: float) -> dict[str, dict[str, Any]]:
    """Per load and config: the figures over every round's completed requests; and
    :data:`REPLAY`, the ``pacing-off`` streams replayed through the pacing rule."""
    out: dict[str, dict[str, Any]] = {}
    for load in LOADS:
        for config in CONFIGS:
            got = [r for r in runs if r.load == load and r.config == config and r.figures is not None]
            if not got:
                continue
            itls = [list(i) for r in got for i in r.itls_s]
            ttfts = [t for r in got for t in r.ttfts_s]
            out.setdefault(load, {})[config] = asdict(PacingFigures.from_lists(itls, ttfts, slo_tbt_ms))
            if config == "pacing-off":
                replayed = [replay_paced(i, slo_tbt_ms) for i in itls]
                out[load][REPLAY] = asdict(PacingFigures.from_lists(replayed, ttfts, slo_tbt_ms))
    return out


def _one_run(
    name: str, load: str, round_: int, cfg: PacingBenchConfig, server: Any, model_dir: Path,
    work: Path, stats_path: Path | None, timeout_s: float,
) -> PacingRun:  # fmt: skip
    out_file = work / f"{name}-{load}-{round_}.jsonl"
    cmd = client_command(cfg.workload(load), server.port, model_dir, out_file)
    offset = stats_path.stat().st_size if stats_path is not None and stats_path.exists() else 0
    load0 = os.getloadavg()[0]
    print(f"[bench pacing] round {round_} {load} {name}: {' '.join(cmd[1:])}", flush=True)
    rc, text = _run_client(cmd, out_file, work / "bench_serving.log", timeout_s)
    load1 = os.getloadavg()[0]
    steps = None
    if stats_path is not None and stats_path.exists():
        with stats_path.open("rb") as fh:
            fh.seek(offset)
            steps = stats_slice_summary(fh.read().decode(errors="replace"))
    try:
        record = last_record(text)
        summary = parse_bench_serving(text)
        itls, ttfts = completed_requests(record)
        figures: dict[str, Any] | None = asdict(PacingFigures.from_lists(itls, ttfts, cfg.slo_tbt_ms))
    except ValueError as exc:
        tail = (work / "bench_serving.log").read_text(errors="replace").splitlines()[-30:]
        print(f"[bench pacing] {name} {load}: {exc} (rc {rc})\n" + "\n".join(tail), flush=True)
        summary, figures, itls, ttfts = {}, None, [], []
    run = PacingRun(
        name, load, round_, figures, summary, steps, (round(load0, 2), round(load1, 2)),
        ("python", *cmd[1:]), rc, tuple(tuple(i) for i in itls), tuple(ttfts),
    )  # fmt: skip
    print(f"[bench pacing] round {round_} {load} {name}: {figures} steps {steps}", flush=True)
    return run


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
        names = chosen_configs(args.configs)
    except ValueError as exc:
        print(f"kvplane bench pacing: {exc}")
        return 2
    from sglang_ext.settings import STATS_FILE_ENV
    from sglang_ext.testing.server import ServerError, SGLangServer
    from sglang_ext.testing.tiny_model import TinyModelSpec, build_tiny_model
    from sglang_ext.tools.sglang_bench import _cpu_model, _slug

    device = f"CPU: {_cpu_model()}"
    code = code_state()
    load_start, t_start = _load_avg(), time.monotonic()
    runs: list[PacingRun] = []
    launch: dict[str, list[str]] = {}
    startup_s: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="kvplane-bench-pacing-") as tmp:
        work = Path(tmp)
        model_dir = build_tiny_model(work / "model", TinyModelSpec())
        policy = work / "policy.json"
        policy.write_text(json.dumps({"slo_tbt_ms": cfg.slo_tbt_ms}))
        flags = server_flags(cfg.budget_token_layers, policy)
        stats = {n: (work / f"{n}-steps.jsonl" if n != "vanilla" else None) for n in names}
        servers = {
            n: SGLangServer(
                model_dir,
                log_path=work / f"{n}.log",
                extra_args=flags[n],
                env={STATS_FILE_ENV: str(stats[n])} if stats[n] is not None else {},
                startup_timeout_s=args.startup_timeout_s,
            )
            for n in names
        }
        try:
            for n, server in servers.items():
                print(f"[bench pacing] starting {n} (CPU start-up takes minutes) ...", flush=True)
                t0 = time.monotonic()
                try:
                    server.start()
                except ServerError as exc:
                    print(f"[bench pacing] {n} failed to start:\n{exc}", flush=True)
                    return 1
                startup_s[n] = round(time.monotonic() - t0, 1)
                launch[n] = ["python" if i == 0 else a for i, a in enumerate(server.command())]
            for round_, order in enumerate(_rotations(names, cfg.repeat)):
                for load in LOADS:
                    for n in order:
                        runs.append(
                            _one_run(n, load, round_, cfg, servers[n], model_dir, work, stats[n], args.client_timeout_s)
                        )
        finally:
            for server in servers.values():
                server.stop()
        if args.keep_dir is not None:
            args.keep_dir.mkdir(parents=True, exist_ok=True)
            for path in [*work.glob("*.log"), *work.glob("*.jsonl")]:
                shutil.copy2(path, args.keep_dir / path.name)
    payload = _payload(cfg, args, device, code, launch, startup_s, runs, load_start, t_start)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"pacing-{_slug(device.removeprefix('CPU: '))}"
    (args.out_dir / f"{stem}.json").write_text(json.dumps(payload, indent=2) + "\n")
    md = markdown(payload)
    (args.out_dir / f"{stem}.md").write_text(md)
    print(md)
    print(f"[bench pacing] wrote {args.out_dir / stem}.json and .md")
    ok = all(
        r.returncode == 0 and r.figures is not None and r.figures["requests"] == cfg.workload(r.load).num_prompts
        for r in runs
    )
    return 0 if ok and runs else 1


def _payload(
    cfg: PacingBenchConfig, args: argparse.Namespace, device: str, code: dict[str, Any],
    launch: dict[str, list[str]], startup_s: dict[str, float], runs: list[PacingRun],
    load_start: tuple[float, float, float], t_start: float,
) -> dict[str, Any]:  # fmt: skip
    from sglang_ext.testing.server import CPU_ARGS, cpu_env
    from sglang_ext.testing.tiny_model import TinyModelSpec

    def run_dict(r: PacingRun) -> dict[str, Any]:
        d = asdict(r)
        d.pop("itls_s")
        d.pop("ttfts_s")
        return d

    payload: dict[str, Any] = {
        "bench": "pacing",
        "machine": {
            "device": device,
            "cpus": os.cpu_count(),
            "load_avg_start": load_start,
            "load_avg_end": _load_avg(),
            "wall_s": round(time.monotonic() - t_start, 1),
        },
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": f"tiny: {TinyModelSpec()} (random weights, built by sglang_ext.testing.tiny_model)",
        "cpu_args": list(CPU_ARGS),
        "cpu_env": cpu_env(),
        "settings": {
            "slo_tbt_ms": cfg.slo_tbt_ms,
            "layered_policy": {"slo_tbt_ms": cfg.slo_tbt_ms},
            "budget_token_layers": cfg.budget_token_layers,
            "layers": cfg.layers,
            "repeat": cfg.repeat,
            "loads": {
                load: {
                    **asdict(cfg.workload(load)),
                    "text": cfg.workload(load).text(),
                    "peak_token_layers": cfg.peak_token_layers(cfg.workload(load)),
                }
                for load in LOADS
            },
        },
        "code": code,
        "launch_commands": launch,
        "startup_s": startup_s,
        "figures": pooled_figures(runs, cfg.slo_tbt_ms),
        "runs": [run_dict(r) for r in runs],
        "notes": [],
    }
    cpus = os.cpu_count() or 1
    peak = max([load_start[0], payload["machine"]["load_avg_end"][0], *(x for r in runs for x in r.load_avg_1m)])
    if peak > cpus:
        payload["notes"].append(
            f"Shared host: the 1-minute load average reached {peak:.1f} on {cpus} CPUs (other "
            "agents' tests and benchmarks ran at the same time), so absolute milliseconds are "
            "noisy; the servers ran one client at a time, the order rotated per round. Read the "
            "shape (pacing on vs off), not the absolute figures."
        )
    if args.note:
        payload["notes"].append(args.note)
    return payload
