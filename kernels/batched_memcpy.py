"""BatchedMemcpy: many segment copies in ONE ``cuMemcpyBatchAsync`` call, run by the copy engines.

kvplane's Triton copy kernels (``block_copy.py``) move KV over PCIe from SMs: every program they
hold is an SM the layers' kernels cannot use while a fetch runs. On an H200 (``kvplane
gpu-check`` runs 13-16, ``benchmarks/results/gpu/session23-h200-runs.md``) that made a
placement whose fetches the model hides cost 28-40% over all-resident even at 8 programs, and a
wave-quantised GEMM loses a whole wave to a single busy SM. The driver's batched memcpy (CUDA
12.8+) takes arrays of ``(dst, src, size)`` and runs them on the DMA copy engines, leaving every
SM to the layers; ``CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE`` asks the driver to prefer the
copy engines (the CUDA 13.1 release notes: "now supported on non-Tegra platforms for the
batched memcpy APIs ... the driver favors Copy Engines to overlap transfers with compute and
keep SMs free"; a hint, the driver decides). NVIDIA's TensorRT-LLM KV cache
manager copies KV pages the same way. One call per (layer, direction) keeps SuperInfer's
batched transfer (§4.3.2): the host builds two pointer arrays (NumPy, ``O(segments)``) instead
of launching a kernel.

The driver entry point is bound with :mod:`ctypes` from ``libcuda.so.1`` (always loaded where
PyTorch runs on CUDA) through ``cuGetProcAddress`` at the ABI of the driver's version: CUDA 13.0
dropped the ``failIdx`` argument of 12.8's signature. Attributes: source access in stream order
(the pinned host pool is written by earlier copies on other streams, ordered by events), no
location hints (pinned and device memory have fixed locations), the overlap flag. Pinned host
memory is addressed by its host pointer (unified virtual addressing).

Opt-in (``--kv-copy-engine dma``): ``kvplane gpu-check`` measures it beside the Triton kernels
(transfer GB/s, duplex and the overlap figure) before it can become the default. Nothing here
runs on the CPU but :func:`segment_pointers`, the pointer arithmetic, which the tests check
against the index reference.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

SRC_ACCESS_ORDER_STREAM = 1
"""``CU_MEMCPY_SRC_ACCESS_ORDER_STREAM``: sources are read in stream order."""
FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1
"""``CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE``."""
MIN_DRIVER = 12080
"""``cuMemcpyBatchAsync`` exists from CUDA 12.8."""
ABI_WITHOUT_FAIL_IDX = 13000
"""From CUDA 13.0 the call has no ``failIdx`` argument."""
PROBE_BYTES = 2 << 20
"""Page-locked probe buffer (an anonymous mapping of its own)."""
MAX_BATCH = 8192
"""Copies per call: a larger batch is split (vLLM issue #49276 reports crashes or hangs near 51K
descriptors in one call; a layer's fetch at Llama-3-8B shapes is ~10^4 segments)."""


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation),
                ("dstLocHint", _MemLocation), ("flags", ctypes.c_uint)]


