"""`kvplane bench sglang`: SGLang tokens/s with and without ``--enable-layered-kv``.

Servers on a local random-weight model (``--model tiny|small``; CPU recipe of
``sglang_ext/testing/server.py``), started one after the other and kept up (idle ones sleep); a
workload (``--workload``: ``throughput`` = one batched ``/generate`` of 8 prompts, 96 tokens
each, the same decode batch every run; ``mixed`` = the demo's 6 staggered OpenAI requests from
``sglang_ext/tools/workload.py``, streaming and not, completions and chat) runs on one server
at a time in interleaved rounds (a warm-up round, then ``--repeat`` measured rounds, order
rotated), so drifting load on a shared host hits every configuration alike:

* ``vanilla``: the baseline, stock SGLang with its defaults -- the overlap scheduler on -- after
  the CPU recipe (kvplane's entry point is installed and loads -- its CPU rotary switch lets
  SGLang run on a CPU host -- but ``--enable-layered-kv`` is off, so nothing else of kvplane is
  swapped in);
* ``vanilla-no-overlap``: vanilla with ``--disable-overlap-schedule``, the scheduler loop that
  ``--enable-layered-kv`` forces: its loss against ``vanilla`` is the cost of forcing the overlap
  scheduler off, part of what a user pays for kvplane;
* ``layered``: ``--enable-layered-kv`` (which implies ``--disable-overlap-schedule``) with the
  default device budget (everything fits: nothing offloaded). Its loss against ``vanilla`` is
  kvplane's whole cost (target <= 5%); against ``vanilla-no-overlap`` the plugin's own share;
* ``layered-offload``: ``--enable-layered-kv --kv-gpu-budget-tokens N`` (forced offloading and
  pauses);
* ``vanilla-b``: vanilla again, a second launch: its paired "overhead" is launch-to-launch noise
  (A/A), the yardstick for the end-to-end figures.

Every figure states which configuration it is against (:data:`COMPARISONS`); each launch's
scheduler loop (overlap on or off) is read back from its ``/server_info`` (SGLang's resolved
server args), not assumed, and the results say so per configuration.

The layered servers also run the in-process overhead meter (:mod:`sglang_ext.overhead`):
kvplane's own time per scheduler step against the step, which launch effects do not move.

Figures: output tokens / wall seconds of a workload run, and output tokens / CPU seconds the
server's process group used during it (less sensitive to other jobs on a shared host); medians
over the measured rounds. Also recorded:
the host's load average around each run (the machine may be shared), and from the per-step
stats of ``layered-offload`` the peak fraction of live layer-KV on host and its pauses
(``layered`` runs without the per-step stats file, as users run it: see :data:`STATS_CONFIGS`).
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
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sglang_ext.overhead import OVERHEAD_FILE_ENV, share_of
from sglang_ext.tools.bench_workloads import MODELS, WORKLOADS, model_spec, run_once, workload_text
from sglang_ext.tools.workload import SHARED_HOST_ARGS

DEFAULT_OUT = Path("benchmarks/results/sglang")
OVERHEAD_TARGET_PCT = 5.0
LOOSE_SLO_TBT_MS = 60_000.0
"""Default policy TBT SLO of the layered configurations: on a slow (or shared) CPU host the
observed step time exceeds the default 200 ms SLO and the controller pauses requests to meet it,
which is policy, not mechanism overhead."""


@dataclass(frozen=True)
class ConfigResult:
    """One server configuration's throughput."""

    name: str
    """vanilla, vanilla-b, vanilla-no-overlap, layered or layered-offload."""
    flags: tuple[str, ...]
    """Extra launch flags after the CPU recipe."""
    startup_s: float
    """Launch to healthy (median over the launches)."""
    tokens_per_s: tuple[float, ...]
    """Output tokens / wall s of each measured workload run."""
    median_tokens_per_s: float
    """Median of ``tokens_per_s``."""
    tokens_per_cpu_s: tuple[float, ...]
    """Output tokens / CPU seconds used by the server's processes (launcher, tokenizer, scheduler,
    detokenizer) during each measured run -- less sensitive to other jobs than wall time."""
    median_tokens_per_cpu_s: float
    """Median of ``tokens_per_cpu_s``."""
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
    kvplane_share_pct: tuple[float, ...] = ()
    """Per launch (layered configs): kvplane's own time in the scheduler process over the step
    time without it (:mod:`sglang_ext.overhead`), over all of that launch's steps."""
    kvplane_ms_per_step: tuple[float, ...] = ()
    """Per launch (layered configs): kvplane's own ms per scheduler step."""
    overlap_schedule: bool | None = None
    """Whether the servers ran SGLang's overlap scheduler, as each launch reported it
    (``disable_overlap_schedule`` in ``/server_info``); None when a launch did not say or the
    launches disagreed."""


