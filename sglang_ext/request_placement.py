"""``RequestPlacement``: per-request placement info, opt-in, built in the scheduler (TP rank 0).

A request asks with ``custom_params: {"kvplane_return_placement": true}``
(:mod:`sglang_ext.placement_param`, checked where requests enter; the
OpenAI endpoints' ``custom_params`` field, ``/generate``'s ``sampling_params.custom_params``) --
the same channel as its own SLO (``kvplane_slo_tbt_ms``). Only such requests are tracked, and only
where the scheduler already touches them (nothing per step for anybody):

* **arrival** (AFTER ``Scheduler._add_request_to_queue``): one dict lookup per request; an asking
  one gets a :class:`~sglang_ext.placement_record.PlacementRecord`;
* **plan install** (after the step boundary installed new residency wants): for each tracked
  running request, the layers the data plane keeps on host (``layers_offloaded_max``);
* **pause / resume** (the residency hooks' ``paused`` / ``resumed`` events): pauses and paused steps;
* **finish** (the tree cache's ``on_release``, before the output is streamed and before the pool
  forgets the request): the layers on host and the host fraction measured on the layered pool,
  the SLO (own or the live policy's) and the controller's deposit. The result rides to the main
  process in SGLang's generic per-request channel ``req.customized_info[KEY]``, on the request's
  final output only; :mod:`sglang_ext.placement_response` turns it into ``meta_info["kvplane"]``.

Requests that never ran (aborted while queued) carry none. The fields are documented at
:data:`sglang_ext.placement_record.RESULT_FIELDS`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import structlog

from sglang_ext.admission import request_slo
from sglang_ext.hooks import ResidencyEvent, ResidencyEventKind
from sglang_ext.placement_param import KEY, PARAM, placement_param_error, wants_placement
from sglang_ext.placement_record import PlacementRecord

log = structlog.get_logger(__name__)

__all__ = ["KEY", "PARAM", "RequestPlacement", "placement_param_error", "wants_placement"]

class _OnFinalOutput(list):  # type: ignore[type-arg]
    """The record as ``customized_info`` values: SGLang's output streamer slices a request's values
    by the tokens of each output (``values[sent:len(output)]``); set on the final output only, every
    slice is the one record, so ``meta_info`` gets it exactly once, whatever was sent before."""

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return list(self)
        return list.__getitem__(self, index)


class RequestPlacement:
    """The records of one scheduler's asking requests (TP rank 0; scheduler thread only)."""

    def __init__(
        self,
        *,
        layers: int,
        installer: Any,
        pool: Any,
        pages_of: Callable[[Any], Sequence[int]],
        step_of: Callable[[], int],
        session_of: Callable[[], Any] | None = None,
        default_slo_of: Callable[[], float] | None = None,
    ) -> None:
        self.layers = layers
        self.installer = installer
        """:class:`~sglang_ext.tp_sync.PlacementInstaller`: the installed wants (``last_wants``)."""
        self.pool = pool
        """The KV pool; read only (the layered pool's residency and map) when it is layered."""
        self._pages_of = pages_of
        self._step_of = step_of
        """The step about to run (boundary) or running (finish)."""
        self._session_of = session_of
        """The control-plane session (its ``deposit(rid)`` when embedded)."""
        self._default_slo_of = default_slo_of
        """The live policy's default TBT SLO (embedded control plane), None when remote."""
        self._records: dict[str, PlacementRecord] = {}
        self._wants_seen: Any = None
        self.returned = 0
        """Records attached to a finished request's output."""

    @property
    def active(self) -> bool:
        """Whether any live request asked (the boundary skips :meth:`installed` otherwise)."""
        return bool(self._records)

    def __contains__(self, rid: object) -> bool:
        return rid in self._records

    # ---- arrival ---------------------------------------------------------------------------
    def arrived(self, req: Any) -> None:
        """A request entered the waiting queue: track it if it asked (retracted ones keep theirs)."""
        if not wants_placement(getattr(getattr(req, "sampling_params", None), "custom_params", None)):
            return
        rid = req.rid
        if rid in self._records:
            return
        record = self._records[rid] = PlacementRecord(self.layers)
        weakref.finalize(req, self._drop, rid, record)  # never leaks, even if it never ran

    def _drop(self, rid: str, record: PlacementRecord) -> None:
        if self._records.get(rid) is record:
            del self._records[rid]

    def forget(self, rids: Iterable[str]) -> None:
        """Finished requests (a record not taken at release, e.g. a session-kept row, goes too)."""
        for rid in rids:
            self._records.pop(rid, None)

    # ---- plan install, pause, resume ---------------------------------------------------------
    def installed(self) -> None:
        """After a step boundary: when new wants were installed, note each tracked running
        request's layers on host (O(tracked x L), only at installs)."""
        wants = self.installer.last_wants
        if wants is self._wants_seen:
            return
        self._wants_seen = wants
        for rid, record in self._records.items():
            if record.paused_since_step is None and rid in wants:
                on_host = self._layers_on_host(rid)
                if on_host is not None:
                    record.offloaded(on_host)

    def on_event(self, event: ResidencyEvent) -> None:
        """Residency-hook subscriber for ``paused`` / ``resumed``."""
        record = self._records.get(event.rid or "")
        if record is None:
            return
        if event.kind is ResidencyEventKind.PAUSED:
            record.paused(self._step_of())
        elif event.kind is ResidencyEventKind.RESUMED:
            record.resumed(self._step_of())

    # ---- finish ------------------------------------------------------------------------------
    def finishing(self, req: Any) -> None:
        """The request is being released (finished or aborted, before its last output is streamed
        and before the pool drops it): attach its result to ``req.customized_info``. A request
        released unfinished (SGLang's retraction, back to the queue) keeps its record: its output
        is not final, and the pauses and offloads it had count in the final one."""
        finished = getattr(req, "finished", None)
        if finished is not None and not finished():
            return
        record = self._records.pop(req.rid, None)
        if record is None:
            return
        try:
            result = self._result(req, record)
        except Exception:  # telemetry must never fail a request
            log.warning("placement_info_failed", rid=req.rid, exc_info=True)
            return
        info = getattr(req, "customized_info", None)
        if info is None:
            info = req.customized_info = {}
        info[KEY] = _OnFinalOutput([result])
        self.returned += 1

    def _result(self, req: Any, record: PlacementRecord) -> dict[str, Any]:
        rid = req.rid
        on_host = self._layers_on_host(rid)
        slo = request_slo(req)
        if slo is None and self._default_slo_of is not None:
            slo = float(self._default_slo_of())
        deposit_tokens, source = None, None
        deposit_of = getattr(self._session_of() if self._session_of is not None else None, "deposit", None)
        if deposit_of is not None:
            deposit = deposit_of(rid)
            deposit_tokens, source = (0 if deposit is None else int(deposit.balance)), "controller"
        return record.result(
            layers_offloaded=on_host,
            host_fraction=self._host_fraction(req),
            slo_tbt_ms=slo,
            deposit_tokens=deposit_tokens,
            deposit_source=source,
            step=self._step_of(),
        )

    def _layers_on_host(self, rid: str) -> int | None:
        """Layers of ``rid`` the data plane keeps on host: the layered pool's wants (the plan, or
        its local fallback before the first plan), else the installed plan's; None if unknown."""
        residency = getattr(self.pool, "residency", None) if self.installer.layered else None
        if residency is not None:
            wanted = residency.gpu_layers(rid)
            if wanted is not None:
                return len(wanted) - sum(wanted)
        if rid in self.installer.placements or rid in self.installer.prefill_placements:
            return self.layers - self.installer.gpu_layer_count(rid)
        return None

    def _host_fraction(self, req: Any) -> float | None:
        """Share of the request's KV layer-pages with no device copy (layered pool only)."""
        store = getattr(self.pool, "store", None) if self.installer.layered else None
        if store is None:
            return None
        settle = getattr(getattr(self.pool, "core", None), "settle", None)
        if settle is not None:  # recorded decode steps, releases and frees first (the store is read directly)
            settle()
        pages = np.asarray(self._pages_of(req), dtype=np.int64)
        if pages.size:
            pages = pages[store.has_kv_np[pages]]  # pages freed (or never written) hold no KV
        if not pages.size:
            return 0.0
        on_host = int((store.map_np[:, pages] < 0).sum())
        return on_host / (store.map_np.shape[0] * int(pages.size))

    # ---- wiring ------------------------------------------------------------------------------
    @classmethod
    def for_scheduler(cls, hooks: Any, control_plane: Any) -> RequestPlacement:
        """The records of TP rank 0's :class:`~sglang_ext.scheduler_hooks.SchedulerHooks`, attached
        to its tree cache; the live policy's default SLO only from an embedded control plane."""
        embedded = hooks.args.kv_control_plane == "embedded"
        placement = cls(
            layers=hooks.layers,
            installer=hooks.installer,
            pool=hooks.pool,
            pages_of=hooks.pages_of,
            step_of=lambda: hooks.step + 1,
            session_of=lambda: None if hooks.client is None else hooks.client.session,
            default_slo_of=(lambda: control_plane.get_policy().slo_tbt_ms) if embedded else None,
        )
        placement.attach(getattr(hooks.scheduler, "tree_cache", None))
        return placement

    def attach(self, tree_cache: Any) -> None:
        """Follow pauses and resumes (the tree's residency hooks) and take each record when the
        tree releases its request (``on_release``, wrapped on the instance)."""
        hooks = getattr(tree_cache, "residency_hooks", None)
        if hooks is not None:
            hooks.subscribe(self.on_event, kinds=[ResidencyEventKind.PAUSED, ResidencyEventKind.RESUMED])
        release = getattr(tree_cache, "on_release", None)
        if release is None:
            log.warning("placement_info_unavailable", reason="the tree cache has no on_release")
            return
        placement = self

        def on_release(req: Any, *args: Any, **kwargs: Any) -> Any:
            if placement._records:  # nobody asked: one truth test per released request
                placement.finishing(req)
            return release(req, *args, **kwargs)

        tree_cache.on_release = on_release
