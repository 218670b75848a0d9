"""Copy-engine descriptors per steady decode step at kvplane gpu-check's Llama-3-8B page structure.

On the CPU host (no GPU): the served core at the check's batch (32 requests, contexts 2K-8K,
32 layers, page 16; tiny heads: only the page structure matters here), two placements:
``half`` (layers 16-31 offloaded for every request: the check's transfer-bound placement) and
``hidden`` (the overlap check's: the real planner leaves out what the model hides under a
12.9 ms step at 48 GB/s, run 14's H200 figures). For each, one steady decode step's fetches as
the copy engines would take them: segments (one ``cuMemcpyBatchAsync`` descriptor each before
this change), strided runs (one ``cuMemcpy2DAsync`` each now), and the runs with the staging
pages in the allocator's order (descending: what the runs were before ``StagingRoom.take``
sorted them), plus the host time of working out the runs and their pointers; and the served plan
(``plan_runs``: the fixed-step runs, then free-step runs for pages left single), also for a
synthetic batch after a long decode, whose pages interleave across the batch.

    PYTHONPATH=. python benchmarks/results/core/dma-runs/dma_runs_probe.py OUT_DIR
"""

import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from kernels.pitched_memcpy import plan_runs, run_pointers, strided_runs
from sglang_ext.dataplane.fetch_run_cache import FetchRunCache
from sglang_ext.dataplane.staging_room import StagingRoom
from sglang_ext.tools.gpu_check_config import GpuCheckConfig
from sglang_ext.tools.gpu_check_measure import CoreCheck
from sglang_ext.tools.gpu_check_overlap import OverlapCheck

CFG = GpuCheckConfig(name="probe", layers=32, q_heads=1, kv_heads=1, head_dim=8, page_size=16, requests=32,
                     context_min=2048, context_max=8192, hidden=16, intermediate=16, dtype="float32", repeat=5)
RESIDENT_MS, GBPS, KV_BYTES_8B = 12.9, 48.0, 16 * 8 * 128 * 2 * 2  # run 14 (H200); a layer-page's K+V at 8B, bf16


def measure(placement: str, ascending: bool) -> dict:
    real = StagingRoom.take
    if not ascending:  # the allocator's own order (most recently freed first)
        StagingRoom.take = lambda self, n: None if (ids := real(self, n)) is None else ids[::-1].copy()
    try:
        cc, cache = CoreCheck(CFG, "cpu"), FetchRunCache()
        b = cc.batch
        if placement == "half":
            rows = [[1] * 16 + [0] * 16 for _ in b.rids]
        else:
            bw_blocks_per_ms = GBPS * 1e9 / KV_BYTES_8B / 1e3
            _, rows, _ = OverlapCheck(cc)._choose([RESIDENT_MS / CFG.layers] * CFG.layers, bw_blocks_per_ms, RESIDENT_MS)
        b.place(rows)
        engine, specs = b.core.store.engine, []
        real_fetch = engine.fetch_pages
        engine.fetch_pages = lambda spec, wait=(): (specs.append(spec), real_fetch(spec, wait))[1]
        out = []
        for _ in range(6):
            specs.clear()
            cc.step()
            segs = fixed = runs = single = 0
            t0 = time.perf_counter()
            for spec in specs:  # as CudaTransferEngine._dma_copy plans a fetch
                src, dst = spec.indices()
                groups, rest, _ = plan_runs(src, dst, engine.host_page_rows, 1)
                for s0, d0, n, _, _ in groups:
                    run_pointers(engine.host.data_ptr(), engine.dev.data_ptr(), engine.segment_bytes, s0, d0)
                    runs += n.size
                segs, single = segs + src.size, single + rest.size
            elapsed = time.perf_counter() - t0
            cache.clear()  # the engine's step start
            reused = cache.reused
            t0 = time.perf_counter()
            for spec in specs:  # as the engine plans a fetch now: FetchRunCache, then the pointers
                groups, _, _ = cache.plan(spec, lambda s, d: plan_runs(s, d, engine.host_page_rows, 1))
                for s0, d0, _n, _, _ in groups:
                    run_pointers(engine.host.data_ptr(), engine.dev.data_ptr(), engine.segment_bytes, s0, d0)
            cached = time.perf_counter() - t0
            for spec in specs:
                fixed += strided_runs(*spec.indices(), engine.host_page_rows, 1)[2].size
            out.append((len(specs), segs, fixed, runs, single, elapsed, cached, cache.reused - reused))
        launches, segs, fixed, runs, single, *_, reused = out[-1]
        return {"placement": placement, "staging": "ascending" if ascending else "allocator order",
                "offloaded_layer_pages": int(sum(r.count(0) * n for r, n in zip(rows, b.blocks(0), strict=True))),
                "fetch_launches": launches, "segments": segs, "runs": fixed, "served_runs": runs,
                "served_single": single, "host_ms_indices_runs_pointers": statistics.median(o[5] for o in out[1:]) * 1e3,
                "host_ms_served": statistics.median(o[6] for o in out[1:]) * 1e3, "served_reused_plans": reused}
    finally:
        StagingRoom.take = real


