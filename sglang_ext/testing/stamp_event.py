"""StampEvent: a CUDA timing event's stand-in on a :class:`~sglang_ext.testing.stamp_clock.StampClock`."""

from __future__ import annotations

from typing import Any


class StampEvent:
    """``record`` stamps the clock's time (ms); ``elapsed_time`` reads two stamps, counted on the
    clock; reading an event never recorded raises as CUDA does."""

    def __init__(self, clock: Any) -> None:
        self.clock = clock
        self.at: float | None = None

    def record(self, stream: object = None) -> None:
        self.at = self.clock.ms

    def query(self) -> bool:
        """Complete once recorded (the clock is moved by hand: what is stamped has run)."""
        return self.at is not None

    def synchronize(self) -> None:
        """Nothing to wait for: the clock is moved by hand."""

    def elapsed_time(self, other: StampEvent) -> float:
        self.clock.reads += 1
        if self.at is None or other.at is None:
            raise RuntimeError("CUDA error: invalid resource handle")
        return other.at - self.at
