"""`kvplane bench value`: at the same device KV budget, what does ``--enable-layered-kv`` buy?

Two SGLang servers on a local random-weight model (``--model tiny|small``; the CPU recipe of
``sglang_ext/testing/server.py`` plus the shared-host flags), one workload driven by **SGLang's
own client** (``python -m sglang.bench_serving --backend sglang --dataset-name random-ids``):

* ``vanilla``: stock SGLang (its defaults after the recipe) whose KV pool holds the budget:
  ``--max-total-tokens B/L`` tokens, where ``B`` is the device budget in token-layers and ``L``
  the model's layers -- vanilla keeps every layer of every token on the device;
* ``layered``: ``--enable-layered-kv --kv-gpu-budget-tokens B`` with a larger slot space
  (``--max-total-tokens S``, ``S = --slot-factor x B/L``): the device holds ``B`` token-layers,
  the host holds every layer of the slot space. The layered pool stages each batch through the
  device budget; with ``B >= S + page`` (one layer of the slot space and its padding page) every
  batch can be staged, so no forward runs as an "overflow" step -- the bench refuses a
  configuration that breaks that, and reads ``overflow_steps_total`` back from the pool's
  per-forward stats (``$KVPLANE_POOL_STATS_FILE``) to show it held.

Both servers are started (one after the other; idle ones sleep) and kept up; the workload runs
on each in turn, ``--repeat`` rounds with the order rotated, so drifting load on a shared host
hits both alike. Reported per server run, as bench_serving reports them: completed requests,
request throughput, output tokens/s, TTFT and ITL (mean, median, p99), the server's effective
KV pool (``max_total_num_tokens`` from its ``/server_info``), and the exact commands.
Results: JSON + Markdown under ``benchmarks/results/value/`` named after the model and machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sglang_ext.tools.bench_workloads import MODELS, model_spec
from sglang_ext.tools.value_report import (  # noqa: F401 - re-exported
    METRICS,
    markdown,
    parse_bench_serving,
    peak_running_from_log,
    pool_stats_summary,
    step_stats_summary,
    table,
)
from sglang_ext.tools.workload import SHARED_HOST_ARGS

DEFAULT_OUT = Path("benchmarks/results/value")
CONFIGS = ("vanilla", "layered", "layered-recompute")
DEFAULT_CONFIGS = ("vanilla", "layered")
"""Run unless ``--configs`` says otherwise; ``layered-recompute`` = ``layered`` plus
``--kv-recompute-ratio`` (eLLM's uncached prefix recomputed every decode step, docs/recompute.md)."""
BENCH_SERVING_MODULE = "sglang.bench_serving"
LOOSE_SLO_TBT_MS = 60_000.0
"""Policy TBT SLO of the layered server: on a slow (or shared) CPU host the step time exceeds
the default 200 ms SLO and the controller would pause requests to meet it -- policy, not what
the budget buys; memory-driven decisions remain."""



@dataclass(frozen=True)
class Budget:
    """The device KV budget and the two servers' pool sizes."""

    token_layers: int
    """``B``: device KV budget in token-layers (``--kv-gpu-budget-tokens`` of ``layered``)."""
    layers: int
    """``L``: the model's decoder layers."""
    slot_factor: float
    """Layered slot space over vanilla's pool (``S = slot_factor x B/L``)."""
    page_size: int = 1
    """SGLang's KV page size (1 on the CPU recipe)."""

    @property
    def vanilla_tokens(self) -> int:
        """Vanilla's ``--max-total-tokens``: every layer of a token on the device, ``B // L``."""
        return self.token_layers // self.layers

    @property
    def slot_tokens(self) -> int:
        """Layered ``--max-total-tokens`` (the slot space, whole pages)."""
        raw = int(self.slot_factor * self.vanilla_tokens)
        return raw - raw % self.page_size

    def check(self) -> None:
        """Raise ValueError unless both pools are usable and the layered one stages every batch."""
        if self.layers < 1 or self.page_size < 1:
            raise ValueError(f"layers={self.layers}, page={self.page_size}: must be >= 1")
        if self.vanilla_tokens < 2 * self.page_size:
            raise ValueError(
                f"--budget-token-layers={self.token_layers} leaves vanilla {self.vanilla_tokens} "
                f"tokens for {self.layers} layers; raise it"
            )
        if self.slot_factor <= 1:
            raise ValueError(f"--slot-factor={self.slot_factor:g} must be > 1 (layered holds more slots)")
        need = self.slot_tokens + self.page_size
        if self.token_layers < need:
            raise ValueError(
                f"--budget-token-layers={self.token_layers} < one layer of the layered slot space "
                f"({self.slot_tokens} tokens) + a page = {need}: batches could not all be staged "
                f"(overflow steps); use --slot-factor <= {math.floor(100 * (self.token_layers - self.page_size) / self.vanilla_tokens) / 100:.2f}"
            )


@dataclass(frozen=True)
class Workload:
    """bench_serving's random-ids workload."""

    num_prompts: int = 24
    input_len: int = 384
    output_len: int = 64
    range_ratio: float = 0.5
    """Lengths drawn uniformly from ``[range_ratio x len, len]``."""
    request_rate: float = float("inf")
    max_concurrency: int = 16
    seed: int = 1
    warmup_requests: int = 1

    def check(self) -> None:
        if self.num_prompts < 1 or self.input_len < 1 or self.output_len < 1:
            raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
        if not 0 <= self.range_ratio <= 1:
            raise ValueError(f"--range-ratio={self.range_ratio:g} is out of range [0, 1]")
        if self.request_rate <= 0:
            raise ValueError(f"--request-rate={self.request_rate:g} must be > 0 (inf: all at once)")
        if self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency={self.max_concurrency} must be >= 1")
        if self.warmup_requests < 0:
            raise ValueError(f"--warmup-requests={self.warmup_requests} must be >= 0")

    def text(self) -> str:
        lo = lambda n: max(1, int(self.range_ratio * n))  # noqa: E731
        rate = "all at once" if self.request_rate == float("inf") else f"Poisson {self.request_rate:g} req/s"
        return (
            f"bench_serving random-ids: {self.num_prompts} prompts, input {lo(self.input_len)}-"
            f"{self.input_len} tokens, output {lo(self.output_len)}-{self.output_len} tokens "
            f"(ignore_eos), {rate}, at most {self.max_concurrency} in flight, seed {self.seed}, "
            f"{self.warmup_requests} warm-up request(s)"
        )


def server_flags(
    budget: Budget, policy_file: Path | None = None, pacing: str = "off", recompute_ratio: float = 0.5,
    recompute_layers: int | None = None,
) -> dict[str, tuple[str, ...]]:
    """Each configuration's launch flags after the CPU recipe (its own ``--max-total-tokens``
    comes last, so it overrides the recipe's). Beyond the recipe and the shared-host flags,
    ``vanilla`` changes nothing but the pool size; ``layered`` launches as a user would, with
    ``--kv-pacing`` as given (off by default: paced streams release one token per TBT-SLO
    interval, so the client's ITL would measure the pacing policy, not the mechanism)."""
    base = tuple(SHARED_HOST_ARGS)
    layered = (*base, "--enable-layered-kv", "--kv-pacing", pacing)
    if policy_file is not None:
        layered += ("--kv-policy", str(policy_file))
    layered += ("--kv-gpu-budget-tokens", str(budget.token_layers), "--max-total-tokens", str(budget.slot_tokens))
    recompute = (*layered, "--kv-recompute-ratio", f"{recompute_ratio:g}")
    if recompute_layers is not None:
        recompute += ("--kv-recompute-layers", str(recompute_layers))
    return {
        "vanilla": (*base, "--max-total-tokens", str(budget.vanilla_tokens)),
        "layered": layered,
        "layered-recompute": recompute,
    }


def bench_serving_command(
    workload: Workload, port: int, model_dir: Path, output_file: Path, python: str = sys.executable
) -> list[str]:
    """SGLang's own client against ``127.0.0.1:port`` (offline: local tokenizer, random ids)."""
    rate = "inf" if workload.request_rate == float("inf") else f"{workload.request_rate:g}"
    return [
        python, "-m", BENCH_SERVING_MODULE,
        "--backend", "sglang",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--model", str(model_dir),
        "--tokenizer", str(model_dir),
        "--dataset-name", "random-ids",
        "--tokenize-prompt",
        "--num-prompts", str(workload.num_prompts),
        "--random-input-len", str(workload.input_len),
        "--random-output-len", str(workload.output_len),
        "--random-range-ratio", f"{workload.range_ratio:g}",
        "--request-rate", rate,
        "--max-concurrency", str(workload.max_concurrency),
        "--seed", str(workload.seed),
        "--warmup-requests", str(workload.warmup_requests),
        "--disable-tqdm",
        "--output-file", str(output_file),
    ]  # fmt: skip


@dataclass(frozen=True)
class RunResult:
    """One bench_serving run against one server."""

    config: str
    round: int
    metrics: dict[str, Any]
    load_avg_1m: float
    """1-minute load average when the run started (the host is shared)."""
    command: tuple[str, ...]
    """The bench_serving command line."""
    returncode: int


def _stem(name: str) -> str:
    """File-name prefix of a configuration's stats files (``layered`` keeps the old names)."""
    return "" if name == "layered" else f"{name}-"


def _rotations(names: list[str], rounds: int) -> list[list[str]]:
    return [names[r % len(names) :] + names[: r % len(names)] for r in range(rounds)]


def _run_client(cmd: list[str], output_file: Path, log_path: Path, timeout_s: float) -> tuple[int, str]:
    output_file.unlink(missing_ok=True)
    with log_path.open("ab") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, output_file.read_text() if output_file.exists() else ""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=MODELS, default="tiny", help="model preset (tiny: 4 layers; small: 8)")
    parser.add_argument(
        "--budget-token-layers",
        type=int,
        default=4096,
        help="B: device KV budget in token-layers; vanilla gets --max-total-tokens B/L",
    )
    parser.add_argument(
        "--slot-factor",
        type=float,
        default=3.0,
        help="layered --max-total-tokens = factor x B/L (needs B >= slot space + one page: at "
        "most L - L/B x page; tiny has L=4)",
    )
    parser.add_argument("--num-prompts", type=int, default=Workload.num_prompts)
    parser.add_argument("--input-len", type=int, default=Workload.input_len)
    parser.add_argument("--output-len", type=int, default=Workload.output_len)
    parser.add_argument("--range-ratio", type=float, default=Workload.range_ratio)
    parser.add_argument(
        "--request-rate", type=float, default=Workload.request_rate, help="requests/s (inf: all at once)"
    )
    parser.add_argument("--max-concurrency", type=int, default=Workload.max_concurrency)
    parser.add_argument("--seed", type=int, default=Workload.seed)
    parser.add_argument("--warmup-requests", type=int, default=Workload.warmup_requests)
    parser.add_argument("--repeat", type=int, default=1, help="rounds (each runs the workload on both servers)")
    parser.add_argument(
        "--slo-tbt-ms",
        type=float,
        default=LOOSE_SLO_TBT_MS,
        help="policy TBT SLO of the layered server (--kv-policy); loose by default so that no "
        "SLO-driven pause confounds what the budget buys",
    )
    parser.add_argument(
        "--kv-pacing",
        choices=("on", "off"),
        default="off",
        help="--kv-pacing of the layered server (off by default: bench_serving streams, and paced "
        "streams release one token per TBT-SLO interval -- the ITL would measure the policy)",
    )
    parser.add_argument(
        "--no-pool-stats",
        action="store_true",
        help="run layered without the per-forward stats files (no overflow count then)",
    )
    parser.add_argument("--client-timeout-s", type=float, default=1800.0)
    parser.add_argument("--startup-timeout-s", type=float, default=600.0)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--keep-dir",
        type=Path,
        default=None,
        help="copy the server logs, bench_serving outputs and per-step stats files here",
    )
    parser.add_argument(
        "--configs", default=",".join(DEFAULT_CONFIGS),
        help=f"comma list of servers to run: {', '.join(CONFIGS)} (default {','.join(DEFAULT_CONFIGS)})",
    )
    parser.add_argument("--recompute-ratio", type=float, default=0.5,
                        help="--kv-recompute-ratio of layered-recompute, in (0, 1)")
    parser.add_argument("--recompute-layers", type=int, default=None,
                        help="--kv-recompute-layers of layered-recompute (default: all layers)")
    parser.add_argument("--note", default="", help="a sentence added to the results")