def long_decode(decode_pages: int = 64) -> dict:
    """Synthetic (no core): the check's batch after a long decode -- each request's context as
    consecutive prompt pages, then ``decode_pages`` more handed out in turn across the batch (as
    SGLang's allocator does when every request opens a page every 16 steps: one request's decode
    pages 32 apart) -- and the half-offloaded placement's fetches (layers 16-31) in
    ``PageFetch.indices`` order (per layer: K of every page of every request, then V) into
    consecutive staging pages. Runs at the fixed step (``strided_runs``) against the served plan
    (``plan_runs``: free-step runs for the interleaved pages)."""
    L, reqs = CFG.layers, CFG.requests
    prompt = [-(-c // CFG.page_size) for c in CFG.contexts]
    starts = 1 + np.concatenate([[0], np.cumsum(prompt)[:-1]])
    first_decode = int(starts[-1] + prompt[-1])
    pages = [np.concatenate([np.arange(starts[r], starts[r] + prompt[r]),
                             first_decode + r + reqs * np.arange(decode_pages)]) for r in range(reqs)]
    flat = np.concatenate(pages)
    dev_v = 10 * flat.size
    segs = fixed = runs = single = 0
    t0 = time.perf_counter()
    for layer in range(L // 2, L):
        k = (flat * L + layer) * 2
        src, dst = np.concatenate([k, k + 1]), np.concatenate([np.arange(flat.size), np.arange(flat.size) + dev_v])
        groups, rest, _ = plan_runs(src, dst, 2 * L, 1)
        segs, runs, single = segs + src.size, runs + sum(g[2].size for g in groups), single + rest.size
        fixed += strided_runs(src, dst, 2 * L, 1)[2].size
    return {"placement": f"half, after {decode_pages} decode pages a request (synthetic)", "staging": "ascending",
            "offloaded_layer_pages": segs // 2, "fetch_launches": L // 2, "segments": segs, "runs": fixed,
            "served_runs": runs, "served_single": single,
            "host_ms_indices_runs_pointers": (time.perf_counter() - t0) * 1e3}


def python_cost_per_run(n: int) -> float:
    """Microseconds of host time per run that ``PitchedMemcpy.copy_runs`` spends outside the
    driver (records filled, one ctypes call each): libc's ``strcmp`` of two empty strings stands
    in for ``cuMemcpy2DAsync`` (same two pointer arguments, returns 0)."""
    import ctypes

    from kernels.pitched_memcpy import PitchedMemcpy

    fn = ctypes.CDLL(None).strcmp
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
    pm = PitchedMemcpy.__new__(PitchedMemcpy)
    pm.calls, pm.rows, pm.call_seconds, pm._fn = 0, 0, 0.0, fn
    empty = ctypes.create_string_buffer(8)  # the "stream": an empty string too
    ptrs, heights = np.arange(n, dtype=np.uint64), np.full(n, 100, dtype=np.int64)
    best = float("inf")
    for _ in range(20):
        t0 = time.perf_counter()
        pm.copy_runs(ptrs, 64, ptrs, 4096, 64, heights, ctypes.addressof(empty))  # record 0 starts with 0 bytes
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e6


def _opt(row: dict, key: str, fmt: str) -> str:
    return fmt.format(row[key]) if key in row else "n/a"


def main() -> None:
    out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    rows = [measure(p, asc) for p in ("half", "hidden") for asc in (True, False)] + [long_decode()]
    machine = f"CPU host ({platform.processor() or platform.machine()}, {__import__('os').cpu_count()} cores), no GPU"
    lines = [f"# Copy-engine descriptors per steady decode step ({machine})", "",
             "| placement | staging | offloaded layer-pages | fetch launches | segments | strided runs (2L) | "
             "served runs (plan_runs) | left single | host ms (indices + plan + pointers), every fetch planned | "
             "host ms served (FetchRunCache: plans reused across layers) | fetches of the step reusing a plan |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['placement']} | {r['staging']} | {r['offloaded_layer_pages']} | {r['fetch_launches']} | "
              f"{r['segments']} | {r['runs']} | {r['served_runs']} | {r['served_single']} | "
              f"{r['host_ms_indices_runs_pointers']:.2f} | {_opt(r, 'host_ms_served', '{:.2f}')} | "
              f"{_opt(r, 'served_reused_plans', '{}')} |" for r in rows]
    lines += ["", "The synthetic row times only the planning (no indices from a core, no pointers). The served "
              "column is what `CudaTransferEngine` spends since `FetchRunCache`: a step's fetch of the same "
              "requests with the same host-only pages as an earlier layer's takes that plan, its host rows "
              "shifted, after one gather of the layer's map row over those pages."]
    per_run = {n: python_cost_per_run(n) for n in (140, 2432)}
    lines += ["", "Host time per run outside the driver (`copy_runs` with a no-op C call in the driver's place): "
              + ", ".join(f"{us:.2f} us at {n} runs" for n, us in per_run.items())
              + ". The driver's own time per `cuMemcpy2DAsync` is measured only on a GPU (`kvplane gpu-check`)."]
    (out_dir / "dma-runs-cpu.json").write_text(json.dumps({"machine": machine, "rows": rows,
                                                           "python_us_per_run": per_run}, indent=1))
    (out_dir / "dma-runs-cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    np.set_printoptions(linewidth=200)
    main()
