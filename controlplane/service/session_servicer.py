"""``kvplane.v1.ControlPlane``: worker Session streams and the what-if Plan RPC.

A thin translation layer over an :class:`api.ControlPlane` (the embedded controller): protobuf in,
domain objects to the control plane, domain results back as protobuf. Errors are raised as domain
exceptions and mapped to status codes by :mod:`controlplane.service.interceptors`.

Isolation: gRPC runs each Session on its own thread from the server pool (sized so that
``max_sessions`` streams never starve unary calls) plus one reader thread. A slow worker only
blocks its own threads (gRPC flow control stops its writes); a worker that disappears ends its
request iterator, and the session is closed exactly once, either by the handler's ``finally`` or
by the RPC-termination callback, whichever comes first.

Replies: each ``SessionReply`` carries the decisions returned by ``report()`` for one report, or
those ``poll()`` found after the controller signalled a finished plan (``report_step`` is then the
newest report the server had processed).
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

import grpc
import structlog

from controlplane import api
from controlplane.service import convert
from controlplane.service.decision_notifier import DecisionNotifier
from controlplane.service.interceptors import CERTIFICATE_IDENTITIES, peer_identity
from controlplane.service.metrics import ServiceMetrics
from kvplane.v1 import controlplane_pb2 as pb
from kvplane.v1 import controlplane_pb2_grpc as pb_grpc

log = structlog.get_logger(__name__)


class _SessionSlots:
    """Counts open sessions against ``max_sessions``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open = 0
        self._lock = threading.Lock()

    def acquire(self) -> bool:
        with self._lock:
            if self._open >= self.limit:
                return False
            self._open += 1
            return True

    def release(self) -> None:
        with self._lock:
            self._open -= 1


class _LiveSession:
    """One open session: serialises report()/poll()/close() and closes exactly once.

    The decisions taken from the controller -- by ``report()`` on the reader thread, by ``poll()``
    on the writer's -- join :attr:`pending` under the same lock that takes them, so the writer
    sends them in the order the controller handed them out. (The reader kept a ``ReportBatch``'s
    decisions until the batch ended while the writer's poll sent a newer plan at once, and the
    worker, applying them in arrival order, installed stale plans: 41 of 81 decisions out of order
    in the control-plane review of session 65.)"""

    def __init__(self, session: api.WorkerSession) -> None:
        self.session = session
        self._poll = getattr(session, "poll", None)
        self._lock = threading.Lock()
        self.closed = False
        self.last_step = -1
        """Step of the newest report processed (for decisions pushed between reports)."""
        self.last_t0 = time.perf_counter()
        """When that report arrived (perf_counter seconds)."""
        self.processed_step = -1
        """Step of the newest report the controller has answered (the writer's heartbeat acks it)."""
        self.pending: deque[tuple[int, float, list[api.Decision]]] = deque()
        """(report step, its arrival, decisions) taken from the controller, not yet sent."""

    def report(self, report: api.StepReport, t0: float) -> bool:
        """``report()`` the controller; its decisions join :attr:`pending`. True when any did."""
        with self._lock:
            if self.closed:
                raise api.Unavailable("session is closed")
            self.last_step, self.last_t0 = report.step, t0
            got = list(self.session.report(report))
            if got:
                self.pending.append((report.step, t0, got))
            self.processed_step = report.step
            return bool(got)

    def poll(self) -> None:
        """Decisions the controller finished between reports join :attr:`pending`."""
        if self._poll is None:
            return
        with self._lock:
            if not self.closed:
                got = list(self._poll())
                if got:
                    self.pending.append((self.last_step, self.last_t0, got))

    def take(self) -> list[tuple[int, float, list[api.Decision]]]:
        """:attr:`pending`, oldest first, emptied."""
        with self._lock:
            out = list(self.pending)
            self.pending.clear()
            return out

    def close(self) -> bool:
        """Close the session; True when this call did it."""
        with self._lock:
            if self.closed:
                return False
            self.closed = True
        self.session.close()
        return True


_WAKE = object()
_TAKE = object()
_END = object()

