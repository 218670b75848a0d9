"""PitchedMemcpy: a layer's fetch as a few strided runs on the copy engines, not one copy per page.

The host pool is block-first (SuperInfer §4.3.2): host row ``page * 2L + 2 * layer`` holds the
K of one layer-page and the next row its V, so one layer's pages sit ``2L`` rows apart on the
host while their staging pages are consecutive on the device. ``cuMemcpyBatchAsync``
(:mod:`kernels.batched_memcpy`) takes one descriptor per 32 KiB segment and its host cost is per
descriptor: 1.2-2 us each on an H100 (``benchmarks/results/gpu/duplex/dma-batch-probe-run9-*``:
1,024 copies in 1.2 ms, 8,192 in 17 ms). A half-offloaded Llama-3-8B decode step at batch 32
fetches ~330K segments, so that path costs the host ~0.5 s a step; even a placement the model
hides (~14K segments) would cost ~20 ms against a 12 ms step.

The same copy is a few strided runs: consecutive host pages of one request at one layer
(source rows ``2L`` apart) into consecutive staging pages (rows 1 apart), K and V each. One 2-D
copy (``cuMemcpy2DAsync``: ``Height`` rows of ``WidthInBytes`` at a source and a destination
pitch) moves a run, still on the copy engines, so the host cost is per run: 2,432 runs for
those 328,512 segments at ``kvplane gpu-check``'s shapes, 140 for the hidden placement's 14,724,
once staging pages are handed out ascending (:class:`~sglang_ext.dataplane.staging_room.StagingRoom`;
``benchmarks/results/core/dma-runs/``).

:func:`strided_runs` finds the runs (NumPy, ``O(segments)`` at memory speed), and
:func:`plan_runs` adds runs at a host step of their own for what is left single (a long
decode's pages interleave across the batch: :func:`free_pitch_runs`);
:class:`PitchedMemcpy` binds ``cuMemcpy2DAsync_v2`` from ``libcuda.so.1`` with :mod:`ctypes`
(``CUDA_MEMCPY2D``: the layout of ``cuda.h`` since CUDA 3.2, size_t fields; both operands
``CU_MEMORYTYPE_UNIFIED``, addressed by their unified virtual addresses, pinned host memory
included) and fills the descriptors of a call in one NumPy record array. Nothing here runs on
the CPU but the run planning, which the tests check against the segment lists; the copies
are checked at the pointer level by the stream-order checker and on a GPU by the probe.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any

import numpy as np

MEMORYTYPE_UNIFIED = 4
"""``CU_MEMORYTYPE_UNIFIED``: the operand's ``*Device`` field is a unified virtual address."""


class _Memcpy2D(ctypes.Structure):
    """``CUDA_MEMCPY2D`` (``CUDA_MEMCPY2D_v2`` of ``cuda.h``)."""

    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int),
                ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
                ("srcPitch", ctypes.c_size_t),
                ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int),
                ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
                ("dstPitch", ctypes.c_size_t),
                ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t)]


RECORD = np.dtype({
    "names": [name for name, _ in _Memcpy2D._fields_],
    "formats": [np.int32 if kind is ctypes.c_int else np.uint64 for _, kind in _Memcpy2D._fields_],
    "offsets": [getattr(_Memcpy2D, name).offset for name, _ in _Memcpy2D._fields_],
    "itemsize": ctypes.sizeof(_Memcpy2D),
})
"""One ``CUDA_MEMCPY2D`` as a NumPy record (the struct's own offsets: 128 bytes on x86-64)."""


