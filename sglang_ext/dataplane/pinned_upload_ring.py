"""PinnedUploadRing: persistent pinned host buffers for the data plane's per-step uploads.

The step's tables (:class:`~sglang_ext.dataplane.step_tables.StepTables`) and the map mirror's
changed columns (:class:`~sglang_ext.dataplane.map_mirror.MapMirror`) reach the device with one
non-blocking copy each, which must come from pinned memory (a pageable source makes PyTorch
synchronise the stream). ``tensor.pin_memory()`` per upload goes through PyTorch's caching host
allocator every step: on the H200 host of ``kvplane gpu-check`` run 14 the two calls per placed
step cost 1.09 ms of kvplane's 12.9 ms host time (``details.kvplane_host_profile``). The ring
allocates its pinned buffers once and writes each upload into the next one.

Rules:

* :meth:`take` hands out the next slot's buffer (a host ``uint8`` view of ``nbytes``) and notes
  the stream current then. First it *releases* the slot taken before: it records an event on
  that slot's stream, where every copy that reads the slot has been enqueued by then -- the
  ring's own copy in :meth:`upload`, and a consumer's copy within the step on the same stream
  (FlashInfer's ``plan`` copies the CSR's host views on the forward stream). A slot is
  written again only once its release event has completed: ``query()``, else ``synchronize()``
  (counted in :attr:`waits`). With the GPU at most a step behind the host and one or two takes a
  step, the event of a slot ``slots`` takes old has long completed: no wait in steady state.
* If the slot coming round is still in use, a fresh slot is inserted in front of it (up to
  :data:`GROW_TO` times the slots: a boundary with many moves allocates as ``pin_memory()`` did
  rather than wait for the forward in flight); only a ring at that size waits.
* A host view stays valid for ``slots - 1`` more takes; an owner that keeps host views across
  steps copies them into its next take (:meth:`PagedStepTables.advanced` does).
* A slot too small grows to the next power of two of what is asked (at least twice its size).
  The old buffer is dropped: PyTorch's host allocator keeps a pinned block whose copies are in
  flight until they finish.
* On a CPU pool there is nothing to pin and nothing in flight: :meth:`upload` returns the values
  as a tensor (host and "device" the same, as before the ring), and the ring keeps no memory.

The event factory and pinning are parameters so the bookkeeping runs on the CPU in tests
(``tests/dataplane/test_pinned_upload_ring.py``), with fake events that report "not done".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

SLOTS = 8
"""Slots of a ring: a host view survives seven more takes (a step takes one or two per ring)."""
MIN_BYTES = 4096
"""Smallest slot buffer."""
GROW_TO = 4
"""A ring grows to this many times its slots before a take waits: a boundary that uploads more
than its slots (many moves) then allocates, as ``pin_memory()`` did, instead of waiting for the
forward in flight."""


class PinnedUploadRing:
    """Round-robin pinned upload buffers with release events (module docstring)."""

    def __init__(self, device: torch.device, slots: int = SLOTS, *, pin: bool | None = None,
                 new_event: Callable[[], Any] | None = None,
                 current_stream: Callable[[], Any] | None = None) -> None:
        if slots < 2:
            raise ValueError(f"PinnedUploadRing: slots={slots}, must be >= 2 (a host view outlives one take)")
        self.device = torch.device(device)
        self.slots = slots
        self.pin = self.device.type == "cuda" if pin is None else pin
        self._new_event = new_event if new_event is not None else torch.cuda.Event
        if current_stream is None:
            cuda = self.device.type == "cuda"
            current_stream = (lambda: torch.cuda.current_stream(self.device)) if cuda else (lambda: None)
        self._current_stream = current_stream
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._events: list[Any] = [None] * slots
        self._streams: list[Any] = [None] * slots
        """The stream current when each slot was taken (its readers' stream)."""
        self._at = -1
        """The slot taken last (-1: none yet)."""
        self.takes = 0
        """Slots handed out since construction."""
        self.waits = 0
        """Takes that had to wait for a release event (0 in steady state)."""
        self.grown = 0
        """Buffers allocated (at most one per slot in steady state)."""
        self.max_slots = GROW_TO * slots
        """Slots the ring may grow to before a take waits."""
        self.added = 0
        """Slots added because the one coming round was still in use."""

    def take(self, nbytes: int) -> torch.Tensor:
        """The next slot's buffer as ``nbytes`` of host ``uint8`` (see the module's rules)."""
        if nbytes < 0:
            raise ValueError(f"PinnedUploadRing.take: nbytes={nbytes} < 0")
        if self._at >= 0:  # release the last slot: its readers are all enqueued by now
            event = self._events[self._at]
            if event is None:
                event = self._events[self._at] = self._new_event()
            event.record(self._streams[self._at])
        at = self._at = (self._at + 1) % self.slots
        event = self._events[at]
        if event is not None and self._buffers[at] is not None and not event.query():
            if self.slots < self.max_slots:  # a fresh slot here; the busy one comes round later
                for slots in (self._buffers, self._events, self._streams):
                    slots.insert(at, None)
                self.slots += 1
                self.added += 1
            else:
                event.synchronize()
                self.waits += 1
        self._streams[at] = self._current_stream()
        buf = self._buffers[at]
        if buf is None or buf.numel() < nbytes:
            size = max(MIN_BYTES, 1 << max(0, nbytes - 1).bit_length(), 2 * (buf.numel() if buf is not None else 0))
            buf = self._buffers[at] = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            self.grown += 1
        self.takes += 1
        return buf[:nbytes]

    def stage(self, values: np.ndarray) -> torch.Tensor:
        """``values`` (1-D, C-contiguous) copied into the next slot; the host view, its dtype."""
        values = np.ascontiguousarray(values)
        host = self.take(values.nbytes)
        host.numpy()[:] = values.view(np.uint8).reshape(-1)
        return host.view(_TORCH[values.dtype.str])

    def upload(self, values: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """``(device tensor, host view)`` of ``values``: staged in the ring and sent with ONE
        non-blocking copy on the current stream. On a CPU pool both are ``values`` as a tensor."""
        if self.device.type == "cpu":
            tensor = torch.from_numpy(values)
            return tensor, tensor
        host = self.stage(values)
        return host.to(self.device, non_blocking=True), host


_TORCH = {np.dtype(t).str: torch.from_numpy(np.zeros(0, dtype=t)).dtype
          for t in (np.int64, np.int32, np.uint8, np.int16, np.float32)}
"""NumPy dtype string -> torch dtype, for the staged view."""
