"""Host CPU of a decode step's boundary after the batch changed (README.md next to this file).

Run from the repository root: ``.venv/bin/python benchmarks/results/core/session37-turnover/turnover_probe.py``
``[resident|placed] [continuity|general]``. It drives `kvplane gpu-check`'s ``CheckBatch`` (the
served core at Llama-3-8B's batch: 32 requests, contexts 2K-8K, 32 layers, page 16, paged
reads; tiny heads, so the CPU device ops stay small) on this host's CPU. ``placed``: the
planner's placement leaving half of the KV on host (steps stage and fetch). Each round finishes
one request (its release and its pages' free, as SGLang's end of step) and lets a new one join
(a prefill of 2K tokens through the core), then times the next decode step's boundary, thread
CPU: ``continuity`` as served now (``prepare_decode_step``: each request continues what it held);
``general`` as before (every request's slots read -- here a NumPy slice per request, on a GPU a
``[B, max_len]`` device-to-host copy and a sync, not counted -- then ``prepare_step``). Then
four steady steps of the new batch. Medians over the rounds.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import torch

from sglang_ext.tools.gpu_check_config import GpuCheckConfig
from sglang_ext.tools.gpu_check_measure import CoreCheck

ROUNDS = 12


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "resident"
    path = sys.argv[2] if len(sys.argv) > 2 else "continuity"
    cfg = GpuCheckConfig(name="probe", layers=32, q_heads=4, kv_heads=1, head_dim=8, page_size=16, requests=32,
                         context_min=2048, context_max=8192, hidden=32, intermediate=32, dtype="float32", repeat=5)
    check = CoreCheck(cfg, "cpu")
    b, core, ps = check.batch, check.batch.core, cfg.page_size
    b.contexts = list(b.contexts)
    if mode == "placed":
        b.place(check.plan([0.5] * cfg.layers, 1000.0))
    for _ in range(3):
        check.step()
    boundary, steady = [], []
    free = list(range(core.config.logical_pages - 1, 0, -1))
    used = {int(s) // ps for slots in b.slots for s in slots}
    free = [p for p in free if p not in used]
    for r in range(ROUNDS):
        # the oldest request finishes: released, its pages freed (SGLang's end of step)
        gone = b.rids.pop(0)
        slots, n = b.slots.pop(0), b.lens.pop(0)
        b.contexts.pop(0)
        pages = sorted({int(s) // ps for s in slots[:n]})
        core.release_request(gone)
        core.page_freed(pages)
        free.extend(pages)
        # a new request joins: 2K-token prompt, prefilled through the core
        rid, tokens = f"n{r}", 2048
        mine = [free.pop() for _ in range(-(-(tokens + 64) // ps))]
        new_slots = np.concatenate([p * ps + np.arange(ps, dtype=np.int64) for p in mine])
        loc = torch.from_numpy(new_slots[:tokens].copy())
        core.prepare_step([(rid, loc.clone())], loc)
        for layer in range(cfg.layers):
            k = torch.zeros((tokens, cfg.kv_heads, cfg.head_dim))
            core.enter_layer(layer)
            core.write(layer, loc, k, k)
            core.exit_layer(layer)
        b.rids.append(rid)
        b.slots.append(new_slots)
        b.lens.append(tokens)
        b.contexts.append(tokens)
        if mode == "placed":
            b.place(check.plan([0.5] * cfg.layers, 1000.0))
        # the decode step after the change
        new = []
        for i in range(len(b.rids)):
            new.append(int(b.slots[i][b.lens[i]]))
            b.lens[i] += 1
        loc = torch.tensor(new, dtype=torch.int64)
        t0 = time.thread_time()
        took = path == "continuity" and core.prepare_decode_step(b.rids, b.lens, loc)
        if not took:
            requests = [(x, torch.from_numpy(b.slots[i][: b.lens[i]].copy())) for i, x in enumerate(b.rids)]
            core.prepare_step(requests, loc)
        boundary.append((time.thread_time() - t0) * 1e3)
        assert took == (path == "continuity"), "the decode path declined a continued batch"
        check.layers(loc)
        for _ in range(4):
            check.step()
            steady.append(b.prepare_cpu_s * 1e3)
    print(f"{mode} {path}: boundary after a finish + a join {statistics.median(boundary):.2f} ms "
          f"(p25 {statistics.quantiles(boundary, n=4)[0]:.2f}, p75 {statistics.quantiles(boundary, n=4)[2]:.2f}); "
          f"steady steps {statistics.median(steady):.2f} ms; turnovers {core.continuity.turnovers}, "
          f"overflow {core.overflow_steps}")


if __name__ == "__main__":
    main()
