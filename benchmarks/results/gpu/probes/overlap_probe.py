"""Session 23's GPU runs 15 and 16: which copy launch lets a fetch overlap the layers before it.

Run 14 (`kvplane gpu-check`, H200) showed the hidden placement's step 71% over all-resident at
the then-default launch (2 persistent programs per SM) and still 42% over at 8 programs: the
layers' kernels waited for the copy programs to leave the SMs. Here the same hidden placement
is timed (and laid out on the compute stream) for more launch shapes, with the engine's H2D and
duplex GB/s at each. Run 15: persistent caps, a non-persistent grid (one program per item,
short-lived), one warp per program. Run 16: shapes around run 15's best (32 programs of 1 warp,
8 of 4), and the transfer-bound half-offloaded step at a few of them. Usage on a GPU host
(``cpu`` as a last argument: the same code at toy sizes on the CPU)::

    python3 benchmarks/results/gpu/probes/overlap_probe.py 15|16 [cpu]

Results: ``overlap-probe-run15-nvidia-h200.*``, ``overlap-probe-run16-nvidia-h200.*``.
"""

from __future__ import annotations

import json
import os
import sys

import kernels.block_copy as bc
import sglang_ext.tools.gpu_check_overlap as ov
import sglang_ext.tools.gpu_check_transfer as tr
from sglang_ext.dataplane.bench_env import sync, time_ms
from sglang_ext.tools.gpu_check_config import LLAMA3_8B
from sglang_ext.tools.gpu_check_measure import CoreCheck
from sglang_ext.tools.step_timeline_probe import StepTimelineProbe

UNBOUNDED = 1 << 30
"""A cap above any launch's items: one short-lived program per item (not persistent)."""
RUNS = {
    # run: ((copy programs, warps per program) of the hidden step, its timed steps, half-offloaded shapes)
    # None: the engine's default, which was 2 programs per SM then
    "15": (((None, 4), (8, 4), (2, 4), (UNBOUNDED, 4), (UNBOUNDED, 1), (8, 1), (32, 1)), None, ()),
    # 5 timed steps (not the config's 10): the batch's slots must last the half-offloaded steps too
    "16": (((None, 4), (32, 1), (16, 1), (64, 1), (32, 2), (16, 2), (8, 4)), 5,
           ((None, 4), (32, 1), (16, 2), (8, 4))),
}


def _launch(engine, programs: int | None, warps: int) -> None:  # noqa: ANN001
    if hasattr(engine, "copy_programs"):
        engine.copy_programs = programs
    bc.COPY_WARPS = warps


def main() -> None:
    run, device = sys.argv[1], "cpu" if sys.argv[2:] == ["cpu"] else "cuda"
    variants, timed, half_shapes = RUNS[run]
    config = LLAMA3_8B if device == "cuda" else LLAMA3_8B.with_overrides(layers=4, requests=4, context_min=200,
                                                                        context_max=500, repeat=8)
    tr.PROGRAM_CAPS = (None,)  # the transfer check once, at the default
    check = CoreCheck(config, device, attention="auto")
    resident = time_ms(check.step, device, config.repeat)
    comp = [resident / config.layers] * config.layers
    transfer = tr.TransferCheck(check.batch, config.repeat).measure()
    ov.PROGRAM_CAPS = (None,)
    ov.OverlapCheck(check).run(comp, transfer.bw_blocks_per_ms, resident, None, transfer.h2d_gbps)
    out = {"resident_ms": check.details["overlap"]["resident_step_ms"], "share": check.details["overlap"]["share"],
           "offloaded_layer_pages": check.details["overlap"]["offloaded_layer_pages"], "variants": []}
    engine = check.batch.core.store.engine
    for programs, warps in variants:
        _launch(engine, programs, warps)
        ms = time_ms(check.step, device, timed or config.repeat)
        timeline = check.timeline()
        link = tr.TransferCheck(check.batch, config.repeat).measure()  # at this launch shape
        row = {"programs": programs, "warps": warps, "step_ms": ms, "h2d_gbps": link.h2d_gbps,
               "duplex_gbps": link.duplex_gbps, "timeline": StepTimelineProbe.summary(timeline),
               "layer_ms": [round(x, 3) for x in timeline["layer_ms"]]}
        out["variants"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "layer_ms"}), flush=True)
    if half_shapes:
        check.batch.place(check.plan(comp, transfer.bw_blocks_per_ms))  # the config's share: half the KV out
        engine.quiesce()
        sync(device)
        out["half_offloaded"] = []
        for programs, warps in half_shapes:
            _launch(engine, programs, warps)
            row = {"programs": programs, "warps": warps, "step_ms": time_ms(check.step, device, 3)}
            out["half_offloaded"].append(row)
            print(json.dumps(row), flush=True)
    sync(device)
    name = "overlap_probe.json" if run == "15" else f"overlap_probe_run{run}.json"  # as the runs wrote them
    with open(os.path.join(os.environ.get("OUT", "/tmp"), name), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
