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
ordering logic above runs and is tested on CPU. The CUDA engine
(:class:`~sglang_ext.dataplane.cuda_transfer_engine.CudaTransferEngine`, its own module) has two
side streams (H2D, D2H), so both directions run concurrently (SuperInfer §4.3.2 "full duplex").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from sglang_ext.dataplane.page_fetch import PageFetch
from sglang_ext.dataplane.transfer_clock import STALL, TransferClock
from sglang_ext.dataplane.wall_clock import WallClock


def rows_bytes(src: torch.Tensor, idx: torch.Tensor) -> int:
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
        self.host_page_rows = 1
        """Host rows between one layer's segments of consecutive pages (the block-first pool:
        ``2 x layers``, set by the store): the source pitch of a fetch's strided runs."""
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
        event = self._launch("h2d", self.host, self.dev, src_idx, dst_idx, wait, host_idx)
        self.stats.h2d_segments += n  # counted once launched (a launch that raises is not)
        self.stats.h2d_launches += 1
        return event

    def d2h(self, src_idx: torch.Tensor, dst_idx: torch.Tensor, wait: Sequence[Any] = (),
            host_idx: tuple[np.ndarray, np.ndarray] | None = None) -> Any:
        """Device segments ``src_idx`` -> host segments ``dst_idx``; returns the launch's event."""
        n = int(src_idx.shape[0])
        if n == 0:
            return None
        event = self._launch("d2h", self.dev, self.host, src_idx, dst_idx, wait, host_idx)
        self.stats.d2h_segments += n
        self.stats.d2h_launches += 1
        return event

    def d2h_rows(self, src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor, dst_idx: torch.Tensor,
                 host_idx: tuple[np.ndarray, np.ndarray] | None = None, keep: tuple[torch.Tensor, ...] = ()) -> Any:
        """Rows ``src_idx`` of the device tensor ``src`` -> rows ``dst_idx`` of the host view
        ``dst`` (both 2-D, rows of equal size, e.g. token rows), one launch after the compute
        stream's work so far; ``keep``: device tensors the copy reads that the caller drops
        (kept alive until it is done). Returns the launch's event."""
        n = int(src_idx.shape[0])
        if n == 0:
            return None
        event = self._launch("d2h", src, dst, src_idx, dst_idx, (), host_idx, keep)
        self.stats.d2h_rows += n
        self.stats.d2h_launches += 1
        return event

    def warm_pool_copies(self, map_row: torch.Tensor | None) -> None:
        """Prepare the copies between the pools (CUDA: compile their kernels at start, not at the
        first offload, write-back or fetch while serving; ``map_row``: a row of the store's map
        mirror, whose dtype the fetch kernel is compiled for; None: no paged fetch). Nothing to do here."""

    def warm_rows(self, host_rows: torch.Tensor) -> None:
        """Prepare :meth:`d2h_rows` of rows shaped like ``host_rows`` (CUDA: compile its copy kernel
        at start, not at the first step that needs it). Nothing to do here."""

    def fetch_pages(self, spec: PageFetch, wait: Sequence[Any] = ()) -> Any:
        """A paged step's fetch at one layer (:class:`PageFetch`: requests, not page lists);
        returns the launch's event. The CUDA engine's Triton path works out the pages on the
        device; the others copy ``spec.indices()``."""
        if spec.segments == 0:
            return None
        event = self._fetch(spec, wait)
        self.stats.h2d_segments += spec.segments
        self.stats.h2d_launches += 1
        return event

    def _fetch(self, spec: PageFetch, wait: Sequence[Any]) -> Any:
        src, dst = spec.indices()
        return self._launch("h2d", self.host, self.dev, self.index_tensor(src), self.index_tensor(dst), wait,
                            (src, dst))

    def _launch(self, kind: str, src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor,
                dst_idx: torch.Tensor, wait: Sequence[Any], host_idx: tuple[np.ndarray, np.ndarray] | None,
                keep: tuple[torch.Tensor, ...] = ()) -> Any:
        raise NotImplementedError

    def after_graph(self) -> None:
        """A step whose copies ran inside a replayed graph has ended (its forks joined into the
        compute stream): later fences and host reads order after it (CUDA). Nothing to do here."""

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
        self.clock.stop(kind, token, nbytes=rows_bytes(src, src_idx))
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


def make_transfer_engine(host_segments: torch.Tensor, dev_segments: torch.Tensor,
                         copy_programs: int | None = None, copy_engine: str = "triton",
                         timing_interval: int = 1) -> TransferEngine:
    """The CUDA engine when the device pool is on a GPU (``copy_programs``: its copy launches'
    programs, :attr:`CudaTransferEngine.copy_programs`; ``copy_engine``: ``triton`` or ``dma``,
    :meth:`CudaTransferEngine.set_copy_engine`; ``timing_interval``: its clock's,
    :class:`~sglang_ext.dataplane.event_clock.EventClock`), the synchronous CPU engine otherwise."""
    if dev_segments.is_cuda:
        from sglang_ext.dataplane.cuda_transfer_engine import CudaTransferEngine

        return CudaTransferEngine(host_segments, dev_segments, copy_programs, copy_engine, timing_interval)
    return CpuTransferEngine(host_segments, dev_segments)
