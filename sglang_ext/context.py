"""``PluginContext``: what kvplane knows in one SGLang process, built by ``register()`` and passed
explicitly to every hook and scheduler object -- kvplane keeps no module-level mutable state.

It holds the launch options (``layered``: from ``KVPLANE_LAYERED_KV_ARGS`` in SGLang's
subprocesses, from the command line in the launcher once parsed), the ``KVPLANE_*`` snapshot
(:class:`~sglang_ext.settings.KvplaneEnv`) or the error reading it, the overhead meter
(``$KVPLANE_OVERHEAD_FILE``), the registry a scheduler's
:class:`~sglang_ext.worker_metrics.WorkerMetrics` registers in (tests inject one; by default each
gets a private one -- with SGLang's ``--enable-metrics`` the values reach ``/metrics`` through
the multiprocess files whatever the registry, and without it no metric is created), built
once per process on first use, the pacing settings (the policy's default SLO), and in the main
process the live policy's default SLO once the scheduler sends one (``--kv-policy-listen``).

Pure Python at import (``plugin.py`` imports it in every process).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sglang_ext import settings
from sglang_ext.args import LayeredKVArgs
from sglang_ext.overhead import OverheadMeter

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from sglang_ext.pacing import PacingSettings


@dataclass
class PluginContext:
    """One process's kvplane state (see the module docstring)."""

    env: settings.KvplaneEnv = field(default_factory=settings.KvplaneEnv)
    """The ``KVPLANE_*`` variables read at plugin load (defaults when ``env_error`` is set)."""
    env_error: str | None = None
    """Why reading them failed (raised at parse / publish when the flag is on), None if it did not."""
    layered: LayeredKVArgs | None = None
    """The launch options this process knows; None before parsing in the launcher (or when the
    options variable itself was bad)."""
    meter: OverheadMeter | None = None
    """kvplane's own time per step (``$KVPLANE_OVERHEAD_FILE``, flag on), None when not asked for."""
    metrics_registry: CollectorRegistry | None = None
    """Registry of this process's WorkerMetrics; None: a private one per WorkerMetrics."""
    live_slo_tbt_ms: float | None = None
    """Main process: the live policy's default TBT SLO as TP rank 0's scheduler last sent it
    (``--kv-policy-listen``, :class:`~sglang_ext.pacing_slo_update.PacingSloUpdate`); None until an
    update changes it, and the pacer uses the launch default (:meth:`pacing_default_slo_tbt_ms`)."""
    live_slo_version: int = 0
    """The policy version of :attr:`live_slo_tbt_ms` (0: none received)."""
    _pacing: tuple[LayeredKVArgs, PacingSettings | None] | None = field(default=None, init=False, repr=False)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> PluginContext:
        """Read the ``KVPLANE_*`` variables; a bad one is kept as ``env_error`` (``register()``
        must not raise for it: SGLang's ``load_plugins`` would swallow it)."""
        ctx = cls()
        try:
            ctx.layered = settings.read_layered_kv_args(environ)
            ctx.env = settings.KvplaneEnv.from_environ(environ)
        except ValueError as exc:
            ctx.env_error = str(exc)
            return ctx
        if ctx.layered.enable_layered_kv and ctx.env.overhead_file is not None:
            ctx.meter = OverheadMeter(ctx.env.overhead_file)
        return ctx

    @property
    def enabled(self) -> bool:
        """Whether ``--enable-layered-kv`` is on in this process (as far as it knows)."""
        return self.layered is not None and self.layered.enable_layered_kv

    def pacing_settings(self) -> PacingSettings | None:
        """The pacing settings for the current options (None with the flag or pacing off),
        resolved once per options object (read per stream: an identity check, O(1))."""
        layered = self.layered
        if layered is None or not layered.enable_layered_kv or not layered.pacing:
            return None
        if self._pacing is None or self._pacing[0] is not layered:
            from sglang_ext.pacing import PacingSettings

            self._pacing = (layered, PacingSettings.from_args(layered))
        return self._pacing[1]

    def pacing_default_slo_tbt_ms(self, settings: PacingSettings) -> float:
        """The TBT SLO a new stream without its own is paced at: the live policy's when the
        scheduler has sent one (:attr:`live_slo_tbt_ms`), else the launch default of ``settings``."""
        live = self.live_slo_tbt_ms
        return settings.default_slo_tbt_ms if live is None else live

    def describe(self) -> dict[str, Any]:
        """Small JSON-ready summary (for logs)."""
        return {
            "enabled": self.enabled,
            "env_error": self.env_error,
            "meter": None if self.meter is None else str(self.meter.path),
        }
