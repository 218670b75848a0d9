"""Scratch: H2D+D2H overlap of the persistent copy kernel vs programs per SM (GPU host)."""

import json
import os
import sys
import time

sys.path.insert(0, ".")
import torch

import kernels.block_copy as bc

dev = torch.device("cuda")
seg_words = 32768 // 8
N = 12000
host = torch.empty((N, seg_words), dtype=torch.int64).pin_memory()
host2 = torch.empty((N, seg_words), dtype=torch.int64).pin_memory()
devp = torch.empty((N, seg_words), dtype=torch.int64, device=dev)
devp2 = torch.empty((N, seg_words), dtype=torch.int64, device=dev)
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


out = {}
for per_sm in (2, 4, 8, 16):
    bc.PROGRAMS_PER_SM = per_sm

    def h2d():
        return bc.copy_segments_triton(host, devp, sidx, didx)

    def d2h():
        return bc.copy_segments_triton(devp2, host2, didx, sidx)

    def both():
        with torch.cuda.stream(s1):
            h2d()
        with torch.cuda.stream(s2):
            d2h()
        s1.synchronize()
        s2.synchronize()

    th, td, tb = timeit(h2d), timeit(d2h), timeit(both)
    r = dict(
        h2d_gbps=nbytes / th / 1e9, d2h_gbps=nbytes / td / 1e9, duplex_gbps=2 * nbytes / tb / 1e9
    )
    r["duplex_vs_one"] = r["duplex_gbps"] / max(r["h2d_gbps"], r["d2h_gbps"])
    out[f"per_sm_{per_sm}"] = r
    print(per_sm, {k: round(v, 3) for k, v in r.items()}, flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "duplex.json"), "w"), indent=1)
