"""``PluginContext``: what kvplane knows in one SGLang process, built by ``register()`` and passed
explicitly to every hook and scheduler object -- kvplane keeps no module-level mutable state.

It holds the launch options (``layered``: from ``KVPLANE_LAYERED_KV_ARGS`` in SGLang's
subprocesses, from the command line in the launcher once parsed), the ``KVPLANE_*`` snapshot
(:class:`~sglang_ext.settings.KvplaneEnv`) or the error reading it, the overhead meter
(``$KVPLANE_OVERHEAD_FILE``), the registry a scheduler's
:class:`~sglang_ext.worker_metrics.WorkerMetrics` registers in (tests inject one; by default each
gets a private one -- with SGLang's ``--enable-metrics`` the values reach ``/metrics`` through
the multiprocess files whatever the registry, and without it no metric is created) and, built
once per process on first use, the pacing settings (the policy's default SLO).

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
    _pacing: tuple[str, PacingSettings | None] | None = field(default=None, init=False, repr=False)

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
        resolved once per set of options."""
        layered = self.layered
        if layered is None or not layered.enable_layered_kv or not layered.pacing:
            return None
        key = layered.to_json()
        if self._pacing is None or self._pacing[0] != key:
            from sglang_ext.pacing import PacingSettings

            self._pacing = (key, PacingSettings.from_args(layered))
        return self._pacing[1]

    def describe(self) -> dict[str, Any]:
        """Small JSON-ready summary (for logs)."""
        return {
            "enabled": self.enabled,
            "env_error": self.env_error,
            "meter": None if self.meter is None else str(self.meter.path),
        }
