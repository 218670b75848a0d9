"""Per-method wall time inside one layered tiny-model SGLang server (``README.md`` here).

Run from the repository root::

    .venv/bin/python benchmarks/results/sglang/method-timing/time_methods.py --seconds 50 \\
        --targets sglang_ext.step_reporter:StepReporter._report,...

It starts ``kvplane bench sglang``'s ``layered`` configuration with this folder's
``sitecustomize.py`` on ``PYTHONPATH``, runs the throughput workload (8 prompts x 96 tokens) for
``--seconds``, and prints the overhead meter's parts per step and each target's calls, time per
call and time per scheduler step. ``--percentiles`` (targets optional then) also prints each meter
part's mean / p50 / p90 / p99 per call inside the server.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pstats
import tempfile
import time
from pathlib import Path

from sglang_ext.overhead import OVERHEAD_FILE_ENV
from sglang_ext.testing.server import SGLangServer
from sglang_ext.testing.tiny_model import build_tiny_model
from sglang_ext.tools.bench_workloads import model_spec, run_once
from sglang_ext.tools.sglang_bench import LOOSE_SLO_TBT_MS, config_flags

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=50.0)
    parser.add_argument("--targets", default="", help="comma list of module:Class.method")
    parser.add_argument("--percentiles", action="store_true", help="percentiles of the meter's parts")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="cProfile inside the targets; print the N functions with the most own time")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="method-timing-"))
    model = build_tiny_model(work / "model", model_spec("tiny"))
    policy = work / "policy.json"
    policy.write_text(json.dumps({"slo_tbt_ms": LOOSE_SLO_TBT_MS}))
    env = {
        OVERHEAD_FILE_ENV: str(work / "meter.json"),
        "PYTHONPATH": os.pathsep.join([str(HERE), os.getcwd()]),
        "METHOD_TIMING_FILE": str(work / "timing"),
        "METHOD_TIMING_TARGETS": args.targets,
        "METHOD_PROFILE": "1" if args.profile else "0",
    }
    if args.percentiles:
        env["METER_PERCENTILES_FILE"] = str(work / "parts")
    server = SGLangServer(model, log_path=work / "server.log", extra_args=config_flags(1024, policy)["layered"],
                          env=env, startup_timeout_s=600)
    server.start()
    try:
        run_once(server, "throughput")  # warm-up
        start = time.monotonic()
        while time.monotonic() - start < args.seconds:
            run_once(server, "throughput")
        time.sleep(6.0)  # one more dump of the accumulators
    finally:
        server.stop()
    meter = json.loads((work / "meter.json").read_text())
    steps = meter["steps"]
    parts = {k: round(v / steps * 1e6, 1) for k, v in meter["parts_s"].items()}
    print(f"steps {steps}, meter share {meter['share_pct']}%, {meter['kvplane_ms_per_step']} ms/step; us/step {parts}")
    for path in glob.glob(str(work / "parts.*")):
        for part, f in sorted(json.loads(Path(path).read_text()).items(), key=lambda kv: -kv[1]["mean"] * kv[1]["n"]):
            print(f"{part:18s} calls {f['n']:6d}  mean {f['mean']:7.1f}  p50 {f['p50']:6.1f}  p90 {f['p90']:6.1f}  "
                  f"p99 {f['p99']:7.1f} us  slowest 1%: {f['top1pct_share']:.0%} of the part")
    for path in glob.glob(str(work / "timing.*[0-9]")):
        figures = json.loads(Path(path).read_text())
        if len(figures) < 2:  # a process that loaded none of the targets
            continue
        for key, (calls, seconds) in sorted(figures.items(), key=lambda kv: -kv[1][1]):
            print(f"{key:90s} calls {int(calls):7d}  {seconds / calls * 1e6:8.1f} us/call  "
                  f"{seconds / steps * 1e6:7.1f} us/step")
    for path in glob.glob(str(work / "timing.*.prof")) if args.profile else ():
        stats = pstats.Stats(path).stats  # type: ignore[attr-defined]
        print(f"cProfile inside the targets (own time per scheduler step, us; {steps} steps):")
        for (file, line, func), (_cc, nc, tt, ct, _callers) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:args.profile]:
            print(f"  {tt / steps * 1e6:7.2f} own {ct / steps * 1e6:7.2f} cum  {nc:7d} calls  {Path(file).name}:{line}({func})")


if __name__ == "__main__":
    main()
