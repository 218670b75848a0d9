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
  (A/A), the yardstick for the end-to-end figures;
* ``layered-overlap`` (not in the default set): ``layered`` with ``--kv-overlap-schedule on``,
  SGLang's overlap loop kept (``docs/overlap-schedule.md``).

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
from sglang_ext.tools.sglang_bench_configs import DEFAULT_CONFIGS, asks_overlap, config_flags
from sglang_ext.tools.sglang_bench_report import (  # noqa: F401 - re-exported
    BASELINE,
    COMPARISONS,
    OVERHEAD_TARGET_PCT,
    ConfigResult,
    _markdown,
    _pct,
    aa_noise_note,
    comparisons,
    extra_ms_per_token,
    find_key,
    overlap_schedule_of,
    paired_overhead,
    pooled_overhead,
)
from sglang_ext.tools.workload import SHARED_HOST_ARGS

DEFAULT_OUT = Path("benchmarks/results/sglang")
LOOSE_SLO_TBT_MS = 60_000.0
"""Default policy TBT SLO of the layered configurations: on a slow (or shared) CPU host the
observed step time exceeds the default 200 ms SLO and the controller pauses requests to meet it,
which is policy, not mechanism overhead."""


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
        "forces), layered, layered-offload; layered-overlap (opt-in: layered with "
        "--kv-overlap-schedule on)",
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


def _configs(args: argparse.Namespace, policy_file: Path) -> dict[str, tuple[str, ...]]:
    all_configs = config_flags(args.offload_budget_tokens, policy_file)
    chosen = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in all_configs]
    if unknown or not chosen:
        raise ValueError(
            f"--configs={args.configs!r}: unknown {unknown}; allowed {sorted(all_configs)}"
        )
    return {c: all_configs[c] for c in chosen}


def group_processes(pgid: int) -> dict[int, tuple[str, int, int]]:
    """Every live process in process group ``pgid`` (Linux /proc): pid -> (state, parent pid,
    user + system CPU clock ticks)."""
    members = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid:  # fields[0] is the state (stat field 3), fields[1] the ppid
            members[int(entry.name)] = (fields[0], int(fields[1]), int(fields[11]) + int(fields[12]))  # utime, stime
    return members


def group_cpu_s(pgid: int) -> float:
    """User + system CPU seconds of every live process in process group ``pgid``."""
    return sum(ticks for _, _, ticks in group_processes(pgid).values()) / os.sysconf("SC_CLK_TCK")


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
                tuple(_parts_ms(m) for m in got.meter if m.get("steps")),
                tuple(dict(m.get("counts") or {}) for m in got.meter if m.get("steps")),
                got.overlap[0] if len(set(got.overlap)) == 1 else None,
            )
        )
    return out


def _parts_ms(meter: dict) -> dict[str, float]:
    """A written meter summary's parts in ms per step."""
    steps = int(meter["steps"])
    return {k: round(1e3 * float(v) / steps, 4) for k, v in (meter.get("parts_s") or {}).items()}


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
    from sglang_ext.testing.server import CPU_ARGS, cpu_env
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
        "cpu_env": cpu_env(),
        "workload": workload_text(args.workload),
        "repeat": args.repeat,
        "instances": args.instances,
        "layered_policy": {"slo_tbt_ms": args.slo_tbt_ms},
        "results": [{**asdict(r), "share_beyond_kv_copy_pct": r.share_beyond_kv_copy_pct} for r in results],
        "comparisons": comparisons(by, args.repeat),
        "overhead_target_pct": OVERHEAD_TARGET_PCT,
        "notes": [],
    }
    for name, key in (("layered", "inprocess_overhead"), ("layered-offload", "inprocess_offload_overhead"),
                      ("layered-overlap", "inprocess_overlap_overhead")):
        shares = by[name].kvplane_share_pct if name in by else ()
        payload[f"{key}_pct"] = round(statistics.median(shares), 3) if shares else None
        beyond = by[name].share_beyond_kv_copy_pct if name in by else ()
        payload[f"{key}_beyond_kv_copy_pct"] = round(statistics.median(beyond), 3) if beyond else None
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
        ("inprocess_overlap_overhead_pct", "layered-overlap: kvplane's own share of the scheduler step (in-process meter)"),
    ):
        if payload[key] is not None:
            beyond = payload[key.replace("_pct", "_beyond_kv_copy_pct")]
            print(f"[bench sglang] {label}: {payload[key]:+.1f}% ({beyond:+.1f}% without the KV copies "
                  f"vanilla SGLang makes too) on {device}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"sglang-{args.model}-{args.workload}-{_slug(device.removeprefix('CPU: '))}"
    (args.out_dir / f"{stem}.json").write_text(json.dumps(payload, indent=2) + "\n")
    (args.out_dir / f"{stem}.md").write_text(_markdown(payload))
    print(f"[bench sglang] wrote {args.out_dir / stem}.json and .md")
    policy_dir.cleanup()
    return 0 if all(r.failed_requests == 0 for r in results) else 1
