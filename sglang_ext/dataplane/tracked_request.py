"""TrackedRequest: :class:`SlotResidency`'s record of one request (pages, wants, pause state)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass(eq=False)  # identity: a record is one request (its tensor fields have no == for dataclasses)
class TrackedRequest:
    """One tracked request: its pages in position order and what it wants on the device."""

    _pages: torch.Tensor
    gpu_layers: list[bool]
    planned: bool = False
    paused: bool = False
    pause_seq: int = 0
    anonymous: bool = False
    uncached: int = 0
    """Leading pages wanted in no layer (eLLM's uncached prefix, ``docs/recompute.md``)."""
    extra: dict = field(default_factory=dict)
    _tail: list[int] = field(default_factory=list)
    """Pages appended by the decode fast path, not yet joined to ``_pages`` (one int per new
    page: a tensor op per request and step would cost more than the step's own bookkeeping)."""

    @property
    def pages(self) -> torch.Tensor:
        """The request's pages in position order."""
        if self._tail:
            tail = np.fromiter(self._tail, dtype=np.int64, count=len(self._tail))
            self._pages = torch.from_numpy(np.concatenate([self._pages.numpy(), tail]))  # 2x torch.cat's cost
            self._tail = []
        return self._pages

    @pages.setter
    def pages(self, value: torch.Tensor) -> None:
        self._pages, self._tail = value, []
