"""Scratch (session 16, GPU host): the segment-copy kernel's settings A/B, interleaved (three
rounds), on a block-first pinned pool: one layer's K and V of 4000 pages (layer-strided, as a
per-layer fetch reads them), H2D, D2H and both together, against one contiguous pinned copy.
A = the shipped settings (BLOCK 1024 words, 4 warps, 3 programs per SM); B, C from run 10's sweep."""

import json
import os
import statistics
import sys
import time

sys.path.insert(0, ".")
import torch

import kernels.block_copy as bc

dev = "cuda"
HB, LL, W = 4000, 32, 32768 // 8
host = torch.empty((HB * LL * 2, W), dtype=torch.int64)
assert int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel() * 8, 0)) == 0
stage = torch.empty((2 * HB, W), dtype=torch.int64, device=dev)
src = torch.cat([torch.arange(HB) * LL * 2 + 6, torch.arange(HB) * LL * 2 + 7]).to(dev)
dst = torch.arange(2 * HB, device=dev)
wb = torch.cat([torch.arange(HB) * LL * 2 + 10, torch.arange(HB) * LL * 2 + 11]).to(dev)
nbytes = 2 * HB * W * 8
s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
CONFIGS = {"A_b1024_w4_p3": (1024, 4, 3), "B_b4096_w4_p2": (4096, 4, 2), "C_b4096_w4_p3": (4096, 4, 3)}


def timeit(fn, reps=6):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def use(cfg):
    bc.COPY_BLOCK_ELEMS, bc.COPY_WARPS, bc.PROGRAMS_PER_SM = cfg


def h2d():
    with torch.cuda.stream(s1):
        bc.copy_segments_triton(host, stage, src, dst)


def d2h():
    with torch.cuda.stream(s2):
        bc.copy_segments_triton(stage, host, dst, wb)


def both():
    h2d()
    d2h()


out = {name: [] for name in CONFIGS}
contig = []
for rnd in range(3):
    contig.append(nbytes / timeit(lambda: stage.copy_(host[: 2 * HB], non_blocking=True)) / 1e9)
    for name, cfg in CONFIGS.items():
        use(cfg)
        th, td, tb = timeit(h2d), timeit(d2h), timeit(both)
        r = {"h2d": nbytes / th / 1e9, "d2h": nbytes / td / 1e9, "duplex": 2 * nbytes / tb / 1e9}
        r["h2d_vs_contig"] = r["h2d"] / contig[-1]
        r["ratio"] = r["duplex"] / max(r["h2d"], r["d2h"])
        out[name].append(r)
        print(f"round {rnd} {name}: h2d {r['h2d']:.1f} ({r['h2d_vs_contig']:.3f}) d2h {r['d2h']:.1f} "
              f"duplex {r['duplex']:.1f} ratio {r['ratio']:.3f}", flush=True)
summary = {name: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for name, rows in out.items()}
for name, m in summary.items():
    print(f"median {name}: h2d/contig {m['h2d_vs_contig']:.3f} duplex ratio {m['ratio']:.3f}")
json.dump({"rounds": out, "contiguous_gbps": contig, "median": summary},
          open(os.path.join(os.environ.get("OUT", "/tmp"), "copy_ab.json"), "w"), indent=1)