@dataclass
class _Samples:
    """One configuration's measurements, accumulated over launches and rounds."""

    rates: list[float] = field(default_factory=list)
    cpu_rates: list[float] = field(default_factory=list)
    load: list[float] = field(default_factory=list)
    startup_s: list[float] = field(default_factory=list)
    tokens: int = 0
    failed: int = 0
    meter: list[dict[str, Any]] = field(default_factory=list)
    """The overhead meter's summary of each launch (layered configs)."""
    overlap: list[bool | None] = field(default_factory=list)
    """Each launch's overlap scheduler, as the server reported it."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeat", type=int, default=3, help="measured workload runs per server launch")
    parser.add_argument(
        "--instances",
        type=int,
        default=1,
        help="launches of each server (fresh processes; results pooled): averages out what "
        "differs between two launches of the same server",
    )
    parser.add_argument(
        "--offload-budget-tokens",
        type=int,
        default=2048,
        help="--kv-gpu-budget-tokens of layered-offload",
    )
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="throughput",
        help="throughput (8 concurrent requests x 96 tokens; default) or mixed (the demo's)",
    )
    parser.add_argument(
        "--model",
        choices=MODELS,
        default="tiny",
        help="model preset: tiny (the tests' 64-wide, 4-layer model; worst case for the "
        "plugin's fixed per-step cost) or small (512 wide, 8 layers; compute-dominated steps)",
    )
    parser.add_argument(
        "--configs",
        default=",".join(DEFAULT_CONFIGS),
        help="comma list of configurations: vanilla (stock SGLang defaults, overlap scheduler "
        "on: the baseline), vanilla-b (a second vanilla launch: the A/A noise), "
        "vanilla-no-overlap (vanilla with --disable-overlap-schedule, which --enable-layered-kv "
        "forces), layered, layered-offload",
    )
    parser.add_argument("--startup-timeout-s", type=float, default=400.0)
    parser.add_argument(
        "--note",
        default="",
        help="a sentence added to the results (e.g. what else ran on the host)",
    )
    parser.add_argument(
        "--slo-tbt-ms",
        type=float,
        default=LOOSE_SLO_TBT_MS,
        help="policy TBT SLO of the layered servers (--kv-policy); loose by default so that no "
        "SLO-driven pause confounds the overhead figure (memory-driven pauses still happen)",
    )


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


BASELINE = "vanilla"
"""Every overhead figure is against this configuration unless it names another."""
DEFAULT_CONFIGS = ("vanilla", "vanilla-b", "vanilla-no-overlap", "layered", "layered-offload")
COMPARISONS: tuple[tuple[str, str, str, str], ...] = (
    ("layered", "vanilla", "overhead", "kvplane's whole cost: layered (nothing offloaded) vs stock vanilla (overlap scheduler on)"),
    ("vanilla-no-overlap", "vanilla", "no_overlap", "forcing the overlap scheduler off (what --enable-layered-kv implies): vanilla-no-overlap vs vanilla"),
    ("layered", "vanilla-no-overlap", "plugin", "the plugin on the same scheduler loop: layered vs vanilla-no-overlap"),
    ("layered-offload", "vanilla", "offload", "forced offloading and pauses: layered-offload vs stock vanilla"),
    ("vanilla-b", "vanilla", "aa_noise", "A/A launch noise: vanilla-b (a second vanilla launch) vs vanilla"),
)
"""(configuration, against, key, what it measures) of every reported loss: the whole cost of
kvplane (``overhead``, held to the target) is the overlap scheduler forced off (``no_overlap``)
plus the plugin itself (``plugin``)."""


def config_flags(offload_budget_tokens: int, policy_file: Path) -> dict[str, tuple[str, ...]]:
    """Every configuration's launch flags after the CPU recipe. Beyond the recipe and the
    shared-host flags (``SHARED_HOST_ARGS``: KV headroom, sleep when idle) ``vanilla`` changes
    none of SGLang's defaults -- the overlap scheduler stays on; the layered ones launch as users
    do: ``--enable-layered-kv`` implies ``--disable-overlap-schedule`` (the plugin sets it)."""
    base = tuple(SHARED_HOST_ARGS)
    layered = (*base, "--enable-layered-kv", "--kv-policy", str(policy_file))
    return {
        "vanilla": base,
        "vanilla-b": base,  # a second vanilla launch: the A/A noise of a paired launch
        "vanilla-no-overlap": (*base, "--disable-overlap-schedule"),
        "layered": layered,
        "layered-offload": (*layered, "--kv-gpu-budget-tokens", str(offload_budget_tokens)),
    }


def asks_overlap(flags: tuple[str, ...]) -> bool:
    """Whether launch flags leave SGLang's overlap scheduler on (its default)."""
    return "--disable-overlap-schedule" not in flags and "--enable-layered-kv" not in flags