def _from_args(args: argparse.Namespace) -> tuple[Budget, Workload]:
    budget = Budget(args.budget_token_layers, model_spec(args.model).num_hidden_layers, args.slot_factor)
    workload = Workload(
        args.num_prompts,
        args.input_len,
        args.output_len,
        args.range_ratio,
        args.request_rate,
        args.max_concurrency,
        args.seed,
        args.warmup_requests,
    )
    budget.check()
    workload.check()
    if args.repeat < 1:
        raise ValueError(f"--repeat={args.repeat} is out of range [1, inf)")
    if not 0 < args.slo_tbt_ms <= 1e7:
        raise ValueError(f"--slo-tbt-ms={args.slo_tbt_ms:g} is out of range (0, 1e7]")
    chosen_configs(args.configs)
    if not 0 < args.recompute_ratio < 1:
        raise ValueError(f"--recompute-ratio={args.recompute_ratio:g} is out of range (0, 1)")
    if args.recompute_layers is not None and args.recompute_layers < 0:
        raise ValueError(f"--recompute-layers={args.recompute_layers} is out of range [0, L]")
    return budget, workload


def chosen_configs(text: str) -> list[str]:
    """The ``--configs`` list, in :data:`CONFIGS` order; ValueError on an unknown or empty one."""
    chosen = {c.strip() for c in text.split(",") if c.strip()}
    unknown = sorted(chosen - set(CONFIGS))
    if unknown or not chosen:
        raise ValueError(f"--configs={text!r}: unknown {unknown}; allowed {list(CONFIGS)}")
    return [c for c in CONFIGS if c in chosen]


