"""``TpSync``: one plan per model instance, installed identically on every TP rank (OrbitFlow §3.5).

Only TP rank 0 talks to the control plane. At every step boundary rank 0 turns the decisions it
received (and its local rules) into a :class:`StepInstall`; :meth:`TpSync.share` broadcasts it
with SGLang's ``broadcast_pyobj`` over the scheduler's gloo CPU group (``scheduler.tp_cpu_group``),
so every rank applies the same pauses, resumes and placements at the same boundary. The schedulers
of all ranks are in lockstep (SGLang broadcasts the incoming requests the same way), so the
per-request pages each rank derives from its ``req_to_token`` are identical too, and
:class:`PlacementInstaller` builds identical residency wants on every rank.

With ``tp_size == 1`` nothing is broadcast.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class StepInstall:
    """What every rank applies at one step boundary (computed on rank 0)."""

    step: int
    """Scheduler step this boundary precedes."""
    pause: tuple[str, ...] = ()
    """Requests to pause (keep KV), in order."""
    resume: tuple[str, ...] = ()
    """Requests to resume, in order."""
    placements: Mapping[str, tuple[int, ...]] | None = None
    """New per-request layer placements (1 GPU / 0 host); None keeps the installed ones."""
    fallback: bool = False
    """True when rank 0 ran this step without a live control plane."""
    reason: str = ""
    """Why (the decision's reason, or the local rule that fired)."""
    admit: tuple[str, ...] = ()
    """Queued requests the control plane admitted for prefill (``layerkv`` / ``lvf``), in order."""
    prefill_layers: Mapping[str, int] | None = None
    """Per admitted prefill, layers kept on the GPU while it prefills (LayerKV Eq. 4); the
    others are written straight to host."""
    recompute: Mapping[str, tuple[int, int]] | None = None
    """With ``placements``: the plan's ``(u blocks, k layers)`` per request that recomputes an
    uncached prefix (``Plan.recompute_blocks`` / ``recompute_layers``, ``docs/recompute.md``;
    blocks are pages). Replaced with every new ``placements``; None: nothing planned."""

    @property
    def empty(self) -> bool:
        return not self.pause and not self.resume and self.placements is None and not self.admit


@dataclass(frozen=True)
class Residency:
    """Stand-in with :class:`sglang_ext.layered_pool.RequestResidency`'s fields (used when the
    layered pool is not active, for telemetry only)."""

    pages: tuple[int, ...]
    """The request's logical pages, in order."""
    gpu_layers: tuple[bool, ...]
    """Wanted residency per layer."""
    paused: bool = False
    """Paused: layers are removable."""


def _residency_cls(pool: Any) -> Any:
    if pool is not None:
        try:
            from sglang_ext.layered_pool import RequestResidency

            return RequestResidency
        except ImportError:
            pass
    return Residency


class TpSync:
    """Broadcasts rank 0's :class:`StepInstall` to every rank of the TP group."""

    def __init__(self, rank: int, world_size: int, group: Any = None, src: int = 0) -> None:
        if world_size < 1:
            raise ValueError(f"world_size={world_size}: must be >= 1")
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.src = src

    @classmethod
    def for_scheduler(cls, scheduler: Any) -> TpSync:
        """The scheduler's TP group (``tp_group.rank``, ``tp_cpu_group``, source ``ranks[0]``)."""
        tp_size = int(getattr(scheduler, "tp_size", 1) or 1)
        if tp_size == 1:
            return cls(0, 1)
        tp_group = scheduler.tp_group
        return cls(tp_group.rank, tp_size, scheduler.tp_cpu_group, src=tp_group.ranks[0])

    @property
    def is_source(self) -> bool:
        """True on the rank that computes (TP rank 0)."""
        return self.world_size == 1 or self.rank == self.src

    def share(self, install: StepInstall | None) -> StepInstall:
        """Rank 0 passes its install; every rank returns the same object."""
        if self.world_size == 1:
            if install is None:
                raise ValueError("install: rank 0 must pass a StepInstall")
            return install
        from sglang_ext.compat import broadcast_pyobj

        if self.is_source and install is None:
            raise ValueError("install: rank 0 must pass a StepInstall")
        data = [install] if self.is_source else []
        got = broadcast_pyobj(data, self.rank, dist_group=self.group, src=self.src)
        if not got or not isinstance(got[0], StepInstall):
            raise RuntimeError(f"kvplane: TP broadcast delivered {got!r}, expected a StepInstall")
        return got[0]


@dataclass
class PlacementInstaller:
    """Turns the installed plan into residency wants and hands them to the layered pool."""

    pool: Any
    """The KV pool; residency is installed only when it has ``update_residency``."""
    layers: int
    """Model layers L."""
    placements: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Installed per-request placements (from the newest plan)."""
    prefill_placements: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Admitted prefills not yet in a plan: their lowest ``min_gpu_layers`` layers on the GPU."""
    last_wants: dict[str, Any] = field(default_factory=dict)
    """Every installed request's wants (also kept without a layered pool, for telemetry); a
    request not sent by the last install keeps those of the install that sent it (its pages then)."""
    uncached: dict[str, int] = field(default_factory=dict)
    """Running requests' uncached prefix pages (eLLM, ``docs/recompute.md``; set by
    :class:`~sglang_ext.recompute_requests.RecomputeRequests`)."""
    planned_recompute: dict[str, tuple[int, int]] = field(default_factory=dict)
    """The newest plan's ``(u pages, k layers)`` per request (sized at the plan window's end);
    :class:`~sglang_ext.recompute_requests.RecomputeRequests` applies them, clamped to the
    request's pages, to the requests without a forced ratio."""
    installs: int = 0
    """update_residency calls made."""
    skipped: int = 0
    """Boundaries where the wants' policy was unchanged, so nothing was installed (an install
    that found no request to send counts in neither this nor :attr:`installs`)."""
    _unsent: set[str] = field(default_factory=set)
    """Requests whose wants the pool refused (``update_residency`` raised): the next install,
    which a change of the batch or the plan triggers (not every step), sends them again."""
    _installed: dict[str, tuple[tuple[bool, ...], bool, int]] | None = None
    _epoch: int = 0
    """Bumped whenever the placements or the installed policy change."""
    _installed_key: tuple[int, tuple[str, ...], tuple[str, ...]] | None = None
    """(epoch, running, paused) last known to match ``_installed``."""

    def __post_init__(self) -> None:
        self._all_gpu = (True,) * self.layers
        self._bool_rows: dict[str, tuple[tuple[int, ...], tuple[bool, ...]]] = {}
        self._layered = self.pool is not None and hasattr(self.pool, "update_residency")
        self._host_tier = getattr(getattr(self.pool, "store", None), "host_tier", True)
        """False: the layered pool keeps every layer on the device (``SlotStoreConfig.host_tier``),
        so every placement installed, reported and recorded is all-GPU, as the pool keeps it."""

    @property
    def layered(self) -> bool:
        return self._layered

    def apply(self, install: StepInstall) -> None:
        if install.prefill_layers or install.placements is not None:
            self._epoch += 1
        for rid, keep in (install.prefill_layers or {}).items():
            keep = max(1, min(self.layers, int(keep) if self._host_tier else self.layers))
            self.prefill_placements[rid] = (1,) * keep + (0,) * (self.layers - keep)
        if install.placements is not None:
            self.placements = {
                rid: tuple(int(x) for x in row) if self._host_tier else (1,) * self.layers
                for rid, row in install.placements.items()
                if len(row) == self.layers
            }
            if len(self.placements) != len(install.placements):  # not this model's: refused, said
                wrong = {rid: len(row) for rid, row in install.placements.items() if len(row) != self.layers}
                log.warning("placement_rows_refused", layers=self.layers, refused=len(wrong),
                            example=next(iter(wrong.items())), hint="those requests run all-GPU")
            for rid in self.placements:  # planned now: the prefill placement has done its job
                self.prefill_placements.pop(rid, None)
            self.planned_recompute = {
                rid: (int(u), int(k)) for rid, (u, k) in (install.recompute or {}).items() if u > 0
            }
            self._bool_rows = {
                rid: hit for rid, hit in self._bool_rows.items()
                if rid in self.placements or rid in self.prefill_placements
            }

    def prune_prefill(self, live: Collection[str]) -> int:
        """Drop the prefill placements of requests this worker no longer holds (``live``: the
        ids queued, running, prefilling or parked; ``admission.live_request_ids``). A placement
        leaves when its request is planned or released; one the control plane sent for a request
        aborted while queued, or for no request of this worker, stayed for good. Returns how
        many went."""
        gone = [rid for rid in self.prefill_placements if rid not in live]
        for rid in gone:
            del self.prefill_placements[rid]
            if rid not in self.placements:
                self._bool_rows.pop(rid, None)
        return len(gone)

    def gpu_layers(self, rid: str) -> tuple[bool, ...]:
        row = self.placements.get(rid) or self.prefill_placements.get(rid)
        if row is None:
            return self._all_gpu  # unplanned: wanted on GPU; the pool's fallback decides
        hit = self._bool_rows.get(rid)
        if hit is not None and hit[0] is row:  # asked twice per request and step: converted once
            return hit[1]
        bools = tuple(bool(x) for x in row)
        self._bool_rows[rid] = (row, bools)
        return bools

    def gpu_layer_count(self, rid: str) -> int:
        """Layers of ``rid`` wanted on the GPU (``sum(gpu_layers(rid))`` without the tuple)."""
        row = self.placements.get(rid) or self.prefill_placements.get(rid)
        return self.layers if row is None else self.layers - row.count(0)

    def wants(
        self, running: Mapping[str, tuple[int, ...]], paused: Mapping[str, tuple[int, ...]]
    ) -> dict[str, Any]:
        """Residency wants: running requests per the plan, paused ones removable."""
        cls = _residency_cls(self.pool if self.layered else None)
        out: dict[str, Any] = {}
        uncached = self.uncached
        for rid, pages in running.items():
            u = min(uncached.get(rid, 0), max(len(pages) - 1, 0))
            prefix = {"uncached_pages": u} if u else {}  # only the layered pool's wants carry it
            out[rid] = cls(pages=tuple(pages), gpu_layers=self.gpu_layers(rid), paused=False, **prefix)
        for rid, pages in paused.items():
            out[rid] = cls(pages=tuple(pages), gpu_layers=(False,) * self.layers, paused=True)
        return out

    def _policy(self, running: Iterable[str], paused: Iterable[str]) -> dict[str, tuple[tuple[bool, ...], bool, int]]:
        uncached = self.uncached
        out = {rid: (self.gpu_layers(rid), False, uncached.get(rid, 0)) for rid in running}
        out.update({rid: ((False,) * self.layers, True, 0) for rid in paused})
        return out

    def set_uncached(self, rid: str, pages: int) -> None:
        """``rid``'s uncached prefix (0: none); a change is installed at this step's boundary."""
        if self.uncached.get(rid, 0) != pages:
            if pages:
                self.uncached[rid] = pages
            else:
                self.uncached.pop(rid, None)
            self._epoch += 1

    def unchanged(self, running: Iterable[str], paused: Iterable[str]) -> bool:
        """Whether the last install already holds these requests with the same layers and pause
        state. Then the boundary installs nothing: pages appended since reach the pool through
        its own step observation (``prepare_step``), so the wants need not be rebuilt.

        Steady state costs a tuple comparison: the same requests, in the same order, with no
        placement change since they last matched (the epoch) are the same policy."""
        key = (self._epoch, tuple(running), tuple(paused))
        if key == self._installed_key:
            self.skipped += 1
            return True
        same = self._installed is not None and self._policy(key[1], key[2]) == self._installed
        self._installed_key = key if same else None
        self.skipped += same
        return same

    def install(
        self, running: Mapping[str, Any], paused: Mapping[str, Any],
        pages_of: Callable[[Any], Sequence[int]] | None = None,
    ) -> Any:
        """Install on the pool the wants of the requests whose policy (layers, pause state,
        uncached prefix) differs from the last install's, new requests included; returns the
        pool's delta (None without a layered pool, or when no request's policy changed). The
        others are not sent: ``update_residency`` keeps a request it is not given as it was,
        and their appended pages reach the pool through its step observation, as at a boundary
        where :meth:`unchanged` holds. ``running`` / ``paused`` map rids to their pages, or to
        requests whose pages ``pages_of`` reads: then only the changed requests' pages are read
        (a batch change costs O(its new requests' pages), not O(the batch's)). A request whose
        wants the pool no longer holds (``holds_wants``: SGLang retracted it, which releases it
        in the pool without a finish) is sent again. ``last_wants`` holds every request's wants
        (the unchanged ones' from their last install)."""
        policy = self._policy(running, paused)
        prior, last = self._installed or {}, self.last_wants
        # a request the pool released without a finish (SGLang retracted it) holds no wants
        holds = getattr(self.pool, "holds_wants", None) if self.layered else None
        holds = holds if holds is not None else (lambda rid: True)
        unsent = self._unsent
        fresh = {rid for rid, p in policy.items()
                 if prior.get(rid) != p or rid not in last or rid in unsent or not holds(rid)}
        read = pages_of if pages_of is not None else (lambda pages: pages)
        wants = self.wants({rid: read(v) for rid, v in running.items() if rid in fresh},
                           {rid: read(v) for rid, v in paused.items() if rid in fresh})
        self.last_wants = {rid: wants[rid] if rid in fresh else last[rid] for rid in policy}
        self._installed = policy
        self._epoch += 1
        self._installed_key = (self._epoch, tuple(running), tuple(paused))
        if not self.layered or not wants:
            return None
        self.installs += 1
        try:
            delta = self.pool.update_residency(wants)
        except Exception:  # the pool may not hold these: the next install sends them again
            unsent.update(wants)
            for rid in wants:  # what the pool held before, for telemetry
                if rid in last:
                    self.last_wants[rid] = last[rid]
                else:
                    self.last_wants.pop(rid, None)
            raise
        unsent.difference_update(wants)
        return delta

    def release(self, rid: str) -> None:
        self.forget(rid)
        if self.layered:
            self.pool.release_request(rid)

    def forget(self, rid: str) -> None:
        """Drop ``rid``'s plan bookkeeping, leaving the pool to SGLang's own release of it (an
        abort of a chunked prefill: SGLang tears it down at a later step, through ``on_release``)."""
        self._bool_rows.pop(rid, None)
        self.uncached.pop(rid, None)
        self.planned_recompute.pop(rid, None)
        self.placements.pop(rid, None)
        self.prefill_placements.pop(rid, None)
        self.last_wants.pop(rid, None)
        self._unsent.discard(rid)
        self._epoch += 1
        if self._installed is not None:
            self._installed.pop(rid, None)
