"""Host work of a CUDA-graph-replayed decode step's boundary + admission, and the torch ops in it.

Run from the repository root:
``.venv/bin/python benchmarks/results/core/session69-staged-host/staged_host_probe.py [hidden|half|resident]``.

It drives `kvplane gpu-check`'s ``CoreCheck`` at Llama-3-8B's batch (32 requests, contexts 2K-8K,
32 layers, page 16, paged reads; tiny heads) on this host's CPU, one thread, with the staged
CUDA-graph buffers of ``DecodeGraphs(staged=True)`` (``docs/cuda-graphs.md``): each step is the
boundary (``prepare_decode_step``) and the admission (the tables and fetch lists loaded into the
graph's buffers); no graph replays (the layers' work is the device's; a stand-in records nothing),
and the step ends as after a replay. ``hidden``: the planner's placement leaving ~10% of the KV
out (gpu-check's overlap phase); ``half``: every request's later 16 layers on host; ``resident``:
nothing offloaded. Printed: the median thread CPU time of the boundary and of the admission over
20 steps; then, over 10 more steps under a ``TorchDispatchMode``, the torch ops dispatched per
step, the CPU time the ones that do device work took themselves (on this CPU device they compute:
the page tables' gather and splice over ``[L, pages]``; on a GPU they are launches, ~5-20 us of
host time each), what is left of the step's host time once that is taken out (Python, NumPy,
the views' dispatch: approximate, as the audited steps are not the timed ones), and those ops by
source line.
"""

from __future__ import annotations

import collections
import statistics
import sys
import time
import traceback
from contextlib import nullcontext

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sglang_ext.dataplane.decode_graphs import DecodeGraphs
from sglang_ext.tools.gpu_check_config import GpuCheckConfig
from sglang_ext.tools.gpu_check_measure import CoreCheck

STEPS, AUDITED = 20, 10
VIEWS = {"aten.slice.Tensor", "aten.view.default", "aten.view.dtype", "aten.detach.default", "aten.alias.default",
         "aten.unsqueeze.default", "aten.unbind.int", "aten.lift_fresh.default", "aten.equal.default"}
"""Ops that launch nothing on a GPU (views, host tensors made from NumPy, host compares)."""


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n, self.own_s = 0, 0.0
        self.sites: collections.Counter[tuple[str, str]] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        t0 = time.thread_time()
        out = func(*args, **(kwargs or {}))
        if str(func) not in VIEWS:  # the ops that compute on this CPU device (launches on a GPU)
            self.own_s += time.thread_time() - t0
        self.n += 1
        frames = [f for f in traceback.extract_stack(limit=10)[:-1] if "/sglang_ext/" in f.filename]
        where = f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}" if frames else "?"
        self.sites[(str(func), where)] += 1
        return out


class _NoReplay:
    def replay(self) -> None:
        """The layers' work is the device's: this probe times the host's side of a step only."""


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "hidden"
    torch.set_num_threads(1)
    cfg = GpuCheckConfig(name="probe", layers=32, q_heads=4, kv_heads=1, head_dim=8, page_size=16, requests=32,
                         context_min=2048, context_max=8192, hidden=32, intermediate=32, dtype="float32", repeat=3)
    check = CoreCheck(cfg, "cpu")
    check.backends.run = lambda backend, q, view: q  # the stand-in attention: no dense read of every page
    b = check.batch
    if mode == "hidden":
        b.place(check.plan([0.35] * cfg.layers, 100.0, share=0.1))
    elif mode == "half":
        b.place([[1] * (cfg.layers // 2) + [0] * (cfg.layers - cfg.layers // 2) for _ in b.rids])
    for _ in range(3):
        check.step()
    core, real = b.core, len(b.rids)
    graphs = DecodeGraphs(core, (real,), b.batch_pages + real + 64, staged=True)
    graphs.graphs[real] = (_NoReplay(), None)

    def step(ops: _Ops | None = None) -> tuple[float, float]:
        with ops if ops is not None else nullcontext():
            loc = b.begin_decode()
            t0 = time.thread_time()
            size = graphs.admit(slots=loc)
            admit_ms = (time.thread_time() - t0) * 1e3
        if size is None:
            raise SystemExit(f"not admitted: {dict(graphs.eager_reasons)}")
        core.exit_layer(cfg.layers - 1)
        return b.prepare_cpu_s * 1e3, admit_ms

    for _ in range(3):
        step()
    plain = [step() for _ in range(STEPS)]
    audits = [_Ops() for _ in range(AUDITED)]
    for ops in audits:
        step(ops)
    boundary, admit = (statistics.median(p[i] for p in plain) for i in (0, 1))
    n = statistics.median(o.n for o in audits)
    own = statistics.median(o.own_s for o in audits) * 1e3
    launches = sum(v for (op, _), v in audits[-1].sites.items() if op not in VIEWS)
    print(f"{mode}: boundary {boundary:.3f} ms + admission {admit:.3f} ms = {boundary + admit:.3f} ms thread CPU; "
          f"{n:.0f} torch ops a step ({launches} of them device work on a GPU, their own CPU time here {own:.3f} ms); "
          f"the rest (Python, NumPy, dispatch) ~{boundary + admit - own:.3f} ms; staged fetch launches loaded: "
          f"{graphs.buffers.staging.loaded_fetches}")
    for (op, where), count in sorted(audits[-1].sites.items(), key=lambda kv: kv[0][1]):
        if op not in VIEWS:
            print(f"  {count} x {op} at {where}")


if __name__ == "__main__":
    main()
