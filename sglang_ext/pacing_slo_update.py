"""``PacingSloUpdate``: the live policy's default TBT SLO, sent from the scheduler to the pacer.

Streaming pacing (:mod:`sglang_ext.pacing`) runs in SGLang's main (HTTP / tokenizer) process; the
live policy (``--kv-policy-listen``) lives in TP rank 0's scheduler, with the embedded control
plane. When an update changes ``slo_tbt_ms``, rank 0's
:class:`~sglang_ext.pacing_slo_publisher.PacingSloPublisher` sends one of these over SGLang's own
scheduler -> tokenizer socket (``Scheduler.ipc_channels.send_to_tokenizer``, the channel SGLang
answers control requests on); the main process's ``TokenizerManager`` dispatches it by type (the
plugin adds this type to ``TokenizerManager._result_dispatcher``) to :meth:`apply`, which makes it
the default SLO of the streams paced from then on
(:attr:`sglang_ext.context.PluginContext.live_slo_tbt_ms`). A request's own
``custom_params.kvplane_slo_tbt_ms`` still wins; streams already paced keep the SLO they started
with (a pacer's deposit is built against one SLO, OrbitFlow §3.2).

Pickled by SGLang's ``send_pyobj``: a plain frozen dataclass of this importable module. Standard
library and structlog only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from sglang_ext.request_slo import MAX_SLO_TBT_MS

if TYPE_CHECKING:
    from sglang_ext.context import PluginContext

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class PacingSloUpdate:
    """The live policy's default TBT SLO changed (scheduler -> main process)."""

    slo_tbt_ms: float
    """The new default TBT SLO, ms, in (0, 1e7] (the bound of ``Policy.slo_tbt_ms``)."""
    policy_version: int
    """The policy version that set it (>= 1); an older version than the one applied is ignored."""

    def __post_init__(self) -> None:
        value = self.slo_tbt_ms
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                or not 0 < value <= MAX_SLO_TBT_MS:
            raise ValueError(f"slo_tbt_ms={value!r} is out of range (0, {MAX_SLO_TBT_MS:g}] ms")
        if isinstance(self.policy_version, bool) or not isinstance(self.policy_version, int) \
                or self.policy_version < 1:
            raise ValueError(f"policy_version={self.policy_version!r} is out of range [1, inf)")

    def apply(self, ctx: PluginContext) -> bool:
        """Main process: new streams without their own SLO are paced at :attr:`slo_tbt_ms`.
        Returns False (nothing changed) for a version older than the one already applied."""
        if ctx.live_slo_version >= self.policy_version:
            return False
        ctx.live_slo_tbt_ms = float(self.slo_tbt_ms)
        ctx.live_slo_version = self.policy_version
        log.info("pacing_slo_updated", slo_tbt_ms=ctx.live_slo_tbt_ms, policy_version=self.policy_version)
        return True