OUTBOX_ITEMS = 256
"""Report results queued for one session's writer before its reader stops reading (backpressure)."""


class _Outbox:
    """Bounded hand-off from a session's reader (and the notifier) to its writer.

    A worker that stops reading its replies blocks its writer; the outbox then fills, its reader
    stops reading reports, and HTTP/2 flow control pushes back on that worker alone. Nothing here
    ever blocks the controller's planning thread (wake-ups are dropped when the outbox is full:
    the decisions stay ready in the controller and leave with the next report's results).
    """

    def __init__(self, maxsize: int = OUTBOX_ITEMS) -> None:
        self.queue: queue.Queue[Any] = queue.Queue(maxsize)
        self.ended = threading.Event()
        self.error: Exception | None = None
        """What the stream ends with, set by :meth:`end` (kept here, not queued: a full outbox
        dropped a queued one, and the stream of a worker that had stopped reading ended OK)."""

    def put(self, item: Any) -> bool:
        """Blocking put with backpressure; False once the session has ended."""
        while not self.ended.is_set():
            try:
                self.queue.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def offer(self, item: Any) -> None:
        """Non-blocking put; dropped when full."""
        try:
            self.queue.put_nowait(item)
        except queue.Full:
            pass

    def end(self, error: Exception | None = None) -> None:
        """End the stream, with ``error`` as its status when given (the first such error wins)."""
        if error is not None and self.error is None:
            self.error = error
        self.ended.set()
        self.offer(_END)


MAX_WHAT_IF_CELLS = 1 << 20
"""Most requests x layers of one what-if ``Plan`` (a million placements; 1,024 requests x 1,024
layers). Larger ones took seconds before the search's budget even applied, and the server kept
computing calls their callers had abandoned, one after another, stalling every other what-if plan
(control-plane review, session 54)."""
WHAT_IF_WAIT_S = 1.0
"""Seconds a what-if ``Plan`` waits for the one running before it is RESOURCE_EXHAUSTED."""
HELLO_TIMEOUT_S = 10.0
"""Seconds a new session stream has to send its hello before it is cancelled and its
``max_sessions`` slot freed (four silent streams held all four slots of a server, the gauge at 0:
control-plane review, session 54)."""