def run(args: argparse.Namespace) -> int:
    try:
        budget, workload = _from_args(args)
    except ValueError as exc:
        print(f"kvplane bench value: {exc}")
        return 2
    from sglang_ext.settings import POOL_STATS_FILE_ENV, STATS_FILE_ENV
    from sglang_ext.testing.server import CPU_ARGS, ServerError, SGLangServer, cpu_env
    from sglang_ext.testing.tiny_model import build_tiny_model
    from sglang_ext.tools.sglang_bench import _cpu_model, _slug

    device = f"CPU: {_cpu_model()}"
    code = code_state()  # before the launches: the servers import the plugin from this checkout
    runs: list[RunResult] = []
    launch: dict[str, list[str]] = {}
    pool: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvplane-bench-value-") as tmp:
        work = Path(tmp)
        model_dir = build_tiny_model(work / "model", model_spec(args.model))
        policy = work / "policy.json"
        policy.write_text(json.dumps({"slo_tbt_ms": args.slo_tbt_ms}))
        flags = server_flags(budget, policy, args.kv_pacing, args.recompute_ratio, args.recompute_layers)
        envs: dict[str, dict[str, str]] = {name: {} for name in CONFIGS}
        if not args.no_pool_stats:
            for name in CONFIGS[1:]:
                envs[name] = {
                    POOL_STATS_FILE_ENV: str(work / f"{_stem(name)}pool-stats.jsonl"),
                    STATS_FILE_ENV: str(work / f"{_stem(name)}step-stats.jsonl"),
                }
        servers = {
            name: SGLangServer(
                model_dir,
                log_path=work / f"{name}.log",
                extra_args=flags[name],
                env=envs[name],
                startup_timeout_s=args.startup_timeout_s,
            )
            for name in chosen_configs(args.configs)
        }
        try:
            for name, server in servers.items():
                print(f"[bench value] starting {name} (CPU start-up takes minutes) ...", flush=True)
                t0 = time.monotonic()
                try:
                    server.start()
                except ServerError as exc:
                    print(f"[bench value] {name} failed to start:\n{exc}", flush=True)
                    return 1
                launch[name] = [
                    "python" if i == 0 else a for i, a in enumerate(server.command())
                ]
                print(f"[bench value] {name} healthy after {time.monotonic() - t0:.0f} s", flush=True)
            for round_, order in enumerate(_rotations(list(servers), args.repeat)):
                for name in order:
                    out_file = work / f"{name}-{round_}.jsonl"
                    cmd = bench_serving_command(workload, servers[name].port, model_dir, out_file)
                    load = os.getloadavg()[0]
                    print(f"[bench value] round {round_} {name}: {' '.join(cmd[1:])}", flush=True)
                    rc, text = _run_client(cmd, out_file, work / "bench_serving.log", args.client_timeout_s)
                    try:
                        metrics = parse_bench_serving(text)
                    except ValueError as exc:
                        tail = (work / "bench_serving.log").read_text(errors="replace").splitlines()[-30:]
                        print(f"[bench value] {name}: {exc} (rc {rc})\n" + "\n".join(tail), flush=True)
                        metrics = {}
                    runs.append(RunResult(name, round_, metrics, round(load, 2), ("python", *cmd[1:]), rc))
                    print(f"[bench value] round {round_} {name}: {metrics}", flush=True)
        finally:
            for server in servers.values():
                server.stop()
        peak_running = {
            name: peak_running_from_log(server.log_path.read_text(errors="replace"))
            for name, server in servers.items()
            if server.log_path.exists()
        }
        if not args.no_pool_stats:
            for name in CONFIGS[1:]:
                stats_path, steps_path = work / f"{_stem(name)}pool-stats.jsonl", work / f"{_stem(name)}step-stats.jsonl"
                if not stats_path.exists():
                    continue
                summary = pool_stats_summary(stats_path.read_text())
                pool[name] = {
                    **(summary or {}),
                    **step_stats_summary(steps_path.read_text() if steps_path.exists() else ""),
                }
        if args.keep_dir is not None:
            args.keep_dir.mkdir(parents=True, exist_ok=True)
            for path in [*work.glob("*.log"), *work.glob("*.jsonl")]:
                shutil.copy2(path, args.keep_dir / path.name)
        model_text = f"{args.model}: {model_spec(args.model)}"
        model_dir_text = str(model_dir)
    payload: dict[str, Any] = {
        "bench": "value",
        "device": device,
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": model_text,
        "model_dir": model_dir_text + " (temporary: built by sglang_ext.testing.tiny_model)",
        "cpu_args": list(CPU_ARGS),
        "cpu_env": cpu_env(),
        "budget": {
            **asdict(budget),
            "vanilla_max_total_tokens": budget.vanilla_tokens,
            "layered_max_total_tokens": budget.slot_tokens,
        },
        "workload": {**asdict(workload), "text": workload.text()},
        "layered_policy": {"slo_tbt_ms": args.slo_tbt_ms},
        "layered_pacing": args.kv_pacing,
        "code": code,
        "launch_commands": launch,
        "runs": [asdict(r) for r in runs],
        "server_peak_running_requests": peak_running,
        "layered_pool": pool.get("layered"),
        "layered_recompute_pool": pool.get("layered-recompute"),
        "recompute": {"ratio": args.recompute_ratio, "layers": args.recompute_layers}
        if "layered-recompute" in launch else None,
        "notes": [],
    }
    peak_load = max((r.load_avg_1m for r in runs), default=0.0)
    cpus = os.cpu_count() or 1
    if peak_load > cpus:
        payload["notes"].append(
            f"Shared host: the 1-minute load average was up to {peak_load:.1f} on {cpus} CPUs at "
            "the start of a run (other engineers' tests running), so every figure is noisy; the "
            "servers ran one workload at a time, rounds rotated."
        )
    if args.note:
        payload["notes"].append(args.note)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"value-{args.model}-{_slug(device.removeprefix('CPU: '))}"
    (args.out_dir / f"{stem}.json").write_text(json.dumps(payload, indent=2) + "\n")
    md = markdown(payload)
    (args.out_dir / f"{stem}.md").write_text(md)
    print(md)
    print(f"[bench value] wrote {args.out_dir / stem}.json and .md")
    ok = all(r.returncode == 0 and r.metrics.get("completed") == workload.num_prompts for r in runs)
    return 0 if ok and runs else 1


def code_state() -> dict[str, Any]:
    """The checkout the servers ran: HEAD and the files modified in the working tree (the plugin
    is imported from it, so uncommitted edits are part of what was measured)."""

    def git(*argv: str) -> str:
        try:
            return subprocess.run(
                ["git", *argv], capture_output=True, text=True, timeout=30, check=False
            ).stdout.rstrip("\n")  # not strip(): porcelain lines start with a status column
        except OSError:
            return ""

    dirty = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines()]
    return {"head": git("rev-parse", "--short", "HEAD").strip() or None, "modified": dirty}
