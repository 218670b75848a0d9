"""PointerMemcpy: the copy engines' calls run on CPU memory, for the stream-order checker.

``--kv-copy-engine dma`` hands the driver three arrays of raw addresses and sizes
(:func:`kernels.batched_memcpy.segment_pointers`) and a stream handle
(``CudaTransferEngine._dma_copy``). A wrong base tensor, row size, index or handle there does
not fail a Python check on a GPU: the copy engines read or write the wrong bytes (another
request's KV, memory outside the pool), or run on another stream than the events the engine
records. This stand-in for :class:`kernels.batched_memcpy.BatchedMemcpy` (``copy``) and
:class:`kernels.pitched_memcpy.PitchedMemcpy` (``copy_runs``: strided runs at two pitches) takes
the same calls and does what the driver would, on the CPU, where a tensor's ``data_ptr()`` is a
real address:

- every ``(dst, src, size)`` must lie inside ONE storage the simulation tracks (the host pool,
  the device pool, a parked-token buffer); anything else raises, naming the address;
- the copies run on the stream whose ``cuda_stream`` is the handle (an unknown handle raises),
  as aten ops on byte views of those storages, so :class:`StreamOrder` checks their order like
  any other access, and the KV the copies move is the KV the driver's checks compare.

Only the pointer arithmetic is new against the reference copies: it is what this adds.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kernels.pitched_memcpy import check_runs


class PointerMemcpy:
    """A :class:`~kernels.batched_memcpy.BatchedMemcpy` over tracked CPU memory (module docstring)."""

    def __init__(self, sim: Any) -> None:
        self.sim = sim
        self.calls = 0
        self.copies = 0
        self.call_seconds = 0.0
        self.bytes = 0
        """Bytes copied since construction."""
        self.runs = 0
        """Strided runs copied (:meth:`copy_runs`)."""

    def reset_counts(self) -> None:
        self.calls = self.copies = self.bytes = self.runs = 0
        self.call_seconds = 0.0

    def copy(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        n = int(dsts.size)
        if n == 0:
            return
        if not (srcs.size == sizes.size == n and dsts.dtype == srcs.dtype == sizes.dtype == np.uint64):
            raise ValueError("BatchedMemcpy.copy: three uint64 arrays of equal length")
        sim = self.sim
        on = sim.stream_of(int(stream))
        views = sim.storage_bytes()
        bases = np.array(sorted(views), dtype=np.uint64)
        ends = np.array([bases_i + views[int(bases_i)].numel() for bases_i in bases], dtype=np.uint64)
        src_at, dst_at = self._resolve(srcs, sizes, bases, ends), self._resolve(dsts, sizes, bases, ends)
        previous = sim.current
        sim.current = on
        try:
            with sim.copying():
                groups = np.unique(np.stack([src_at, dst_at, sizes.astype(np.int64)], axis=1), axis=0)
                for s_i, d_i, size in groups.tolist():
                    pick = (src_at == s_i) & (dst_at == d_i) & (sizes == size)
                    src, dst = views[int(bases[s_i])], views[int(bases[d_i])]
                    span = torch.arange(size, dtype=torch.int64)
                    s_off = torch.from_numpy((srcs[pick] - bases[s_i]).astype(np.int64))
                    d_off = torch.from_numpy((dsts[pick] - bases[d_i]).astype(np.int64))
                    rows = src.index_select(0, (s_off[:, None] + span).reshape(-1))
                    dst.index_put_(((d_off[:, None] + span).reshape(-1),), rows)
        finally:
            sim.current = previous
        sim.copies["dma"] += 1
        self.calls += 1
        self.copies += n
        self.bytes += int(sizes.sum())

    def copy_runs(self, dsts: np.ndarray, dst_pitch: int | np.ndarray, srcs: np.ndarray, src_pitch: int | np.ndarray,
                  width: int, heights: np.ndarray, stream: int) -> None:
        """:meth:`kernels.pitched_memcpy.PitchedMemcpy.copy_runs`: each run's rows, at their
        pitches, resolved and copied as :meth:`copy` does (one call)."""
        n = check_runs(dsts, srcs, heights, width, src_pitch, dst_pitch)
        if n == 0:
            return
        k = np.arange(int(heights.sum()), dtype=np.uint64) - np.repeat(
            (np.cumsum(heights) - heights).astype(np.uint64), heights)
        run_d, run_s = np.repeat(dsts.astype(np.uint64), heights), np.repeat(srcs.astype(np.uint64), heights)
        d_pitch, s_pitch = (np.repeat(np.broadcast_to(np.asarray(p, dtype=np.uint64), (n,)), heights)
                            for p in (dst_pitch, src_pitch))  # one pitch, or one per run
        self.copy(run_d + k * d_pitch, run_s + k * s_pitch,
                  np.full(k.size, width, dtype=np.uint64), stream)
        self.runs += n

    @staticmethod
    def _resolve(ptrs: np.ndarray, sizes: np.ndarray, bases: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """The tracked storage each ``[ptr, ptr + size)`` lies in (its index in ``bases``)."""
        at = np.searchsorted(bases, ptrs, side="right").astype(np.int64) - 1
        inside = at >= 0
        inside[inside] &= ptrs[inside] + sizes[inside] <= ends[at[inside]]
        if not inside.all():
            bad = int(np.flatnonzero(~inside)[0])
            raise RuntimeError(f"batched memcpy: [{int(ptrs[bad]):#x}, +{int(sizes[bad])}) is not inside one "
                               f"tracked allocation")
        return at
