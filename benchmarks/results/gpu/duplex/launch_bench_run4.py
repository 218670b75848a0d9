"""Scratch: host µs per call of the pieces of a kvplane launch (GPU host)."""

import json
import os
import sys
import time

sys.path.insert(0, ".")
import torch

from kernels.block_copy import copy_segments_triton, fetch_pages_triton
from sglang_ext.dataplane.cuda_transfer_engine import CudaTransferEngine

dev = torch.device("cuda")
host = torch.zeros((4096, 4096), dtype=torch.bfloat16).pin_memory()
devp = torch.zeros((4096, 4096), dtype=torch.bfloat16, device=dev)
eng = CudaTransferEngine(host, devp)
idx = torch.arange(4, device=dev)
s = torch.cuda.Stream()


def i32(*v):
    return torch.tensor(v, dtype=torch.int32, device=dev)


flat, stage, mrow, reqs, starts, counts = (
    i32(1, 2, 3),
    i32(5, 6, 7),
    torch.full((64,), -1, dtype=torch.int32, device=dev),
    i32(0),
    i32(0),
    i32(3),
)
k = torch.zeros((32, 8, 128), dtype=torch.bfloat16, device=dev)
rows = torch.arange(32, device=dev)
flatv = devp.view(-1, 8, 128)
ev = torch.cuda.Event()


def t(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    a = time.perf_counter()
    for _ in range(n):
        fn()
    b = time.perf_counter()
    torch.cuda.synchronize()
    return (b - a) / n * 1e6


out = {
    "record_event_new": t(lambda: torch.cuda.current_stream().record_event()),
    "event_record_reuse": t(lambda: ev.record()),
    "stream_ctx": t(
        lambda: (
            torch.cuda.stream(s).__enter__() or torch.cuda.set_stream(torch.cuda.default_stream())
        )
    ),
    "wait_event": t(lambda: s.wait_event(ev)),
    "current_stream": t(lambda: torch.cuda.current_stream()),
    "copy_segments_triton_n4": t(lambda: copy_segments_triton(host, devp, idx, idx)),
    "fetch_pages_triton": t(
        lambda: fetch_pages_triton(
            host, devp, flat, stage, mrow, reqs, starts, counts, 3, 0, 2, 2048
        )
    ),
    "engine_h2d_n4": t(lambda: eng.h2d(idx, idx)),
    "clock_start_stop": t(lambda: eng.clock.stop("h2d", eng.clock.start("h2d", s), s)),
    "index_copy_x2": t(lambda: (flatv.index_copy_(0, rows, k), flatv.index_copy_(0, rows, k))),
    "get_device_properties": t(lambda: torch.cuda.get_device_properties(dev).multi_processor_count),
}
eng.clock.harvest()
for k_, v in out.items():
    print(f"{k_:28s} {v:8.1f} us")
json.dump(
    out, open(os.path.join(os.environ.get("OUT", "/tmp"), "launch_bench.json"), "w"), indent=1
)
