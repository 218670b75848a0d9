"""Per-worker adaptive controller (OrbitFlow §3.2-3.4): triggers, token deposit, pause/resume,
starvation guard, EWMA profile, and the per-worker schedulers (fcfs, layerkv, lvf).

Primitives:

* :class:`SessionController` - one worker's session (implements ``api.WorkerSession``):
  ``report(StepReport) -> list[Decision]``, ``poll()``, ``flush(timeout_s)``, ``close()``,
  ``status()``, ``deposit(request_id)``.
* :class:`TokenDeposit` - pure, explicit-time token pacing (OrbitFlow §3.2).
* :class:`ProfileTracker` - per-layer compute and bandwidth, EWMA-updated on mismatch.
* :func:`make_scheduler` / ``SCHEDULERS`` - the scheduler registry.
* :class:`ControllerObserver` with :class:`ControllerCounters` and :class:`PrometheusObserver`.
"""

from controlplane.controller.batch_limits import UNLIMITED, BatchLimits
from controlplane.controller.decision_builder import DecisionBuilder, PlannerLike, PlanningInput
from controlplane.controller.metrics import (
    ControllerCounters,
    ControllerObserver,
    CounterSnapshot,
    FanOutObserver,
    NullObserver,
    PrometheusObserver,
    SafeObserver,
)
from controlplane.controller.profile_tracker import ProfileTracker, ProfileUpdate
from controlplane.controller.schedulers import SCHEDULERS, make_scheduler
from controlplane.controller.session_controller import SessionController
from controlplane.controller.session_status import SessionStatus
from controlplane.controller.token_deposit import Delivery, TokenDeposit
from controlplane.controller.victims import select_victim

__all__ = [
    "SCHEDULERS",
    "UNLIMITED",
    "BatchLimits",
    "ControllerCounters",
    "ControllerObserver",
    "CounterSnapshot",
    "DecisionBuilder",
    "Delivery",
    "FanOutObserver",
    "NullObserver",
    "PlannerLike",
    "PlanningInput",
    "ProfileTracker",
    "ProfileUpdate",
    "PrometheusObserver",
    "SafeObserver",
    "SessionController",
    "SessionStatus",
    "TokenDeposit",
    "make_scheduler",
    "select_victim",
]
