"""Scratch (session 16, GPU host): copy-engine batched copies (cuMemcpyBatchAsync through ctypes)
against the Triton segment copy, on a block-first pinned pool, one direction and duplex, with
the host time per call. Prints one line per figure and writes dma_probe.json under $OUT."""

import ctypes
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, ".")
import numpy as np
import torch

import kernels.block_copy as bc

out: dict = {}
try:
    hdr = subprocess.run(
        "grep -n -A3 'cuMemcpyBatchAsync\\b\\|cuMemcpyBatchAsync_v2\\|define cuMemcpyBatchAsync' "
        "/usr/local/cuda/include/cuda.h | head -40", shell=True, capture_output=True, text=True).stdout
    out["header"] = hdr
    print(hdr)
except Exception as exc:  # noqa: BLE001
    print("header grep failed", exc)

lib = ctypes.CDLL("libcuda.so.1")
fn_v2 = getattr(lib, "cuMemcpyBatchAsync_v2", None)
fn_v1 = getattr(lib, "cuMemcpyBatchAsync", None)
print("symbols: v2", fn_v2 is not None, "v1", fn_v1 is not None)
ver = ctypes.c_int()
lib.cuDriverGetVersion(ctypes.byref(ver))
out["driver_version"] = ver.value
print("driver", ver.value)


class MemLoc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class Attrs(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", MemLoc), ("dstLocHint", MemLoc),
                ("flags", ctypes.c_uint)]


P = ctypes.c_void_p
if fn_v2 is not None:
    fn_v2.argtypes = [P, P, P, ctypes.c_size_t, P, P, ctypes.c_size_t, P]
    fn_v2.restype = ctypes.c_int
if fn_v1 is not None:
    fn_v1.argtypes = [P, P, P, ctypes.c_size_t, P, P, ctypes.c_size_t, P, P]
    fn_v1.restype = ctypes.c_int

dev = torch.device("cuda")
L, HB, WORDS = 8, 6000, 32768 // 8  # segments of 32 KiB (Llama-3-8B: 16 x 8 x 128 bf16)
host = torch.empty((HB * L * 2, WORDS), dtype=torch.int64)
nbytes_host = host.numel() * 8
cudart = torch.cuda.cudart()
assert int(cudart.cudaHostRegister(host.data_ptr(), nbytes_host, 0)) == 0
host.view(-1)[:: 997] = 7
N = 5000
stage = torch.zeros((2 * N, WORDS), dtype=torch.int64, device=dev)
dev_src = torch.randint(0, 1 << 40, (2 * N, WORDS), dtype=torch.int64, device=dev)
layer = 3
pages = np.random.default_rng(0).permutation(HB)[:N].astype(np.int64)
src_seg = np.concatenate([(pages * L + layer) * 2, (pages * L + layer) * 2 + 1])
dst_seg = np.concatenate([np.arange(N), np.arange(N) + N]).astype(np.int64)
wb_pages = np.random.default_rng(1).permutation(HB)[:N].astype(np.int64)
wb_seg = np.concatenate([(wb_pages * L + 5) * 2, (wb_pages * L + 5) * 2 + 1])
SEG = WORDS * 8
nbytes = 2 * N * SEG
s_h2d, s_d2h = torch.cuda.Stream(), torch.cuda.Stream()


def attrs_for(h2d: bool, hints: bool, flags: int):
    a = Attrs()
    a.srcAccessOrder = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    if hints:
        a.srcLocHint = MemLoc(2 if h2d else 1, 0)  # HOST=2 / DEVICE=1
        a.dstLocHint = MemLoc(1 if h2d else 2, 0)
    a.flags = flags
    return a


def batch_fn(h2d: bool, hints: bool = True, flags: int = 0, chunk: int = 0):
    a = attrs_for(h2d, hints, flags)
    idx0 = (ctypes.c_size_t * 1)(0)
    fail = ctypes.c_size_t(0)
    hbase, dbase = host.data_ptr(), (stage if h2d else dev_src).data_ptr()
    hseg = src_seg if h2d else wb_seg
    stream = s_h2d if h2d else s_d2h

    def run():
        h = (hbase + hseg * SEG).astype(np.uint64)
        d = (dbase + dst_seg * SEG).astype(np.uint64)
        srcs, dsts = (h, d) if h2d else (d, h)
        sizes = np.full(len(srcs), SEG, dtype=np.uint64)
        step = chunk or len(srcs)
        for s in range(0, len(srcs), step):
            n = min(step, len(srcs) - s)
            args = (dsts[s:].ctypes.data, srcs[s:].ctypes.data, sizes[s:].ctypes.data, n,
                    ctypes.byref(a), idx0, 1)
            if fn_v2 is not None:
                rc = fn_v2(*args, ctypes.c_void_p(stream.cuda_stream))
            else:
                rc = fn_v1(*args, ctypes.byref(fail), ctypes.c_void_p(stream.cuda_stream))
            if rc != 0:
                raise RuntimeError(f"cuMemcpyBatchAsync rc={rc} fail={fail.value}")
    return run