class SessionServicer(pb_grpc.ControlPlaneServicer):
    """Serves worker sessions and what-if plans from ``control_plane``.

    Each session uses two threads: the gRPC handler thread writes replies, a reader thread reads
    reports and calls ``report()``; both meet at the session's outbound queue, which the
    :class:`DecisionNotifier` also feeds, so decisions planned between reports are pushed at once.
    """

    def __init__(
        self,
        control_plane: api.ControlPlane,
        metrics: ServiceMetrics,
        max_sessions: int,
        notifier: DecisionNotifier | None = None,
        idle_check_s: float = 1.0,
        hello_timeout_s: float = HELLO_TIMEOUT_S,
        max_message_bytes: int = 4 * 1024 * 1024,
    ) -> None:
        self._cp = control_plane
        self._max_bytes = max_message_bytes
        """gRPC's send limit (``--max-message-bytes``): a reply above it fails the stream."""
        self._hello_timeout_s = hello_timeout_s
        self._what_if_gate = threading.Lock()
        self._metrics = metrics
        self._slots = _SessionSlots(max_sessions)
        self._ids = itertools.count(1)
        self._notifier = notifier
        self._idle_check_s = idle_check_s
        self._owners: dict[str, tuple[str, _LiveSession, _Outbox]] = {}
        """worker id -> (the caller's identity, its live session, its stream's outbox): under mTLS
        a worker id belongs to the client certificate whose session holds it (:meth:`_claim`); a
        hello that replaces a session ends its stream through the outbox."""
        self._owners_lock = threading.Lock()
        self._hello_lock = threading.Lock()
        """Makes a hello's claim, its session's opening and its ownership one step: two hellos of
        one worker id from two certificates at once cannot both pass :meth:`_claim`."""

    def _claim(self, worker_id: str, peer: str) -> tuple[str, _LiveSession, _Outbox] | None:
        """Refuse a hello for a worker id whose live session another client certificate holds.
        Without mTLS the caller is an address that changes with every reconnect, so nothing is
        refused (a reconnect replaces the old session, as the control plane does). Returns the
        holder of the live session the hello replaces (None: none), which :meth:`Session` counts
        (``kvplane_sessions_replaced``), logs and ends once the new session is open: two workers
        sharing one id replace each other on every reconnect, and only this says so."""
        with self._owners_lock:
            owner = self._owners.get(worker_id)
        if owner is None or owner[1].closed:
            return None
        if owner[0] != peer and owner[0].startswith(CERTIFICATE_IDENTITIES) and peer.startswith(CERTIFICATE_IDENTITIES):
            raise api.PermissionDenied(
                f"hello.worker_id: {worker_id!r} has a live session of another client certificate "
                f"({owner[0]}); a worker id belongs to one certificate while its session lives"
            )
        return owner

    def _own(self, worker_id: str, peer: str, live: _LiveSession, outbox: _Outbox) -> None:
        with self._owners_lock:
            self._owners[worker_id] = (peer, live, outbox)

    def _disown(self, worker_id: str, live: _LiveSession) -> None:
        """Forget the holder of ``worker_id`` if it is still ``live`` (a reconnect replaced it)."""
        with self._owners_lock:
            owner = self._owners.get(worker_id)
            if owner is not None and owner[1] is live:
                del self._owners[worker_id]

    def _forget(self, worker_id: str, live: _LiveSession) -> None:
        """Drop the control plane's record of this worker's session if it is still ours.

        (A reconnect of the same worker replaces it; that newer session must stay.)
        """
        sessions = getattr(self._cp, "sessions", None)
        close_session = getattr(self._cp, "close_session", None)
        if not callable(sessions) or not callable(close_session):
            return
        if sessions().get(worker_id) is live.session:
            close_session(worker_id)

    def _observe_decisions(self, decisions: list[api.Decision]) -> list[pb.Decision]:
        out = []
        for d in decisions:
            out.append(convert.decision_to_proto(d))
            self._metrics.solve_ms.observe(max(0.0, float(d.plan.solve_ms)))
        self._metrics.decisions.inc(len(out))
        return out

    def Plan(self, request: pb.PlanRequest, context: grpc.ServicerContext) -> pb.PlanResponse:
        if not request.HasField("batch"):
            raise api.InvalidArgument("batch: is required")
        batch = convert.batch_from_proto(request.batch)
        cells = len(batch.requests) * batch.model.layers
        if cells > MAX_WHAT_IF_CELLS:
            self._metrics.rejected.labels(limit="what_if_cells").inc()
            raise api.ResourceExhausted(
                f"batch: {len(batch.requests)} requests x {batch.model.layers} layers = {cells} placements "
                f"(limit {MAX_WHAT_IF_CELLS} for a what-if plan)"
            )
        # one at a time; a caller waits at most WHAT_IF_WAIT_S (queued callers held a server
        # thread each until the RPC limit refused health checks too: control-plane review, session 63)
        if not self._what_if_gate.acquire(timeout=WHAT_IF_WAIT_S):
            raise api.ResourceExhausted(f"another what-if plan is running (waited {WHAT_IF_WAIT_S:g} s); retry later")
        try:
            if not context.is_active():
                raise api.Unavailable("the caller cancelled or passed its deadline before its plan started")
            plan = self._cp.plan(batch)
        finally:
            self._what_if_gate.release()
        self._metrics.whatif_plans.inc()
        self._metrics.solve_ms.observe(max(0.0, float(plan.solve_ms)))
        response = pb.PlanResponse(plan=convert.plan_to_proto(plan))
        self._check_size(response.ByteSize(), "the plan")
        return response

    def _check_size(self, size: int, what: str) -> None:
        """RESOURCE_EXHAUSTED naming ``--max-message-bytes`` when ``what`` (``size`` bytes) cannot
        be sent (gRPC failed such a stream with no log and no metric, and the worker reconnected
        into the same failure for ever: control-plane review, session 65)."""
        if size > self._max_bytes:
            self._metrics.rejected.labels(limit="max_message_bytes").inc()
            log.error("reply_too_large", what=what, bytes=size, max_message_bytes=self._max_bytes)
            raise api.ResourceExhausted(
                f"max_message_bytes: {what} takes {size} bytes, over the server's limit of {self._max_bytes} "
                "(raise --max-message-bytes on the server and the client)")

    def _reply(self, step: int, decisions: list[pb.Decision], sent: int) -> Iterator[pb.SessionReply]:
        """``decisions`` as one reply, or as several where one would pass the send limit."""
        reply = pb.SessionReply(report_step=step, decisions=decisions, decisions_sent=sent)
        size = reply.ByteSize()  # once: a large decision's size is a pass over all of it
        if size <= self._max_bytes or len(decisions) == 1:
            self._check_size(size, "a decision")
            yield reply
            return
        half = len(decisions) // 2
        yield from self._reply(step, decisions[:half], sent - (len(decisions) - half))
        yield from self._reply(step, decisions[half:], sent)

    def Session(
        self, request_iterator: Iterator[pb.WorkerMessage], context: grpc.ServicerContext
    ) -> Iterator[pb.SessionReply]:
        if not self._slots.acquire():
            self._metrics.rejected.labels(limit="max_sessions").inc()
            raise api.ResourceExhausted(
                f"max_sessions: the server already serves {self._slots.limit} sessions "
                f"(limit max_sessions = {self._slots.limit})"
            )
        live: _LiveSession | None = None
        session_id = f"s{next(self._ids)}"
        peer = peer_identity(context)
        worker_id = "?"
        outbox = _Outbox()

        def wake() -> None:
            outbox.offer(_WAKE)

        def cleanup() -> None:
            outbox.end()
            if live is not None and live.close():
                if self._notifier is not None:
                    self._notifier.unregister(worker_id, wake)
                self._forget(worker_id, live)
                self._disown(worker_id, live)
                self._metrics.sessions.dec()
                log.info("session_closed", session=session_id, worker=worker_id, peer=peer)

        def vanished() -> None:
            # gRPC runs this on the server's one event thread: it only signals and closes on a
            # thread of its own (a report in flight holds the session's lock; waiting for it
            # there would stall every RPC of the server)
            outbox.end()
            threading.Thread(target=cleanup, name=f"kvplane-close-{session_id}", daemon=True).start()

        # a stream that sends no hello would hold its slot for good (keepalive pings keep it up)
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            context.cancel()

        deadline = threading.Timer(self._hello_timeout_s, expire)
        deadline.daemon = True
        deadline.start()
        try:
            try:
                first = next(request_iterator, None)
            finally:
                deadline.cancel()
            if expired.is_set():
                log.warning("session_without_hello", session=session_id, peer=peer, timeout_s=self._hello_timeout_s)
                return
            if first is None:
                return
            if first.WhichOneof("kind") != "hello":
                raise api.InvalidArgument(
                    "hello: the first WorkerMessage of a Session must be hello (WorkerInfo), "
                    f"got {first.WhichOneof('kind') or 'an empty message'}"
                )
            info = convert.worker_info_from_proto(first.hello)
            worker_id = info.worker_id
            with self._hello_lock:  # claim, open and own at once (hellos are rare: no contention)
                replaced = self._claim(worker_id, peer)
                live = _LiveSession(self._cp.open_session(info))
                self._own(worker_id, peer, live, outbox)
            if replaced is not None:
                self._metrics.replaced.inc()
                log.warning("session_replaced_live", worker=worker_id, old_peer=replaced[0], new_peer=peer,
                            hint="a reconnect; if it repeats, two workers share this worker id (KVPLANE_WORKER_ID)")
                # the old stream ends now (its slot with it), not when its worker reports again or
                # keepalive notices it gone: reconnects were refused where max_sessions fits the fleet
                replaced[2].end(api.Unavailable(
                    f"session replaced: a newer hello of worker {worker_id!r} (from {peer}) took it over"))
            self._metrics.sessions.inc()
            if self._notifier is not None:
                self._notifier.register(worker_id, wake)
            context.add_callback(vanished)  # the peer vanished while we were blocked elsewhere
            log.info("session_opened", session=session_id, worker=worker_id, peer=peer)
            yield pb.SessionReply(session_id=session_id)
            reader = threading.Thread(
                target=self._read_reports,
                args=(request_iterator, live, outbox),
                name=f"kvplane-reader-{session_id}",
                daemon=True,
            )
            reader.start()
            yield from self._replies(live, outbox, context)
        finally:
            cleanup()
            self._slots.release()

    def _read_reports(
        self, requests: Iterator[pb.WorkerMessage], live: _LiveSession, outbox: _Outbox
    ) -> None:
        """Reader thread: report() each message; hand results (or the error) to the writer."""
        try:
            for message in requests:
                t0 = time.perf_counter()
                kind = message.WhichOneof("kind")
                if kind == "report":
                    batch: Any = (message.report,)
                    prefix = "report"
                elif kind == "reports":
                    batch = message.reports.reports
                    if len(batch) > convert.MAX_ENTRIES:
                        raise api.InvalidArgument(
                            f"reports.reports: has {len(batch)} entries "
                            f"(allowed at most {convert.MAX_ENTRIES})"
                        )
                    prefix = "reports.reports[{}]"
                else:
                    raise api.InvalidArgument(
                        f"report: expected a StepReport after hello, got {kind or 'an empty message'}"
                    )
                decided, done = False, 0
                try:
                    for i, msg in enumerate(batch):
                        report = convert.step_report_from_proto(msg, prefix.format(i))
                        decided = live.report(report, t0) or decided
                        done = i + 1
                finally:
                    # a bad entry ends the stream, but what the controller decided on the reports
                    # before it goes out first (its state already holds those decisions)
                    self._metrics.reports.inc(done)
                    if decided:  # wake the writer only when there is something to send
                        outbox.put(_TAKE)
        except grpc.RpcError:
            pass  # the worker went away; the writer ends on _END
        except Exception as exc:
            outbox.put(exc)
        finally:
            outbox.put(_END)

    def _replies(
        self, live: _LiveSession, outbox: _Outbox, context: grpc.ServicerContext
    ) -> Iterator[pb.SessionReply]:
        """Writer (gRPC handler thread): turn report results and wake-ups into replies."""
        sent, acked, replied = 0, -1, time.monotonic()
        while True:
            try:
                item = outbox.queue.get(timeout=self._idle_check_s)
            except queue.Empty:
                if outbox.ended.is_set():  # read once: an end(error) between two reads was lost
                    if outbox.error is not None:
                        raise outbox.error from None
                    return
                if not context.is_active():
                    return
                item = None
            if item is _WAKE:
                live.poll()
            # every wake-up sends what is pending, in the order it was taken (before an error
            # or the end: the controller's state already holds those decisions)
            for step, t0, decisions in live.take():
                out = self._observe_decisions(decisions)
                sent += len(out)
                # this reply answers up to ``step``; reports processed after it (a batch's later
                # ones) are acked by the heartbeat below, else a worker that then goes quiet reads
                # them as unanswered and degrades (review of session 88)
                acked, replied = max(acked, step), time.monotonic()
                self._metrics.decision_latency_ms.observe((time.perf_counter() - t0) * 1e3)
                yield from self._reply(step, out, sent)
            if item is _END:
                if outbox.error is not None:
                    raise outbox.error
                return
            if isinstance(item, Exception):
                raise item
            # heartbeat: reports answered without a decision since the last reply are acked once
            # ``idle_check_s`` has passed without a reply, however often the writer woke meanwhile
            # (the worker tells a hung control plane from a quiet one by these: a worker whose
            # reports go unanswered falls back to its own placement)
            done = live.processed_step
            if done >= 0 and done != acked and time.monotonic() - replied >= self._idle_check_s:
                acked, replied = done, time.monotonic()
                yield pb.SessionReply(report_step=done, decisions_sent=sent)
