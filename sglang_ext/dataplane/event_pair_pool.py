"""EventPairPool: reusable ``(start, end)`` timing-event pairs for :class:`EventClock`.

Pairs are created lazily, up to ``capacity``, and go back to a free list once the clock has read
them. The pool therefore stops growing at the largest number of pairs that were ever outstanding
at once (about one step's copies and waits), and never exceeds ``capacity``. If events stop
completing, :meth:`acquire` returns None at the cap (the caller counts the launch as untimed), so
memory stays bounded. Acquire and release are O(1).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

DEFAULT_CAPACITY = 1024
"""Pairs at most (2 events each): a step of an 80-layer model issues up to ~3 per layer."""


class EventPairPool:
    """A free list of event pairs, capped at ``capacity`` (module docstring)."""

    def __init__(self, new_event: Callable[[], Any], capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"EventPairPool: capacity={capacity}, must be >= 1")
        self._new = new_event
        self.capacity = capacity
        self._free: list[tuple[Any, Any]] = []
        self.created = 0
        """Pairs created since construction (at most ``capacity``)."""
        self.in_use = 0
        """Pairs handed out and not yet released."""

    def acquire(self) -> tuple[Any, Any] | None:
        """A free pair, a new one below the cap, or None when all ``capacity`` pairs are out."""
        if self._free:
            pair = self._free.pop()
        elif self.created < self.capacity:
            pair = (self._new(), self._new())
            self.created += 1
        else:
            return None
        self.in_use += 1
        return pair

    def release(self, pair: tuple[Any, Any]) -> None:
        """``pair`` has been read and may be recorded again."""
        self.in_use -= 1
        self._free.append(pair)