def _configs(args: argparse.Namespace, policy_file: Path) -> dict[str, tuple[str, ...]]:
    all_configs = config_flags(args.offload_budget_tokens, policy_file)
    chosen = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in all_configs]
    if unknown or not chosen:
        raise ValueError(
            f"--configs={args.configs!r}: unknown {unknown}; allowed {sorted(all_configs)}"
        )
    return {c: all_configs[c] for c in chosen}


def group_cpu_s(pgid: int) -> float:
    """User + system CPU seconds of every live process in process group ``pgid`` (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid:  # fields[0] is the state (stat field 3)
            total += int(fields[11]) + int(fields[12])  # utime, stime (stat fields 14, 15)
    return total / tick


def find_key(tree: Any, key: str) -> Any:
    """The first value of ``key`` anywhere in nested dicts and lists (None when absent)."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        tree = list(tree.values())
    if isinstance(tree, list):
        for item in tree:
            found = find_key(item, key)
            if found is not None:
                return found
    return None


def overlap_schedule_of(server_info: dict[str, Any]) -> bool | None:
    """Whether a server runs SGLang's overlap scheduler, from its ``/server_info`` (the resolved
    server args: ``disable_overlap_schedule`` after every flag and plugin has had its say)."""
    disabled = find_key(server_info, "disable_overlap_schedule")
    return None if not isinstance(disabled, bool) else not disabled


def _server_overlap(base_url: str) -> bool | None:
    try:
        with urllib.request.urlopen(f"{base_url}/server_info", timeout=60) as resp:
            return overlap_schedule_of(json.loads(resp.read()))
    except (OSError, ValueError) as exc:
        print(f"[bench sglang] /server_info unreadable ({exc}): overlap scheduler unknown", flush=True)
        return None


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
    """``args.instances`` times: start every configuration's server (one after the other), run
    the workload in interleaved rounds -- a warm-up round, then ``args.repeat`` measured rounds,
    the order rotated each round -- so load drift on a shared host hits every configuration
    alike, and stop them all. Fresh server processes per instance average out what differs
    between two launches of the same server (on a small CPU host that alone moves throughput by
    10-20%)."""
    samples = {name: _Samples() for name in configs}
    for name in configs:
        (workdir / f"{name}-stats.jsonl").unlink(missing_ok=True)
    for instance in range(args.instances):
        _measure_instance(configs, model_dir, workdir, args, instance, samples)
    out = []
    for name, flags in configs.items():
        steps, host, pauses = _stats_summary(workdir / f"{name}-stats.jsonl")
        got = samples[name]
        out.append(
            ConfigResult(
                name,
                flags,
                round(statistics.median(got.startup_s), 1),
                tuple(round(r, 2) for r in got.rates),
                round(statistics.median(got.rates), 2),
                tuple(round(r, 2) for r in got.cpu_rates),
                round(statistics.median(got.cpu_rates), 2),
                got.tokens,
                got.failed,
                (round(min(got.load), 2), round(max(got.load), 2)),
                steps,
                None if host is None else round(host, 3),
                pauses,
                tuple(x for x in (share_of(m) for m in got.meter) if x is not None),
                tuple(float(m["kvplane_ms_per_step"]) for m in got.meter if m.get("kvplane_ms_per_step") is not None),
                got.overlap[0] if len(set(got.overlap)) == 1 else None,
            )
        )
    return out


