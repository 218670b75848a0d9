"""Scratch (session 16, GPU host): where kvplane's host time per decode step goes at gpu-check's
Llama-3-8B shapes (boundary vs per-layer calls, cProfile by function, torch ops per phase), what
SGLang's own KV write (two index_put per layer into flat buffers) costs on the same host, and a
sweep of the segment-copy kernel's BLOCK / warps / programs for H2D, D2H and duplex."""

import collections
import cProfile
import io
import json
import os
import pstats
import sys
import time

sys.path.insert(0, ".")
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kernels.block_copy as bc
from sglang_ext.tools.gpu_check_batch import CheckBatch
from sglang_ext.tools.gpu_check_config import PRESETS

OUT = os.environ.get("OUT", "/tmp")
res: dict = {}
dev = os.environ.get("PROBE_DEV", "cuda")
cfg = PRESETS["llama3-8b" if dev == "cuda" else "small"]
if dev == "cpu":
    torch.cuda.synchronize = lambda *a: None
t = time.perf_counter()
b = CheckBatch(cfg, dev)
res["setup_s"] = time.perf_counter() - t
core = b.core
L = cfg.layers
split = {"boundary": 0.0, "enter": 0.0, "write": 0.0, "exit": 0.0}


def step(timed=False):
    t0 = time.thread_time()
    loc = b.begin_decode()
    t1 = time.thread_time()
    for layer in range(L):
        a = time.thread_time()
        core.enter_layer(layer)
        c = time.thread_time()
        core.write(layer, loc, b.k1, b.v1)
        d = time.thread_time()
        core.exit_layer(layer)
        e = time.thread_time()
        if timed:
            split["enter"] += c - a
            split["write"] += d - c
            split["exit"] += e - d
    if timed:
        split["boundary"] += t1 - t0


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, f, types, args=(), kwargs=None):
        self.ops[str(f)] += 1
        return f(*args, **(kwargs or {}))


def phase(name, steps=10):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    for k in split:
        split[k] = 0.0
    for _ in range(steps):
        step(True)
        torch.cuda.synchronize()
    res[name] = {k: v / steps * 1e3 for k, v in split.items()}
    res[name]["total_ms"] = sum(res[name].values())
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        step()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
    res[name + "_profile"] = s.getvalue()
    m = Ops()
    with m:
        step()
    res[name + "_ops"] = dict(m.ops)
    print(name, json.dumps(res[name]), "ops/step", sum(m.ops.values()), flush=True)


phase("resident")
b.place([[1 if (layer % 2 == 0) else 0 for layer in range(L)] for _ in b.rids])
torch.cuda.synchronize()
phase("placed")
# SGLang's own KV write on this host: two index_put per layer into flat [tokens, H, D] buffers
kbuf = torch.empty((200_000, cfg.kv_heads, cfg.head_dim), dtype=b.dtype, device=dev)
vbuf = torch.empty_like(kbuf)
loc = torch.arange(b.k1.shape[0], device=dev) * 7
for _ in range(3):
    for _ in range(L):
        kbuf[loc] = b.k1
        vbuf[loc] = b.v1
torch.cuda.synchronize()
t0 = time.thread_time()
for _ in range(10):
    for _ in range(L):
        kbuf[loc] = b.k1
        vbuf[loc] = b.v1
res["vanilla_write_ms_per_step"] = (time.thread_time() - t0) / 10 * 1e3
print("vanilla-style write ms/step", res["vanilla_write_ms_per_step"], flush=True)
b = core = None  # the batch's pools go before the sweep's
if dev == "cpu":
    sys.exit(0)
torch.cuda.empty_cache()

# ---- copy kernel sweep: one layer's K and V of HB block-first pages ----------------------
HB, LL, W = 4000, 32, 32768 // 8
host = torch.empty((HB * LL * 2, W), dtype=torch.int64)
assert int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel() * 8, 0)) == 0
stage = torch.empty((2 * HB, W), dtype=torch.int64, device=dev)
src = torch.cat([torch.arange(HB) * LL * 2 + 6, torch.arange(HB) * LL * 2 + 7]).to(dev)
dst = torch.arange(2 * HB, device=dev)
wb = torch.cat([torch.arange(HB) * LL * 2 + 10, torch.arange(HB) * LL * 2 + 11]).to(dev)
nbytes = 2 * HB * W * 8
s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()


def timeit(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def launch(s, d, si, di, block, warps, per_sm):
    progs = per_sm * torch.cuda.get_device_properties(0).multi_processor_count
    bc._copy_segments_kernel[(progs,)](s, d, si, di, si.numel(), progs, SEG=W, BLOCK=block, num_warps=warps)


sweep = {}
contig = timeit(lambda: stage.copy_(host[: 2 * HB], non_blocking=True))
sweep["contiguous_gbps"] = nbytes / contig / 1e9
for block in (1024, 2048, 4096):
    for warps in (4, 8):
        for per_sm in (2, 3, 4):
            try:
                def h2d(block=block, warps=warps, per_sm=per_sm):
                    with torch.cuda.stream(s1):
                        launch(host, stage, src, dst, block, warps, per_sm)

                def d2h(block=block, warps=warps, per_sm=per_sm):
                    with torch.cuda.stream(s2):
                        launch(stage, host, dst, wb, block, warps, per_sm)

                def both():
                    h2d()
                    d2h()
                th, td, tb = timeit(h2d), timeit(d2h), timeit(both)
                r = dict(h2d=nbytes / th / 1e9, d2h=nbytes / td / 1e9, duplex=2 * nbytes / tb / 1e9)
                r["h2d_vs_contig"] = r["h2d"] / sweep["contiguous_gbps"]
                r["ratio"] = r["duplex"] / max(r["h2d"], r["d2h"])
                sweep[f"b{block}_w{warps}_p{per_sm}"] = r
                print(f"b{block} w{warps} p{per_sm}: h2d {r['h2d']:.1f} ({r['h2d_vs_contig']:.3f}) "
                      f"d2h {r['d2h']:.1f} duplex {r['duplex']:.1f} ratio {r['ratio']:.3f}", flush=True)
            except Exception as exc:  # noqa: BLE001
                print(block, warps, per_sm, "ERROR", repr(exc)[:200], flush=True)
res["copy_sweep"] = sweep
print("contiguous", sweep["contiguous_gbps"])
json.dump(res, open(os.path.join(OUT, "host_time_probe.json"), "w"), indent=1)
print(res["resident_profile"][:3500])
print(res["placed_profile"][:3500])
print("resident ops", res["resident_ops"])
