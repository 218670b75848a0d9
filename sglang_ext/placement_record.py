"""``PlacementRecord``: what one request that asked for its placement info has been through.

Kept by :class:`~sglang_ext.request_placement.RequestPlacement` (TP rank 0) only for requests whose
``custom_params`` carry ``"kvplane_return_placement": true``, and updated only where the scheduler
already touches the request: a plan install (the layers the data plane keeps on host), a pause, a
resume, the finish. :meth:`PlacementRecord.result` is the finished request's ``meta_info["kvplane"]``
(see :data:`RESULT_FIELDS`). Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

RESULT_FIELDS: tuple[str, ...] = (
    "layers",
    "layers_offloaded",
    "layers_offloaded_max",
    "host_fraction",
    "pauses",
    "paused_steps",
    "slo_tbt_ms",
    "deposit_tokens",
    "deposit_source",
)
"""Keys of ``meta_info["kvplane"]``, in order:

* ``layers`` -- the model's layers L;
* ``layers_offloaded`` -- layers of the request the data plane kept on host at its finish (the
  installed plan's host layers, or the pool's local fallback's before the first plan); None when
  neither knows the request (no plan installed for it, no layered pool);
* ``layers_offloaded_max`` -- the most layers kept on host at any plan install of its life;
* ``host_fraction`` -- share of the request's KV layer-pages (one layer of ``page_size`` tokens)
  that had no device copy at its finish, measured on the layered pool (None without it); it
  can disagree with ``layers_offloaded`` (the plan's wants) where the device could not hold the
  wanted layers (a device budget below the batch's pages: served from host at rest);
* ``pauses`` / ``paused_steps`` -- keep-KV pauses and the scheduler steps spent paused;
* ``slo_tbt_ms`` -- the TBT SLO the controller planned it against (its own
  ``custom_params.kvplane_slo_tbt_ms`` or the live policy's default); None when the control plane
  is remote (``grpc://``) and the request named none;
* ``deposit_tokens`` / ``deposit_source`` -- tokens generated but not yet due for delivery when it
  finished: ``"pacer"`` for a paced stream (``--kv-pacing on``: the tokens the stream held back and
  released in the finish burst), else ``"controller"`` (the controller's model of the same deposit,
  at its last report; nothing is held back from the client); None with a remote control plane.
"""


@dataclass
class PlacementRecord:
    """Counters of one request (mutable; owned by the scheduler thread of TP rank 0)."""

    layers: int
    """Model layers L."""
    layers_offloaded_max: int = 0
    """Most layers kept on host at any plan install so far."""
    pauses: int = 0
    """Keep-KV pauses so far."""
    paused_steps: int = 0
    """Scheduler steps spent paused (closed pause intervals)."""
    paused_since_step: int | None = None
    """First step of the current pause, None while running."""

    def offloaded(self, layers_on_host: int) -> None:
        """A plan install left ``layers_on_host`` of its layers on host."""
        if layers_on_host > self.layers_offloaded_max:
            self.layers_offloaded_max = layers_on_host

    def paused(self, step: int) -> None:
        """Paused from ``step`` on (the first step it does not run)."""
        if self.paused_since_step is None:
            self.pauses += 1
            self.paused_since_step = step

    def resumed(self, step: int) -> None:
        """Runs again from ``step`` on."""
        if self.paused_since_step is not None:
            self.paused_steps += max(0, step - self.paused_since_step)
            self.paused_since_step = None

    def result(
        self,
        *,
        layers_offloaded: int | None,
        host_fraction: float | None,
        slo_tbt_ms: float | None,
        deposit_tokens: int | None,
        deposit_source: str | None,
        step: int,
    ) -> dict[str, Any]:
        """The finished request's ``meta_info["kvplane"]`` (a pause still open ends at ``step``)."""
        self.resumed(step)
        if layers_offloaded is not None:
            self.offloaded(layers_offloaded)
        return {
            "layers": self.layers,
            "layers_offloaded": layers_offloaded,
            "layers_offloaded_max": self.layers_offloaded_max,
            "host_fraction": None if host_fraction is None else round(host_fraction, 6),
            "pauses": self.pauses,
            "paused_steps": self.paused_steps,
            "slo_tbt_ms": slo_tbt_ms,
            "deposit_tokens": deposit_tokens,
            "deposit_source": deposit_source if deposit_tokens is not None else None,
        }
