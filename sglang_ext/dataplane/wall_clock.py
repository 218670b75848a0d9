"""WallClock: the synchronous CPU engine's clock (``time.perf_counter`` around each copy).

The CPU engine copies on the calling (scheduler) thread. The time spent inside a copy is the
copy's time, and it is also time the step waited: each copy adds its seconds both to its
direction and to the open step's stall. Stream waits are no-ops on the CPU (events are born
complete), so they are not timed. This is what kvplane has always measured on the CPU.
"""

from __future__ import annotations

import time
from typing import Any

from sglang_ext.dataplane.transfer_clock import STALL, TransferClock


class WallClock(TransferClock):
    """Wall time of synchronous copies. Copy seconds also count as stall."""

    def start(self, kind: str, stream: Any = None) -> float | None:
        return None if kind == STALL else time.perf_counter()

    def stop(self, kind: str, token: Any, stream: Any = None, nbytes: int = 0) -> None:
        if token is None:
            return
        seconds = time.perf_counter() - token
        self.times.add_copy(kind, seconds, nbytes)
        self.times.add_stall(seconds)

    def harvest(self) -> int:
        return 0
