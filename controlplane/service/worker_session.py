"""``GrpcWorkerSession``: one worker's Session stream, kept alive across server restarts.

The worker's step loop calls :meth:`GrpcWorkerSession.report` once per step. It never blocks and
never raises: the report is queued for a background stream, and whatever decisions have arrived
since the last call are returned. While the stream is down the session is *degraded*: reports
return ``[]`` (the worker keeps running its last plan, :attr:`last_decision`), the newest report is
kept, and a background thread reconnects with exponential backoff plus jitter. On reconnect it
sends the hello again and then that newest report, so the server re-plans from current state.
"""

from __future__ import annotations

import collections
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import cast

import grpc
import structlog

from controlplane import api
from controlplane.service import convert
from controlplane.service.metrics import ClientMetrics
from kvplane.v1 import controlplane_pb2 as pb
from kvplane.v1 import controlplane_pb2_grpc as pb_grpc

log = structlog.get_logger(__name__)

_END = object()


@dataclass(frozen=True)
class Backoff:
    """Reconnect delays: ``initial_s`` doubling up to ``max_s``, each scaled by [1-jitter, 1]."""

    initial_s: float = 0.05
    """First retry delay."""
    max_s: float = 2.0
    """Largest retry delay."""
    jitter: float = 0.3
    """Fraction of random reduction per delay (spreads reconnect storms)."""

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s <= 600:
            raise ValueError(
                f"backoff: need 0 < initial_s ({self.initial_s}) <= max_s ({self.max_s}) <= 600"
            )
        if not 0 <= self.jitter < 1:
            raise ValueError(f"backoff.jitter: {self.jitter} is out of range (allowed [0, 1))")

    def delays(self) -> Iterator[float]:
        delay = self.initial_s
        while True:
            yield delay * (1 - self.jitter * random.random())
            delay = min(self.max_s, delay * 2)


@dataclass
class SessionStats:
    """Counters of one client session (read them; the session updates them)."""

    reports_sent: int = 0
    """Reports handed to a live stream."""
    reports_dropped: int = 0
    """Reports not sent: stream down (only the newest is kept) or send queue full."""
    decisions_received: int = 0
    """Decisions received over all streams."""
    decisions_refused: int = 0
    """Decisions received that could not be decoded (each logged ``decision_refused``; the
    others of the same reply are delivered and the stream stays up)."""
    stale_periods: int = 0
    """Times a live stream left a report unanswered for ``stale_after_s`` (a hung control plane, or
    one answering ever further behind: the worker is degraded until the replies catch up)."""
    decisions_announced: int = 0
    """Sum over streams of the server's last ``decisions_sent`` (equals received when none lost)."""
    reconnects: int = 0
    """Streams established after the first one."""
    batches_sent: int = 0
    """ReportBatch messages sent (reports that queued up behind a busy stream)."""
    batched_reports: int = 0
    """Reports that went out inside a ReportBatch."""
    latencies_ms: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=100_000)
    )
    """Report-sent to decision-received latency per reply carrying decisions (newest 100k)."""


