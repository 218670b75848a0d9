"""TransferEngine: batched host<->device segment copies with events.

Primitives (one launch each, all pairs batched):

* ``h2d(host_segs, dev_segs, wait) -> event`` and ``d2h(dev_segs, host_segs, wait) -> event``;
  every launch is ordered after all work issued so far on the compute stream, and after the
  events in ``wait``.
* ``stream_wait(events)``: the compute stream waits (attention waits for its layer; SGLang's
  ``LayerDoneCounter`` pattern, one event per launch, the cache keeps them per layer).
* ``host_wait(events)`` / ``quiesce()``: the host blocks until done.

:class:`CpuTransferEngine` copies synchronously (events are born complete), so everything above is
testable without a GPU. :class:`CudaTransferEngine` uses two streams, one per direction, so H2D and
D2H run concurrently (SuperInfer §4.3.2 "full duplex"); the copy is the Triton gather/scatter
kernel reading the pinned host pool through unified addressing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog
import torch

from kernels.block_copy import copy_segments

log = structlog.get_logger(__name__)


@dataclass
class TransferStats:
    """Counters since construction."""

    h2d_segments: int = 0
    """Segments (K or V of one layer-block) copied host -> device."""
    d2h_segments: int = 0
    """Segments copied device -> host."""
    h2d_launches: int = 0
    """Batched H2D launches."""
    d2h_launches: int = 0
    """Batched D2H launches."""


class TransferEngine:
    """Base: holds the two segment views and the counters."""

    def __init__(self, host_segments: torch.Tensor, dev_segments: torch.Tensor) -> None:
        self.host = host_segments
        self.dev = dev_segments
        self.stats = TransferStats()

    def h2d(self, host_segs: list[int], dev_segs: list[int], wait: list[Any] | None = None) -> Any:
        raise NotImplementedError

    def d2h(self, dev_segs: list[int], host_segs: list[int], wait: list[Any] | None = None) -> Any:
        raise NotImplementedError

    def stream_wait(self, events: list[Any]) -> None:
        raise NotImplementedError

    def host_wait(self, events: list[Any]) -> None:
        raise NotImplementedError

    def quiesce(self) -> None:
        raise NotImplementedError


class CpuTransferEngine(TransferEngine):
    """Synchronous copies; ``None`` is the (always complete) event."""

    def h2d(self, host_segs: list[int], dev_segs: list[int], wait: list[Any] | None = None) -> None:
        if host_segs:
            copy_segments(self.host, self.dev, torch.tensor(host_segs), torch.tensor(dev_segs))
            self.stats.h2d_segments += len(host_segs)
            self.stats.h2d_launches += 1
        return None

    def d2h(self, dev_segs: list[int], host_segs: list[int], wait: list[Any] | None = None) -> None:
        if dev_segs:
            copy_segments(self.dev, self.host, torch.tensor(dev_segs), torch.tensor(host_segs))
            self.stats.d2h_segments += len(dev_segs)
            self.stats.d2h_launches += 1
        return None

    def stream_wait(self, events: list[Any]) -> None:
        return None

    def host_wait(self, events: list[Any]) -> None:
        return None

    def quiesce(self) -> None:
        return None


class CudaTransferEngine(TransferEngine):
    """Two side streams (H2D, D2H); one Triton launch per call; events order everything."""

    def __init__(self, host_segments: torch.Tensor, dev_segments: torch.Tensor) -> None:
        super().__init__(host_segments, dev_segments)
        if not host_segments.is_pinned():
            raise ValueError("CudaTransferEngine needs a pinned host pool")
        self.device = dev_segments.device
        self.h2d_stream = torch.cuda.Stream(device=self.device)
        self.d2h_stream = torch.cuda.Stream(device=self.device)
        self._last: dict[str, torch.cuda.Event | None] = {"h2d": None, "d2h": None}
        self.impl = self._probe_zero_copy()
        """``triton`` (one gather/scatter launch through UVA) or ``memcpy`` (fallback: one
        ``cudaMemcpyAsync`` per segment, correct but launch-bound) if Triton refuses host memory."""

    def _probe_zero_copy(self) -> str:
        """Check once that the Triton kernel can read and write the pinned host pool."""
        probe_host = torch.arange(8, dtype=torch.float32).view(2, 4).pin_memory()
        probe_dev = torch.zeros(2, 4, device=self.device)
        idx = torch.tensor([1, 0], device=self.device)
        try:
            copy_segments(probe_host, probe_dev, idx, idx.flip(0), impl="triton")
            # dev = host rows swapped: [[4..7], [0..3]]; then host row 0 = dev row 0 = [4..7]
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

    def _launch(
        self,
        kind: str,
        stream: torch.cuda.Stream,
        src: torch.Tensor,
        dst: torch.Tensor,
        src_segs: list[int],
        dst_segs: list[int],
        wait: list[Any] | None,
    ) -> torch.cuda.Event | None:
        if not src_segs:
            return None
        compute_done = torch.cuda.current_stream(self.device).record_event()
        idx = torch.tensor([src_segs, dst_segs], dtype=torch.int64, pin_memory=True)
        with torch.cuda.stream(stream):
            stream.wait_event(compute_done)
            for e in wait or ():
                if e is not None:
                    stream.wait_event(e)
            if self.impl == "triton":
                idx_dev = idx.to(self.device, non_blocking=True)
                copy_segments(src, dst, idx_dev[0], idx_dev[1], impl="triton")
            else:
                for s_i, d_i in zip(src_segs, dst_segs, strict=True):
                    dst[d_i].copy_(src[s_i], non_blocking=True)
            event = stream.record_event()
        self._last[kind] = event
        return event

    def h2d(self, host_segs: list[int], dev_segs: list[int], wait: list[Any] | None = None) -> Any:
        ev = self._launch("h2d", self.h2d_stream, self.host, self.dev, host_segs, dev_segs, wait)
        if host_segs:
            self.stats.h2d_segments += len(host_segs)
            self.stats.h2d_launches += 1
        return ev

    def d2h(self, dev_segs: list[int], host_segs: list[int], wait: list[Any] | None = None) -> Any:
        ev = self._launch("d2h", self.d2h_stream, self.dev, self.host, dev_segs, host_segs, wait)
        if dev_segs:
            self.stats.d2h_segments += len(dev_segs)
            self.stats.d2h_launches += 1
        return ev

    def stream_wait(self, events: list[Any]) -> None:
        current = torch.cuda.current_stream(self.device)
        for e in events:
            if e is not None:
                current.wait_event(e)

    def host_wait(self, events: list[Any]) -> None:
        for e in events:
            if e is not None:
                e.synchronize()

    def quiesce(self) -> None:
        self.host_wait([self._last["h2d"], self._last["d2h"]])


def make_transfer_engine(host_segments: torch.Tensor, dev_segments: torch.Tensor) -> TransferEngine:
    """The CUDA engine when the device pool is on a GPU, the synchronous CPU engine otherwise."""
    if dev_segments.is_cuda:
        return CudaTransferEngine(host_segments, dev_segments)
    return CpuTransferEngine(host_segments, dev_segments)
