"""``DecisionNotifier``: wakes a worker's Session stream when its controller finishes a plan.

The embedded controller plans on its own thread, one step ahead, and hands decisions out on the
next ``report()`` or on ``poll()``. Pass a notifier as (part of) the controller's observer and to
:func:`~controlplane.service.server.create_server`; its ``on_plan`` then wakes the stream of that
worker, which polls and pushes the decision at once instead of waiting for the next report.
Implements the controller's ``ControllerObserver`` interface (only ``on_plan`` does anything).
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class DecisionNotifier:
    """worker_id -> wake-up callback; thread-safe, never raises into the controller."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wakers: dict[str, Callable[[], None]] = {}

    def register(self, worker_id: str, wake: Callable[[], None]) -> None:
        with self._lock:
            self._wakers[worker_id] = wake

    def unregister(self, worker_id: str, wake: Callable[[], None]) -> None:
        """Remove ``wake`` if it is still the registered one (a reconnect may have replaced it)."""
        with self._lock:
            if self._wakers.get(worker_id) is wake:
                del self._wakers[worker_id]

    def on_plan(self, worker_id: str, reason: str, solve_ms: float, feasible: bool) -> None:
        with self._lock:
            wake = self._wakers.get(worker_id)
        if wake is not None:
            wake()

    def on_trigger(self, worker_id: str, reason: str) -> None:
        pass

    def on_pause(self, worker_id: str, request_id: str, reason: str) -> None:
        pass

    def on_resume(self, worker_id: str, request_id: str, reason: str) -> None:
        pass

    def on_error(self, worker_id: str, error: str) -> None:
        pass
