"""StampClock: a device clock moved by hand, with timing events on it and a capture flag.

The CPU has no CUDA events and its emulated graphs (:class:`~sglang_ext.testing.tape_graph.TapeGraph`)
replay none, so the tests of per-layer timing on replayed graphs
(:class:`~sglang_ext.dataplane.graph_layer_marks.GraphLayerMarks`) play the device's part: a test
moves :attr:`StampClock.ms` as layers would take time and stamps a graph's events as its replay
would. No sleeping, so a loaded host cannot reorder the times.
"""

from __future__ import annotations

from sglang_ext.testing.stamp_event import StampEvent


class StampClock:
    """The clock (ms), the events made on it (:meth:`event`), and whether a capture records now
    (the object called: ``GraphLayerMarks``' ``capturing``)."""

    def __init__(self) -> None:
        self.ms = 0.0
        self.reads = 0
        """``elapsed_time`` calls on its events (a dropped sample must not be read: on a GPU the
        next replay may be stamping its events as they are read)."""
        self.capturing = False

    def event(self) -> StampEvent:
        return StampEvent(self)

    def __call__(self) -> bool:
        return self.capturing
