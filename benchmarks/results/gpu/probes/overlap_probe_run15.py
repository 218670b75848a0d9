"""Session 23's second GPU call: which copy launch lets a fetch overlap the layers before it.

Run 14 (`kvplane gpu-check`, H200) showed the hidden placement's step 71% over all-resident at
the default launch (2 persistent programs per SM) and still 42% over at 8 programs: the layers'
kernels wait for the copy programs to leave the SMs. Here the same hidden placement is timed
(and laid out on the compute stream) for more launch shapes: persistent caps, a non-persistent
grid (one program per item, short-lived), one warp per program, and the H2D GB/s of each.
Usage on a GPU host: ``python3 benchmarks/results/gpu/probes/overlap_probe_run15.py [cpu]``.
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
VARIANTS = ((None, 4), (8, 4), (2, 4), (UNBOUNDED, 4), (UNBOUNDED, 1), (8, 1), (32, 1))
"""(copy programs, warps per program)."""


def main() -> None:
    device = "cpu" if sys.argv[1:] == ["cpu"] else "cuda"
    config = LLAMA3_8B if device == "cuda" else LLAMA3_8B.with_overrides(layers=4, requests=4, context_min=200,
                                                                        context_max=500, repeat=3)
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
    for programs, warps in VARIANTS:
        if hasattr(engine, "copy_programs"):
            engine.copy_programs = programs
        bc.COPY_WARPS = warps
        ms = time_ms(check.step, device, config.repeat)
        timeline = check.timeline()
        link = tr.TransferCheck(check.batch, config.repeat).measure()  # at this launch shape
        row = {"programs": programs, "warps": warps, "step_ms": ms, "h2d_gbps": link.h2d_gbps,
               "duplex_gbps": link.duplex_gbps, "timeline": StepTimelineProbe.summary(timeline),
               "layer_ms": [round(x, 3) for x in timeline["layer_ms"]]}
        out["variants"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "layer_ms"}), flush=True)
    sync(device)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "overlap_probe.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
