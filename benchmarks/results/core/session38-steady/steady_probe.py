"""Host time of kvplane's steady decode step at Llama-3-8B's batch (README.md next to this file).

Run from the repository root:
``.venv/bin/python benchmarks/results/core/session38-steady/steady_probe.py [resident|hidden] [attention|none]``.
It drives `kvplane gpu-check`'s ``CoreCheck`` (the served core at Llama-3-8B's batch: 32
requests, contexts 2K-8K, 32 layers, page 16, paged reads; tiny heads, so the CPU device ops stay
small) on this host's CPU, one thread. ``hidden``: the planner's placement leaving ~10% of the KV
out (steps stage and fetch a little, as gpu-check's overlap phase). ``none``: the stand-in
attention returns its query instead of reading every page (on this CPU the dense torch
reference reads the whole KV every layer, evicting the caches the next boundary then misses: on
a GPU host the attention runs on the device). Three warm steps, then 40 steps: the median thread
CPU of the boundary (``prepare_decode_step``) and of kvplane's per-layer calls (``enter_layer``,
``write``, ``exit_layer``), summed over the layers.
"""

from __future__ import annotations

import statistics
import sys

import torch

from sglang_ext.tools.gpu_check_config import GpuCheckConfig
from sglang_ext.tools.gpu_check_measure import CoreCheck
from sglang_ext.tools.gpu_check_probes import CpuTimeProbe

STEPS = 40


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "resident"
    attention = (sys.argv[2] if len(sys.argv) > 2 else "none") == "attention"
    torch.set_num_threads(1)
    cfg = GpuCheckConfig(name="probe", layers=32, q_heads=4, kv_heads=1, head_dim=8, page_size=16, requests=32,
                         context_min=2048, context_max=8192, hidden=32, intermediate=32, dtype="float32", repeat=3)
    check = CoreCheck(cfg, "cpu")
    if not attention:
        check.backends.run = lambda backend, q, view: q
    b = check.batch
    if mode == "hidden":
        b.place(check.plan([0.35] * cfg.layers, 100.0, share=0.1))
    for _ in range(3):
        check.step()
    boundary, parts = [], []
    for _ in range(STEPS):
        probe = CpuTimeProbe()
        check.step(probe.scope)
        boundary.append(b.prepare_cpu_s * 1e3)
        parts.append({k: v * 1e3 for k, v in probe.parts_s.items()})
    core = b.core
    split = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
    print(f"{mode} ({'attention' if attention else 'no attention'}): boundary {statistics.median(boundary):.3f} ms "
          f"(p25 {statistics.quantiles(boundary, n=4)[0]:.3f}); layer calls "
          + " + ".join(f"{k} {v:.3f}" for k, v in split.items())
          + f"; staged advances {core.staged_advances}, opened {core.opened_advances}, "
          f"resident builds {core.resident_builds}")


if __name__ == "__main__":
    main()
