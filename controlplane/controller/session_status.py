"""The read-only summary of one controller session."""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.controller.profile_tracker import ProfileUpdate


@dataclass(frozen=True)
class SessionStatus:
    """A read-only summary of one session (for the service, the simulator and tests)."""

    worker_id: str
    step: int | None
    """Step of the last report."""
    running: tuple[str, ...]
    """Decoding, not paused."""
    paused: tuple[str, ...]
    """Paused, longest-paused first."""
    expiry_step: int | None
    """Expiry of the latest decision."""
    layer_compute_ms: tuple[float, ...]
    """Current profile."""
    h2d_gbps: float
    """Current effective bandwidth."""
    planning: bool
    """True while a plan is being computed or queued."""
    last_triggers: tuple[str, ...]
    """Triggers fired by the last report."""
    last_profile_update: ProfileUpdate | None
    """The most recent EWMA update, if any."""