def strided_runs(src_idx: np.ndarray, dst_idx: np.ndarray, src_step: int,
                 dst_step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The copies ``dst[dst_idx[i]] = src[src_idx[i]]`` as maximal runs ``(src_start, dst_start,
    length)``: pair ``i`` continues the run of pair ``i - 1`` when its source row is ``src_step``
    rows on and its destination ``dst_step`` on. Run ``r`` copies rows ``src_start[r] + k *
    src_step`` to ``dst_start[r] + k * dst_step`` for ``k < length[r]``: the pairs, in order
    (any input: a pair that continues nothing starts a run of 1)."""
    if src_step < 1 or dst_step < 1:
        raise ValueError(f"strided_runs: steps must be >= 1 (a pitch at least one row), got {src_step}, {dst_step}")
    src = np.asarray(src_idx, dtype=np.int64)
    dst = np.asarray(dst_idx, dtype=np.int64)
    if src.shape != dst.shape or src.ndim != 1:
        raise ValueError(f"strided_runs: two 1-D index arrays of one length, got {src.shape} and {dst.shape}")
    if not src.size:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    breaks = (np.diff(src) != src_step) | (np.diff(dst) != dst_step)
    starts = np.concatenate([[0], np.flatnonzero(breaks) + 1])
    lengths = np.diff(np.append(starts, src.size))
    return src[starts], dst[starts], lengths


def free_pitch_runs(fixed_idx: np.ndarray, free_idx: np.ndarray, fixed_step: int,
                    max_step: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Runs whose ``fixed_idx`` advance by ``fixed_step`` and whose ``free_idx`` advance by a
    constant step of their own (``1..max_step``; None: unbounded): ``(fixed_start, free_start,
    length, free_step)``, every pair in exactly one run, in order (``free_step`` 0 for runs of 1).
    The bound keeps a run's pitch within what the driver takes (:data:`MAX_PITCH_BYTES`).

    A long decode's pages interleave across the batch (SGLang hands out a page to whichever
    request crosses a page boundary next), so one request's pages at a layer are ``k * 2L`` host
    rows apart for a ``k`` of their own, not ``2L``: :func:`strided_runs` at ``2L`` sees runs of
    1. A link (pair ``i`` to ``i + 1``) joins a run when it belongs to a block of at least two
    consecutive links with the fixed step and one equal free step; where two such blocks share a
    pair, the later block gives up its first link (each run stays one progression). Isolated
    two-pair progressions stay runs of 1 (vectorised, no pass per pair in Python)."""
    fixed = np.asarray(fixed_idx, dtype=np.int64)
    free = np.asarray(free_idx, dtype=np.int64)
    n = int(fixed.size)
    d = np.diff(free)
    good = (np.diff(fixed) == fixed_step) & (d >= 1)
    if max_step is not None:
        good &= d <= max_step
    same = good[1:] & good[:-1] & (d[1:] == d[:-1])  # link j+1 continues link j's step
    if not same.any():  # no progression of three (or under three pairs): every pair alone
        return fixed, free, np.ones(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    eq_prev = np.concatenate([[False], same])
    block = eq_prev | np.concatenate([same, [False]])
    # a block's first link goes when the link before it is kept (another block's last)
    keep = block & (eq_prev | ~np.concatenate([[False], block[:-1]]))
    starts = np.concatenate([[0], np.flatnonzero(~keep) + 1])
    lengths = np.diff(np.append(starts, n))
    step = np.where(lengths > 1, d[np.minimum(starts, n - 2)], 0)
    return fixed[starts], free[starts], lengths, step


MAX_PITCH_BYTES = (1 << 31) - 1
"""The largest 2-D copy pitch the driver takes where it does not say otherwise
(``CU_DEVICE_ATTRIBUTE_MAX_PITCH``: 2^31 - 1 bytes on current GPUs; :meth:`PitchedMemcpy.max_pitch`
asks the driver). A free-step run above it would be refused, and a refusal turns the 2-D copies
off for the process (``CudaTransferEngine``): runs are cut below it."""

MAX_PITCH_ATTRIBUTE = 11
"""``CU_DEVICE_ATTRIBUTE_MAX_PITCH`` in ``cuda.h``'s ``CUdevice_attribute``."""

FREE_PITCH_MIN = 64
"""Pairs left single by the fixed-step runs below which :func:`plan_runs` does not look for
free-step runs: that pass costs 10-35 us of NumPy whatever its size (the CPU host), what the
batched memcpy's host cost for 10-20 single segments is (1.2-2 us each on an H100), and a placed
step makes it per fetch launch. A batch of 32 whose requests each hold two decode pages at a
layer already leaves 64."""

RunGroup = tuple[np.ndarray, np.ndarray, np.ndarray, "int | np.ndarray", "int | np.ndarray"]
"""``(src_start, dst_start, length, src_step, dst_step)``: runs with one step each side, or a step
per run (arrays)."""


def plan_runs(src_idx: np.ndarray, dst_idx: np.ndarray, src_step: int, dst_step: int, min_run: int = 2,
              max_step: int | None = None) -> tuple[list[RunGroup], np.ndarray, np.ndarray]:
    """A copy's pairs as 2-D copies and single segments: ``(groups, rest_src, rest_dst)``, each
    group's runs of ``min_run`` (>= 2) rows or more (one :meth:`PitchedMemcpy.copy_runs` call
    each), the rest every pair of the shorter runs. First :func:`strided_runs` at the given steps;
    then, when one side is pitched (``src_step`` or ``dst_step`` above 1: the block-first host
    pool) and at least :data:`FREE_PITCH_MIN` pairs are left, those are cut by
    :func:`free_pitch_runs` with that side's step free up to ``max_step`` (a long decode's
    interleaved pages): a second group with a step per run."""
    if min_run < 2:
        raise ValueError(f"plan_runs: min_run must be >= 2 (a 2-D copy of one row has no step), got {min_run}")
    s0, d0, n = strided_runs(src_idx, dst_idx, src_step, dst_step)
    long = n >= min_run
    groups: list[RunGroup] = []
    if long.all():
        return ([(s0, d0, n, src_step, dst_step)] if n.size else []), s0[:0], d0[:0]
    if long.any():
        groups.append((s0[long], d0[long], n[long], src_step, dst_step))
    rest_s, rest_d = _pairs_of(s0[~long], d0[~long], n[~long], src_step, dst_step, min_run)
    if (src_step > 1) == (dst_step > 1) or rest_s.size < FREE_PITCH_MIN:
        return groups, rest_s, rest_d
    host_is_src = src_step > 1
    fixed_step = dst_step if host_is_src else src_step
    f0, h0, m, step = free_pitch_runs(rest_d if host_is_src else rest_s, rest_s if host_is_src else rest_d,
                                      fixed_step, max_step)
    more = m >= min_run
    if not more.any():
        return groups, rest_s, rest_d
    groups.append((h0[more], f0[more], m[more], step[more], fixed_step) if host_is_src else
                  (f0[more], h0[more], m[more], fixed_step, step[more]))
    free_rows, fixed_rows = _pairs_of(h0[~more], f0[~more], m[~more], step[~more], fixed_step, min_run)
    return groups, *((free_rows, fixed_rows) if host_is_src else (fixed_rows, free_rows))


def _pairs_of(a0: np.ndarray, b0: np.ndarray, m: np.ndarray, a_step: int | np.ndarray, b_step: int | np.ndarray,
              min_run: int) -> tuple[np.ndarray, np.ndarray]:
    """Every pair of runs ``(a0, b0, m)`` at their steps, in order (runs of one when ``min_run`` is
    2: the starts themselves, no expansion)."""
    if min_run == 2:
        return a0, b0
    within = np.arange(int(m.sum())) - np.repeat(np.cumsum(m) - m, m)
    return (np.repeat(a0, m) + within * np.repeat(np.broadcast_to(a_step, m.shape), m),
            np.repeat(b0, m) + within * np.repeat(np.broadcast_to(b_step, m.shape), m))


def device_attribute(lib: Any, ordinal: int, attribute: int) -> int | None:
    """``cuDeviceGetAttribute(attribute)`` of CUDA device ``ordinal`` through the driver library
    ``lib`` (``libcuda.so.1`` loaded with :mod:`ctypes`), or None where it lacks the calls or
    fails (CUDA initialised by the caller)."""
    get_dev, get_attr = (getattr(lib, name, None) for name in ("cuDeviceGet", "cuDeviceGetAttribute"))
    if get_dev is None or get_attr is None:
        return None
    dev, value = ctypes.c_int(), ctypes.c_int()
    if get_dev(ctypes.byref(dev), ctypes.c_int(ordinal)) != 0:
        return None
    if get_attr(ctypes.byref(value), ctypes.c_int(attribute), dev) != 0:
        return None
    return int(value.value)


class PitchedMemcpy:
    """``cuMemcpy2DAsync`` bound from the driver (module docstring). Construction raises
    ``RuntimeError`` naming what is missing."""

    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise RuntimeError(f"pitched memcpy: the CUDA driver library is not loadable ({exc})") from exc
        fn = getattr(lib, "cuMemcpy2DAsync_v2", None)
        if fn is None:
            raise RuntimeError("pitched memcpy: the driver has no cuMemcpy2DAsync_v2")
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        self._fn: Any = fn
        self._lib = lib
        self.calls = 0
        """Runs copied (one driver call each) since construction."""
        self.rows = 0
        """Rows those runs moved."""
        self.call_seconds = 0.0
        """Host time inside the driver calls."""

    def max_pitch(self, ordinal: int) -> int:
        """``CU_DEVICE_ATTRIBUTE_MAX_PITCH`` (bytes) of CUDA device ``ordinal``, or
        :data:`MAX_PITCH_BYTES` where the driver does not answer (CUDA initialised by the caller)."""
        value = device_attribute(getattr(self, "_lib", None), ordinal, MAX_PITCH_ATTRIBUTE)
        return MAX_PITCH_BYTES if value is None or value <= 0 else value

    def reset_counts(self) -> None:
        self.calls = self.rows = 0
        self.call_seconds = 0.0

    def copy_runs(self, dsts: np.ndarray, dst_pitch: int | np.ndarray, srcs: np.ndarray,
                  src_pitch: int | np.ndarray, width: int, heights: np.ndarray, stream: int) -> None:
        """Run ``r``: ``heights[r]`` rows of ``width`` bytes from ``srcs[r]`` (rows ``src_pitch``
        bytes apart: one pitch, or one per run) to ``dsts[r]`` (``dst_pitch`` apart), on the CUDA
        stream handle ``stream``."""
        n = check_runs(dsts, srcs, heights, width, src_pitch, dst_pitch)
        if n == 0:
            return
        ops = np.zeros(n, dtype=RECORD)
        ops["srcMemoryType"] = ops["dstMemoryType"] = MEMORYTYPE_UNIFIED
        ops["srcDevice"], ops["dstDevice"] = srcs, dsts
        ops["srcPitch"], ops["dstPitch"], ops["WidthInBytes"], ops["Height"] = src_pitch, dst_pitch, width, heights
        base, size, fn, handle = ops.ctypes.data, RECORD.itemsize, self._fn, ctypes.c_void_p(stream)
        t0 = time.perf_counter()
        for i in range(n):
            rc = fn(base + i * size, handle)
            if rc != 0:
                self.call_seconds += time.perf_counter() - t0
                self.calls += i  # the runs enqueued before it
                self.rows += int(heights[:i].sum())
                raise RuntimeError(f"cuMemcpy2DAsync of run {i} of {n} failed: CUresult {rc}")
        self.call_seconds += time.perf_counter() - t0
        self.calls += n
        self.rows += int(heights.sum())


def check_runs(dsts: np.ndarray, srcs: np.ndarray, heights: np.ndarray, width: int, src_pitch: int | np.ndarray,
               dst_pitch: int | np.ndarray) -> int:
    """How many runs a :meth:`PitchedMemcpy.copy_runs` call holds; ``ValueError`` for arrays of
    other lengths (pitches: one, or one per run) or rows wider than a pitch (they would overlap)."""
    n = int(heights.size)
    pitches = [np.atleast_1d(np.asarray(p, dtype=np.int64)) for p in (src_pitch, dst_pitch)]
    if (not (dsts.size == srcs.size == n) or any(p.size not in (1, n) for p in pitches)
            or (n and width > min(int(p.min()) for p in pitches))):
        sizes = "/".join(str(p.size) for p in pitches)
        lowest = ", ".join(str(int(p.min())) if p.size else "-" for p in pitches)
        raise ValueError(f"copy_runs: {dsts.size} / {srcs.size} / {n} runs, pitches of {sizes}, width {width} "
                         f"over a pitch (smallest source, destination: {lowest})")
    return n


def run_pointers(src_base: int, dst_base: int, row_bytes: int, src_start: np.ndarray,
                 dst_start: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(dsts, srcs)`` (uint64) of runs starting at rows ``src_start`` / ``dst_start`` of two
    tensors at ``src_base`` / ``dst_base`` with rows of ``row_bytes``."""
    row = np.uint64(row_bytes)
    return (dst_start.astype(np.uint64) * row + np.uint64(dst_base),
            src_start.astype(np.uint64) * row + np.uint64(src_base))


def probe(pm: PitchedMemcpy, device: Any = "cuda", host: Any = None) -> None:
    """Known strided runs each way on a side stream, from and to page-locked host memory of both
    kinds (``pin_memory()`` and registered pageable memory, as the host KV pool is); ``host``
    (2-D, registered): the caller's own pool, whose rows 0 and 2 go to the device and back.
    Raises ``RuntimeError`` if what arrives is not what was sent."""
    import torch

    from kernels.batched_memcpy import BatchedMemcpy, probe_sources, registered_pages

    with registered_pages(BatchedMemcpy(), device) as whole:
        for src in probe_sources(whole, 6, host):
            rows, row = src.shape[0], src.shape[1] * src.element_size()
            step = 2
            picked = (rows + step - 1) // step  # source rows 0, 2, 4, ... -> device rows 0, 1, 2, ...
            dev = torch.zeros((picked, src.shape[1]), dtype=src.dtype, device=device)
            back = torch.zeros(src.shape, dtype=src.dtype).pin_memory()
            stream = torch.cuda.Stream(device=device)
            stream.wait_stream(torch.cuda.current_stream(device))
            one = np.array([picked], dtype=np.uint64)
            with torch.cuda.stream(stream):
                pm.copy_runs(np.array([dev.data_ptr()], dtype=np.uint64), row, np.array([src.data_ptr()], dtype=np.uint64),
                             step * row, row, one, stream.cuda_stream)
                pm.copy_runs(np.array([back.data_ptr()], dtype=np.uint64), step * row,
                             np.array([dev.data_ptr()], dtype=np.uint64), row, row, one, stream.cuda_stream)
            stream.synchronize()
            want = torch.zeros_like(src)
            want[::step] = src[::step]
            if not torch.equal(back.view(torch.uint8), want.view(torch.uint8)):
                raise RuntimeError(f"pitched memcpy probe: sent {src.tolist()[:3]}, got back {back.tolist()[:3]}")


PROBE_STAGES = ("batched ok", "pitched ok")
"""What this module's probe child prints, one line per probe passed (:func:`probe_in_subprocess`)."""


def probe_in_subprocess(device: int = 0, timeout_s: float = 120.0) -> tuple[str | None, str | None]:
    """Both copy-engine probes (the batched memcpy's, then the 2-D copies') in ONE child process
    (:func:`kernels.batched_memcpy.probe_stages_in_subprocess`): why each failed, or None."""
    from kernels.batched_memcpy import probe_stages_in_subprocess

    batched, pitched = probe_stages_in_subprocess(device, timeout_s, "kernels.pitched_memcpy", PROBE_STAGES)
    return batched, pitched


if __name__ == "__main__":  # the child of probe_in_subprocess
    import sys

    from kernels.batched_memcpy import BatchedMemcpy
    from kernels.batched_memcpy import probe as probe_batched

    where = f"cuda:{int(sys.argv[1]) if len(sys.argv) > 1 else 0}"
    probe_batched(BatchedMemcpy(), where)
    print(PROBE_STAGES[0], flush=True)  # before the next probe: a crash there leaves this one passed
    probe(PitchedMemcpy(), where)
    print(PROBE_STAGES[1])