def triton_fn(h2d: bool):
    si = torch.from_numpy(src_seg).to(dev)
    di = torch.from_numpy(dst_seg).to(dev)
    wi = torch.from_numpy(wb_seg).to(dev)
    stream = s_h2d if h2d else s_d2h

    def run():
        with torch.cuda.stream(stream):
            if h2d:
                bc.copy_segments_triton(host, stage, si, di)
            else:
                bc.copy_segments_triton(dev_src, host, di, wi)
    return run


contig_h = host[: 2 * N]
contig_h2 = host[2 * N: 4 * N]


def contig_fn(h2d: bool):
    stream = s_h2d if h2d else s_d2h

    def run():
        with torch.cuda.stream(stream):
            if h2d:
                stage.copy_(contig_h, non_blocking=True)
            else:
                contig_h2.copy_(dev_src, non_blocking=True)
    return run


def timeit(fn, reps=6):
    fn()
    torch.cuda.synchronize()
    host_t = 0.0
    t = time.perf_counter()
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        host_t += time.perf_counter() - t0
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps, host_t / reps


def measure(name, mk):
    try:
        h, d = mk(True), mk(False)

        def both():
            h()
            d()
        (th, hh), (td, hd), (tb, _) = timeit(h), timeit(d), timeit(both)
        r = dict(h2d=nbytes / th / 1e9, d2h=nbytes / td / 1e9, duplex=2 * nbytes / tb / 1e9,
                 host_ms_h2d_call=hh * 1e3, host_ms_d2h_call=hd * 1e3, segments=2 * N)
        r["ratio"] = r["duplex"] / max(r["h2d"], r["d2h"])
        out[name] = r
        print(f"{name:28s} h2d {r['h2d']:5.1f} d2h {r['d2h']:5.1f} duplex {r['duplex']:5.1f} "
              f"ratio {r['ratio']:.3f} host ms/call {hh * 1e3:.3f}/{hd * 1e3:.3f}", flush=True)
    except Exception as exc:  # noqa: BLE001
        out[name] = {"error": repr(exc)}
        print(name, "ERROR", repr(exc), flush=True)


measure("contiguous_copy_", contig_fn)
measure("triton_segments", triton_fn)
measure("dma_batch_hints", lambda h2d: batch_fn(h2d, True))
measure("dma_batch_nohints", lambda h2d: batch_fn(h2d, False))
measure("dma_batch_overlapflag", lambda h2d: batch_fn(h2d, True, 1))
measure("dma_batch_chunk1024", lambda h2d: batch_fn(h2d, True, 0, 1024))
# correctness: the batch fetch equals the gather
try:
    stage.zero_()
    batch_fn(True)()
    torch.cuda.synchronize()
    ref = host[torch.from_numpy(src_seg)]
    out["dma_fetch_equal"] = bool(torch.equal(stage.cpu(), ref))
    host_before = host[torch.from_numpy(wb_seg)].clone()
    batch_fn(False)()
    torch.cuda.synchronize()
    out["dma_writeback_equal"] = bool(torch.equal(host[torch.from_numpy(wb_seg)], dev_src.cpu()))
    out["dma_writeback_changed"] = not bool(torch.equal(host_before, host[torch.from_numpy(wb_seg)]))
    print("correct:", out["dma_fetch_equal"], out["dma_writeback_equal"], out["dma_writeback_changed"])
except Exception as exc:  # noqa: BLE001
    print("correctness ERROR", repr(exc))
# per-entry driver cost: small batches
for n in (1, 64, 1024, 8192):
    try:
        a = attrs_for(True, True, 0)
        idx0 = (ctypes.c_size_t * 1)(0)
        d = (stage.data_ptr() + np.arange(n, dtype=np.uint64) % (2 * N) * SEG).astype(np.uint64)
        s = (host.data_ptr() + np.arange(n, dtype=np.uint64) * SEG).astype(np.uint64)
        z = np.full(n, 4096, dtype=np.uint64)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(20):
            fn_v2(d.ctypes.data, s.ctypes.data, z.ctypes.data, n, ctypes.byref(a), idx0, 1,
                  ctypes.c_void_p(s_h2d.cuda_stream))
        host_us = (time.perf_counter() - t) / 20 * 1e6
        torch.cuda.synchronize()
        out[f"call_us_{n}"] = host_us
        print(f"batch of {n} x 4 KiB: {host_us:.1f} us host per call")
    except Exception as exc:  # noqa: BLE001
        print("small batch ERROR", repr(exc))
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "dma_probe.json"), "w"), indent=1)
