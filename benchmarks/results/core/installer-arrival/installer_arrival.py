"""The plan install at an arrival, as SGLang's step boundary runs it: full (every request's wants,
as before session 27) against delta (the changed requests' only, ``PlacementInstaller.install``).

Run from the repository root::

    .venv/bin/python benchmarks/results/core/installer-arrival/installer_arrival.py

A real served core (CPU device, paged layout with room for everything: nothing moves, so the
figure is the bookkeeping), ``live`` requests of 2K-8K tokens (page 16, the gpu-check's Llama-3-8B
page structure, 4 layers to keep the pool small) each decoded once; then one request arrives
and the boundary installs. ``pages_of`` reads a request's row as the adapter's does on a CPU
host (``req_to_token`` row // page size, ``tolist``, ``dict.fromkeys``). The full install is the
same installer with its memory of the last install dropped (it then sends every request, which
is what ``install`` did before). Median thread CPU ms of the install call over ``ROUNDS``.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from sglang_ext.dataplane.layered_kv_core import LayeredKVCore
from sglang_ext.dataplane.slot_store_config import SlotStoreConfig
from sglang_ext.tp_sync import PlacementInstaller, StepInstall

LAYERS, PAGE, ROUNDS = 4, 16, 15


def run(live: int, full: bool) -> float:
    rng = np.random.default_rng(0)
    tokens = rng.integers(2048, 8193, size=live + ROUNDS)
    pages = -(-tokens // PAGE) + 1
    logical = int(pages.sum()) + 2
    core = LayeredKVCore(SlotStoreConfig(layers=LAYERS, page_size=PAGE, kv_heads=1, head_dim=8,
                                         logical_pages=logical, device_pages=LAYERS * logical - 1,
                                         dtype=torch.float16, device="cpu"))
    starts = 1 + np.concatenate([[0], np.cumsum(pages)[:-1]])
    rows = {f"r{i}": int(s) * PAGE + np.arange(int(n)) for i, (s, n) in enumerate(zip(starts, tokens, strict=True))}
    installer = PlacementInstaller(core, LAYERS)

    def pages_of(rid: str) -> tuple[int, ...]:
        return tuple(dict.fromkeys((rows[rid] // PAGE).tolist()))

    def prefill(rid: str) -> None:
        loc = torch.from_numpy(rows[rid])
        core.prepare_step([(rid, loc.clone())], loc)

    running = [f"r{i}" for i in range(live)]
    for rid in running:
        prefill(rid)
    installer.apply(StepInstall(step=0, placements={rid: (1,) * LAYERS for rid in running}))
    installer.install({rid: rid for rid in running}, {}, pages_of)
    times = []
    for k in range(ROUNDS):
        new = f"r{live + k}"
        prefill(new)
        running.append(new)
        if full:
            installer._installed = None  # no memory: every request is sent (the old install)
        t0 = time.thread_time()
        installer.install({rid: rid for rid in running}, {}, pages_of)
        times.append(time.thread_time() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    print("| live requests | batch pages | full install ms | delta install ms |")
    print("|---:|---:|---:|---:|")
    for live in (8, 32, 128):
        full, delta = run(live, True), run(live, False)
        print(f"| {live} | ~{live * 5136 // PAGE} | {full:.2f} | {delta:.2f} |", flush=True)


if __name__ == "__main__":
    main()