STATS_CONFIGS = ("layered-offload",)
"""Configurations run with the per-step stats file (``$KVPLANE_STATS_FILE``: peak host KV and
pauses). It is an opt-in debugging sink -- a JSON line per step costs about 0.2 ms on this host,
a few % of a tiny model's step -- so the overhead configuration ``layered`` runs as users run it,
without one (nothing can be offloaded there: no budget means the identity layout)."""


def _bench_env(name: str, workdir: Path, instance: int = 0) -> dict[str, str]:
    env = {"KVPLANE_STATS_FILE": str(workdir / f"{name}-stats.jsonl")} if name in STATS_CONFIGS else {}
    if name.startswith("layered"):
        env[OVERHEAD_FILE_ENV] = str(_meter_path(name, workdir, instance))
    return env


def _meter_path(name: str, workdir: Path, instance: int) -> Path:
    return workdir / f"{name}-overhead-{instance}.json"


def _measure_instance(
    configs: dict[str, tuple[str, ...]],
    model_dir: Path,
    workdir: Path,
    args: argparse.Namespace,
    instance: int,
    samples: dict[str, _Samples],
) -> None:
    """One launch of every configuration: its rounds are appended to ``samples``."""
    from sglang_ext.testing.server import ServerError, SGLangServer

    servers: dict[str, SGLangServer] = {}
    for name, flags in configs.items():
        servers[name] = SGLangServer(
            model_dir,
            log_path=workdir / f"{name}-{instance}.log",
            extra_args=flags,
            env=_bench_env(name, workdir, instance),
            startup_timeout_s=args.startup_timeout_s,
        )
    errors: dict[str, BaseException] = {}

    def start(name: str) -> None:
        # One at a time (a start-up under heavy load can time out inside SGLang's own post-start
        # step and exit), with one retry; idle servers sleep (--sleep-on-idle) meanwhile.
        for attempt in (1, 2):
            t0 = time.monotonic()
            try:
                servers[name].start()
                samples[name].startup_s.append(time.monotonic() - t0)
                errors.pop(name, None)
                return
            except ServerError as exc:
                errors[name] = exc
                servers[name].stop()  # reap what is left; the retry gets a fresh port
                servers[name].port = 0
                print(f"[bench sglang] {name}: start-up attempt {attempt} failed", flush=True)

    try:
        for name in servers:
            start(name)
        if errors:
            raise RuntimeError(f"server(s) failed to start: {errors}")
        for name, server in servers.items():
            samples[name].overlap.append(_server_overlap(server.base_url))
        names = list(servers)
        for round_ in range(args.repeat + 1):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            for name in order:
                load_before = os.getloadavg()[0]
                pgid = servers[name]._proc.pid  # the launcher leads its own process group
                cpu0 = group_cpu_s(pgid)
                t = time.monotonic()
                run_tokens, run_failed = run_once(servers[name], args.workload)
                wall = time.monotonic() - t
                cpu = group_cpu_s(pgid) - cpu0
                if round_ == 0:
                    continue  # warm-up
                got = samples[name]
                got.tokens = run_tokens
                got.failed += run_failed
                got.rates.append(run_tokens / wall)
                got.cpu_rates.append(run_tokens / cpu if cpu > 0 else 0.0)
                got.load.append(load_before)
                print(
                    f"[bench sglang] instance {instance} round {round_} {name}: "
                    f"{run_tokens / wall:.2f} tokens/s, {got.cpu_rates[-1]:.2f} tokens/CPU-s "
                    f"(load {load_before:.1f})",
                    flush=True,
                )
        for name in servers:
            path = _meter_path(name, workdir, instance)
            if name.startswith("layered") and path.exists():
                samples[name].meter.append(json.loads(path.read_text()))
    finally:
        for server in servers.values():
            server.stop()


