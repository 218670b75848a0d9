"""TransferEngine: batched host<->device segment copies, ordered by events, never by host syncs.

Primitives (one launch each, all pairs of a call batched):

* ``h2d(src_idx, dst_idx, wait) -> event`` and ``d2h(src_idx, dst_idx, wait) -> event``: copy
  segments ``dst[dst_idx[i]] = src[src_idx[i]]`` between the host pool's and the device pool's
  segment views. Index tensors live on the device (CUDA: one pinned upload per step done by the
  caller; CPU: plain tensors). Every launch is ordered after all work issued so far on the
  compute stream and after the events in ``wait``.
* ``stream_wait(events)``: the compute stream waits (attention at layer ``l`` waits on the fetch
  of layer ``l``; SGLang's ``LayerDoneCounter`` pattern) -- a stream wait, never a host wait.
* ``fence()``: the newest D2H event. Pages whose copy-out is in flight may be reused only after
  it, so the step start makes the compute and H2D streams wait on it (:meth:`wait_fence`).
* ``quiesce()``: the host blocks until every copy is done (tests, shutdown, benchmarks only).
* ``clock``: times every launch and every compute-stream wait into ``clock.times``
  (:class:`~sglang_ext.dataplane.transfer_times.TransferTimes`). The CPU engine uses a
  :class:`~sglang_ext.dataplane.wall_clock.WallClock`, the CUDA engine an
  :class:`~sglang_ext.dataplane.event_clock.EventClock` (event pairs, read later without a sync,
  on about one step in ``timing_interval``).

:class:`CpuTransferEngine` copies synchronously (events are ``None``, born complete), so all the
ordering logic above runs and is tested on CPU. :class:`CudaTransferEngine` has two side streams
(H2D, D2H), so both directions run concurrently (SuperInfer §4.3.2 "full duplex"); a copy is one
Triton gather/scatter launch reading or writing the pinned, block-first host pool through unified
addressing (``kernels/block_copy.py``), or, where Triton refuses host pointers, one
``cudaMemcpyAsync`` per segment (correct, launch-bound; logged once at construction).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog
import torch

from kernels.batched_memcpy import BatchedMemcpy, probe_in_subprocess, segment_pointers
from kernels.batched_memcpy import probe as probe_dma
from kernels.block_copy import copy_segments, word_view
from sglang_ext.dataplane.event_clock import EventClock
from sglang_ext.dataplane.page_fetch import PageFetch
from sglang_ext.dataplane.pinned_upload_ring import PinnedUploadRing
from sglang_ext.dataplane.transfer_clock import STALL, TransferClock
from sglang_ext.dataplane.wall_clock import WallClock

log = structlog.get_logger(__name__)

DMA_MIN_BYTES = 28 << 10
"""Under ``--kv-copy-engine dma``, copies of smaller rows stay on the Triton kernel: the copy
engines' batched H2D "falls off a cliff" under ~28 KiB a copy (vLLM #42212, which added a kernel
path for that reason). KV segments at page 16 are 32 KiB (Llama-3-8B shapes); a decode step's
parked token rows (2 KiB) are one short kernel launch a step."""
INDEX_SLOTS = 32
"""Slots of the CUDA engine's index-upload ring: a boundary that moves pages takes two per
launch, and a slot must not come round within one boundary (its release would then wait on the
step the GPU is still running)."""


def _rows_bytes(src: torch.Tensor, idx: torch.Tensor) -> int:
    """Bytes a launch copying rows ``idx`` of the 2-D ``src`` moves (booked with its seconds)."""
    return int(idx.shape[0]) * src.shape[1] * src.element_size()


@dataclass
class TransferStats:
    """Counters since construction (host-side bookkeeping, no device reads)."""

    h2d_segments: int = 0
    """Segments (K or V of one layer-page) copied host -> device."""
    d2h_segments: int = 0
    """Segments copied device -> host."""
    h2d_launches: int = 0
    """Batched H2D launches."""
    d2h_launches: int = 0
    """Batched D2H launches."""
    d2h_rows: int = 0
    """Token rows copied device -> host (:meth:`TransferEngine.d2h_rows`: a decode step's parked
    new tokens, :class:`~sglang_ext.dataplane.token_writeback.TokenWriteback`)."""


class TransferEngine:
    """Base: the two segment views, the counters and the launch bookkeeping."""

    copies_beside_compute = False
    """Copies run on streams of their own beside the layers (CUDA), not inside the forward's
    host calls (the synchronous CPU engine, whose copy time is inside the layers' time)."""

    def __init__(self, host_segments: torch.Tensor, dev_segments: torch.Tensor) -> None:
        if host_segments.dim() != 2 or dev_segments.dim() != 2 or host_segments.shape[1] != dev_segments.shape[1]:
            raise ValueError(
                f"segment views must be 2-D with equal rows, got {tuple(host_segments.shape)} and "
                f"{tuple(dev_segments.shape)}"
            )
        self.host = host_segments
        self.dev = dev_segments
        self.segment_bytes = host_segments.shape[1] * host_segments.element_size()
        self.stats = TransferStats()
        self.clock: TransferClock = WallClock()
        """Times the launches and the compute-stream waits (the CUDA engine replaces it)."""

    def h2d(self, src_idx: torch.Tensor, dst_idx: torch.Tensor, wait: Sequence[Any] = (),
            host_idx: tuple[np.ndarray, np.ndarray] | None = None) -> Any:
        """Host segments ``src_idx`` -> device segments ``dst_idx``; returns the launch's event.
        ``host_idx``: the same indices as NumPy (only the per-segment fallback reads them)."""
        n = int(src_idx.shape[0])
        if n == 0:
            return None
        self.stats.h2d_segments += n
        self.stats.h2d_launches += 1
        return self._launch("h2d", self.host, self.dev, src_idx, dst_idx, wait, host_idx)

    def d2h(self, src_idx: torch.Tensor, dst_idx: torch.Tensor, wait: Sequence[Any] = (),
            host_idx: tuple[np.ndarray, np.ndarray] | None = None) -> Any:
        """Device segments ``src_idx`` -> host segments ``dst_idx``; returns the launch's event."""
        n = int(src_idx.shape[0])
        if n == 0:
            return None
        self.stats.d2h_segments += n
        self.stats.d2h_launches += 1
        return self._launch("d2h", self.dev, self.host, src_idx, dst_idx, wait, host_idx)

    def d2h_rows(self, src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor,
                 host_idx: tuple[np.ndarray, np.ndarray] | None = None, keep: tuple[torch.Tensor, ...] = ()) -> Any:
        """Rows ``src_idx`` of the device tensor ``src`` -> rows ``dst_idx`` of the host view
        ``dst`` (both 2-D, rows of equal size, e.g. token rows), one launch after the compute
        stream's work so far; ``keep``: device tensors the copy reads that the caller drops
        (kept alive until it is done). Returns the launch's event."""
        n = int(src_idx.shape[0])
        if n == 0:
            return None
        self.stats.d2h_rows += n
        self.stats.d2h_launches += 1
        return self._launch("d2h", src, dst, src_idx, dst_idx, (), host_idx, keep)

    def warm_rows(self, host_rows: torch.Tensor) -> None:
        """Prepare :meth:`d2h_rows` of rows shaped like ``host_rows`` (CUDA: compile its copy kernel
        at start, not at the first step that needs it). Nothing to do here."""

    def fetch_pages(self, spec: PageFetch, wait: Sequence[Any] = ()) -> Any:
        """A paged step's fetch at one layer (:class:`PageFetch`: requests, not page lists);
        returns the launch's event. The CUDA engine's Triton path works out the pages on the
        device; the others copy ``spec.indices()``."""
        if spec.segments == 0:
            return None
        self.stats.h2d_segments += spec.segments
        self.stats.h2d_launches += 1
        return self._fetch(spec, wait)

    def _fetch(self, spec: PageFetch, wait: Sequence[Any]) -> Any:
        src, dst = spec.indices()
        return self._launch("h2d", self.host, self.dev, self.index_tensor(src), self.index_tensor(dst), wait,
                            (src, dst))

    def _launch(self, kind: str, src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor,
                dst_idx: torch.Tensor, wait: Sequence[Any], host_idx: tuple[np.ndarray, np.ndarray] | None,
                keep: tuple[torch.Tensor, ...] = ()) -> Any:
        raise NotImplementedError

    def mark_compute(self) -> None:
        """The next launches may share one wait on the compute stream's work so far (CUDA)."""

    def clear_compute_mark(self) -> None:
        """End of :meth:`mark_compute`'s sharing."""

    def end_compute(self) -> None:
        """The forward is over: the next launches read the current stream again (CUDA)."""

    def index_tensor(self, values: np.ndarray) -> torch.Tensor:
        """``values`` (int64) as an index tensor on the device (boundary operations only: one
        small upload; the per-step indices come from the step's single metadata upload)."""
        raise NotImplementedError

    def stream_wait(self, events: Sequence[Any]) -> None:
        raise NotImplementedError

    def fence(self) -> Any:
        raise NotImplementedError

    def wait_fence(self) -> None:
        """Step start: the compute stream waits for every copy issued so far (the boundary's
        moves, the last step's write-backs), the H2D stream for every copy-out."""
        raise NotImplementedError

    @property
    def fence_pending(self) -> bool:
        """Copies were launched since the last :meth:`wait_fence` (a step that starts without the
        pipeline must wait for them before its layers touch the pool). Never on the CPU engine,
        whose copies are done when launched."""
        return False

    def quiesce(self) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class CpuEvent:
    """A CPU launch's event: complete when born (the copy ran synchronously). Carries which launch
    it marks, so tests can check who waits on what."""

    kind: str
    """``h2d`` or ``d2h``."""
    seq: int
    """Launch number of this engine."""


class CpuTransferEngine(TransferEngine):
    """Synchronous copies (one ``index_select`` + ``index_copy_`` per call); events are
    :class:`CpuEvent` (always complete); ``waited`` records every stream wait (tests)."""

    def __init__(self, host_segments: torch.Tensor, dev_segments: torch.Tensor) -> None:
        super().__init__(host_segments, dev_segments)
        self._seq = 0
        self.waited: list[Any] = []

    def _launch(self, kind, src, dst, src_idx, dst_idx, wait, host_idx, keep=()):  # noqa: ANN001, ANN202
        token = self.clock.start(kind)
        dst.index_copy_(0, dst_idx, src.index_select(0, src_idx))
        self.clock.stop(kind, token, nbytes=_rows_bytes(src, src_idx))
        self._seq += 1
        return CpuEvent(kind, self._seq)

    def index_tensor(self, values: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))

    def stream_wait(self, events: Sequence[Any]) -> None:
        if not events:
            return
        token = self.clock.start(STALL)  # the WallClock does not time waits: they are no-ops here
        self.waited.extend(events)
        if len(self.waited) > 4096:
            del self.waited[:2048]
        self.clock.stop(STALL, token)

    def fence(self) -> Any:
        return None

    def wait_fence(self) -> None:
        return None

    def quiesce(self) -> None:
        return None


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
        self.dma_error: str | None = None
        """Why ``dma`` was refused (None: not asked for, or working)."""
        if copy_engine == "dma":
            self.set_copy_engine("dma")
        self.clock = EventClock(interval=timing_interval)
        self._indices = PinnedUploadRing(self.device, INDEX_SLOTS)
        """Pinned sources of :meth:`index_tensor`'s uploads (a boundary's moves take a few each)."""
        self.copy_programs: int | None = copy_programs
        """Persistent programs of each Triton copy launch; None: the kernel's default
        (``kernels.block_copy.DEFAULT_PROGRAMS``). Few leave SMs to the compute stream's
        kernels while a fetch runs (``kvplane gpu-check``'s overlap figure sweeps it)."""

    def _probe_zero_copy(self) -> str:
        """Check once, at construction, that the Triton kernel can read and write pinned memory."""
        probe_host = torch.arange(8, dtype=torch.float32).view(2, 4).pin_memory()
        probe_dev = torch.zeros(2, 4, device=self.device)
        idx = torch.tensor([1, 0], device=self.device)
        try:
            copy_segments(probe_host, probe_dev, idx, idx.flip(0), impl="triton")
            copy_segments(probe_dev, probe_host, idx[1:], idx[1:], impl="triton")  # row 0 -> row 0
            torch.cuda.synchronize(self.device)
            ok = probe_dev.cpu().tolist() == [[4.0, 5.0, 6.0, 7.0], [0.0, 1.0, 2.0, 3.0]] and (
                probe_host.tolist() == [[4.0, 5.0, 6.0, 7.0], [4.0, 5.0, 6.0, 7.0]]
            )
        except Exception as exc:  # noqa: BLE001 - any failure selects the safe path
            log.warning("kv_transfer_zero_copy_unavailable", error=str(exc))
            return "memcpy"
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
        if self._dma is None:
            if self.dma_error is not None:  # refused before: do not probe again
                return False
            # first in a child process: a call the driver takes with another ABI, or a fault on
            # the memory, would end this process or leave its CUDA context dead
            why = probe_in_subprocess(self.device.index if self.device.index is not None
                                      else torch.cuda.current_device())
            try:
                if why is not None:
                    raise RuntimeError(why)
                dma = BatchedMemcpy()
                self.quiesce()  # the pool's first row is read: nothing in flight may write it
                probe_dma(dma, self.device, self.host)  # and here, on this pool's own memory
                dma.reset_counts()
            except Exception as exc:  # noqa: BLE001 - any failure keeps the kernels
                self.dma_error = str(exc) or type(exc).__name__
                log.warning("kv_copy_engine_dma_unavailable", error=self.dma_error)
                return False
            self._dma = dma
        self.impl = "dma"
        return True

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

    def _dma_copy(self, src: torch.Tensor, dst: torch.Tensor, src_idx: np.ndarray, dst_idx: np.ndarray) -> None:
        """The copies as one batched memcpy on the current (side) stream."""
        assert self._dma is not None
        self._dma.copy(*segment_pointers(src, dst, src_idx, dst_idx), torch.cuda.current_stream(self.device).cuda_stream)

    def _launch(self, kind, src, dst, src_idx, dst_idx, wait, host_idx, keep=()):  # noqa: ANN001, ANN202
        def copy() -> None:
            if host_idx is not None and self._on_dma(src.shape[1] * src.element_size()):
                self._dma_copy(src, dst, host_idx[0], host_idx[1])
                return
            if self._kernel_impl == "triton":
                s_words, d_words = self._pool_words(src, dst)
                copy_segments(s_words, d_words, src_idx, dst_idx, impl="triton", programs=self.copy_programs)
                return
            if host_idx is None:
                raise RuntimeError("memcpy transfer fallback needs host indices")
            for s_i, d_i in zip(host_idx[0].tolist(), host_idx[1].tolist(), strict=True):
                dst[d_i].copy_(src[s_i], non_blocking=True)

        return self._on_stream(kind, wait, copy, (src_idx, dst_idx, *keep),
                               _rows_bytes(src, src_idx))

    def _fetch(self, spec: PageFetch, wait: Sequence[Any]) -> Any:
        nbytes = spec.segments * self.segment_bytes
        if self._on_dma(self.segment_bytes):  # the pages listed on the host, no SM taken
            src, dst = spec.indices()
            return self._on_stream("h2d", wait, lambda: self._dma_copy(self.host, self.dev, src, dst), (spec.flat,),
                                   nbytes)
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
        and the events of ``wait``; timed by the clock; returns its event."""
        stream = self.h2d_stream if kind == "h2d" else self.d2h_stream
        compute = self._compute_stream()
        compute_done = self._compute_mark if self._compute_mark is not None else compute.record_event()
        stream.wait_event(compute_done)
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
            torch.cuda.set_stream(compute)
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

    def quiesce(self) -> None:
        for event in self._last.values():
            if event is not None:
                event.synchronize()


def make_transfer_engine(host_segments: torch.Tensor, dev_segments: torch.Tensor,
                         copy_programs: int | None = None, copy_engine: str = "triton",
                         timing_interval: int = 1) -> TransferEngine:
    """The CUDA engine when the device pool is on a GPU (``copy_programs``: its copy launches'
    programs, :attr:`CudaTransferEngine.copy_programs`; ``copy_engine``: ``triton`` or ``dma``,
    :meth:`CudaTransferEngine.set_copy_engine`; ``timing_interval``: its clock's,
    :class:`~sglang_ext.dataplane.event_clock.EventClock`), the synchronous CPU engine otherwise."""
    if dev_segments.is_cuda:
        return CudaTransferEngine(host_segments, dev_segments, copy_programs, copy_engine, timing_interval)
    return CpuTransferEngine(host_segments, dev_segments)
