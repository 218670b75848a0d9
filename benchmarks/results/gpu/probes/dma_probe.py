"""Session 32's GPU run 19: which copy-engine configuration serves the hidden and the
half-offloaded placements best.

Run 18 (`kvplane gpu-check`, H200, the copy engines' first GPU run) measured the copy engines'
duplex at 1.65x one direction (the target, 1.5x, met; the Triton kernels 1.19x) and the layers'
compute unslowed by a fetch (0.35 ms a layer against 0.49 with the Triton copy programs on the
SMs), but the half-offloaded step at 243 ms against the kernels' 233, its host issuing it in
161 ms: 2-D copies cost 31 us of host time each (single segments 0.66 us) and a long decode's
interleaved pages moved at 32.9 GB/s as 2-D copies at a 64 MiB pitch. Here, after gpu-check's
overlap phase (the hidden placement now planned with the compute timed beside it), both
placements are stepped on the copy engines under four configurations:

- ``default``: 2-D copies of runs of 2+ rows at any pitch the driver takes;
- ``min_run_32``: only runs of 32+ rows as 2-D copies, the rest batched;
- ``layer_pitch``: 2-D copies only at the pool's own layer pitch (no free-step runs);
- ``batched``: no 2-D copies, every segment in the batched memcpy.

Per configuration and placement: the step (median), its timeline (boundary, waits, compute, host
issue) and the driver calls it made (2-D copies, rows, single segments, host us each). Usage on
a GPU host (``cpu`` as a last argument: the same code at toy sizes on the CPU, where nothing is
on the copy engines and the configurations are skipped)::

    python3 benchmarks/results/gpu/probes/dma_probe.py [cpu]

Results: ``dma-probe-run19-nvidia-h200.*``.
"""

from __future__ import annotations

import json
import os
import sys

import sglang_ext.dataplane.cuda_transfer_engine as cte
import sglang_ext.tools.gpu_check_overlap as ov
import sglang_ext.tools.gpu_check_transfer as tr
from sglang_ext.dataplane.bench_env import sync, time_ms
from sglang_ext.tools.gpu_check_config import LLAMA3_8B
from sglang_ext.tools.gpu_check_measure import CoreCheck
from sglang_ext.tools.step_timeline_probe import StepTimelineProbe

CONFIGS = ("default", "min_run_32", "layer_pitch", "batched")


def _counters(engine) -> tuple[int, int, int, float, float]:  # noqa: ANN001
    dma, pitched = engine._dma, engine._pitched
    return (pitched.calls if pitched else 0, pitched.rows if pitched else 0, dma.copies,
            pitched.call_seconds if pitched else 0.0, dma.call_seconds)


def _configure(engine, name: str, saved: dict) -> None:  # noqa: ANN001
    cte.MIN_RUN = 32 if name == "min_run_32" else saved["min_run"]
    engine._max_pitch = engine.host_page_rows * engine.segment_bytes if name == "layer_pitch" else saved["pitch"]
    engine._pitched = None if name == "batched" else saved["pitched"]


def _step(check, device: str, repeat: int) -> dict:  # noqa: ANN001
    engine = check.batch.core.store.engine
    engine.quiesce()
    sync(device)
    before = _counters(engine)
    ms = time_ms(check.step, device, repeat)
    after = _counters(engine)
    steps = repeat + 2
    runs, rows, singles, run_s, single_s = (a - b for a, b in zip(after, before, strict=True))
    timeline = check.timeline()
    return {"step_ms": round(ms, 3), "timeline": StepTimelineProbe.summary(timeline),
            "host_enqueue_ms": round(timeline["host_enqueue_ms"], 3),
            "per_step": {"runs_2d": runs / steps, "run_rows": rows / steps, "single_segments": singles / steps,
                         "host_ms_2d": run_s * 1e3 / steps, "host_ms_batched": single_s * 1e3 / steps},
            "host_us_per_2d": run_s / runs * 1e6 if runs else None,
            "host_us_per_2d_row": run_s / rows * 1e6 if rows else None,
            "host_us_per_single": single_s / singles * 1e6 if singles else None}


def main() -> None:
    device = "cpu" if sys.argv[1:] == ["cpu"] else "cuda"
    config = LLAMA3_8B if device == "cuda" else LLAMA3_8B.with_overrides(layers=4, requests=4, context_min=200,
                                                                        context_max=500, repeat=8)
    tr.PROGRAM_CAPS = ov.PROGRAM_CAPS = (None,)  # no Triton cap sweep: the copy engines are the question
    check = CoreCheck(config, device, attention="auto")
    resident = time_ms(check.step, device, config.repeat)
    comp = [resident / config.layers] * config.layers
    if device == "cuda":
        check.dma_error = None  # as CoreCheck.run does on CUDA: the transfer check probes the copy engines
    transfer = tr.TransferCheck(check.batch, config.repeat, check.dma_error).measure()
    check.dma_error = transfer.dma_error
    ov.OverlapCheck(check).run(comp, transfer.bw_blocks_per_ms, resident, None, transfer.h2d_gbps)
    o = check.details["overlap"]
    out = {"device": device, "resident_ms": o["resident_step_ms"], "share": o["share"],
           "offloaded_layer_pages": o["offloaded_layer_pages"], "model_stall_ms": o["model_stall_ms"],
           "hidden_triton_ms": o["step_ms"], "hidden_dma_ms": o["step_ms_by_programs"].get("dma"),
           "h2d_gbps": transfer.h2d_gbps, "dma_error": check.dma_error, "hidden": {}, "half_offloaded": {}}
    print(json.dumps({k: v for k, v in out.items() if k not in ("hidden", "half_offloaded")}), flush=True)
    engine = check.batch.core.store.engine
    if device == "cuda" and check.dma_error is None and engine.set_copy_engine("dma"):
        saved = {"min_run": cte.MIN_RUN, "pitch": engine._max_pitch, "pitched": engine._pitched}
        half = check.plan(comp, transfer.bw_blocks_per_ms)  # the config's share: half the KV out
        try:
            # the hidden placement is the one the overlap phase left installed
            for placement, rows, repeat in (("hidden", None, 5), ("half_offloaded", half, 3)):
                if rows is not None:
                    check.batch.place(rows)
                for name in CONFIGS:
                    _configure(engine, name, saved)
                    try:
                        row = _step(check, device, repeat)
                    except Exception as exc:  # noqa: BLE001 - one configuration's fault loses its row only
                        engine.quiesce()
                        row = {"error": f"{type(exc).__name__}: {exc}"[:400]}
                    out[placement][name] = row
                    print(json.dumps({"placement": placement, "config": name, **row}), flush=True)
        finally:
            _configure(engine, "default", saved)
            engine.set_copy_engine("triton")
    sync(device)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "dma_probe_run19.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