BASELINE_TEXT = (
    "vanilla: stock SGLang with its defaults after the CPU recipe and the shared-host flags "
    f"({' '.join(SHARED_HOST_ARGS)}) -- the overlap scheduler on; "
    "kvplane's entry point is installed and loads (its CPU rotary switch is what lets SGLang "
    "run on a CPU host) but --enable-layered-kv is off: its stream hook passes through and "
    "nothing else of kvplane is swapped in. --enable-layered-kv implies --disable-overlap-schedule: vanilla-no-overlap "
    "(vanilla with that flag) measures what forcing it costs, part of kvplane's whole cost."
)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1f}%"


def _markdown(payload: dict[str, Any]) -> str:
    lines = [
        f"# kvplane bench sglang — {payload['device']}",
        "",
        f"Date: {payload['date']}. Model: {payload['model']}. Workload: {payload['workload']} "
        f"(warm-up + {payload['repeat']} measured runs per server launch, {payload.get('instances', 1)} "
        "launch(es) per server, median of all runs).",
        f"CPU recipe: `{' '.join(payload['cpu_args'])}`. Host: {payload['cpus']} CPUs, shared "
        "machine (load average recorded per configuration). Layered servers run the policy "
        f"`{json.dumps(payload['layered_policy'])}` (no SLO-driven pauses; memory-driven ones "
        "remain); streamed output is paced (`--kv-pacing on`, the default). Only `layered-offload` "
        "writes the per-step stats file (`$KVPLANE_STATS_FILE`, for peak host KV and pauses); "
        "`layered` runs without it, as deployed.",
        "",
        f"Baseline {payload['baseline']} The overlap scheduler column is what each server "
        "reported (`/server_info`), not what was asked for.",
        "",
        "| config | flags | overlap scheduler | tokens/s (median) | runs | tokens/CPU-s (median) | runs | failed | load avg 1m min/max | peak host KV | pauses |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in payload["results"]:
        host = "-" if r["peak_host_fraction"] is None else f"{r['peak_host_fraction']:.0%}"
        overlap = {True: "on", False: "off", None: "?"}[r.get("overlap_schedule")]
        lines.append(
            f"| {r['name']} | `{' '.join(r['flags'])}` | {overlap} | {r['median_tokens_per_s']:.2f} | "
            f"{', '.join(f'{x:.2f}' for x in r['tokens_per_s'])} | "
            f"{r['median_tokens_per_cpu_s']:.2f} | "
            f"{', '.join(f'{x:.2f}' for x in r['tokens_per_cpu_s'])} | {r['failed_requests']} | "
            f"{r['load_avg_1m'][0]:.1f} / {r['load_avg_1m'][1]:.1f} | {host} | {r['pauses']} |"
        )
    lines += [
        "",
        "Throughput loss (positive = slower than the configuration it is against). Paired: each "
        "server launch's median run against the same launch's median run of the other "
        "configuration (interleaved rounds), median over launches -- it cancels "
        "launch-to-launch differences, which the pooled medians do not. Read every figure "
        "against the A/A noise.",
        "",
    ]
    for c in payload.get("comparisons", []):
        target = (
            f"; target <= {payload['overhead_target_pct']:g}%" if c["key"] == "overhead" else ""
        )
        per_launch = ", ".join(_pct(x) for x in c["paired_per_launch_pct"]) or "-"
        ms = "-" if c["extra_ms_per_token"] is None else f"{c['extra_ms_per_token']:+.3f} ms"
        lines.append(
            f"- {c['what']}: **{_pct(c['paired_pct'])}** paired (per launch "
            f"{per_launch}{target}); pooled medians {_pct(c['wall_pct'])} wall tokens/s, "
            f"{_pct(c['cpu_pct'])} tokens per server CPU-s; {ms} of wall time per output token."
        )
    for r in payload["results"]:
        if r.get("kvplane_share_pct"):
            lines.append(
                f"- {r['name']}: kvplane's own time in the scheduler process (in-process meter, "
                f"launch effects cancel): **{statistics.median(r['kvplane_share_pct']):+.2f}%** of the "
                f"step (median of launches; per launch {', '.join(f'{x:.2f}%' for x in r['kvplane_share_pct'])}), "
                f"{statistics.median(r['kvplane_ms_per_step']):.3f} ms per step."
            )
    for note in payload.get("notes", []):
        lines += ["", note]
    return "\n".join(lines) + "\n"


def extra_ms_per_token(by: dict[str, ConfigResult], base: str = BASELINE) -> dict[str, float]:
    """Wall ms per output token each configuration adds over ``base`` (medians)."""
    if base not in by or by[base].median_tokens_per_s <= 0:
        return {}
    base_ms = 1000.0 / by[base].median_tokens_per_s
    return {
        name: round(1000.0 / r.median_tokens_per_s - base_ms, 3)
        for name, r in by.items()
        if name != base and r.median_tokens_per_s > 0
    }


def paired_overhead(
    by: dict[str, ConfigResult], name: str, repeat: int, base: str = BASELINE
) -> tuple[float | None, list[float]]:
    """Throughput loss of ``name`` vs ``base`` per server launch (median run of each, same
    launch, interleaved rounds), and the median over launches. Two launches of one server
    differ by up to 25% on a small shared host, more than the effect measured; pairing each
    launch's runs cancels that, which the pooled medians do not."""
    if base not in by or name not in by or repeat < 1:
        return None, []
    base_rates, other = by[base].tokens_per_s, by[name].tokens_per_s
    per_launch = []
    for start in range(0, min(len(base_rates), len(other)), repeat):
        b = statistics.median(base_rates[start : start + repeat])
        o = statistics.median(other[start : start + repeat])
        if b > 0:
            per_launch.append(round(100.0 * (1 - o / b), 2))
    return (round(statistics.median(per_launch), 2) if per_launch else None), per_launch


def pooled_overhead(
    by: dict[str, ConfigResult], name: str, base: str, field: str = "median_tokens_per_s"
) -> float | None:
    """Throughput loss of ``name`` vs ``base`` from the pooled medians of ``field``."""
    if base not in by or name not in by or getattr(by[base], field) <= 0:
        return None
    return round(100.0 * (1 - getattr(by[name], field) / getattr(by[base], field)), 2)


def aa_noise_note(measured: list[dict[str, Any]]) -> str | None:
    """How far apart two launches of the same server were (the A/A comparison), as a sentence:
    a paired figure within that spread does not tell the configurations apart."""
    aa = next((c for c in measured if c["key"] == "aa_noise"), None)
    if aa is None or not aa["paired_per_launch_pct"]:
        return None
    spread = max(abs(x) for x in aa["paired_per_launch_pct"])
    return (
        f"A/A noise: two launches of stock vanilla differed by up to {spread:.1f}% per launch "
        f"(paired); a paired figure within +/-{spread:.1f}% does not distinguish the "
        "configurations on this run."
    )


def comparisons(by: dict[str, ConfigResult], repeat: int) -> list[dict[str, Any]]:
    """Every :data:`COMPARISONS` entry whose two configurations were measured."""
    out = []
    for name, base, key, what in COMPARISONS:
        if name not in by or base not in by:
            continue
        paired_pct, per_launch = paired_overhead(by, name, repeat, base)
        out.append(
            {
                "key": key,
                "config": name,
                "against": base,
                "what": what,
                "paired_pct": paired_pct,
                "paired_per_launch_pct": per_launch,
                "wall_pct": pooled_overhead(by, name, base),
                "cpu_pct": pooled_overhead(by, name, base, "median_tokens_per_cpu_s"),
                "extra_ms_per_token": extra_ms_per_token(by, base).get(name),
            }
        )
    return out


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def run(args: argparse.Namespace) -> int:
    policy_dir = tempfile.TemporaryDirectory(prefix="kvplane-bench-policy-")
    policy_file = Path(policy_dir.name) / "policy.json"
    try:
        configs = _configs(args, policy_file)
        if not 0 < args.slo_tbt_ms <= 1e7:
            raise ValueError(f"--slo-tbt-ms={args.slo_tbt_ms} is out of range (0, 1e7]")
        policy_file.write_text(json.dumps({"slo_tbt_ms": args.slo_tbt_ms}))
        if args.repeat < 1:
            raise ValueError(f"--repeat={args.repeat} is out of range [1, inf)")
        if not 1 <= args.instances <= 20:
            raise ValueError(f"--instances={args.instances} is out of range [1, 20]")
        if args.offload_budget_tokens < 1:
            raise ValueError(
                f"--offload-budget-tokens={args.offload_budget_tokens} is out of range [1, inf)"
            )
    except ValueError as exc:
        print(f"kvplane bench sglang: {exc}")
        return 2
    from sglang_ext.testing.server import CPU_ARGS
    from sglang_ext.testing.tiny_model import build_tiny_model
    device = f"CPU: {_cpu_model()}"
    with tempfile.TemporaryDirectory(prefix="kvplane-bench-sglang-") as tmp:
        workdir = Path(tmp)
        model_dir = build_tiny_model(workdir / "model", model_spec(args.model))
        print(
            f"[bench sglang] launching {', '.join(configs)} (one after the other; CPU start-up takes minutes) ...",
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
    payload: dict[str, Any] = {
        "bench": "sglang",
        "device": device,
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": f"{args.model}: {model_spec(args.model)}",
        "baseline": BASELINE_TEXT,
        "cpu_args": list(CPU_ARGS),
        "workload": workload_text(args.workload),
        "repeat": args.repeat,
        "instances": args.instances,
        "layered_policy": {"slo_tbt_ms": args.slo_tbt_ms},
        "results": [asdict(r) for r in results],
        "comparisons": comparisons(by, args.repeat),
        "overhead_target_pct": OVERHEAD_TARGET_PCT,
        "notes": [],
    }
    for name in ("layered", "layered-offload"):
        shares = by[name].kvplane_share_pct if name in by else ()
        key = "inprocess_overhead_pct" if name == "layered" else "inprocess_offload_overhead_pct"
        payload[key] = round(statistics.median(shares), 3) if shares else None
    cpus = os.cpu_count() or 1
    peak_load = max((r.load_avg_1m[1] for r in results), default=0.0)
    if peak_load > cpus:
        payload["notes"].append(
            f"Shared host: the 1-minute load average reached {peak_load:.1f} on {cpus} CPUs during "
            "the measured runs (other jobs running), so run-to-run noise is large; the rounds are "
            "interleaved so the drift hits every configuration alike, but the overhead figure "
            "needs a quiet host to be held to the 5% target."
        )
    aa_note = aa_noise_note(payload["comparisons"])
    if aa_note:
        payload["notes"].append(aa_note)
    if args.note:
        payload["notes"].append(args.note)
    for r in results:
        asked = asks_overlap(r.flags)
        if r.overlap_schedule is not None and r.overlap_schedule != asked:
            payload["notes"].append(
                f"{r.name}: SGLang ran the overlap scheduler {'on' if r.overlap_schedule else 'off'} "
                f"although its flags ask for it {'on' if asked else 'off'} (see its /server_info)."
            )
    for c in payload["comparisons"]:
        print(
            f"[bench sglang] {c['what']}: {_pct(c['paired_pct'])} paired (per launch "
            f"{c['paired_per_launch_pct']}), {_pct(c['wall_pct'])} pooled wall, "
            f"{_pct(c['cpu_pct'])} per CPU-s on {device}"
        )
    for key, label in (
        ("inprocess_overhead_pct", "layered: kvplane's own share of the scheduler step (in-process meter)"),
        ("inprocess_offload_overhead_pct", "layered-offload: kvplane's own share of the scheduler step (in-process meter)"),
    ):
        if payload[key] is not None:
            print(f"[bench sglang] {label}: {payload[key]:+.1f}% on {device}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"sglang-{args.model}-{args.workload}-{_slug(device.removeprefix('CPU: '))}"
    (args.out_dir / f"{stem}.json").write_text(json.dumps(payload, indent=2) + "\n")
    (args.out_dir / f"{stem}.md").write_text(_markdown(payload))
    print(f"[bench sglang] wrote {args.out_dir / stem}.json and .md")
    policy_dir.cleanup()
    return 0 if all(r.failed_requests == 0 for r in results) else 1
