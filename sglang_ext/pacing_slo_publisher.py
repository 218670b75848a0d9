"""``PacingSloPublisher``: TP rank 0's scheduler tells the pacer when the live default SLO changes.

With ``--kv-policy-listen`` the live policy is updated in TP rank 0's scheduler (its embedded
control plane's :class:`~controlplane.policy_store.PolicyStore`), while streaming pacing
(``--kv-pacing on``) runs in SGLang's main process with the launch default. The publisher closes
that gap: at every scheduler iteration (the step boundary, idle iterations included: an idle
scheduler with ``--sleep-on-idle`` wakes at least once a second) it reads the live policy -- one
attribute read and an identity compare, the store hands out the same immutable ``Policy`` until an
update replaces it -- and when ``slo_tbt_ms`` changed, sends one
:class:`~sglang_ext.pacing_slo_update.PacingSloUpdate` over SGLang's scheduler -> tokenizer socket.
Nothing is sent per token or per request; other policy changes (alpha, scheduler, windows) send
nothing (the pacer does not use them).

Built only where it can work (:meth:`for_scheduler`): rank 0 with the endpoint on and pacing on,
and one tokenizer process (``--tokenizer-worker-num 1``, SGLang's default). Several tokenizer
workers are refused at launch under ``--enable-layered-kv`` (SGLang loads no plugins in them:
:mod:`sglang_ext.launch_decision`); should a scheduler see them anyway, SGLang's router forwards
only per-request outputs, so no publisher is built (one ``pacing_slo_not_live`` warning). The send happens on the scheduler thread, the
only one using that socket, through SGLang's ``wrap_as_pickle`` (the object as is with SGLang's
default pickle IPC, a ``PickleWrapper`` the receiver unwraps with ``SGLANG_USE_PICKLE_IPC=0``).
A failed send is logged, never raised (the scheduler serves on).
No torch; SGLang is reached through :mod:`sglang_ext.compat` when the publisher is built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog

from sglang_ext import compat
from sglang_ext.args import LayeredKVArgs
from sglang_ext.pacing_slo_update import PacingSloUpdate

log = structlog.get_logger(__name__)


class PacingSloPublisher:
    """Sends the live policy's default TBT SLO to the main process when it changes."""

    def __init__(self, control_plane: Any, send: Callable[[Any], Any]) -> None:
        self._cp = control_plane
        self._send = send
        self._seen = control_plane.get_policy()
        self._sent_slo_tbt_ms = float(self._seen.slo_tbt_ms)
        """What the main process paces at: the launch policy's SLO (the same ``--kv-policy`` file
        or default that :class:`~sglang_ext.pacing.PacingSettings` read there), then each sent one."""
        self.sent = 0
        """Updates sent so far."""

    @classmethod
    def for_scheduler(cls, scheduler: Any, args: LayeredKVArgs, endpoint: Any,
                      control_plane: Any) -> PacingSloPublisher | None:
        """Rank 0's publisher, or None: no endpoint (the policy cannot change), pacing off, or more
        than one tokenizer worker (logged)."""
        if endpoint is None or not args.pacing:
            return None
        workers = int(getattr(scheduler.server_args, "tokenizer_worker_num", 1) or 1)
        if workers > 1:
            log.warning(
                "pacing_slo_not_live",
                tokenizer_worker_num=workers,
                reason="SGLang routes only per-request outputs to several tokenizer workers",
                action="streams without their own kvplane_slo_tbt_ms are paced at the launch default",
            )
            return None
        send_output = scheduler.ipc_channels.send_to_tokenizer.send_output
        wrap = compat.resolve(compat.WRAP_AS_PICKLE.path)  # msgpack IPC needs it; pickle IPC: identity

        def send(update: PacingSloUpdate) -> None:
            send_output(wrap(update))

        return cls(control_plane, send)

    @property
    def sent_slo_tbt_ms(self) -> float:
        """The default SLO the main process was last told (the launch one before any update)."""
        return self._sent_slo_tbt_ms

    def poll(self) -> bool:
        """Send the live SLO if it changed since the last call; True when something was sent."""
        policy = self._cp.get_policy()
        if policy is self._seen:
            return False
        self._seen = policy
        slo = float(policy.slo_tbt_ms)
        if slo == self._sent_slo_tbt_ms:
            return False
        try:
            self._send(PacingSloUpdate(slo_tbt_ms=slo, policy_version=int(policy.version)))
        except Exception:  # the scheduler must serve on; the next change tries again
            log.exception("pacing_slo_push_failed", slo_tbt_ms=slo, policy_version=policy.version)
            return False
        self._sent_slo_tbt_ms = slo
        self.sent += 1
        log.info("pacing_slo_pushed", slo_tbt_ms=slo, policy_version=policy.version)
        return True
