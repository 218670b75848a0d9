"""Loading the CBC solver library once per process, before the first plan needs it."""

from __future__ import annotations

import threading

import structlog

log = structlog.get_logger(__name__)

_warm_lock = threading.Lock()
_warm_done = False


def warm_up_solver() -> None:
    """Load the CBC library once per process, in the calling thread.

    Loading it (python-mip's first ``Model(solver_name="CBC")``) holds the GIL for ~240 ms on the
    2-core dev machine; left to the first plan on the planning thread, it would stall the worker's
    ``report()`` for that long. Sessions in asynchronous mode call this when they are opened.
    """
    global _warm_done
    with _warm_lock:
        if _warm_done:
            return
        try:
            import mip

            mip.Model(solver_name=mip.CBC)
        except Exception:  # no CBC here: the planner degrades to its exact search
            log.warning("solver_warm_up_failed", exc_info=True)
        _warm_done = True
