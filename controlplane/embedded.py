"""The in-process control plane (issue 2 §5 "embedded mode"): ``api.ControlPlane`` without a network.

The SGLang plugin uses it by default; the gRPC servicer wraps the same object, so both transports
share one behaviour:

* ``open_session(worker)`` -> :class:`~controlplane.controller.SessionController` (re-opening a
  worker id closes its previous session: a reconnecting worker starts afresh);
* ``plan(batch)`` -> :class:`~controlplane.model.Plan` (the what-if planner, ``kvplane plan``);
  ``batch`` is a :class:`~controlplane.model.Batch` or its JSON mapping;
* ``get_policy`` / ``update_policy(changes, token, actor)`` / ``watch_policy`` ->
  :class:`~controlplane.policy_store.PolicyStore`.

Sessions read the store's current policy at every report, so a policy update reaches every live
session at its next step. Over the network the policy API is served by
:func:`controlplane.service.server.create_server`: with every service by ``kvplane serve``, and
with ``sessions=False`` (``PolicyService`` alone) by the SGLang plugin's ``--kv-policy-listen``
(``sglang_ext/policy_endpoint.py``), whose workers are in-process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import structlog

from controlplane.api import InvalidArgument, WorkerInfo
from controlplane.controller import (
    ControllerCounters,
    ControllerObserver,
    FanOutObserver,
    PlannerLike,
    SessionController,
)
from controlplane.model import Batch, Plan, SchemaError
from controlplane.policy import Policy
from controlplane.policy_store import PolicyStore, PolicyWatch

log = structlog.get_logger(__name__)


def _default_planner() -> PlannerLike:
    from controlplane.planner import Planner

    return Planner()


class EmbeddedControlPlane:
    """Implements :class:`controlplane.api.ControlPlane` in-process."""

    def __init__(
        self,
        store: PolicyStore | None = None,
        *,
        planner_factory: Callable[[], PlannerLike] | None = None,
        observer: ControllerObserver | None = None,
        synchronous: bool = False,
        time_budget_ms: float | None = None,
    ) -> None:
        self._store = store or PolicyStore()
        self._planner_factory = planner_factory or _default_planner
        self._counters = ControllerCounters()
        self._observer: ControllerObserver = (
            FanOutObserver([self._counters, observer]) if observer is not None else self._counters
        )
        self._synchronous = synchronous
        self._time_budget_ms = time_budget_ms
        self._lock = threading.Lock()
        self._sessions: dict[str, SessionController] = {}
        self._what_if: PlannerLike | None = None
        self._what_if_lock = threading.Lock()

    @classmethod
    def from_files(
        cls,
        policy_file: str | Path | None = None,
        token_file: str | Path | None = None,
        **kwargs: Any,
    ) -> EmbeddedControlPlane:
        """Load an optional policy file (YAML or JSON) and an optional bearer-token file."""
        return cls(PolicyStore.from_files(policy_file, token_file), **kwargs)

    @property
    def store(self) -> PolicyStore:
        return self._store

    @property
    def counters(self) -> ControllerCounters:
        """Totals over every session (plans, pauses, resumes, solve ms, triggers)."""
        return self._counters

    # ---- sessions --------------------------------------------------------------------------
    def open_session(self, worker: WorkerInfo) -> SessionController:
        if not isinstance(worker, WorkerInfo):
            raise InvalidArgument(f"worker: expected WorkerInfo, got {type(worker).__name__}")
        if not worker.worker_id:
            raise InvalidArgument("worker.worker_id: must be a non-empty string")
        session = SessionController(
            worker,
            policy_source=self._store.get,
            planner=self._planner_factory(),
            synchronous=self._synchronous,
            observer=self._observer,
            on_close=self._forget,
            time_budget_ms=self._time_budget_ms,
        )
        with self._lock:
            old = self._sessions.pop(worker.worker_id, None)
            self._sessions[worker.worker_id] = session
        if old is not None:
            old.close()
            log.info("session_replaced", worker=worker.worker_id)
        log.info("session_opened", worker=worker.worker_id, scheduler=worker.scheduler)
        return session

    def _forget(self, session: SessionController) -> None:
        """A session closed itself: drop it unless a newer one replaced it."""
        with self._lock:
            if self._sessions.get(session.worker_id) is session:
                del self._sessions[session.worker_id]

    def close_session(self, worker_id: str) -> None:
        """Close and forget a worker's session (no-op when unknown)."""
        with self._lock:
            session = self._sessions.pop(worker_id, None)
        if session is not None:
            session.close()
            log.info("session_closed", worker=worker_id)

    def sessions(self) -> dict[str, SessionController]:
        with self._lock:
            return dict(self._sessions)

    def close(self) -> None:
        """Close every session."""
        with self._lock:
            sessions = list(self._sessions.values())
            self._sessions.clear()
        for s in sessions:
            s.close()

    # ---- what-if planning ------------------------------------------------------------------
    def plan(self, batch: Any) -> Plan:
        """Plan one batch (a ``Batch`` or its JSON mapping); ``InvalidArgument`` names bad fields."""
        if isinstance(batch, Mapping):
            try:
                batch = Batch.from_dict(batch)
            except SchemaError as exc:
                raise InvalidArgument(str(exc)) from exc
        if not isinstance(batch, Batch):
            raise InvalidArgument(f"batch: expected an object, got {type(batch).__name__}")
        with self._what_if_lock:  # one planner instance, one solve at a time
            if self._what_if is None:
                self._what_if = self._planner_factory()
            policy = self._store.get()
            return self._what_if.plan(batch, victim_rule=policy.victim_rule)

    # ---- policy ----------------------------------------------------------------------------
    def get_policy(self) -> Policy:
        return self._store.get()

    def update_policy(
        self, changes: Mapping[str, Any], token: str | None = None, actor: str = "local"
    ) -> Policy:
        return self._store.update(changes, token=token, actor=actor)

    def watch_policy(self) -> PolicyWatch:
        return self._store.watch()
