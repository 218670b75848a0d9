"""``OutlierGuard``: whether a step's profile mismatch moves the profile now (OrbitFlow §3.4's
profile-mismatch trigger, guarded against one-off steps)."""

from __future__ import annotations

import structlog

from controlplane.controller.profile_tracker import ProfileTracker

log = structlog.get_logger(__name__)

OUTLIER_RATIO = 3.0
"""A step observed more than this many times slower (or faster) than the profile predicts moves
the profile only when the next mismatched report agrees (slower again, or faster again): one
500 ms step among 76 ms ones (a GC pause, a preemption) scaled every layer by 6.5, paused 17 of
24 requests, and they stayed paused long after the profile recovered (control-plane review,
session 54). A real change of that size costs one more report."""


class OutlierGuard:
    """One session's memory of its last mismatched report (was it an outlier, which way)."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self._outlier: bool | None = None
        """The last mismatched report was an outlier: slower (True) or faster (False); None: not."""

    def moves(self, observed: float, predicted: float, threshold: float, step: int) -> bool:
        """Whether the profile moves on this observation: a mismatch above ``threshold`` that is
        not a first outlier (:data:`OUTLIER_RATIO`)."""
        if ProfileTracker.mismatch(observed, predicted) <= threshold:
            self._outlier = None
            return False
        ratio = observed / predicted if predicted > 0 else 1.0
        if 1.0 / OUTLIER_RATIO <= ratio <= OUTLIER_RATIO:
            self._outlier = None
            return True
        held, self._outlier = self._outlier, ratio > 1.0
        if held == self._outlier:  # the second in a row, the same way: a real change
            self._outlier = None
            return True
        log.info("profile_outlier_held", worker=self.worker_id, step=step, observed_ms=round(observed, 3),
                 predicted_ms=round(predicted, 3))
        return False
