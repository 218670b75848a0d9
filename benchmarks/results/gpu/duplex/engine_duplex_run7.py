"""Scratch: engine-level duplex on a gpu-check-sized block-first pool: layer-strided vs
contiguous segments, kernel configs (GPU host)."""

import json
import os
import sys
import time

sys.path.insert(0, ".")
import numpy as np
import torch

import kernels.block_copy as bc
from sglang_ext.dataplane.cuda_transfer_engine import CudaTransferEngine

dev = torch.device("cuda")
L, P, SEGB = 32, 10400, 16 * 8 * 128 * 2  # bytes per segment (bf16 page of K)
W = SEGB // 2
t0 = time.perf_counter()
host = torch.empty((P * L * 2, W), dtype=torch.bfloat16, pin_memory=True)
print(
    "pinned",
    host.numel() * 2 / 2**30,
    "GiB in",
    round(time.perf_counter() - t0, 1),
    "s",
    flush=True,
)
devp = torch.empty((4 * P, W), dtype=torch.bfloat16, device=dev)
eng = CudaTransferEngine(host, devp)
n = P
pages = np.random.default_rng(0).permutation(P)


def idx(a):
    return eng.index_tensor(np.asarray(a))


strided_src = idx(np.concatenate([(pages * L + 0) * 2, (pages * L + 0) * 2 + 1]))
strided_dst_h = idx(np.concatenate([(pages * L + 1) * 2, (pages * L + 1) * 2 + 1]))
contig_src = idx(np.arange(2 * n))
contig_dst_h = idx(np.arange(2 * n, 4 * n))
dst_a = idx(np.arange(2 * n))
src_b = idx(np.arange(2 * n, 4 * n))
nbytes = 2 * n * SEGB


def timeit(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


out = {}
for per_sm, warps in ((3, 8), (3, 4), (2, 8), (4, 4), (2, 4)):
    bc.PROGRAMS_PER_SM, bc.COPY_WARPS = per_sm, warps
    for name, hs, hd in (
        ("strided", strided_src, strided_dst_h),
        ("contig", contig_src, contig_dst_h),
    ):

        def h2d(hs=hs):
            return eng.h2d(hs, dst_a)

        def d2h(hd=hd):
            return eng.d2h(src_b, hd)

        th, td, tb = timeit(h2d), timeit(d2h), timeit(lambda: (h2d(), d2h()))
        r = dict(h2d=nbytes / th / 1e9, d2h=nbytes / td / 1e9, duplex=2 * nbytes / tb / 1e9)
        r["ratio_vs_h2d"] = r["duplex"] / r["h2d"]
        out[f"{name}_{per_sm}sm_w{warps}"] = r
        print(
            f"{name:8s} {per_sm}sm w{warps}: h2d {r['h2d']:5.1f} d2h {r['d2h']:5.1f} duplex {r['duplex']:5.1f} ratio {r['ratio_vs_h2d']:.3f}",
            flush=True,
        )
flat_h = host[: 2 * n]
flat_d = devp[: 2 * n]
out["dma_contiguous_h2d"] = nbytes / timeit(lambda: flat_d.copy_(flat_h, non_blocking=True)) / 1e9
print("dma contiguous h2d", round(out["dma_contiguous_h2d"], 1))
json.dump(
    out, open(os.path.join(os.environ.get("OUT", "/tmp"), "engine_duplex.json"), "w"), indent=1
)
