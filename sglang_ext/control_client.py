"""``ControlClient``: the scheduler's fault-tolerant handle on the kvplane control plane.

The scheduler calls :meth:`ControlClient.report` once per step. Whatever happens to the control
plane -- not reachable at start, killed mid-run, restarted, slow, or answering with an error --
``report`` never raises and never blocks the step (issue 5, "never a failed request because of the
control plane"):

* the session is the embedded :class:`~controlplane.embedded.EmbeddedControlPlane`'s
  ``SessionController`` (default) or a ``GrpcWorkerSession`` of
  :class:`~controlplane.service.client.GrpcControlPlane` (``--kv-control-plane grpc://HOST:PORT``,
  with the TLS / bearer-token options of :class:`~sglang_ext.args.LayeredKVArgs`);
* a step whose report could not reach a live control plane (the gRPC stream is down, the session
  raised, or no session could be opened) is a *fallback step*: it returns ``[]`` so the scheduler
  keeps its last plan (or the pool's local heuristic), counts it on ``fallbacks`` (with SGLang's
  ``--enable-metrics``: ``kvplane:control_plane_fallback_steps_total`` of
  :class:`~sglang_ext.worker_metrics.WorkerMetrics`; otherwise nothing is exported) and logs
  ``control_plane_unavailable`` once per outage (``control_plane_recovered`` when a report goes
  through again), and tells ``on_outage`` both edges (``kvplane:control_plane_degraded`` and
  ``kvplane:control_plane_outages_total`` with ``--enable-metrics``);
* a session that raised is dropped and re-opened with exponential backoff; the gRPC session
  reconnects on its own (its background thread), re-sending the hello and the newest report.

Pure Python apart from grpc (loaded only for a remote control plane): no torch, no SGLang.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import structlog
from prometheus_client import CollectorRegistry, Counter

from controlplane.api import (
    ControlPlane,
    Decision,
    InvalidArgument,
    StepReport,
    WorkerInfo,
    WorkerSession,
)
from sglang_ext.args import LayeredKVArgs

log = structlog.get_logger(__name__)

FALLBACKS_METRIC = "kvplane_control_plane_fallbacks"
"""Name of :func:`fallback_counter`'s standalone counter (tests; a scheduler exports
``kvplane:control_plane_fallback_steps_total`` through its WorkerMetrics instead)."""


class StepCounter(Protocol):
    """What the client counts fallback steps on (a prometheus_client counter child fits)."""

    def inc(self, amount: float = 1) -> None: ...


class _Uncounted:
    """The fallback counter when no metrics are exported (no prometheus object, no file)."""

    def inc(self, amount: float = 1) -> None:
        pass


def fallback_counter(registry: CollectorRegistry) -> Counter:
    """A new standalone fallback-steps counter registered in ``registry``."""
    return Counter(
        FALLBACKS_METRIC,
        "Scheduler steps run without a live control plane (last plan or local heuristic)",
        registry=registry,
    )


def build_control_plane(args: LayeredKVArgs, *, observer: Any = None) -> ControlPlane:
    """The control plane ``args`` selects: embedded (with ``--kv-policy``; ``observer`` receives
    its controller's events) or a gRPC client."""
    if args.kv_control_plane == "embedded":
        from controlplane.embedded import EmbeddedControlPlane

        return EmbeddedControlPlane.from_files(args.kv_policy, observer=observer)
    from controlplane.service.client import ClientTLS, GrpcControlPlane

    if args.kv_policy is not None:
        log.warning(
            "kv_policy_ignored",
            reason="a remote control plane serves its own policy (kvplane serve --policy)",
            kv_policy=args.kv_policy,
        )
    token = None
    if args.kv_policy_token_file is not None:
        from controlplane.policy_store import load_token_file

        try:  # the launch check's reader: one line of printable ASCII, never empty
            token = load_token_file(args.kv_policy_token_file)
        except InvalidArgument as exc:
            raise ValueError(f"--kv-policy-token-file: {exc}") from None
    tls = None
    if args.kv_tls_ca or args.kv_tls_cert:
        tls = ClientTLS(
            root_certificates=_read(args.kv_tls_ca),
            private_key=_read(args.kv_tls_key),
            cert_chain=_read(args.kv_tls_cert),
        )
    return GrpcControlPlane(args.kv_control_plane, token=token, tls=tls)


def _read(path: str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


def _delays(initial_s: float, max_s: float) -> Iterator[float]:
    delay = initial_s
    while True:
        yield delay
        delay = min(max_s, delay * 2)


class ControlClient:
    """One worker's session with the control plane, made safe for the scheduler's step loop."""

    def __init__(
        self,
        control_plane: ControlPlane,
        worker: WorkerInfo,
        *,
        fallbacks: StepCounter | None = None,
        on_decisions: Callable[[Sequence[Decision]], None] | None = None,
        on_outage: Callable[[bool], None] | None = None,
        reopen_initial_s: float = 0.1,
        reopen_max_s: float = 5.0,
        connect_wait_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < reopen_initial_s <= reopen_max_s:
            raise ValueError(
                f"reopen_initial_s={reopen_initial_s}, reopen_max_s={reopen_max_s}: need "
                "0 < reopen_initial_s <= reopen_max_s"
            )
        self._cp = control_plane
        self._worker = worker
        self._fallbacks: StepCounter = fallbacks if fallbacks is not None else _Uncounted()
        self._on_decisions = on_decisions
        self._on_outage = on_outage
        self._reopen = (reopen_initial_s, reopen_max_s)
        self._delays = _delays(*self._reopen)
        self._backing_off = False
        """A delay was taken since a report last went through (such a report starts them again)."""
        self._clock = clock
        self._session: WorkerSession | None = None
        self._next_open_s = 0.0
        self._in_outage = False
        self.fallback_steps = 0
        """Steps reported without a live control plane."""
        self.outages = 0
        """Outages seen (each warned once)."""
        self.last_decision: Decision | None = None
        """Newest decision received (kept across outages)."""
        self.last_error: str | None = None
        self._open()
        wait = getattr(self._session, "wait_connected", None)
        if connect_wait_s > 0 and wait is not None:
            wait(connect_wait_s)

    # ---- scheduler-facing ----------------------------------------------------------------
    @property
    def in_fallback(self) -> bool:
        """True while the last report did not reach a live control plane."""
        return self._in_outage

    @property
    def session(self) -> WorkerSession | None:
        return self._session

    @property
    def can_poll(self) -> bool:
        """The session hands over decisions between reports (:meth:`poll`); without it they
        arrive only with a report's answer."""
        return getattr(self._session, "poll", None) is not None

    def report(self, report: StepReport) -> list[Decision]:
        """Send one step's telemetry; the decisions ready now, ``[]`` on any failure."""
        if self._session is None and self._clock() >= self._next_open_s:
            self._open()
        session = self._session
        if session is None:
            self._fallback(self.last_error or "no session")
            return []
        try:
            decisions = list(session.report(report))
        except Exception as exc:  # never raise into the scheduler
            self._drop_session(exc)
            self._fallback(self.last_error or repr(exc))
            return []
        if self._backing_off:  # a report went through: the next outage backs off from the start
            self._delays, self._backing_off = _delays(*self._reopen), False
        if getattr(session, "degraded", False):
            self._fallback(getattr(session, "last_error", None) or "stream down")
        else:
            self._recovered()
        if decisions:
            self._received(decisions)
        return decisions

    def poll(self) -> list[Decision]:
        """Decisions that became ready since the last report (``[]`` when unsupported/failed)."""
        poll = getattr(self._session, "poll", None)
        if poll is None:
            return []
        try:
            decisions = list(poll())
        except Exception as exc:
            self._drop_session(exc)
            return []
        if decisions:
            self._received(decisions)
        return decisions

    def close(self) -> None:
        """Close the session and the control plane client (idempotent, never raises)."""
        session, self._session = self._session, None
        for closer in (getattr(session, "close", None), getattr(self._cp, "close", None)):
            if closer is None:
                continue
            try:
                closer()
            except Exception:
                log.warning("control_plane_close_failed", exc_info=True)

    # ---- internals -----------------------------------------------------------------------
    def _received(self, decisions: list[Decision]) -> None:
        self.last_decision = decisions[-1]
        _tell(self._on_decisions, decisions, "decision_metrics_failed")

    def _open(self) -> None:
        try:
            self._session = self._cp.open_session(self._worker)
        except Exception as exc:
            self._session = None
            self.last_error = repr(exc)
            self._next_open_s = self._clock() + next(self._delays)
            self._backing_off = True
            return
        # the delays start again once a report goes through (:meth:`report`), not here: a session
        # that opens but whose reports raise was re-opened at the first delay forever

    def _drop_session(self, exc: BaseException) -> None:
        self.last_error = repr(exc)
        session, self._session = self._session, None
        try:
            if session is not None:
                session.close()
        except Exception:
            pass
        self._next_open_s = self._clock() + next(self._delays)
        self._backing_off = True

    def _fallback(self, why: str) -> None:
        self.fallback_steps += 1
        self._fallbacks.inc()
        if not self._in_outage:
            self._in_outage = True
            self.outages += 1
            log.warning(
                "control_plane_unavailable",
                worker=self._worker.worker_id,
                error=why,
                action="keeping the last plan / local heuristic; reconnecting with backoff",
            )
            _tell(self._on_outage, True, "outage_metrics_failed")

    def _recovered(self) -> None:
        if self._in_outage:
            self._in_outage = False
            log.info(
                "control_plane_recovered",
                worker=self._worker.worker_id,
                fallback_steps=self.fallback_steps,
            )
            _tell(self._on_outage, False, "outage_metrics_failed")


def _tell(callback: Callable[[Any], None] | None, value: Any, event: str) -> None:
    """Hand ``value`` to a telemetry callback; one that raises is logged as ``event``: telemetry
    must never fail a report."""
    if callback is None:
        return
    try:
        callback(value)
    except Exception:
        log.warning(event, exc_info=True)


def describe(client: Any) -> dict[str, Any]:
    """Small JSON-ready summary of a client (for stats lines and logs)."""
    return {
        "fallback": bool(getattr(client, "in_fallback", False)),
        "fallback_steps": int(getattr(client, "fallback_steps", 0)),
        "outages": int(getattr(client, "outages", 0)),
    }
