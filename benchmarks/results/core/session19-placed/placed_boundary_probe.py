"""Host time of a placed (half-offloaded) paged decode boundary at gpu-check's batch-32 shapes
(README.md next to this file).

Run from the repository root: ``.venv/bin/python benchmarks/results/core/session19-placed/placed_boundary_probe.py``.
It drives gpu-check's ``CoreCheck`` on the CPU with Llama-3-8B's layer and page counts (32
layers, batch 32, page 16, contexts 2K-8K: 10,446 batch pages) but one KV head of 8 (the host
work depends on pages, not bytes), places layers 16-31 of every request on the host, and prints
the mean thread CPU time per step of the boundary (``prepare_decode_step``) with and without the
first fetch launch (``LayerPipeline.begin_step``: on this CPU a synchronous copy, on a GPU an
asynchronous kernel), over 20 steps, and how many of them advanced (``staged_advances``).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch

from sglang_ext.dataplane.layer_pipeline import LayerPipeline
from sglang_ext.tools import gpu_check
from sglang_ext.tools.gpu_check_measure import CoreCheck

STEPS = 20


def main() -> None:
    torch.set_num_threads(1)
    launch = {"s": 0.0}
    begin_step = LayerPipeline.begin_step

    def timed_begin_step(self: LayerPipeline, tables: object) -> None:
        t0 = time.thread_time()
        begin_step(self, tables)  # type: ignore[arg-type]
        launch["s"] += time.thread_time() - t0

    LayerPipeline.begin_step = timed_begin_step  # type: ignore[method-assign]
    parser = argparse.ArgumentParser()
    gpu_check.add_arguments(parser)
    args = parser.parse_args(["--device", "cpu", "--shapes", "llama3-8b", "--layers", "32",
                              "--context-min", "2048", "--context-max", "8192", "--repeat", "3"])
    config = dataclasses.replace(gpu_check.config_from_args(args, "cpu"), dtype="float32", intermediate=64,
                                 hidden=64, kv_heads=1, q_heads=1, head_dim=8)
    check = CoreCheck(config, "cpu", "torch")
    for _ in range(2):
        check.step()
    check.batch.place([[1] * 16 + [0] * 16 for _ in range(config.requests)])
    for _ in range(3):
        check.step()
    core = check.batch.core
    before = getattr(core, "staged_advances", 0)
    total, launch["s"] = 0.0, 0.0
    for _ in range(STEPS):
        check.step()
        total += check.batch.prepare_cpu_s
    advanced = getattr(core, "staged_advances", 0) - before
    print(f"placed boundary {total / STEPS * 1e3:.3f} ms, without the first fetch launch "
          f"{(total - launch['s']) / STEPS * 1e3:.3f} ms; {advanced} of {STEPS} steps advanced")


if __name__ == "__main__":
    main()
