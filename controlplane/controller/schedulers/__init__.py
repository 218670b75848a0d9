"""Admission/rotation schedulers, selectable per worker, and their registry.

``fcfs`` (arrival order while memory allows), ``layerkv`` (LayerKV §3.1 Eq. 1-4) and ``lvf``
(SuperInfer §4.2 Virtual Lag Time, Largest-VLT-First). :func:`make_scheduler` validates the name
when a session is opened (``InvalidArgument`` naming the field and the allowed values).
"""

from __future__ import annotations

from collections.abc import Callable

from controlplane.api import InvalidArgument
from controlplane.controller.schedulers.base import (
    RequestView,
    Scheduler,
    SchedulerDecision,
    SchedulerView,
)
from controlplane.controller.schedulers.fcfs import FcfsScheduler
from controlplane.controller.schedulers.layerkv import LayerKVScheduler
from controlplane.controller.schedulers.lvf import LvfScheduler
from controlplane.model import shown

SCHEDULERS: dict[str, Callable[[], Scheduler]] = {
    FcfsScheduler.name: FcfsScheduler,
    LayerKVScheduler.name: LayerKVScheduler,
    LvfScheduler.name: LvfScheduler,
}


def make_scheduler(name: str, field_path: str = "scheduler") -> Scheduler:
    """The scheduler registered as ``name``; ``InvalidArgument`` naming ``field_path`` otherwise."""
    factory = SCHEDULERS.get(name) if isinstance(name, str) else None
    if factory is None:
        raise InvalidArgument(f"{field_path}: {shown(name)} is not one of {tuple(SCHEDULERS)}")
    return factory()


__all__ = [
    "SCHEDULERS",
    "FcfsScheduler",
    "LayerKVScheduler",
    "LvfScheduler",
    "RequestView",
    "Scheduler",
    "SchedulerDecision",
    "SchedulerView",
    "make_scheduler",
]