class GrpcWorkerSession:
    """A worker's session over gRPC (implements :class:`api.WorkerSession`)."""

    MAX_BATCH = 64
    """Most queued reports sent together in one ReportBatch."""

    def __init__(
        self,
        stub: pb_grpc.ControlPlaneStub,
        hello: pb.WorkerInfo,
        worker_id: str,
        *,
        backoff: Backoff,
        metrics: ClientMetrics,
        send_queue: int = 1024,
        on_close: Callable[[GrpcWorkerSession], None] | None = None,
        max_batch_bytes: int = 2 << 20,
        stale_after_s: float = 5.0,
        healthy_after_s: float = 5.0,
    ) -> None:
        self.worker_id = worker_id
        self.stale_after_s = stale_after_s
        """A live stream whose reports go unanswered this long is degraded (the server acks
        answered reports at least once a second, ``SessionServicer``'s heartbeat); 0: never."""
        self.healthy_after_s = healthy_after_s
        """A stream that stayed up this long resets the reconnect backoff; one that fails sooner
        (a replaced session, a stream the server ends after its hello) waits longer each time."""
        self.max_batch_bytes = max_batch_bytes
        """Most serialized bytes of one ReportBatch (the client passes half its message limit, at most
        1 MiB: it does not know the server's limit, and ``kvplane serve`` refuses a
        ``--max-message-bytes`` below 2 MiB, so every server takes such a batch). By
        count alone, 64 reports of a worker running 1,500 requests made a 5.4 MB batch, which gRPC
        refused (RESOURCE_EXHAUSTED), dropping the stream -- under load, when reports queue up."""
        self.stats = SessionStats()
        self._stub = stub
        self._hello = pb.WorkerMessage(hello=hello)
        self._backoff = backoff
        self._degraded_gauge = metrics.degraded.labels(worker=worker_id)
        self._reconnects = metrics.reconnects.labels(worker=worker_id)
        self._send_queue = send_queue
        self._on_close = on_close
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._inbox: collections.deque[api.Decision] = collections.deque()
        self._outbox: queue.Queue[object] | None = None  # set while a stream is live
        self._pending: pb.WorkerMessage | None = None  # newest report while disconnected
        self._sent_at: dict[int, float] = {}
        self._last_decision: api.Decision | None = None
        self._connected = threading.Event()
        self._closed = threading.Event()
        self._call: grpc.Future | None = None
        self.session_id: str | None = None
        self.last_error: str | None = None
        self._announced_this_stream = 0
        self._unanswered: collections.deque[tuple[int, float]] = collections.deque()
        """(step, monotonic send time) of the reports out on this stream that no reply has answered
        yet, oldest first: a reply answers every report up to its ``report_step`` (the server
        handles a stream's reports in order; its heartbeat carries the newest one answered). A
        server that answers, but ever further behind, is as stale as a silent one: a 512-request
        worker reporting every step saw its decisions planned 7 s behind it, half of them expired
        on arrival, and was never degraded while any reply counted (scale review, session 88)."""
        self._stale = False
        self._degraded_gauge.set(1)
        self._thread = threading.Thread(
            target=self._run, name=f"kvplane-session-{worker_id}", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------ worker-facing

    @property
    def degraded(self) -> bool:
        """True while no stream is live, or while a live one has left a report unanswered for
        ``stale_after_s`` (a hung control plane, or one answering ever further behind its
        reports; the worker should keep its last plan)."""
        if not self._connected.is_set():
            return True
        with self._lock:
            since = self._unanswered[0][1] if self._unanswered else None
        stale = bool(self.stale_after_s > 0 and since is not None
                     and time.monotonic() - since > self.stale_after_s)
        if stale != self._stale:  # an edge: said once each way
            self._stale = stale
            self._degraded_gauge.set(int(stale))
            if stale:
                self.stats.stale_periods += 1
                self.last_error = (f"a report unanswered for {self.stale_after_s:g} s (control plane hung, or "
                                   "behind its reports?)")
                log.warning("control_plane_unresponsive", worker=self.worker_id, stale_after_s=self.stale_after_s)
            else:
                log.info("control_plane_responsive", worker=self.worker_id)
        return stale

    @property
    def last_decision(self) -> api.Decision | None:
        """The newest decision received (kept across disconnects)."""
        return self._last_decision

    def wait_connected(self, timeout_s: float) -> bool:
        """Block until a stream is live (for start-up and tests); False on timeout."""
        return self._connected.wait(timeout_s)

    def report(self, report: api.StepReport) -> list[api.Decision]:
        """Queue one step's report; return the decisions received since the last call."""
        try:
            msg = pb.WorkerMessage(report=convert.step_report_to_proto(report))
        except Exception as exc:  # a malformed report must not kill the worker's loop
            log.warning("report_not_encodable", worker=self.worker_id, error=repr(exc))
            self.last_error = repr(exc)
            return self._drain()
        with self._lock:
            outbox = self._outbox
            if outbox is None:
                if self._pending is not None:
                    self.stats.reports_dropped += 1
                self._pending = msg
            else:
                try:
                    outbox.put_nowait(msg)
                    unanswered = self._unanswered
                    if unanswered and report.step <= unanswered[-1][0]:
                        unanswered.clear()  # steps went back (a worker counting again): start over
                    if len(unanswered) < 4 * self._send_queue:  # full: the oldest ones decide
                        unanswered.append((report.step, time.monotonic()))
                    self._sent_at[report.step] = time.perf_counter()
                    if len(self._sent_at) > 4 * self._send_queue:
                        for step in sorted(self._sent_at)[: len(self._sent_at) // 2]:
                            del self._sent_at[step]
                    self.stats.reports_sent += 1
                except queue.Full:
                    self.stats.reports_dropped += 1
        return self._drain()

    def poll(self) -> list[api.Decision]:
        """The decisions received since the last call, without a report (the worker's step
        boundary asks every step; the usual empty answer takes no lock)."""
        if not self._inbox:
            return []
        return self._drain()

    def _drain(self) -> list[api.Decision]:
        with self._lock:
            out = list(self._inbox)
            self._inbox.clear()
        return out

    def wait_decisions(self, timeout_s: float) -> list[api.Decision]:
        """Block until a decision has arrived (or ``timeout_s``); return and consume them.

        For closed-loop load generators and tests; a worker's step loop uses :meth:`report`.
        """
        with self._arrived:
            self._arrived.wait_for(lambda: bool(self._inbox) or self._closed.is_set(), timeout_s)
            out = list(self._inbox)
            self._inbox.clear()
        return out

    def close(self, drain_s: float = 5.0) -> None:
        """End the stream and stop reconnecting (idempotent).

        Graceful: reports already queued are still sent and the stream is half-closed, so the
        server reads them all and its replies (decisions) still arrive. After ``drain_s``
        seconds without the server finishing, the call is cancelled (queued reports are lost;
        the worker is going away anyway).
        """
        if self._closed.is_set():
            return
        self._closed.set()
        deadline = time.monotonic() + drain_s
        with self._lock:
            outbox = self._outbox
        if outbox is not None:
            try:
                outbox.put(_END, timeout=drain_s)
            except queue.Full:
                pass
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            with self._lock:
                call = self._call
            if call is not None:
                call.cancel()
            self._thread.join(timeout=5.0)
        self._degraded_gauge.set(0)
        if self._on_close is not None:
            self._on_close(self)

    # ------------------------------------------------------------ background stream

    def _requests(self, outbox: queue.Queue[object]) -> Iterator[pb.WorkerMessage]:
        """The stream's messages: hello, then reports; reports that queued up while the previous
        message was being written go out together as one ReportBatch (adaptive batching)."""
        yield self._hello
        carry: object = None  # a report that did not fit the last batch: the next one starts with it
        while True:
            item, carry = (outbox.get() if carry is None else carry), None
            if item is _END:
                return
            batch = [cast(pb.WorkerMessage, item)]
            size = batch[0].ByteSize()
            end = False
            while len(batch) < self.MAX_BATCH:
                try:
                    more = outbox.get_nowait()
                except queue.Empty:
                    break
                if more is _END:
                    end = True
                    break
                more_size = cast(pb.WorkerMessage, more).ByteSize()
                if size + more_size > self.max_batch_bytes:
                    carry = more
                    break
                batch.append(cast(pb.WorkerMessage, more))
                size += more_size
            if len(batch) == 1:
                yield batch[0]
            else:
                self.stats.batches_sent += 1
                self.stats.batched_reports += len(batch)
                yield pb.WorkerMessage(
                    reports=pb.ReportBatch(reports=[m.report for m in batch])
                )
            if end:
                return

    def _run(self) -> None:
        delays = self._backoff.delays()
        streams = 0
        while not self._closed.is_set():
            outbox: queue.Queue[object] = queue.Queue(maxsize=self._send_queue)
            try:
                call = self._stub.Session(self._requests(outbox))
            except ValueError as exc:  # the client's channel is closed: no stream is ever opened
                self.last_error = repr(exc)
                log.warning("session_channel_closed", worker=self.worker_id, error=repr(exc))
                self._closed.set()
                return
            with self._lock:
                self._call = call
            up_at = None
            try:
                for reply in call:
                    if reply.session_id:
                        self._on_connected(reply.session_id, outbox, streams)
                        streams += 1
                        up_at = time.monotonic()
                        continue
                    self._on_reply(reply)
            except grpc.RpcError as err:
                if not self._closed.is_set():
                    self.last_error = f"{err.code().name}: {err.details()}"
                    log.warning(
                        "session_stream_failed",
                        worker=self.worker_id,
                        code=err.code().name,
                        details=err.details(),
                    )
            except Exception as exc:  # never let the thread die silently
                self.last_error = repr(exc)
                log.error("session_stream_error", worker=self.worker_id, error=repr(exc))
            finally:
                self._on_disconnected(outbox, call)
            if up_at is not None and time.monotonic() - up_at >= self.healthy_after_s:
                delays = self._backoff.delays()  # it was healthy: the next attempt is quick again
            if self._closed.wait(next(delays)):
                return

    def _on_connected(self, session_id: str, outbox: queue.Queue[object], streams: int) -> None:
        with self._lock:
            self.session_id = session_id
            pending, self._pending = self._pending, None
            self._unanswered.clear()
            if pending is not None:
                self._unanswered.append((pending.report.step, time.monotonic()))
            self._stale = False  # a new stream: its own answers decide
            if pending is not None:
                outbox.put_nowait(pending)
                self._sent_at[pending.report.step] = time.perf_counter()
                self.stats.reports_sent += 1
            self._outbox = outbox
            if self._closed.is_set():  # close() ran while this stream was being opened
                outbox.put_nowait(_END)
        self._connected.set()
        self._degraded_gauge.set(0)
        if streams:
            self.stats.reconnects += 1
            self._reconnects.inc()
        log.info("session_connected", worker=self.worker_id, session=session_id, stream=streams)

    def _on_reply(self, reply: pb.SessionReply) -> None:
        now = time.perf_counter()
        decisions = []
        for i, d in enumerate(reply.decisions):  # one undecodable decision costs itself, not the stream
            try:
                decisions.append(convert.decision_from_proto(d))
            except Exception as exc:
                self.stats.decisions_refused += 1
                log.warning("decision_refused", worker=self.worker_id, report_step=reply.report_step,
                            index=i, reason=d.reason, error=str(exc))
        with self._lock:
            unanswered = self._unanswered  # answered: every report up to the reply's step
            while unanswered and unanswered[0][0] <= reply.report_step:
                unanswered.popleft()
            sent_at = self._sent_at.pop(reply.report_step, None)
            self._inbox.extend(decisions)
            if decisions:
                self._last_decision = decisions[-1]
                self._arrived.notify_all()
            self.stats.decisions_received += len(decisions)
            if sent_at is not None and reply.decisions:
                self.stats.latencies_ms.append((now - sent_at) * 1e3)
            self._announced_this_stream = reply.decisions_sent

    def _on_disconnected(self, outbox: queue.Queue[object], call: grpc.Future) -> None:
        with self._lock:
            was_live = self._outbox is outbox
            self._outbox = None
            self._call = None
            self._sent_at.clear()
            self._unanswered.clear()
            self.stats.decisions_announced += self._announced_this_stream
            self._announced_this_stream = 0
        self._connected.clear()
        self._degraded_gauge.set(1)
        try:
            outbox.put_nowait(_END)  # unblock gRPC's request-consumer thread
        except queue.Full:
            _clear(outbox)
            outbox.put_nowait(_END)
        call.cancel()
        if was_live and not self._closed.is_set():
            log.warning("session_degraded", worker=self.worker_id)


def _clear(q: queue.Queue[object]) -> None:
    while True:
        try:
            q.get_nowait()
        except queue.Empty:
            return
