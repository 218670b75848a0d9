"""Percentiles of the overhead meter's parts inside one layered tiny-model SGLang server.

Run from the repository root::

    .venv/bin/python benchmarks/results/sglang/meter-percentiles/run.py --seconds 30

It starts ``kvplane bench sglang``'s ``layered`` configuration with this folder's
``sitecustomize.py`` on ``PYTHONPATH``, runs the throughput workload for ``--seconds`` and prints
the meter's parts per step, then each part's mean / p50 / p90 / p99 per call.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
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
    parser.add_argument("--seconds", type=float, default=30.0)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="meter-percentiles-"))
    model = build_tiny_model(work / "model", model_spec("tiny"))
    policy = work / "policy.json"
    policy.write_text(json.dumps({"slo_tbt_ms": LOOSE_SLO_TBT_MS}))
    env = {
        OVERHEAD_FILE_ENV: str(work / "meter.json"),
        "PYTHONPATH": os.pathsep.join([str(HERE), os.getcwd()]),
        "METHOD_TIMING_FILE": str(work / "parts"),
    }
    server = SGLangServer(model, log_path=work / "server.log", extra_args=config_flags(1024, policy)["layered"],
                          env=env, startup_timeout_s=600)
    server.start()
    try:
        run_once(server, "throughput")  # warm-up
        start = time.monotonic()
        while time.monotonic() - start < args.seconds:
            run_once(server, "throughput")
        time.sleep(6.0)  # one more dump
    finally:
        server.stop()
    meter = json.loads((work / "meter.json").read_text())
    steps = meter["steps"]
    parts = {k: round(v / steps * 1e6, 1) for k, v in meter["parts_s"].items()}
    print(f"steps {steps}, meter share {meter['share_pct']}%, {meter['kvplane_ms_per_step']} ms/step; us/step {parts}")
    for path in glob.glob(str(work / "parts.*")):
        figures = json.loads(Path(path).read_text())
        for part, f in sorted(figures.items(), key=lambda kv: -kv[1]["mean"] * kv[1]["n"]):
            print(f"{part:18s} calls {f['n']:6d}  mean {f['mean']:7.1f}  p50 {f['p50']:6.1f}  p90 {f['p90']:6.1f}  "
                  f"p99 {f['p99']:7.1f} us  slowest 1%: {f['top1pct_share']:.0%} of the part")


if __name__ == "__main__":
    main()
