"""Scratch: duplex of copy-kernel variants (GPU host)."""

import json
import os
import sys
import time

sys.path.insert(0, ".")
import torch
import triton
import triton.language as tl

import kernels.block_copy as bc


@triton.jit
def pair_outer(
    src, dst, sidx, didx, n, SEG: tl.constexpr, BLOCK: tl.constexpr, PROGRAMS: tl.constexpr
):
    for pair in range(tl.program_id(0), n, PROGRAMS):
        s = tl.load(sidx + pair).to(tl.int64)
        d = tl.load(didx + pair).to(tl.int64)
        for off in range(0, SEG, BLOCK):
            o = off + tl.arange(0, BLOCK)
            m = o < SEG
            tl.store(dst + d * SEG + o, tl.load(src + s * SEG + o, mask=m), mask=m)


dev = torch.device("cuda")
sm = torch.cuda.get_device_properties(dev).multi_processor_count
W = 32768 // 8
N = 12000
host = torch.empty((N, W), dtype=torch.int64).pin_memory()
host2 = torch.empty((N, W), dtype=torch.int64).pin_memory()
devp = torch.empty((N, W), dtype=torch.int64, device=dev)
devp2 = torch.empty((N, W), dtype=torch.int64, device=dev)
sidx = torch.randperm(N).to(dev)
didx = torch.arange(N, device=dev)
s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
nbytes = N * 32768


def timeit(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def measure(h2d, d2h):
    def both():
        with torch.cuda.stream(s1):
            h2d()
        with torch.cuda.stream(s2):
            d2h()
        s1.synchronize()
        s2.synchronize()

    th, td, tb = timeit(h2d), timeit(d2h), timeit(both)
    r = dict(h2d=nbytes / th / 1e9, d2h=nbytes / td / 1e9, duplex=2 * nbytes / tb / 1e9)
    r["ratio"] = r["duplex"] / max(r["h2d"], r["d2h"])
    return r


out = {}


def po(src, dst, si, di, progs, warps, block):
    return lambda: pair_outer[(progs,)](
        src, dst, si, di, N, SEG=W, BLOCK=block, PROGRAMS=progs, num_warps=warps
    )


for per_sm in (1, 2, 3):
    for warps in (4, 8):
        for block in (1024, 2048):
            p = per_sm * sm
            out[f"pair_outer_{per_sm}sm_w{warps}_b{block}"] = measure(
                po(host, devp, sidx, didx, p, warps, block),
                po(devp2, host2, didx, sidx, p, warps, block),
            )
for hp, dp in ((3, 1), (2, 1), (4, 2)):
    out[f"pair_outer_asym_h{hp}_d{dp}"] = measure(
        po(host, devp, sidx, didx, hp * sm, 4, 1024), po(devp2, host2, didx, sidx, dp * sm, 4, 1024)
    )
for per_sm in (2, 4):
    bc.PROGRAMS_PER_SM = per_sm
    out[f"flattened_{per_sm}sm"] = measure(
        lambda: bc.copy_segments_triton(host, devp, sidx, didx),
        lambda: bc.copy_segments_triton(devp2, host2, didx, sidx),
    )
out["dma_contiguous"] = measure(
    lambda: devp.copy_(host, non_blocking=True), lambda: host2.copy_(devp2, non_blocking=True)
)
for k, r in sorted(out.items(), key=lambda kv: -kv[1]["ratio"]):
    print(
        f"{k:34s} h2d {r['h2d']:5.1f} d2h {r['d2h']:5.1f} duplex {r['duplex']:5.1f} ratio {r['ratio']:.3f}"
    )
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "duplex2.json"), "w"), indent=1)
