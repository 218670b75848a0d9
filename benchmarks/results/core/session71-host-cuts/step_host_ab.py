"""Host time of a CUDA-graph-replayed decode step, per step, with optional per-function totals.

Run from the repository root (or a worktree of another commit, with PYTHONPATH at it):
``.venv/bin/python benchmarks/results/core/session71-host-cuts/step_host_ab.py hidden|resident
[module:Class:method ...]``. The setup is session 69's probe's (``staged_host_probe.py``: gpu-check's
``CoreCheck`` at Llama-3-8B's batch on this host's CPU, ``DecodeGraphs(staged=True)``, no replay);
each of 180 timed steps is the driver's ``begin_decode`` (kvplane's boundary plus the driver's
own ~30 us building the step's slots), the admission and the step's end (``exit_layer``), in
thread CPU time. Printed: the mean, median and 25th percentile per step; with ``module:Class:method``
arguments (modules of ``sglang_ext.dataplane``), each one's thread CPU time per step (wrapped: ~1 us
of overhead each).
"""

from __future__ import annotations

import collections
import importlib
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "session69-staged-host"))
import staged_host_probe as probe  # noqa: E402

from sglang_ext.dataplane.decode_graphs import DecodeGraphs  # noqa: E402
from sglang_ext.tools.gpu_check_config import GpuCheckConfig  # noqa: E402
from sglang_ext.tools.gpu_check_measure import CoreCheck  # noqa: E402

STEPS, WARM = 180, 5


def _wrap(spec: str, spent: collections.Counter[str], calls: collections.Counter[str]) -> None:
    mod, cls_name, name = spec.split(":")
    cls = getattr(importlib.import_module(f"sglang_ext.dataplane.{mod}"), cls_name)
    inner, key = getattr(cls, name), f"{cls_name}.{name}"

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.thread_time_ns()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[key] += time.thread_time_ns() - t0
            calls[key] += 1

    setattr(cls, name, timed)


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "hidden"
    spent: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    for spec in sys.argv[2:]:
        _wrap(spec, spent, calls)
    torch.set_num_threads(1)
    cfg = GpuCheckConfig(name="probe", layers=32, q_heads=4, kv_heads=1, head_dim=8, page_size=16, requests=32,
                         context_min=2048, context_max=8192, hidden=32, intermediate=32, dtype="float32", repeat=3)
    check = CoreCheck(cfg, "cpu")
    check.backends.run = lambda backend, q, view: q  # no dense read of every page
    b = check.batch
    if mode == "hidden":
        b.place(check.plan([0.35] * cfg.layers, 100.0, share=0.1))
    for _ in range(3):
        check.step()
    core, real = b.core, len(b.rids)
    graphs = DecodeGraphs(core, (real,), b.batch_pages + real + 64, staged=True)
    graphs.graphs[real] = (probe._NoReplay(), None)
    per: list[int] = []

    def step() -> None:
        t0 = time.thread_time_ns()
        loc = b.begin_decode()
        if graphs.admit(slots=loc) is None:
            raise SystemExit(f"not admitted: {dict(graphs.eager_reasons)}")
        core.exit_layer(cfg.layers - 1)
        per.append(time.thread_time_ns() - t0)

    for _ in range(WARM):
        step()
    per.clear()
    spent.clear()
    calls.clear()
    for _ in range(STEPS):
        step()
    mean = sum(per) / len(per)
    per.sort()
    print(f"{mode} total {mean / 1e3:.0f} us/step, median {per[len(per) // 2] / 1e3:.0f}, "
          f"p25 {per[len(per) // 4] / 1e3:.0f}")
    for key, ns in spent.most_common():
        print(f"  {ns / STEPS / 1e3:7.1f} us  {calls[key] / STEPS:.1f}x  {key}")


if __name__ == "__main__":
    main()
