"""The control plane's Python interface, shared by the embedded mode and the gRPC client.

Primitives (a worker's view):

* ``ControlPlane.open_session(worker)`` -> :class:`WorkerSession`: one per SGLang worker (model
  instance). Sessions are independent: one slow or dead worker never affects another.
* ``WorkerSession.report(report)`` -> list of :class:`Decision`: send one step's telemetry, get
  back whatever decisions are ready. Never blocks on planning: plans are computed one step ahead
  and delivered with a later report (OrbitFlow §3.3 "one decode iteration ahead").
* ``WorkerSession.close()``.
* ``ControlPlane.plan(batch)`` -> :class:`~controlplane.model.Plan`: the what-if planner
  (`kvplane plan`).
* ``ControlPlane.get_policy() / update_policy(changes, token) / watch_policy()``: the versioned
  policy-tuning API.

These are plain frozen dataclasses: no protobuf, no torch. The gRPC service translates protobuf to
and from them; the SGLang plugin builds them from its scheduler state.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from controlplane.model import Hardware, ModelSpec, Plan, Profile
from controlplane.policy import Policy

MAX_ID_CHARS = 256
"""Longest accepted worker or request id (the gRPC service refuses longer ones; SGLang accepts any
``rid``, so the plugin refuses longer ones where requests enter)."""


class ControlPlaneError(Exception):
    """Base of the control plane's domain errors (mapped to gRPC status codes by the service)."""


class InvalidArgument(ControlPlaneError):
    """A request or policy is malformed or out of range (INVALID_ARGUMENT)."""


class NotFound(ControlPlaneError):
    """A session or request id is unknown (NOT_FOUND)."""


class Unauthenticated(ControlPlaneError):
    """A policy write without the right bearer token (UNAUTHENTICATED)."""


class PermissionDenied(ControlPlaneError):
    """The caller may not act on what it named: another client certificate holds that worker
    id's live session (PERMISSION_DENIED)."""


class Unavailable(ControlPlaneError):
    """The control plane cannot be reached or is shutting down (UNAVAILABLE)."""


class ResourceExhausted(ControlPlaneError):
    """A session, message-size or rate limit was exceeded (RESOURCE_EXHAUSTED)."""


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker tells the control plane when it opens a session."""

    worker_id: str
    """Unique worker (model instance) id."""
    model: ModelSpec
    hardware: Hardware
    profile: Profile
    """Initial per-layer compute profile (refined online by EWMA)."""
    scheduler: str | None = None
    """Scheduler override for this worker (fcfs, layerkv, lvf); None = policy default."""
    tp_size: int = 1
    """Tensor-parallel ranks sharing this plan (OrbitFlow §3.5)."""


@dataclass(frozen=True)
class RequestState:
    """A request the worker is currently decoding (or holding paused)."""

    id: str
    context_tokens: int
    """Tokens in context including the one being decoded."""
    generated_tokens: int = 0
    """Output tokens generated so far."""
    slo_tbt_ms: float | None = None
    """Per-request TBT SLO; None = policy default."""
    paused: bool = False
    """True while the request is paused (KV kept, not decoding)."""
    gpu_layers: int | None = None
    """Layers currently resident on the GPU (residency telemetry), if known."""
    max_new_tokens: int | None = None
    """Output length limit, if known (caps LayerKV Eq. 1 N_future)."""


@dataclass(frozen=True)
class QueuedRequest:
    """A request waiting for prefill admission."""

    id: str
    prompt_tokens: int
    arrival_ms: float
    """Arrival time on the worker's clock."""
    slo_ttft_ms: float | None = None


@dataclass(frozen=True)
class StepReport:
    """One step's telemetry from a worker."""

    step: int
    """Worker's step counter (monotonic)."""
    now_ms: float
    """Worker clock at the end of the step."""
    running: tuple[RequestState, ...] = ()
    queued: tuple[QueuedRequest, ...] = ()
    observed_step_ms: float | None = None
    """Measured duration of this step (None for the first report)."""
    layer_compute_ms: tuple[float, ...] | None = None
    """Measured per-layer compute of this step, when sampled."""
    h2d_gbps: float | None = None
    """Measured host-to-device bandwidth this step, when sampled."""
    finished: tuple[str, ...] = ()
    """Requests that finished since the last report."""
    free_gpu_blocks: int | None = None
    """Free GPU KV blocks after this step, when known."""
    pauses_dropped: tuple[str, ...] = ()
    """Requests whose decided pause the worker dropped since the last report: they keep decoding
    (the data plane refuses some pauses for good, ``sglang_ext/pause.py``)."""


@dataclass(frozen=True)
class Decision:
    """What a worker should do from ``apply_at_step`` on."""

    plan: Plan
    """Placements for the running, non-paused requests."""
    apply_at_step: int
    """Install at the boundary before this step."""
    expiry_step: int
    """Re-plan no later than this step."""
    pause: tuple[str, ...] = ()
    """Requests to pause (keep KV, stop decoding)."""
    resume: tuple[str, ...] = ()
    """Requests to resume."""
    admit: tuple[str, ...] = ()
    """Queued requests to admit for prefill, in order."""
    min_gpu_layers: dict[str, int] = field(default_factory=dict)
    """LayerKV Eq. 4: for admitted prefills, layers that must stay on the GPU."""
    reason: str = ""
    """Why this decision was made (batch-change, expiry, profile-mismatch, ...)."""
    policy_version: int = 0


@dataclass(frozen=True)
class PolicyUpdate:
    """An accepted policy change (audit record and watch event)."""

    policy: Policy
    old_version: int
    actor: str
    """Who changed it (peer identity or 'local')."""


class WorkerSession(Protocol):
    """One worker's session with the control plane."""

    def report(self, report: StepReport) -> list[Decision]: ...

    def close(self) -> None: ...


class ControlPlane(Protocol):
    """Implemented by the embedded controller and by the gRPC client alike."""

    def open_session(self, worker: WorkerInfo) -> WorkerSession: ...

    def plan(self, batch: Any) -> Plan: ...

    def get_policy(self) -> Policy: ...

    def update_policy(self, changes: Mapping[str, Any], token: str | None = None) -> Policy: ...

    def watch_policy(self) -> Iterator[Policy]: ...
