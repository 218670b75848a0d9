"""``DecisionInbox``: the control plane's decisions between the step that receives them and the
boundary that installs them (TP rank 0).

Decisions arrive with a report's answer (:class:`~sglang_ext.step_reporter.StepReporter`) or a
poll at the boundary (:class:`~sglang_ext.step_boundary.StepBoundary`); both go through
:meth:`DecisionInbox.receive`, the one place that tracks the newest decision's expiry (which
ends report coalescing: the step that reaches it is reported). Pauses that could not be applied
yet (the request is still prefilling) wait here too.
"""

from __future__ import annotations

from controlplane.api import Decision


def _offloads(decision: Decision) -> bool:
    return bool(decision.pause or decision.resume) or not decision.plan.all_gpu()


class DecisionInbox:
    """Decisions received and not yet installed, their expiry, and the deferred pauses."""

    def __init__(self) -> None:
        self.pending: list[Decision] = []
        """Received since the last boundary, oldest first."""
        self.expiry_step = 0
        """Expiry step of the newest decision received."""
        self.received_offloading = 0
        """Decisions received so far that keep anything off the GPU: a layer on host, a
        recomputed prefix, a pause or a resume (the step reporter's quiet cadence ends at one)."""
        self.deferred_pause: dict[str, int] = {}
        """Requests to pause once they join the running batch -> the step the pause was decided."""

    def receive(self, decisions: list[Decision]) -> None:
        """Decisions from the control plane: installed at the next boundary; the newest one's
        expiry ends report coalescing (the step reaching it is reported)."""
        if decisions:
            self.expiry_step = decisions[-1].expiry_step
            self.pending.extend(decisions)
            self.received_offloading += sum(map(_offloads, decisions))

    def take(self) -> list[Decision]:
        """The pending decisions, oldest first; the inbox keeps none."""
        decisions, self.pending = self.pending, []
        return decisions