def segment_pointers(src: torch.Tensor, dst: torch.Tensor, src_idx: np.ndarray,
                     dst_idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dsts, srcs, sizes)`` (uint64) of the copies ``dst[dst_idx[i]] = src[src_idx[i]]`` between
    two contiguous 2-D tensors of equal row size: row ``i`` of a tensor starts at ``data_ptr() +
    i * row_bytes``."""
    row = row_bytes(src, dst)
    s = np.asarray(src_idx, dtype=np.uint64) * np.uint64(row) + np.uint64(src.data_ptr())
    d = np.asarray(dst_idx, dtype=np.uint64) * np.uint64(row) + np.uint64(dst.data_ptr())
    return d, s, np.full(s.size, row, dtype=np.uint64)


def row_bytes(src: torch.Tensor, dst: torch.Tensor) -> int:
    """The row size of two contiguous 2-D tensors of equal row bytes (``ValueError`` otherwise):
    row ``i`` of each starts at ``data_ptr() + i * row``."""
    if src.dim() != 2 or dst.dim() != 2 or src.shape[1] * src.element_size() != dst.shape[1] * dst.element_size():
        raise ValueError(f"copy-engine rows: 2-D tensors of equal row bytes, got {tuple(src.shape)} "
                         f"{src.dtype} and {tuple(dst.shape)} {dst.dtype}")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("copy-engine rows: tensors must be contiguous")
    return src.shape[1] * src.element_size()


class BatchedMemcpy:
    """The driver's ``cuMemcpyBatchAsync`` bound at the driver's ABI (module docstring).
    Construction raises ``RuntimeError`` naming what is missing (no driver, too old, no entry)."""

    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise RuntimeError(f"batched memcpy: the CUDA driver library is not loadable ({exc})") from exc
        self._lib = lib
        version = ctypes.c_int(0)
        _check(lib.cuDriverGetVersion(ctypes.byref(version)), "cuDriverGetVersion")
        self.driver_version = version.value
        if version.value < MIN_DRIVER:
            raise RuntimeError(f"batched memcpy needs a CUDA 12.8+ driver; this one is {_version(version.value)}")
        abi = ABI_WITHOUT_FAIL_IDX if version.value >= ABI_WITHOUT_FAIL_IDX else MIN_DRIVER
        get = lib.cuGetProcAddress_v2
        get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64,
                        ctypes.POINTER(ctypes.c_int)]
        get.restype = ctypes.c_int
        pfn, status = ctypes.c_void_p(0), ctypes.c_int(0)
        _check(get(b"cuMemcpyBatchAsync", ctypes.byref(pfn), abi, 0, ctypes.byref(status)), "cuGetProcAddress")
        if not pfn.value:
            raise RuntimeError(f"batched memcpy: the driver ({_version(version.value)}) has no cuMemcpyBatchAsync "
                               f"(symbol status {status.value})")
        head = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                ctypes.POINTER(_MemcpyAttributes), ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t]
        self.fail_idx = abi < ABI_WITHOUT_FAIL_IDX
        """The 12.8 ABI: a ``failIdx`` pointer before the stream."""
        tail = [ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p] if self.fail_idx else [ctypes.c_void_p]
        self._fn: Any = ctypes.CFUNCTYPE(ctypes.c_int, *head, *tail)(pfn.value)
        self._attrs = _MemcpyAttributes(SRC_ACCESS_ORDER_STREAM, _MemLocation(0, 0), _MemLocation(0, 0),
                                        FLAG_PREFER_OVERLAP_WITH_COMPUTE)
        self._first = ctypes.c_size_t(0)
        self._failed = ctypes.c_size_t(0)
        self.calls = 0
        self.copies = 0
        """Copies enqueued since construction."""
        self.call_seconds = 0.0
        """Host time inside the driver calls (what a copy entry costs the host: ``kvplane
        gpu-check`` reports it per copy, to weigh against one 2-D copy per run of pages)."""

    def register(self, ptr: int, nbytes: int) -> None:
        """Page-lock host memory with the driver (``cuMemHostRegister``: an error leaves no
        sticky runtime error behind, unlike the runtime's ``cudaHostRegister``)."""
        _check(self._lib.cuMemHostRegister_v2(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes), ctypes.c_uint(0)),
               "cuMemHostRegister")

    def unregister(self, ptr: int) -> None:
        _check(self._lib.cuMemHostUnregister(ctypes.c_void_p(ptr)), "cuMemHostUnregister")

    def reset_counts(self) -> None:
        """Forget the calls so far (a probe's, before serving)."""
        self.calls = self.copies = 0
        self.call_seconds = 0.0

    def copy(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        """Enqueue the copies ``(dsts[i], srcs[i], sizes[i])`` (uint64 arrays, read during the
        call) on the CUDA stream handle ``stream`` (``torch.cuda.Stream.cuda_stream``; not the
        legacy default stream)."""
        n = int(dsts.size)
        if n == 0:
            return
        if not (srcs.size == sizes.size == n and dsts.dtype == srcs.dtype == sizes.dtype == np.uint64):
            raise ValueError("BatchedMemcpy.copy: three uint64 arrays of equal length")
        d, s, z = (np.ascontiguousarray(a) for a in (dsts, srcs, sizes))
        for at in range(0, n, MAX_BATCH):
            k = min(MAX_BATCH, n - at)
            args = [d.ctypes.data + 8 * at, s.ctypes.data + 8 * at, z.ctypes.data + 8 * at, k,
                    ctypes.byref(self._attrs), ctypes.byref(self._first), 1]
            if self.fail_idx:
                args.append(ctypes.byref(self._failed))
            t0 = time.perf_counter()
            rc = self._fn(*args, ctypes.c_void_p(stream))
            self.call_seconds += time.perf_counter() - t0
            self.calls += 1
            self.copies += k
            if rc != 0:
                raise RuntimeError(f"cuMemcpyBatchAsync of {k} copies failed: CUresult {rc}")


def make_current(device: torch.device | str) -> int:
    """Make ``device``'s primary context current on this thread (``cuda`` without an index: the
    current device); returns the device that was current, for the caller to restore.
    ``cuMemHostRegister`` registers with the current context, and a fresh process (the probe
    child) has none until the runtime makes one: the call then fails with
    ``CUDA_ERROR_NOT_INITIALIZED`` (CUresult 3, ``kvplane gpu-check`` run 17 on an H200, the copy
    engines' first GPU run)."""
    before = torch.cuda.current_device()  # initialises the runtime where nothing did yet
    where = torch.device(device)
    index = before if where.index is None else where.index
    torch.cuda.set_device(index)
    torch.empty(1, device=f"cuda:{index}")  # an allocation: the runtime creates the primary context
    return before


@contextmanager
def registered_pages(registrar: BatchedMemcpy, device: torch.device | str | None = None) -> Iterator[torch.Tensor]:
    """:data:`PROBE_BYTES` of pageable memory of its own (an anonymous mapping: page-aligned, as the
    host pool's), page-locked with the driver while the block runs, as float32; ``device``: made
    current first (:func:`make_current`; None: the caller's context is current already)."""
    import mmap

    before = None if device is None else make_current(device)
    try:
        pages = mmap.mmap(-1, PROBE_BYTES)
        whole = torch.frombuffer(pages, dtype=torch.float32)
        registrar.register(whole.data_ptr(), PROBE_BYTES)
        try:
            yield whole
        finally:
            registrar.unregister(whole.data_ptr())  # the mapping goes with its last tensor
    finally:
        if before is not None:  # the caller's current device again (a server's is its own)
            torch.cuda.set_device(before)


def probe_sources(whole: torch.Tensor, rows: int, host: torch.Tensor | None) -> list[torch.Tensor]:
    """A probe's sources: ``rows`` known rows of 4 float32 in ``pin_memory()`` memory and in the
    registered ``whole`` (:func:`registered_pages`), and the first three rows of ``host`` (the
    pool: read, never written) if given."""
    registered = whole[: rows * 4].view(rows, 4)
    registered.copy_(torch.arange(rows * 4, dtype=torch.float32).view(rows, 4) + 10)
    sources = [torch.arange(rows * 4, dtype=torch.float32).view(rows, 4).pin_memory(), registered]
    return sources if host is None else [*sources, host[:3]]


def probe(dma: BatchedMemcpy, device: torch.device | str = "cuda", host: torch.Tensor | None = None) -> None:
    """Known copies each way on a side stream, from and to page-locked host memory of both
    kinds: ``pin_memory()`` (``cudaHostAlloc``) and registered pageable memory (an anonymous
    mapping, page-locked in place), as the host KV pool is (``sglang_ext/dataplane/host_pool.py``); ``host`` (2-D, registered):
    the caller's own pool, whose first rows are copied to the device and back, unchanged. Raises
    ``RuntimeError`` if what arrives is not what was sent."""
    with registered_pages(dma, device) as whole:
        for src in probe_sources(whole, 2, host):
            rows = src.shape[0]
            dev = torch.zeros(src.shape, dtype=src.dtype, device=device)
            back = torch.zeros(src.shape, dtype=src.dtype).pin_memory()
            stream = torch.cuda.Stream(device=device)
            stream.wait_stream(torch.cuda.current_stream(device))  # the zero-fill comes first
            order = np.arange(rows)[::-1].copy()
            with torch.cuda.stream(stream):
                dma.copy(*segment_pointers(src, dev, order, np.arange(rows)), stream.cuda_stream)
                dma.copy(*segment_pointers(dev, back, np.arange(rows), order), stream.cuda_stream)
            stream.synchronize()
            if not torch.equal(back.view(torch.uint8), src.view(torch.uint8)):  # bytes: NaN-safe
                raise RuntimeError(f"batched memcpy probe: sent {src.tolist()[:2]}, got back {back.tolist()[:2]}")


def probe_in_subprocess(device: int = 0, timeout_s: float = 120.0) -> str | None:
    """Run :func:`probe` on CUDA device ``device`` in a child process (``python -m
    kernels.batched_memcpy DEVICE``): a driver that takes the call with another ABI, or faults on
    the memory, could crash the process or leave its CUDA context dead, and neither a server
    nor `kvplane gpu-check` may die of it. None when it copied right, else why not."""
    return probe_stages_in_subprocess(device, timeout_s, "kernels.batched_memcpy", ("ok",))[0]


def probe_stages_in_subprocess(device: int, timeout_s: float, module: str,
                               stages: tuple[str, ...]) -> list[str | None]:
    """Run ``python -m module DEVICE`` (a probe child, as :func:`probe_in_subprocess`), which
    prints one line per stage it passed, in order: per stage, None when its line came, else why
    not (the exit status and the child's last line; a stage after a failed one is not probed).
    One child for several probes: each costs a process start and a CUDA context."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    try:
        done = subprocess.run([sys.executable, "-m", module, str(device)], capture_output=True, text=True,
                              timeout=timeout_s, check=False, cwd=root, env=env)
        out, why = done.stdout, None
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
            why = f"the probe exited with {done.returncode}: {tail[0][:300]}"
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        why = f"the probe did not finish in {timeout_s:.0f} s"
    passed = {line.strip() for line in out.splitlines()}
    result: list[str | None] = []
    failed: str | None = None
    for stage in stages:
        if failed is None and stage in passed:
            result.append(None)
            continue
        failed = failed or why or f"the probe exited without passing {stage!r}"
        result.append(failed)
    return result


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"batched memcpy: {what} failed with CUresult {rc}")


def _version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


if __name__ == "__main__":  # the child of probe_in_subprocess
    import sys

    probe(BatchedMemcpy(), f"cuda:{int(sys.argv[1]) if len(sys.argv) > 1 else 0}")
    print("ok")
