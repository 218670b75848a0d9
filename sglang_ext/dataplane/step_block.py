"""StepBlock: a graph's per-step inputs as typed regions of ONE device buffer, sent in ONE copy.

A CUDA graph reads each step's tables from buffers that stay put
(:class:`~sglang_ext.dataplane.graph_step_buffers.GraphStepBuffers`). Loaded one tensor at a time
from the step's device tables, an admission cost a dozen copy launches and twice as many views,
a few microseconds of host time each on a GPU host (session 69's probe: 12 copies and ~30 views
of the ~80 torch ops a staged step's boundary and admission dispatch). Here every region the
graph reads -- rows, CSR, page lists, staging entries, fetch lists, write-back indices -- is a
view of one device buffer laid out once, and the host writes a step's values into NumPy views
of a pinned twin of it (no torch op) and sends them with one non-blocking copy
(:meth:`send`) of a prefix of the buffer (the graph buffers send up to the step's last staging
entry: every region before it whole, ~0.45 MiB at Llama-3-8B's 32 layers and 256 rows, plus the
step's page columns; where the page-list region's unused tail is wide -- many page columns, as
SGLang's page of one token makes -- that tail is skipped with a second copy:
``GraphStepBuffers.SPLIT_BYTES``).

Two host twins alternate: the one being written was sent two admissions ago, and on CUDA an
event recorded after that copy says it has been read (waited for only if not: ``waits`` counts
it; 0 in steady state). On a CPU device the copy is synchronous and no event is needed.

Regions are laid out in the order given, each at an 8-byte boundary; values past what a step
writes are whatever an earlier step left (its readers are bounded by the step's lengths).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

TWINS = 2
"""Host buffers written in turn."""


class StepBlock:
    """Regions ``(name, dtype, shape)`` of one device buffer and its pinned host twins (module
    docstring). ``new_event`` / ``current_stream``: how a twin's copy is tracked (default: CUDA
    events on the device's current stream, on CUDA only; the tests pass stand-ins to run the
    twins' wait on the CPU, as :class:`PinnedUploadRing`'s do)."""

    def __init__(self, regions: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], device: Any,
                 new_event: Callable[[], Any] | None = None, current_stream: Callable[[], Any] | None = None) -> None:
        self.device = torch.device(device)
        at, spans = 0, {}
        for name, dtype, shape in regions:
            if name in spans:
                raise ValueError(f"StepBlock: region {name!r} twice")
            at = -(-at // 8) * 8
            count = int(np.prod(shape))
            itemsize = torch.empty(0, dtype=dtype).element_size()
            spans[name] = (at, dtype, tuple(shape), itemsize)
            at += count * itemsize
        self.nbytes = -(-at // 8) * 8
        self._spans = spans
        self.dev = torch.zeros(self.nbytes, dtype=torch.uint8, device=self.device)
        self.views = {name: self._typed(self.dev, name) for name in spans}
        """Each region as a typed device view (what a graph captures)."""
        cuda = self.device.type == "cuda"
        self._hosts = [torch.zeros(self.nbytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(TWINS)]
        self._host_views = [{name: self._typed(h, name).numpy() for name in spans} for h in self._hosts]
        if new_event is None and cuda:
            new_event = torch.cuda.Event
        self._events: list[Any] = [new_event() for _ in range(TWINS)] if new_event is not None else []
        self._current_stream = current_stream or (lambda: torch.cuda.current_stream(self.device))
        self._sent = [False] * TWINS
        self._at = 0
        self.sends = 0
        self.waits = 0
        """Host twins that were still being read when their turn came (0 in steady state)."""

    def _typed(self, buf: torch.Tensor, name: str) -> torch.Tensor:
        at, dtype, shape, itemsize = self._spans[name]
        return buf[at: at + int(np.prod(shape)) * itemsize].view(dtype).view(shape)

    def end(self, name: str, count: int) -> int:
        """Byte offset just past the first ``count`` elements of region ``name``."""
        at, _, _, itemsize = self._spans[name]
        return at + count * itemsize

    def host(self) -> dict[str, np.ndarray]:
        """The next host twin's regions as NumPy views, free to write (waits for its last copy
        only if the device has not read it yet)."""
        at = self._at = (self._at + 1) % TWINS
        if self._events and self._sent[at] and not self._events[at].query():
            self._events[at].synchronize()
            self.waits += 1
        return self._host_views[at]

    def start(self, name: str) -> int:
        """Byte offset of region ``name``."""
        return self._spans[name][0]

    def send(self, nbytes: int | None = None, also: tuple[int, int] | None = None) -> None:
        """The twin :meth:`host` handed out, its first ``nbytes`` (default: all), to the device
        buffer in one non-blocking copy on the current stream; ``also``: a byte range
        ``(start, end)`` past them sent in a second copy (a gap not worth sending between)."""
        n = self.nbytes if nbytes is None else int(nbytes)
        if not 0 <= n <= self.nbytes:
            raise ValueError(f"StepBlock.send: {n} bytes of a {self.nbytes}-byte block")
        if also is not None and not n <= also[0] <= also[1] <= self.nbytes:
            raise ValueError(f"StepBlock.send: range {also} is not within bytes {n}..{self.nbytes}")
        at = self._at
        self.dev[:n].copy_(self._hosts[at][:n], non_blocking=True)
        if also is not None and also[1] > also[0]:
            lo, hi = also
            self.dev[lo:hi].copy_(self._hosts[at][lo:hi], non_blocking=True)
        if self._events:  # on the stream the copy went to (the block's device's current one)
            self._events[at].record(self._current_stream())
        self._sent[at] = True
        self.sends += 1
