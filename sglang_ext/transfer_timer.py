"""``TransferTimer``: the wall time of a synchronous transfer engine's copies (CPU).

The layered pool's :class:`~sglang_ext.dataplane.transfer_engine.CpuTransferEngine` copies
synchronously on the calling (scheduler) thread, so the time spent inside its ``h2d`` / ``d2h``
calls *is* the copy time. :meth:`TransferTimer.attach` wraps those two methods of the pool's
engine instance (the data plane's code is unchanged; the store and the layer pipeline share the
engine, so every copy passes through the wrappers) and sums the seconds per direction.

A CUDA engine only launches copies on side streams; the time of a call is launch time, not copy
time, so :meth:`attach` returns None there and nothing is measured (timing the copies would need
CUDA events read after the step's sync, inside the data plane).

Cost: two ``perf_counter`` calls per batched launch (at most a few per layer per step).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from sglang_ext.dataplane.transfer_engine import CpuTransferEngine


class TransferTimer:
    """Seconds spent in one synchronous engine's copies, per direction (scheduler thread)."""

    def __init__(self, engine: CpuTransferEngine) -> None:
        if not isinstance(engine, CpuTransferEngine):
            raise ValueError(
                f"TransferTimer needs a synchronous CpuTransferEngine, got {type(engine).__name__} "
                "(asynchronous copies cannot be timed by the calling thread)"
            )
        self.h2d_s = 0.0
        """Seconds spent copying host -> device."""
        self.d2h_s = 0.0
        """Seconds spent copying device -> host."""
        engine.h2d = self._timed(engine.h2d, "h2d_s")  # type: ignore[method-assign]
        engine.d2h = self._timed(engine.d2h, "d2h_s")  # type: ignore[method-assign]

    @property
    def total_s(self) -> float:
        """Both directions."""
        return self.h2d_s + self.d2h_s

    def _timed(self, call: Callable[..., Any], field: str) -> Callable[..., Any]:
        clock = time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return call(*args, **kwargs)
            finally:
                setattr(self, field, getattr(self, field) + (clock() - t0))

        return timed

    @classmethod
    def attach(cls, pool: Any) -> TransferTimer | None:
        """A timer on ``pool``'s transfer engine (the layered pool: ``pool.core.store.engine``),
        or None when the engine is not synchronous (CUDA) or the pool is not layered."""
        engine = getattr(getattr(getattr(pool, "core", None), "store", None), "engine", None)
        if not isinstance(engine, CpuTransferEngine):
            return None
        return cls(engine)
