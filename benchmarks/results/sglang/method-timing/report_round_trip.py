"""Warm cost of one steady step report: ``StepReporter`` -> ``ControlClient`` -> the embedded
controller, 8 running requests (measurement aid, not part of kvplane; ``README.md`` here).

Run from the repository root::

    .venv/bin/python benchmarks/results/sglang/method-timing/report_round_trip.py [steps]

Stand-in SGLang requests, the real reporter and controller; every step reports (interval 1), the
observed step time equals the all-GPU prediction and the budget holds every context, so no
trigger fires: the figure is the steady report's own cost, warm. Inside a server the same report
costs ~3-4x more (cold caches between forwards, ``../meter-session19-amd-epyc.md``).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import structlog

from sglang_ext.args import LayeredKVArgs
from sglang_ext.control_client import ControlClient, build_control_plane
from sglang_ext.decision_inbox import DecisionInbox
from sglang_ext.pause import PauseManager
from sglang_ext.step_reporter import StepReporter
from sglang_ext.tp_sync import PlacementInstaller
from sglang_ext.worker_info import build_worker_info

LAYERS, BATCH = 4, 8


def _request(i: int) -> SimpleNamespace:
    req = SimpleNamespace(rid=f"r{i}", origin_input_ids=list(range(100)), output_ids=[1],
                          sampling_params=SimpleNamespace(max_new_tokens=96, custom_params=None))
    req.finished = lambda: False
    return req


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))  # warnings off
    policy = Path(tempfile.mkdtemp()) / "policy.json"
    policy.write_text(json.dumps({"slo_tbt_ms": 60000.0}))
    args = LayeredKVArgs(kv_policy=str(policy))
    worker = build_worker_info(worker_id="w", layers=LAYERS, block_size=1, block_bytes=512,
                               gpu_kv_budget_blocks=10**9, args=args)
    client = ControlClient(build_control_plane(args), worker)
    reqs = [_request(i) for i in range(BATCH)]
    batch = SimpleNamespace(reqs=reqs)
    scheduler = SimpleNamespace(waiting_queue=[], running_batch=batch, chunked_req=None,
                                token_to_kv_pool_allocator=SimpleNamespace(available_size=lambda: 1000))
    reporter = StepReporter(scheduler=scheduler, client=client, inbox=DecisionInbox(), pauser=PauseManager(),
                            installer=PlacementInstaller(None, LAYERS), pool=None, layers=LAYERS, page_size=1,
                            report_interval=1)
    predicted = sum(worker.profile.layer_compute_ms)

    def step(n: int) -> None:
        for req in reqs:
            req.output_ids.append(1)
        reporter.end_step(batch, step=n, finished=(), is_decode=True, step_ms=predicted, layer_ms=None,
                          build_always=False)

    for n in range(1, 201):
        step(n)
    start = time.perf_counter()
    for n in range(201, 201 + steps):
        step(n)
    per = (time.perf_counter() - start) / steps
    print(f"steady report round trip, {BATCH} requests: {per * 1e6:.1f} us (warm); reports sent {reporter.reports}")


if __name__ == "__main__":
    main()
