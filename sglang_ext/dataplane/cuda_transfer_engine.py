"""CudaTransferEngine: the transfer engine on a GPU -- two side streams, events, batched copies.

The contract is :class:`~sglang_ext.dataplane.transfer_engine.TransferEngine`'s (that module's
docstring). Here H2D and D2H run on two side streams of their own, so both directions run
concurrently (SuperInfer §4.3.2 "full duplex"), ordered by events only. A copy is one Triton
gather/scatter launch reading or writing the pinned, block-first host pool through unified
addressing (``kernels/block_copy.py``); under ``--kv-copy-engine dma`` it runs on the copy
engines instead, as 2-D copies of strided runs and one batched memcpy of the rest
(``kernels/pitched_memcpy.py``, ``kernels/batched_memcpy.py``); where Triton refuses host
pointers, one ``cudaMemcpyAsync`` per segment (correct, launch-bound; logged once at
construction).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import structlog
import torch

from kernels.batched_memcpy import BatchedMemcpy, row_bytes, segment_pointers
from kernels.batched_memcpy import probe as probe_dma
from kernels.block_copy import copy_segments, fetch_pages_triton, word_view
from kernels.pitched_memcpy import MAX_PITCH_BYTES, PitchedMemcpy, plan_runs, run_pointers
from kernels.pitched_memcpy import probe as probe_pitched
from kernels.pitched_memcpy import probe_in_subprocess as probe_copy_engines
from sglang_ext.dataplane.event_clock import EventClock
from sglang_ext.dataplane.fetch_run_cache import FetchRunCache, Plan
from sglang_ext.dataplane.host_pool import registered_host_pointers
from sglang_ext.dataplane.page_fetch import PageFetch
from sglang_ext.dataplane.pinned_upload_ring import PinnedUploadRing
from sglang_ext.dataplane.transfer_clock import STALL
from sglang_ext.dataplane.transfer_engine import TransferEngine, rows_bytes

log = structlog.get_logger(__name__)

ROCM_NO_COPY_ENGINES = ("--kv-copy-engine dma: the batched and 2-D copies are CUDA driver calls "
                        "(cuMemcpyBatchAsync, cuMemcpy2DAsync), not on ROCm; the Triton copy kernels serve")
"""Why ``dma`` keeps the kernels on a ROCm build, said without the probe child (which would fail)."""

DMA_MIN_BYTES = 28 << 10
"""Under ``--kv-copy-engine dma``, copies of smaller rows stay on the Triton kernel: the copy
engines' batched H2D "falls off a cliff" under ~28 KiB a copy (vLLM #42212, which added a kernel
path for that reason). KV segments at page 16 are 32 KiB (Llama-3-8B shapes); a decode step's
parked token rows (2 KiB) are one short kernel launch a step."""
MIN_RUN = 2
"""Strided runs of at least this many rows go to the copy engines as one 2-D copy; shorter
ones join the batched memcpy (one descriptor a row)."""
INDEX_SLOTS = 32
"""Slots of the CUDA engine's index-upload ring: a boundary that moves pages takes two per
launch, and a slot must not come round within one boundary (its release would then wait on the
step the GPU is still running)."""


class CudaTransferEngine(TransferEngine):
    """Two side streams (H2D, D2H); one launch per call; events order everything."""

    copies_beside_compute = True

    def __init__(self, host_segments: torch.Tensor, dev_segments: torch.Tensor,
                 copy_programs: int | None = None, copy_engine: str = "triton",
                 timing_interval: int = 1) -> None:
        super().__init__(host_segments, dev_segments)
        if not host_segments.is_pinned():
            raise ValueError("CudaTransferEngine needs a pinned host pool")
        self.device = dev_segments.device
        self.h2d_stream = torch.cuda.Stream(device=self.device)
        self.d2h_stream = torch.cuda.Stream(device=self.device)
        self._last: dict[str, Any] = {"h2d": None, "d2h": None}
        self._fresh = False  # a launch since the last wait_fence (its wait is then timed)
        self._compute: Any = None
        """The step's compute stream (set at :meth:`wait_fence`, the step start)."""
        self._compute_mark: Any = None
        """A compute-stream event shared by the launches of one layer end (:meth:`mark_compute`)."""
        self._words = (word_view(host_segments), word_view(dev_segments))
        """The pools as the copy kernels read them (integer words), viewed once, not per launch."""
        self.impl = self._kernel_impl = self._probe_zero_copy()
        """``triton`` (one gather/scatter launch through UVA) or ``memcpy`` (fallback: one
        ``cudaMemcpyAsync`` per segment, correct but launch-bound) if Triton refuses host memory;
        ``dma`` after :meth:`set_copy_engine` (one batched memcpy on the copy engines)."""
        self._dma: BatchedMemcpy | None = None
        """The copy engines' batched memcpy, once :meth:`set_copy_engine` found it working."""
        self._pitched: PitchedMemcpy | None = None
        """The copy engines' 2-D copies (one per strided run), once :meth:`set_copy_engine` found
        them working beside :attr:`_dma` (None: every segment goes to the batched memcpy)."""
        self._max_pitch = MAX_PITCH_BYTES
        """The largest 2-D copy pitch the driver takes (bytes; asked when the 2-D copies are probed)."""
        self.fetch_runs = FetchRunCache()
        """The copy engines' plans of the step's fetches, reused across its layers (cleared at
        :meth:`wait_fence`, the step start)."""
        self.dma_error: str | None = None
        """Why ``dma`` was refused (None: not asked for, or working)."""
        self.pitched_error: str | None = None
        """Why ``dma`` runs without 2-D copies (None: not asked for, or working)."""
        self.clock = EventClock(interval=timing_interval)
        self._indices = PinnedUploadRing(self.device, INDEX_SLOTS)
        """Pinned sources of :meth:`index_tensor`'s uploads (a boundary's moves take a few each)."""
        self.copy_programs: int | None = copy_programs
        """Persistent programs of each Triton copy launch; None: the kernel's default
        (``kernels.block_copy.DEFAULT_PROGRAMS``). Few leave SMs to the compute stream's
        kernels while a fetch runs (``kvplane gpu-check``'s overlap figure sweeps it)."""
        if copy_engine == "dma":  # last: the probes run on a whole engine (--kv-copy-engine's default)
            self.set_copy_engine("dma")

    def _probe_zero_copy(self) -> str:
        """Check once, at construction, that the Triton kernel can read and write the host pool:
        the pool is registered memory (``cudaHostRegister``), whose host address a kernel may use
        only where the device says so (:func:`registered_host_pointers`; a kernel touching it
        elsewhere faults the whole context, so it is never tried), and then two of the pool's own
        rows make a round trip (restored after)."""
        if registered_host_pointers(self.device) is False:
            log.warning("kv_transfer_zero_copy_unavailable",
                        error="the device cannot use registered host memory's host pointers")
            return "memcpy"
        host = self._words[0]
        if host.shape[0] < 2:
            return "memcpy"
        saved = host[:2].clone()
        host[:2] = torch.arange(2 * host.shape[1], dtype=host.dtype).view(2, -1)
        expected = host[:2].clone()
        probe_dev = torch.zeros_like(expected, device=self.device)
        idx = torch.tensor([1, 0], device=self.device)
        try:
            copy_segments(host, probe_dev, idx, idx.flip(0), impl="triton")
            copy_segments(probe_dev, host, idx[1:], idx[1:], impl="triton")  # dev row 0 (pool row 1) -> row 0
            torch.cuda.synchronize(self.device)
            ok = torch.equal(probe_dev.cpu(), expected.flip(0)) and torch.equal(host[:2], expected[1:].expand(2, -1))
        except Exception as exc:  # noqa: BLE001 - any failure selects the safe path
            log.warning("kv_transfer_zero_copy_unavailable", error=str(exc))
            return "memcpy"
        finally:
            try:  # a failed launch may have left a copy running: it must not land after the restore
                torch.cuda.synchronize(self.device)
            except Exception:  # noqa: BLE001 - the context may be gone; the rows are restored anyway
                pass
            host[:2] = saved
        if not ok:
            log.warning("kv_transfer_zero_copy_wrong_result")
            return "memcpy"
        return "triton"

    def set_copy_engine(self, name: str) -> bool:
        """Run the copies with ``triton`` kernels or the ``dma`` copy engines (``--kv-copy-engine``);
        ``dma`` is probed once -- in a child process, then here on this pool's memory (known
        copies each way on a side stream); if the driver lacks it or a probe fails, the engine
        keeps its kernels, logs why (:attr:`dma_error`) and returns False."""
        if name not in ("triton", "dma"):
            raise ValueError(f"copy engine {name!r} must be 'triton' or 'dma'")
        if name == "triton":
            self.impl = self._kernel_impl
            return True
        if self.dma_error is not None:  # refused before (by a probe, or by the driver while serving)
            return False
        if self._dma is None and getattr(torch.version, "hip", None):  # no child probe: it cannot pass
            self.dma_error = ROCM_NO_COPY_ENGINES
            log.info("kv_copy_engine_dma_not_on_rocm", now=self.impl)
            return False
        if self._dma is None:
            # first in a child process: a call the driver takes with another ABI, or a fault on
            # the memory, would end this process or leave its CUDA context dead
            why, why_pitched = probe_copy_engines(self.device.index if self.device.index is not None
                                                  else torch.cuda.current_device())
            try:
                if why is not None:
                    raise RuntimeError(why)
                dma = BatchedMemcpy()
                self.quiesce()  # the pool's first rows are read: nothing in flight may write them
                probe_dma(dma, self.device, self.host)  # and here, on this pool's own memory
                dma.reset_counts()
            except Exception as exc:  # noqa: BLE001 - any failure keeps the kernels
                self.dma_error = str(exc) or type(exc).__name__
                log.warning("kv_copy_engine_dma_unavailable", error=self.dma_error)
                return False
            self._dma = dma
            self._pitched = self._probe_pitched(why_pitched)
        self.impl = "dma"
        return True

    def _probe_pitched(self, why: str | None) -> PitchedMemcpy | None:
        """The 2-D copies, probed as the batched memcpy is (``why``: the child process's verdict,
        from the same child; then this pool's memory); None, with :attr:`pitched_error` and a
        log line, when they fail (``dma`` then runs every segment through the batched memcpy)."""
        try:
            if why is not None:
                raise RuntimeError(why)
            pitched = PitchedMemcpy()
            probe_pitched(pitched, self.device, self.host)
            pitched.reset_counts()
            self._max_pitch = pitched.max_pitch(self.device.index if self.device.index is not None
                                                else torch.cuda.current_device())
        except Exception as exc:  # noqa: BLE001 - any failure keeps one copy per segment
            self.pitched_error = str(exc) or type(exc).__name__
            log.warning("kv_copy_engine_pitched_unavailable", error=self.pitched_error)
            return None
        return pitched

    def warm_pool_copies(self, map_row: torch.Tensor | None) -> None:
        """One launch of each pool copy kernel, specialised as served, so Triton compiles them here:
        a segment copy of host segment 0 into a scratch segment (every H2D and D2H of segments
        runs this kernel on the pools' words, with int64 index lists), and for a paged store one
        fetch of a request with no page (int32 index views of a step's upload, the mirror's row):
        it copies nothing. Without it the first of each, on a request's path, waits for a compile."""
        if self._kernel_impl != "triton":
            return
        host_words, dev_words = self._words
        scratch = torch.empty((1, dev_words.shape[1]), dtype=dev_words.dtype, device=self.device)
        zero = torch.zeros(1, dtype=torch.int64, device=self.device)
        copy_segments(host_words, scratch, zero, zero, impl="triton", programs=self.copy_programs)
        if map_row is not None:
            none = torch.zeros(1, dtype=torch.int32, device=self.device)  # request 0 holds no page
            fetch_pages_triton(host_words, dev_words, none, none, map_row, none, none, none, 1, 0,
                               self.host_page_rows, 0, self.copy_programs)

    def warm_rows(self, host_rows: torch.Tensor) -> None:
        if self._kernel_impl != "triton" or not host_rows.shape[0]:
            return
        scratch = torch.empty((1, host_rows.shape[1]), dtype=host_rows.dtype, device=self.device)
        zero = torch.zeros(1, dtype=torch.int64, device=self.device)
        copy_segments(host_rows, scratch, zero, zero, impl="triton", programs=self.copy_programs)
        torch.cuda.synchronize(self.device)

    def _on_dma(self, row_bytes: int) -> bool:
        """Copies of rows this large go to the copy engines (``dma`` on, at or above the floor)."""
        return self.impl == "dma" and row_bytes >= DMA_MIN_BYTES

    def _dma_copy(self, src: torch.Tensor, dst: torch.Tensor, indices: Callable[[], tuple[np.ndarray, np.ndarray]],
                  steps: tuple[int, int] = (1, 1), plan: Plan | None = None) -> bool:
        """The copies ``dst[dst_idx[i]] = src[src_idx[i]]`` (``indices()``) on the copy engines, on
        the current (side) stream: the strided runs (``steps``: source and destination rows
        between a run's rows; then, on the host side, runs with a step of their own: a long
        decode's interleaved pages, :func:`kernels.pitched_memcpy.plan_runs`) of :data:`MIN_RUN`
        rows or more as one 2-D copy each, the other segments as one batched memcpy (all of them
        where the 2-D copies were refused). ``plan``: those runs planned by the caller (a fetch's,
        :class:`FetchRunCache`, at this engine's pitch bound); ``indices`` is then called only if a
        refusal needs every segment. True when enqueued.

        A call the driver refuses while serving does not fail the step: a refused 2-D copy turns
        them off (:attr:`pitched_error`) and the batched memcpy takes every segment; a refused
        batched memcpy turns ``dma`` off (:attr:`dma_error`, :attr:`impl` back to the kernels)
        and this returns False: the caller copies the segments the kernels' way. Segments a
        refused call's predecessors already enqueued are copied again: the same bytes, in stream
        order."""
        assert self._dma is not None
        stream = torch.cuda.current_stream(self.device).cuda_stream
        left = None  # None: every segment (``indices()``)
        if self._pitched is not None:
            row = row_bytes(src, dst)
            groups, rest_s, rest_d = (plan if plan is not None
                                      else plan_runs(*indices(), *steps, MIN_RUN, self._max_pitch // row))
            try:
                for s0, d0, n, s_step, d_step in groups:
                    dsts, srcs = run_pointers(src.data_ptr(), dst.data_ptr(), row, s0, d0)
                    self._pitched.copy_runs(dsts, d_step * row, srcs, s_step * row, row, n, stream)
                if not rest_s.size:
                    return True
                left = (rest_s, rest_d)  # left single: the segments themselves
            except RuntimeError as exc:
                self._pitched, self.pitched_error = None, str(exc)
                log.warning("kv_copy_engine_pitched_refused", error=self.pitched_error)
        try:
            self._dma.copy(*segment_pointers(src, dst, *(left if left is not None else indices())), stream)
        except RuntimeError as exc:
            self.impl, self.dma_error = self._kernel_impl, str(exc)
            log.warning("kv_copy_engine_dma_refused", error=self.dma_error, now=self.impl)
            return False
        return True

    def _memcpy_rows(self, src: torch.Tensor, dst: torch.Tensor, src_idx: np.ndarray, dst_idx: np.ndarray) -> None:
        """One ``cudaMemcpyAsync`` per row (the fallback where Triton refuses host memory)."""
        for s_i, d_i in zip(np.asarray(src_idx).tolist(), np.asarray(dst_idx).tolist(), strict=True):
            dst[d_i].copy_(src[s_i], non_blocking=True)

    def _launch(self, kind, src, dst, src_idx, dst_idx, wait, host_idx, keep=()):  # noqa: ANN001, ANN202
        def copy() -> None:
            if host_idx is not None and self._on_dma(src.shape[1] * src.element_size()):
                pitch = self.host_page_rows  # between the pools: one layer's pages, pitched on the host
                steps = (pitch, 1) if src is self.host and dst is self.dev else (
                    (1, pitch) if src is self.dev and dst is self.host else (1, 1))
                if self._dma_copy(src, dst, lambda: host_idx, steps):
                    return
            if self._kernel_impl == "triton":
                s_words, d_words = self._pool_words(src, dst)
                copy_segments(s_words, d_words, src_idx, dst_idx, impl="triton", programs=self.copy_programs)
                return
            if host_idx is None:
                raise RuntimeError("memcpy transfer fallback needs host indices")
            self._memcpy_rows(src, dst, *host_idx)

        return self._on_stream(kind, wait, copy, (src_idx, dst_idx, *keep),
                               rows_bytes(src, src_idx))

    def _fetch(self, spec: PageFetch, wait: Sequence[Any]) -> Any:
        nbytes = spec.segments * self.segment_bytes
        if self._on_dma(self.segment_bytes):  # the pages listed on the host, no SM taken
            steps = (self.host_page_rows, 1)  # a page's rows at consecutive layers: 2L host rows apart
            planned: Plan | None = None
            if self._pitched is not None:  # planned before the copy's timing window opens
                max_step = self._max_pitch // self.segment_bytes
                planned = self.fetch_runs.plan(spec, lambda s, d: plan_runs(s, d, *steps, MIN_RUN, max_step))

            def copy() -> None:
                if self._dma_copy(self.host, self.dev, spec.indices, steps, planned):
                    return
                if self._kernel_impl == "triton":  # the driver refused: the kernels' way, same stream
                    spec.run_triton(*self._words, self.copy_programs)
                else:
                    self._memcpy_rows(self.host, self.dev, *spec.indices())

            return self._on_stream("h2d", wait, copy, (spec.flat,), nbytes)
        if self._kernel_impl != "triton":
            return super()._fetch(spec, wait)
        host_words, dev_words = self._words
        return self._on_stream("h2d", wait, lambda: spec.run_triton(host_words, dev_words, self.copy_programs),
                               (spec.flat,), nbytes)

    def _pool_words(self, src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``src`` and ``dst`` as the copy kernel reads them: the pools' kept word views between
        the two pools (H2D, D2H), else themselves (the kernel views them: token rows)."""
        host_words, dev_words = self._words
        if src is self.host and dst is self.dev:
            return host_words, dev_words
        if src is self.dev and dst is self.host:
            return dev_words, host_words
        return src, dst

    def _on_stream(self, kind: str, wait: Sequence[Any], copy: Callable[[], None],
                   keep: tuple[torch.Tensor, ...], nbytes: int = 0) -> Any:
        """Run ``copy`` (of ``nbytes``) on the ``kind`` stream after the compute stream's work so far
        and the events of ``wait``; timed by the clock; returns its event. When the caller's
        current stream is not the step's compute stream (SGLang's overlap loop installs plans on
        its schedule stream while the last forward's stream is remembered), the copy also follows
        the current stream, where its index lists were uploaded, and that stream stays current."""
        stream = self.h2d_stream if kind == "h2d" else self.d2h_stream
        current = torch.cuda.current_stream(self.device)
        compute = self._compute if self._compute is not None else current
        compute_done = self._compute_mark if self._compute_mark is not None else compute.record_event()
        stream.wait_event(compute_done)
        if compute != current:
            stream.wait_event(current.record_event())
        for e in wait:
            if e is not None:
                stream.wait_event(e)
        # the launch goes to ``stream`` as the current stream (Triton launches on the current one);
        # set_stream and back costs a fraction of the ``torch.cuda.stream`` context on a GPU host
        torch.cuda.set_stream(stream)
        try:
            token = self.clock.start(kind, stream)  # after the waits: the pair times the copy alone
            # the indices were allocated on the compute stream: keep their memory until this
            # stream is done with it (the caching allocator would otherwise reuse it)
            for t in keep:
                t.record_stream(stream)
            copy()
            self.clock.stop(kind, token, stream, nbytes)
            event = stream.record_event()
        finally:
            torch.cuda.set_stream(current)
        self._last[kind] = event
        self._fresh = True
        return event

    def _compute_stream(self) -> Any:
        """The stream the forward runs on: read once per step (at :meth:`wait_fence`, forgotten at
        :meth:`end_compute`), as SGLang runs a step's boundary and layers on one stream; outside
        a step, read each time."""
        return self._compute if self._compute is not None else torch.cuda.current_stream(self.device)

    def mark_compute(self) -> None:
        """The launches until :meth:`clear_compute_mark` follow the compute stream's work so far
        through ONE event (a layer's write-back and fetches share it)."""
        self._compute_mark = self._compute_stream().record_event()

    def clear_compute_mark(self) -> None:
        self._compute_mark = None

    def end_compute(self) -> None:
        self._compute = self._compute_mark = None

    def index_tensor(self, values: np.ndarray) -> torch.Tensor:
        return self._indices.upload(np.ascontiguousarray(values, dtype=np.int64))[0]

    def stream_wait(self, events: Sequence[Any]) -> None:
        if not events:
            return
        current = self._compute_stream()
        token = self.clock.start(STALL, current)  # the pair brackets the compute stream's wait
        for e in events:
            if e is not None:
                current.wait_event(e)
        self.clock.stop(STALL, token, current)

    def fence(self) -> Any:
        return self._last["d2h"]

    @property
    def fence_pending(self) -> bool:
        return self._fresh

    def wait_fence(self) -> None:
        self.fetch_runs.clear()
        current = self._compute = torch.cuda.current_stream(self.device)
        # the wait is timed only if something was launched since the last fence (otherwise the
        # compute stream has already waited on these events)
        fresh, self._fresh = self._fresh, False
        token = self.clock.start(STALL, current) if fresh else None
        for event in (self._last["h2d"], self._last["d2h"]):
            if event is not None:
                current.wait_event(event)
        self.clock.stop(STALL, token, current)
        if self._last["d2h"] is not None:
            self.h2d_stream.wait_event(self._last["d2h"])

    def after_graph(self) -> None:
        # the graph's fetches and write-back are joined into the compute stream at its end: an
        # event there stands for the last copy each way (the next fence, quiesce, host reads)
        event = self._compute_stream().record_event()
        self._last["h2d"] = self._last["d2h"] = event
        self._fresh = True

    def quiesce(self) -> None:
        for event in self._last.values():
            if event is not None:
                event.synchronize()
