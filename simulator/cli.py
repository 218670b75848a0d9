"""``kvplane sim``: run, sweep, reproduce, trace.

* ``kvplane sim run --policy P --trace T --profile F [--json OUT]``: one run; table on stdout.
  ``--trace`` is a JSONL file or a workload name (generated with ``--rate``, ``--n``, ...).
* ``kvplane sim sweep --policies a,b --rates 0.5,1 --slo-scales 1,1.5``: the grid, with a
  progress bar, JSON results.
* ``kvplane sim reproduce NAME|all [--smoke] [--out DIR] [--jobs N]``.
* ``kvplane sim trace --workload W --n N --rate R --out FILE``: write a JSONL trace.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from simulator.engine import SOLVER_TIME_MODES
from simulator.trace import ARRIVALS, WORKLOADS, TraceSpec

DEFAULT_PROFILE = "llama3-8b-a5000-pcie3"


def _trace_args(p: argparse.ArgumentParser) -> None:
    d = TraceSpec()
    p.add_argument("--profile", default=DEFAULT_PROFILE, help="preset name or profile JSON")
    p.add_argument("--n", type=int, default=d.n_requests, help="requests to generate")
    p.add_argument("--rate", type=float, default=d.rate_per_min, help="arrivals per minute")
    p.add_argument("--arrival", choices=ARRIVALS, default=d.arrival)
    p.add_argument("--cv", type=float, default=d.cv, help="inter-arrival CV (gamma/lognormal)")
    p.add_argument("--slo-scale", type=float, default=d.slo_scale)
    p.add_argument("--slo-tbt-ms", type=float, default=None, help="fixed TBT SLO")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="fixed TTFT SLO")
    p.add_argument("--seed", type=int, default=d.seed)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="sim_command", required=True)
    run = sub.add_parser("run", help="simulate one policy on one trace")
    run.add_argument("--policy", required=True)
    run.add_argument("--trace", default="orbitflow-32k",
                     help=f"JSONL trace file or workload name {WORKLOADS}")
    _trace_args(run)
    run.add_argument("--solver-time", choices=SOLVER_TIME_MODES, default="model",
                     help="planner time charge: model (deterministic), measured, zero")
    run.add_argument("--planner", choices=("deterministic", "full"), default="deterministic")
    run.add_argument("--json", type=Path, default=None, help="write the metrics JSON here")

    sweep = sub.add_parser("sweep", help="rates x SLO scales x policies")
    sweep.add_argument("--policies", required=True, help="comma-separated policy names")
    sweep.add_argument("--rates", default="0.5,1,1.5,2", help="comma-separated req/min")
    sweep.add_argument("--slo-scales", default="1,1.5,2.5")
    sweep.add_argument("--workload", choices=WORKLOADS, default="orbitflow-32k")
    _trace_args(sweep)
    sweep.add_argument("--solver-time", choices=SOLVER_TIME_MODES, default="model")
    sweep.add_argument("--jobs", type=int, default=1)
    sweep.add_argument("--json", type=Path, default=None)

    rep = sub.add_parser("reproduce", help="reproduce a paper figure (or all)")
    rep.add_argument("name", help="experiment name or 'all'")
    rep.add_argument("--smoke", action="store_true", help="tiny version (< 60 s for all)")
    rep.add_argument("--out", type=Path, default=Path("benchmarks/results/sim"))
    rep.add_argument("--jobs", type=int, default=2, help="parallel processes")

    tr = sub.add_parser("trace", help="generate a JSONL trace")
    tr.add_argument("--workload", choices=WORKLOADS, default="orbitflow-32k")
    _trace_args(tr)
    tr.add_argument("--out", type=Path, required=True)


def _spec(args: argparse.Namespace, workload: str, rate: float, scale: float) -> TraceSpec:
    return TraceSpec(workload, args.n, rate, args.arrival, args.cv, scale, args.seed,
                     args.slo_tbt_ms, args.slo_ttft_ms)


def _bar(done: int, total: int, row: dict) -> None:
    width = 30
    filled = int(width * done / max(1, total))
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
                     f"{row.get('policy', '')[:20]:20s}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _print_metrics(m: dict) -> None:
    keys = ["policy", "requests", "finished", "rejected", "tbt_attainment", "tpot_attainment",
            "ttft_attainment", "tbt_p50_ms", "tbt_p95_ms", "tbt_p99_ms", "tpot_p99_ms",
            "ttft_p50_ms", "ttft_p99_ms", "e2e_mean_ms", "throughput_req_per_min",
            "throughput_tok_per_s", "kv_util_mean", "pauses", "preemptions",
            "solver_calls_per_request", "solver_time_share", "forced_fallbacks"]
    for k in keys:
        v = m.get(k)
        s = f"{v:.4g}" if isinstance(v, float) else str(v)
        print(f"{k:26s} {s}")


def run(args: argparse.Namespace) -> int:
    from simulator.logs import quiet

    quiet()
    try:
        return _dispatch(args)
    except ValueError as exc:
        print(f"kvplane sim: {exc}", file=sys.stderr)
        return 2


def _floats(text: str, flag: str) -> list[float]:
    """A comma list of numbers (ValueError naming the flag and the value)."""
    try:
        return [float(x) for x in text.split(",") if x]
    except ValueError:
        raise ValueError(f"{flag}={text!r}: expected a comma list of numbers") from None


def _dispatch(args: argparse.Namespace) -> int:
    from kvplane.output_path import output_path_error
    from simulator.runner import RunSpec, run_many, run_spec_dict

    cmd = args.sim_command
    out = getattr(args, "json", None) or getattr(args, "out", None)
    if out is not None:  # before any work: a run that cannot write its result is refused
        flag = "--json" if getattr(args, "json", None) is not None else "--out"
        problem = output_path_error(out, flag, directory=cmd == "reproduce")
        if problem:
            raise ValueError(problem)
    if cmd == "trace":
        from simulator.profile import load_profile
        from simulator.trace import generate_trace, save_trace

        spec = _spec(args, args.workload, args.rate, args.slo_scale)
        prof = load_profile(args.profile)
        save_trace(generate_trace(spec, prof), args.out,
                   meta={"workload": args.workload, "profile": prof.name, "seed": args.seed})
        print(f"wrote {args.n} requests to {args.out}")
        return 0
    if cmd == "run":
        from simulator.trace import load_trace

        if args.trace in WORKLOADS:
            rs = RunSpec(args.policy, args.profile,
                         trace=_spec(args, args.trace, args.rate, args.slo_scale),
                         solver_time=args.solver_time, planner_mode=args.planner)
        else:
            path = Path(args.trace)
            if not path.exists():
                raise ValueError(f"--trace: {args.trace!r} is neither a file nor one of "
                                 f"{WORKLOADS}")
            rs = RunSpec(args.policy, args.profile, requests=tuple(load_trace(path)),
                         solver_time=args.solver_time, planner_mode=args.planner)
        m = run_spec_dict(rs)
        _print_metrics(m)
        if args.json:
            args.json.write_text(json.dumps(m, indent=1))
        return 0
    if cmd == "sweep":
        pols = [p for p in args.policies.split(",") if p]
        rates = _floats(args.rates, "--rates")
        scales = _floats(args.slo_scales, "--slo-scales")
        from simulator.policies import policy_names

        for p in pols:
            if p not in policy_names():
                raise ValueError(f"--policies: {p!r} is not one of {policy_names()}")
        specs = [RunSpec(p, args.profile, trace=_spec(args, args.workload, r, s),
                         solver_time=args.solver_time,
                         tags={"rate_per_min": r, "slo_scale": s})
                 for s in scales for r in rates for p in pols]
        rows = run_many(specs, jobs=args.jobs, progress=_bar)
        print(f"{'scale':>6} {'rate':>6} {'policy':20s} {'TBT':>7} {'TPOT':>7} {'TTFT':>7} "
              f"{'req/min':>8}")
        for r in rows:
            print(f"{r['slo_scale']:6.2f} {r['rate_per_min']:6.2f} {r['policy']:20s} "
                  f"{r['tbt_attainment']:7.3f} {r['tpot_attainment']:7.3f} "
                  f"{r['ttft_attainment']:7.3f} {r['throughput_req_per_min']:8.2f}")
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        return 0
    if cmd == "reproduce":
        from simulator.experiments import EXPERIMENTS
        from simulator.reproduce import reproduce_many

        names = list(EXPERIMENTS) if args.name == "all" else [args.name]
        for n in names:
            if n not in EXPERIMENTS:
                raise ValueError(f"reproduce: {n!r} is not one of {sorted(EXPERIMENTS)} or 'all'")
        t0 = time.perf_counter()
        paths = reproduce_many(names, args.out, smoke=args.smoke, jobs=args.jobs, progress=_bar)
        for n, path in zip(names, paths, strict=True):
            print(f"{n}: {path}")
        print(f"reproduce {args.name}: {time.perf_counter() - t0:.0f} s wall")
        return 0
    raise ValueError(f"unknown sim command {cmd!r}")
