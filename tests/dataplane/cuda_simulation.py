"""The simulated CUDA runtime the stream-order checker runs the served core under.

:func:`install` patches ``torch.cuda``'s streams and events with :class:`StreamOrder`'s, makes
the stores' transfer engine the CUDA one over CPU pools (its copies the torch reference, or the
pointer-level batched memcpy of :class:`PointerMemcpy`), and runs the pinned upload rings and the
store's device-only branches as on a GPU. :func:`track_core` names the memory to check.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tests.dataplane.pointer_memcpy import PointerMemcpy
from tests.dataplane.stream_order import NEVER, StreamOrder


def install(monkeypatch: Any, query_completes: str = NEVER, dma: bool = False, dma_floor: int = 0,
            pitched: bool = True) -> StreamOrder:
    """Simulated CUDA for the served core (module docstring): ``torch.cuda``'s streams and events,
    the stores' transfer engine the CUDA one over CPU pools, its Triton copies their torch
    reference run as copies of the current stream (``dma``: the copy engines' path, its batched
    memcpy and 2-D copy calls -- addresses, pitches, sizes, stream handle -- run by
    :class:`PointerMemcpy`; ``pitched=False``: the batched memcpy alone, as when the 2-D copies
    were refused). Build the core after this, then
    :meth:`StreamOrder.track` its pools (:func:`track_core`) and run it under ``sim.tracer()``."""
    from kernels.block_copy import copy_segments_ref, fetch_page_indices
    from sglang_ext.dataplane import cuda_transfer_engine as transfer_engine
    from sglang_ext.dataplane import slot_kv_store, token_writeback
    from sglang_ext.dataplane.page_fetch import PageFetch

    if getattr(torch.cuda.Event, "sim", None) is not None:  # a second install would wrap the first's patches
        raise RuntimeError("install: a simulation is already installed here; run each in its own "
                           "monkeypatch.context()")
    sim = StreamOrder(query_completes)
    monkeypatch.setattr(torch.cuda, "Stream", sim._new_stream)
    monkeypatch.setattr(torch.cuda, "Event", sim.Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: sim.current)
    monkeypatch.setattr(torch.cuda, "set_stream", sim.set_stream)
    monkeypatch.setattr(torch.cuda, "synchronize", sim.synchronize)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: sim.record_stream(self, stream))
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, device=None: True)
    engine_cls = transfer_engine.CudaTransferEngine
    monkeypatch.setattr(engine_cls, "_probe_zero_copy", lambda self: "triton")
    monkeypatch.setattr(slot_kv_store, "make_transfer_engine",
                        lambda host, dev, copy_programs=None, copy_engine="triton", timing_interval=1:
                        engine_cls(host, dev, copy_programs, copy_engine, timing_interval))

    def copy(src, dst, src_idx, dst_idx, impl="auto", programs=None):  # noqa: ANN001, ANN202
        sim.copies["kernel"] += 1
        with sim.copying():
            src_idx.sum(), dst_idx.sum()  # the kernel reads its index lists (uploads: tracked)
            copy_segments_ref(src, dst, src_idx, dst_idx)

    def fetch(self, host, dev, programs=None):  # noqa: ANN001, ANN202
        src, dst = self.indices()
        with sim.copying():
            for t in (self.map_row, self.reqs, self.flat, self.stage, self.starts, self.counts):
                t.sum()  # the kernel reads the mirror's row of its layer and the step's upload
            copy_segments_ref(host, dev, torch.from_numpy(src), torch.from_numpy(dst))

    def fetch_pages(host, dev, flat, stage, map_row, reqs, starts, counts, max_pages, host_base,  # noqa: ANN001, ANN202
                    host_stride, dev_v, programs=None):
        arrays = [t.numpy() for t in (flat, stage, map_row, reqs, starts, counts)]
        src, dst = fetch_page_indices(*arrays, host_base, host_stride, dev_v)
        with sim.copying():
            copy_segments_ref(host, dev, torch.from_numpy(src), torch.from_numpy(dst))

    monkeypatch.setattr(transfer_engine, "copy_segments", copy)
    monkeypatch.setattr(transfer_engine, "fetch_pages_triton", fetch_pages)  # the engine's warm-up calls it
    if dma:  # --kv-copy-engine dma: the engine's own batched-memcpy calls, run at the pointer level
        monkeypatch.setattr(transfer_engine, "DMA_MIN_BYTES", dma_floor)  # rows under it: the kernels
        real_engine_init = engine_cls.__init__

        def engine_init(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
            real_engine_init(self, *args, **kwargs)
            self._dma = PointerMemcpy(sim)  # as set_copy_engine leaves it once probed: ...
            self._pitched = self._dma if pitched else None  # ... with the 2-D copies, or without
            self.impl = "dma"

        monkeypatch.setattr(engine_cls, "__init__", engine_init)
    monkeypatch.setattr(PageFetch, "run_triton", fetch)
    real_allocate = token_writeback.TokenWriteback.allocate

    def allocate(self) -> None:  # noqa: ANN001
        fresh = self.buf is None
        real_allocate(self)
        if fresh:
            sim.track(self.buf)  # a fresh buffer: its accesses are checked from its allocation on
            sim.allocated(self.buf)

    monkeypatch.setattr(token_writeback.TokenWriteback, "allocate", allocate)
    _ring_as_on_cuda(monkeypatch, sim)
    real_store_init = slot_kv_store.SlotKVStore.__init__

    def store_init(self, config) -> None:  # noqa: ANN001
        real_store_init(self, config)
        self.staged_uploads = True  # the device paths: host views staged in the ring, ...
        if self.mirror is not None:
            self.mirror.staged = True  # ... the mirror's columns uploaded through its ring

    monkeypatch.setattr(slot_kv_store.SlotKVStore, "__init__", store_init)
    return sim


def _ring_as_on_cuda(monkeypatch: Any, sim: StreamOrder) -> None:
    """Every :class:`PinnedUploadRing` runs its CUDA path: the release events and the slot's
    stream are the simulation's; a staged slot is a host write; the upload is a copy of the slot
    on the current stream (``host.to(device, non_blocking=True)``), which writes its device copy."""
    from sglang_ext.dataplane.pinned_upload_ring import _TORCH, PinnedUploadRing

    real_init, real_take = PinnedUploadRing.__init__, PinnedUploadRing.take

    def init(self, device, slots=8, *, pin=None, new_event=None, current_stream=None):  # noqa: ANN001, ANN202
        real_init(self, device, slots, pin=False, new_event=sim.RingEvent, current_stream=lambda: sim.current)

    def take(self, nbytes):  # noqa: ANN001, ANN202
        buf = real_take(self, nbytes)
        if buf.untyped_storage().data_ptr() not in sim._state:  # a new slot buffer
            sim.track(buf, host=True)
        return buf

    def stage(self, values):  # noqa: ANN001, ANN202
        values = np.ascontiguousarray(values)
        host = self.take(values.nbytes)
        sim.host_write(host)
        host.numpy()[:] = values.view(np.uint8).reshape(-1)
        return host.view(_TORCH[values.dtype.str])

    def upload(self, values):  # noqa: ANN001, ANN202
        host = self.stage(values)
        with sim.copying():
            dev = host.clone()
        sim.allocated(dev)
        sim.device_write(dev)  # written on the current stream: what reads it must follow that
        return dev, host

    monkeypatch.setattr(PinnedUploadRing, "__init__", init)
    monkeypatch.setattr(PinnedUploadRing, "take", take)
    monkeypatch.setattr(PinnedUploadRing, "stage", stage)
    monkeypatch.setattr(PinnedUploadRing, "upload", upload)


def track_core(sim: StreamOrder, core: Any) -> None:
    """Check the accesses to ``core``'s host and device pools."""
    sim.track(core.store.host, host=True)
    sim.track(core.store.dev)
    if core.store.mirror is not None:
        sim.track(core.store.mirror.dev)
