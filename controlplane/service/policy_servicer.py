"""``kvplane.v1.PolicyService``: get / update / watch the versioned policy.

Reads are open; UpdatePolicy is guarded by :class:`~controlplane.service.interceptors.AuthInterceptor`
(bearer token) and every accepted change is written to the audit log (event ``policy_audit`` with
``actor`` = client-certificate CN or peer address, ``old_version``, ``new_version``, ``changes``).

Watchers: one background thread consumes ``control_plane.watch_policy()`` and fans each new policy
out to per-watcher queues, so a watcher that goes away is noticed within ``poll_s`` (or at once via
the RPC-termination callback) instead of pinning a thread until the next update.
"""

from __future__ import annotations

import inspect
import queue
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import structlog

from controlplane import api
from controlplane.policy import Policy
from controlplane.service import policy_convert
from controlplane.service.interceptors import bearer_token, peer_identity
from controlplane.service.metrics import ServiceMetrics
from kvplane.v1 import controlplane_pb2 as pb
from kvplane.v1 import controlplane_pb2_grpc as pb_grpc

log = structlog.get_logger(__name__)

_STOP = object()
"""A watch's queue item: its client went away (the stream just ends)."""
_GONE = object()
"""A watch's queue item: the policy source ended (server stop, a failed source); the stream
ends UNAVAILABLE, so a client tells an outage from a normal end."""


class PolicyServicer(pb_grpc.PolicyServiceServicer):
    """Serves the policy of ``control_plane``; at most ``max_watchers`` concurrent watches."""

    def __init__(
        self,
        control_plane: api.ControlPlane,
        metrics: ServiceMetrics,
        max_watchers: int = 32,
        poll_s: float = 0.5,
    ) -> None:
        self._cp = control_plane
        self._metrics = metrics
        self._max_watchers = max_watchers
        self._poll_s = poll_s
        self._watchers: set[queue.Queue[Any]] = set()
        self._lock = threading.Lock()
        self._update_lock = threading.Lock()
        self._pump: threading.Thread | None = None
        self._watch: Any = None
        self._stopped = threading.Event()
        try:
            params = inspect.signature(control_plane.update_policy).parameters
        except (TypeError, ValueError):
            params = {}  # type: ignore[assignment]
        self._takes_actor = "actor" in params
        metrics.policy_version.set(control_plane.get_policy().version)

    # ------------------------------------------------------------ unary

    def GetPolicy(self, request: pb.GetPolicyRequest, context: grpc.ServicerContext) -> pb.Policy:
        return policy_convert.policy_to_proto(self._cp.get_policy())

    def UpdatePolicy(
        self, request: pb.UpdatePolicyRequest, context: grpc.ServicerContext
    ) -> pb.UpdatePolicyResponse:
        changes = policy_convert.policy_changes_from_proto(request.changes)
        if not changes:
            raise api.InvalidArgument("changes: no policy field is set (nothing to update)")
        actor = peer_identity(context)
        with self._update_lock:  # old/new versions in the audit log are exact
            old = self._cp.get_policy()
            if self._takes_actor:
                new = self._cp.update_policy(changes, bearer_token(context), actor=actor)  # type: ignore[call-arg]
            else:
                new = self._cp.update_policy(changes, bearer_token(context))
        self._metrics.policy_version.set(new.version)
        if new.version != old.version:  # a change that changes nothing makes no version (PolicyStore.update)
            log.info(
                "policy_audit",
                actor=actor,
                old_version=old.version,
                new_version=new.version,
                changes=changes,
            )
        return pb.UpdatePolicyResponse(policy=policy_convert.policy_to_proto(new), old_version=old.version)

    # ------------------------------------------------------------ watch

    def _ensure_pump(self) -> None:
        # Subscribe here, on the watcher's own thread, before its first event is sent: an update
        # landing before the pump thread gets scheduled is then still broadcast.
        with self._lock:
            if self._pump is None:
                self._watch = watch = self._cp.watch_policy()
                self._pump = threading.Thread(
                    target=self._run_pump, args=(watch,), name="kvplane-policy-pump", daemon=True
                )
                self._pump.start()

    def _run_pump(self, watch: Iterator[Policy]) -> None:
        try:
            for policy in watch:
                if self._stopped.is_set():
                    return
                self._broadcast(policy)
        except Exception as exc:  # the control plane is going away: end every watch
            log.warning("policy_watch_source_failed", error=repr(exc))
        finally:
            with self._lock:
                self._pump = None
                watchers = list(self._watchers)
            for q in watchers:
                _stop(q, _GONE)

    def _broadcast(self, policy: Policy) -> None:
        self._metrics.policy_version.set(policy.version)
        with self._lock:
            watchers = list(self._watchers)
        for q in watchers:
            try:
                q.put_nowait(policy)
            except queue.Full:  # a watcher this far behind only needs the latest policy
                _drain(q)
                q.put_nowait(policy)

    def stop(self) -> None:
        """End every watch (server shutdown)."""
        self._stopped.set()
        close = getattr(self._watch, "close", None)
        if callable(close):
            close()
        with self._lock:
            watchers = list(self._watchers)
        for q in watchers:
            _stop(q, _GONE)

    def WatchPolicy(
        self, request: pb.WatchPolicyRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.PolicyEvent]:
        q: queue.Queue[Any] = queue.Queue(maxsize=64)
        with self._lock:
            if len(self._watchers) >= self._max_watchers:
                self._metrics.rejected.labels(limit="max_watchers").inc()
                raise api.ResourceExhausted(
                    f"max_watchers: {self._max_watchers} policy watches are already open "
                    f"(limit max_watchers = {self._max_watchers})"
                )
            self._watchers.add(q)
        context.add_callback(lambda: _stop(q))  # on gRPC's event thread: must never block
        self._ensure_pump()
        try:
            last = self._cp.get_policy()
            yield pb.PolicyEvent(policy=policy_convert.policy_to_proto(last))
            while context.is_active():
                if self._stopped.is_set():
                    raise _unavailable()
                try:
                    item = q.get(timeout=self._poll_s)
                except queue.Empty:
                    continue
                if item is _STOP:
                    return
                if item is _GONE:
                    raise _unavailable()
                if item.version <= last.version:
                    continue  # already sent (raced with the initial GetPolicy)
                last = item
                yield pb.PolicyEvent(policy=policy_convert.policy_to_proto(item))
        finally:
            with self._lock:
                self._watchers.discard(q)


def _drain(q: queue.Queue[Any]) -> None:
    while True:
        try:
            q.get_nowait()
        except queue.Empty:
            return


def _unavailable() -> api.Unavailable:
    return api.Unavailable("policy watch: the policy service is shutting down or lost its source; watch again")


def _stop(q: queue.Queue[Any], item: object = _STOP) -> None:
    """End a watch (``item``: :data:`_STOP` or :data:`_GONE`) without blocking: a full queue (a
    watcher that stopped reading) is drained first -- its policies are moot once the watch ends."""
    while True:
        try:
            q.put_nowait(item)
            return
        except queue.Full:
            _drain(q)
