"""LayeredKVCore: the served layered-KV data plane, SGLang-free (the pool adapter, the benchmarks
and the GPU check all drive this object).

Primitives (scheduler thread; a forward is ``prepare_step`` .. ``exit_layer(L-1)``):

- ``update_residency(wants)`` / ``release_request(rid)`` / ``page_freed(pages)`` -- boundary
  changes from the control plane and SGLang's allocator (:class:`SlotResidency`).
- ``prepare_step(requests, new_slots, new_counts)`` -- the step boundary: observe the batch,
  reconcile the placement (staging kept free), build the step's tables once
  (:class:`StepTables`, staging reserved by :class:`StagingRoom`), start the
  :class:`LayerPipeline` (first fetches launched). ``prepare_decode_step`` is its steady-decode
  fast path (identity layout, everything resident: the new pages' bookkeeping is journalled and
  applied by the next reader of residency, :class:`~sglang_ext.dataplane.decode_journal.DecodeJournal`).
- per layer: ``enter_layer(l)`` (stream wait on the layer's fetches), ``write(l, k, v)`` (the
  step's new KV into its device rows), the attention reads ``layer_in_place(l)`` (identity) or
  ``device_kv()`` through ``token_rows(l)`` / ``tables.tab[l]``, ``exit_layer(l)`` (write-back of
  staged new tokens, next fetches).
- ``read_kv(l, slots)`` / ``write_at_rest(...)`` -- at rest, between forwards (tests, tools,
  overflow steps).
- ``close_transfer_step()`` -- once per forward, for the metrics: the stall seconds of the steps
  whose transfer timing is complete (:class:`TransferTimes`; CUDA events harvested without a sync);
  the CUDA clock decides there whether the next step is timed (``--kv-timing-interval``).

When even evicting everything leaves too little room to stage the batch (the control plane let
the running batch's staging slots outgrow the budget, or has not planned yet) the step
*overflows*: it is served exactly through the at-rest path (host syncs), counted and logged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from functools import partial

import numpy as np
import structlog
import torch

from sglang_ext.dataplane.decode_continuity import DecodeContinuity
from sglang_ext.dataplane.identity_decode_step import IdentityDecodeStep
from sglang_ext.dataplane.layer_page_moves import LayerPageMoves
from sglang_ext.dataplane.layer_pipeline import LayerPipeline
from sglang_ext.dataplane.new_token_counts import new_token_counts
from sglang_ext.dataplane.page_ids import check_page_ids
from sglang_ext.dataplane.paged_decode_step import PagedDecodeStep
from sglang_ext.dataplane.paged_step_tables import PagedStepTables
from sglang_ext.dataplane.slot_kv_store import SlotKVStore
from sglang_ext.dataplane.slot_residency import SlotResidency
from sglang_ext.dataplane.slot_results import RequestResidency, ResidencyDelta, ResidencyStats
from sglang_ext.dataplane.slot_store_config import SlotStoreConfig
from sglang_ext.dataplane.sorted_ids import distinct_sorted
from sglang_ext.dataplane.staging_columns import staging_demand
from sglang_ext.dataplane.staging_room import StagingRoom
from sglang_ext.dataplane.step_tables import StepTables
from sglang_ext.dataplane.transfer_times import TransferTimes

log = structlog.get_logger(__name__)

WRITEBACK_FREE_SHARE = 0.25
"""Eager write-back runs at a step boundary when fewer than this share of device pages are free."""


class LayeredKVCore:
    """Store + residency + staging + per-step tables + layer pipeline (see module docstring)."""

    def __init__(self, config: SlotStoreConfig, on_moves: Callable[[LayerPageMoves], None] | None = None) -> None:
        self.config = config
        self.store = SlotKVStore(config)
        self.residency = SlotResidency(self.store)
        self.room = StagingRoom(self.residency)
        self.pipeline = LayerPipeline(self.store, self._release_staging)
        self.layers = config.layers
        self.page_size = config.page_size
        self._on_moves = on_moves
        self.tables: StepTables | None = None
        """The current forward's tables (None between forwards and on overflow / fast steps)."""
        self.token_tables = True
        """Build torch-native token tables per step (a paged-only backend turns this off)."""
        self.paged_reads = False
        """The attention reads the step's page tables (FlashInfer, Triton): always build them.
        Off (torch-native), an identity-layout step with every live layer-page resident is read
        in place and builds none (:meth:`_begin_in_place`)."""
        self.overflow = False
        """This step could not stage its batch inside the budget and runs the at-rest path."""
        self.overflow_steps = 0
        """Steps that overflowed."""
        self.step_loc: torch.Tensor | None = None
        """``new_slots`` of the current forward (the object SGLang passes to every layer's write)."""
        self._step_index: torch.Tensor | None = None
        """:attr:`step_loc` as an int64 index on the store's device (made at the step's first write)."""
        self._paged_last: tuple[list, list[int], list[np.ndarray]] | None = None
        """(rids, seq_lens, page lists) of the last step (paged steady decode starts from it)."""
        self.paged_decode_steps = 0
        """Steps the paged steady-decode path prepared."""
        self._paged_tables: PagedStepTables | None = None
        """The last step's tables when :class:`PagedStepTables` built them (may advance: :meth:`PagedDecodeStep.advance`)."""
        self.defer_tables = False
        """A CUDA graph may take the next decode steps: their tables' device half waits (``DeferredDevice``)."""
        self.advanced_decode_steps = self.opened_advances = self.staged_advances = self.resident_builds = 0
        """Paged steady-decode steps whose tables were advanced (no build): resident opening no page,
        resident opening pages, staging (a placed batch); and steps built knowing the batch
        resident (:meth:`PagedDecodeStep.still_resident`)."""
        self.paged_decode = PagedDecodeStep(self)
        """The paged layout's steady decode boundary (:meth:`prepare_decode_step` there)."""
        self.identity_decode = IdentityDecodeStep(self)
        """The identity layout's steady step read through page tables (``paged_reads``)."""
        self.continuity = DecodeContinuity(self.residency, config.page_size)
        """What each request held at its last boundary: decode steps continue it (:meth:`prepare_decode_step`)."""
        self.decode_delta: ResidencyDelta | None = None
        """The last decode step's reconciliation (a journalled step has none, unless a release or
        free since the last boundary made it reconcile first)."""

    # ----- boundary changes ---------------------------------------------------------

    def update_residency(self, wants: Mapping[str, RequestResidency]) -> ResidencyDelta:
        """Install the plan's wants and move data now (call at a step boundary only). Without a
        host tier every want is kept on the device (:meth:`RequestResidency.on_device`): a plan's
        offload, or an uncached prefix, would free no page another could use."""
        if not self.store.host_tier:
            wants = {rid: want.on_device() for rid, want in wants.items()}
        self.pipeline.end_step()  # a forward that stopped early writes its parked tokens back first
        self.residency.update_residency(wants)
        self._eager_writeback()
        return self._reconcile()

    def release_request(self, rid: str) -> None:
        """The request finished or was aborted: drop its wants (tree-owned pages stay)."""
        self._paged_last = self._paged_tables = None
        self.continuity.forget(rid)
        self.residency.release_request(rid)

    def holds_wants(self, rid: str) -> bool:
        """Whether the residency holds installed wants of ``rid`` (:meth:`SlotResidency.holds_wants`)."""
        return self.residency.holds_wants(rid)

    def page_freed(self, pages: Sequence[int]) -> None:
        """SGLang's allocator took ``pages`` back. A running request's row may have been rewritten
        (a prefix the tree already held replaces the request's copy): the next step reads every
        request's slots again (:class:`PagedDecodeStep` does not apply)."""
        self._paged_last = self._paged_tables = None
        self.residency.page_freed(pages)

    def free_device_pages(self) -> int:
        """Device layer-pages free now, counting prefix-cache pages given up on demand; journalled
        decode pages count as placed without applying the journal (the step report reads this)."""
        res = self.residency
        taken = None if res.ended.pending else res.journal.pending_layer_pages()  # frees: apply
        if taken is None:
            res.settle()
        return self.store.allocator.free_count - (taken or 0) + res.reclaimable_pages

    def stats(self) -> ResidencyStats:
        """Device/host occupancy, host fraction of live KV, bytes moved, steps staged / overflowed."""
        times = self.transfer_times
        return dataclasses.replace(
            self.residency.stats(),
            staged_steps_total=self.pipeline.steps,
            overflow_steps_total=self.overflow_steps,
            fetched_layer_pages_total=self.pipeline.fetched_layer_pages,
            h2d_seconds_total=times.h2d_s,
            d2h_seconds_total=times.d2h_s,
            stall_seconds_total=times.stall_s,
            advanced_decode_steps_total=self.advanced_decode_steps,
            opened_advances_total=self.opened_advances,
            resident_builds_total=self.resident_builds, opened_one_pass_total=self.paged_decode.openings.taken,
            staged_advances_total=self.staged_advances,
            decode_turnovers_total=self.continuity.turnovers,
            slot_handoffs_total=self.continuity.slots.handoffs, slot_readbacks_total=self.continuity.slots.readbacks,
        )

    @property
    def transfer_times(self) -> TransferTimes:
        """Copy and stall seconds so far, one account for CPU and CUDA (the engine's clock's)."""
        return self.store.engine.clock.times

    @property
    def link_account(self) -> TransferTimes | None:
        """The copies' account when they run beside the compute (CUDA): what the worker samples the
        link's bandwidth from. None on the synchronous CPU engine, whose copies run inside the
        layers (their time is in the layer samples: a bandwidth sample would count it twice)."""
        engine = self.store.engine
        return engine.clock.times if engine.copies_beside_compute else None

    def close_transfer_step(self) -> list[float]:
        """End of a forward (the metrics call it once per step): books the completed timing
        events without blocking, closes the step (the clock decides whether the next is timed);
        returns the stall seconds of each step now completely measured (this one, sometimes
        earlier ones: :class:`TransferTimes`)."""
        clock = self.store.engine.clock
        clock.harvest()
        closed = clock.times.close_step()
        clock.opened()
        return closed

    # ----- the step boundary ----------------------------------------------------------

    def prepare_step(
        self,
        requests: Sequence[tuple[str | None, torch.Tensor]],
        new_slots: torch.Tensor | None,
        new_counts: Sequence[int] | None = None,
        recompute: np.ndarray | None = None,
        recompute_ids: list | None = None,
    ) -> ResidencyDelta:
        """Boundary before a forward: ``requests`` = (rid, CPU slots of its first seq_len tokens);
        ``new_slots`` the slots the forward writes, ``new_counts[i]`` of them request ``i``'s last
        positions (default: one each -- a decode step -- or all of them for a single request).
        Positions ``[i * page_size, (i + 1) * page_size)`` of a request share one page.
        ``recompute[i] = (u, k)`` (decode steps): request ``i``'s first ``u`` pages are recomputed
        by the forward at layers ``< k`` (``tables.recompute``; ``docs/recompute.md``);
        ``recompute_ids[i]`` its token ids, uploaded with the tables (``tables.recompute.input_ids``)."""
        rids, lens = [rid for rid, _ in requests], [int(slots.numel()) for _, slots in requests]
        n_new = 0 if new_slots is None else int(new_slots.numel())
        counts = new_token_counts(rids, lens, n_new, new_counts)  # refused before anything changes
        ps = self.page_size
        page_lists, pages_of = [], []
        for _, slots in requests:
            # kept by residency, so never a view of req_to_token
            fresh = slots.device.type == "cpu" and slots.dtype == torch.int64 and slots._base is None
            pages = slots if fresh else slots.to("cpu", torch.int64, copy=True)
            pages_of.append(pages[::ps] // ps if ps > 1 else pages)  # position order; one slot per page
        if pages_of:  # before any request is recorded
            check_page_ids(np.concatenate([p.numpy() for p in pages_of]), self.store.map_np.shape[1], "a request's slots")
        self._boundary(new_slots)
        for index, ((rid, _), pages) in enumerate(zip(requests, pages_of, strict=True)):
            if rid is None:
                self.residency.observe(f"__anonymous_{index}", pages, anonymous=True)
            else:
                self.residency.observe(rid, pages)
            page_lists.append(pages.numpy())
        self.continuity.record(rids, lens, page_lists)
        known = all(rid is not None for rid in rids) and recompute is None
        self._paged_last = (rids, lens, page_lists) if known else None
        delta = self._reconcile()
        new_np = None  # rows come from positions; on CPU the slots are also checked against them
        if n_new and new_slots is not None and new_slots.device.type == "cpu":
            new_np = new_slots.numpy().astype(np.int64, copy=False)
        batch = {rid for rid, _ in requests if rid is not None}
        self._begin(page_lists, np.asarray(lens, dtype=np.int64), counts, new_np, batch, recompute, recompute_ids)
        return delta

    def _boundary(self, new_slots: torch.Tensor | None) -> None:
        """What every step boundary does first: apply journalled bookkeeping, harvest timing
        events (the clock decides this step's timing here unless the metrics' close did:
        :class:`~sglang_ext.dataplane.event_clock.EventClock`), end the last forward, eager
        write-back under pressure."""
        self.residency.settle()
        self.store.engine.clock.boundary()  # earlier steps' timing events (non-blocking)
        self.pipeline.end_step()
        self.step_loc, self._step_index = new_slots, None
        self.residency.drop_anonymous()
        self._eager_writeback()

    def _begin(self, page_lists: list[np.ndarray], lens: np.ndarray, counts: np.ndarray,
               new_np: np.ndarray | None, batch: set[str], recompute: np.ndarray | None = None,
               recompute_ids: list | None = None, *, resident: bool = False) -> None:
        """Build the step's tables (making staging room if needed) and start the pipeline, or
        mark the step as overflowing (module docstring). ``resident``: the caller knows no page
        of the batch is host-only at any layer (:meth:`PagedDecodeStep.still_resident`; the first build only)."""
        self.overflow = False
        self._paged_tables = None  # set again by a build that installs (a failed one leaves none)
        if recompute is None and self._begin_in_place(page_lists, lens, counts):
            return
        paged = recompute is None and self.store.mirror is not None  # the paged layout's usual step
        for attempt in range(self.layers + 2):
            tables: StepTables = self.room.building(lambda take: PagedStepTables(  # noqa: B023 - called at once
                self.store, page_lists, lens, counts, new_np, take, token_tables=self.token_tables,
                defer=self.defer_tables, resident=resident and attempt == 0) if paged else StepTables(  # noqa: B023
                self.store, page_lists, lens, counts, new_np, take, token_tables=self.token_tables,
                recompute=recompute, recompute_ids=recompute_ids))
            if tables.reserved:
                self._paged_tables = tables if paged else None  # type: ignore[assignment]
                self.store.mark_dirty(tables.dirty_ids)
                self.store.has_kv_np[tables.new_pages] = True
                self.store.staging_pages = int(tables.staging_ids.size)
                self.tables = tables
                self.pipeline.begin_step(tables)
                return
            if not self.room.make_room_for(batch, partial(staging_demand, self.store, page_lists) if paged else None):
                break
        self.overflow = True
        self.overflow_steps += 1
        self.store.engine.end_compute()  # no pipeline this step: the engine reads the stream again
        if self.overflow_steps & (self.overflow_steps - 1) == 0:  # 1, 2, 4, 8, ...
            log.warning(
                "layered_kv_staging_overflow",
                staging_pages_needed=self.room.wanted,
                device_pages=self.store.allocator.capacity,
                overflow_steps=self.overflow_steps,
                hint="the running batch's staging slots exceed the device budget; the control plane "
                "pauses requests to prevent this (raise --kv-gpu-budget-tokens for headroom)",
            )

    def _begin_in_place(self, page_lists: list[np.ndarray], lens: np.ndarray, counts: np.ndarray) -> bool:
        """Identity layout, every live layer-page resident: nothing is staged or fetched and writes
        go in place by slot, so only the pages receiving new tokens are marked (O(new tokens)).
        Attention reading in place needs no tables; the paged-read backends get the identity
        row and CSR (:meth:`IdentityDecodeStep.tables`: one upload of the batch's pages, one
        device add), not :class:`StepTables`' ``L x`` host build. False (nothing done) otherwise."""
        if not self.store.identity or not self.residency.all_live_resident():
            return False
        ps = self.page_size
        new = [pages[(n - e) // ps: (n - 1) // ps + 1]
               for pages, n, e in zip(page_lists, lens.tolist(), counts.tolist(), strict=True) if e > 0]
        if new:
            fresh = distinct_sorted(np.concatenate(new))
            self.store.mark_dirty(self.store.identity_ids(fresh).reshape(-1))
            self.store.has_kv_np[fresh] = True
        self.store.staging_pages = 0
        if self.paged_reads:
            self.tables = self.identity_decode.tables(page_lists, lens)
            self.pipeline.begin_step(self.tables)  # waits for the boundary's copies; idle
            return True
        self.store.engine.wait_fence()  # the boundary's copies (if any) before the layers read
        self.store.engine.end_compute()  # no pipeline: later launches read the current stream
        return True

    def _release_staging(self, tables: StepTables) -> None:
        self.room.give_back(tables.staging_ids)
        self.store.staging_pages = 0
        if self.tables is tables:
            self.tables = None

    def prepare_decode_step(self, rids: Sequence[str], seq_lens: Sequence[int] | np.ndarray,
                            new_slots: torch.Tensor) -> bool:
        """:meth:`prepare_step` for a decode step that continues what each of its requests held
        (:class:`DecodeContinuity`: ``seq_lens[i] - 1`` tokens at its last boundary, the new
        slot ``new_slots[i]`` continuing its pages; the batch itself may differ from the last
        step's), or False (nothing done, but the reconciliation a release or free since made due).
        In the identity layout with every live layer-page resident the step's only change is the
        new pages of ``new_slots``, which the forward writes and reads in place; their bookkeeping
        (placed at every layer, holding KV, dirty, joined to their requests) is journalled and
        applied when anything reads residency
        (:class:`~sglang_ext.dataplane.decode_journal.DecodeJournal`). Nothing is staged. In the
        paged layout (offloading) the step's page lists come from the same record and it stages
        as usual (:class:`PagedDecodeStep`)."""
        if self.store.mirror is not None:
            return self.paged_decode.prepare(rids, seq_lens, new_slots)
        if ((new_slots.device.type != "cpu" and not self.paged_reads) or new_slots.numel() != len(rids)
                or self.residency.has_anonymous):
            return False
        # plain ints (a NumPy call costs 5-10 us between forwards): the allocation hook's list, or
        # on a GPU read back here, the boundary's one sync (HostSlots)
        slots = self.continuity.slots.read(rids, seq_lens, new_slots)
        # the decode backends read page tables: each request's last pages, grown
        cont = self.continuity.continued(rids, seq_lens, slots, lists=self.paged_reads)
        if cont is None:
            return False
        opens, lists = cont
        self.decode_delta = None
        res = self.residency
        if not res.all_live_resident():
            if res.counts.paused_requests or res.counts.partial_requests:
                return False  # offloaded requests: the journal refuses whatever a reconciliation does
            self.pipeline.end_step()  # a release or free since (a batch change): the general path's
            self.decode_delta = self._reconcile()  # reconciliation, then the journal may apply
        ps = self.page_size
        if ps == 1:
            owners, pages, written = None, slots, None
        else:
            owners, pages, written = opens, [slots[i] // ps for i in opens], [s // ps for s in slots]
        if not self.residency.journal.record(rids, owners, pages, written):
            return False
        self.continuity.advanced(rids, seq_lens, slots, lists)
        engine = self.store.engine
        engine.clock.boundary()
        self.pipeline.end_step()
        if engine.fence_pending:  # copies since the last step (a plan's moves): the layers follow them
            engine.wait_fence()
            engine.end_compute()
        self.overflow = False
        self.step_loc, self._step_index = new_slots, None
        if lists is not None:
            self.identity_decode.begin(lists, seq_lens)
        return True

    def settle(self) -> None:
        """Apply the journalled decode steps' bookkeeping now (every reader of residency through
        this object does it first; tests and tools reading ``store`` / ``residency`` arrays
        directly call it)."""
        self.residency.settle()

    def _eager_writeback(self) -> None:
        """Write dirty device layer-pages back to host at the boundary, under memory pressure only
        (SuperInfer §4.3.2, eager block rotation: a later offload then only drops the device copy).
        With at least :data:`WRITEBACK_FREE_SHARE` free no offload is near: the copy is deferred
        (an offload writes back any dirty page itself). The identity layout never makes room."""
        allocator = self.store.allocator
        if not self.store.identity and allocator.free_count < WRITEBACK_FREE_SHARE * allocator.capacity:
            self.store.sync_dirty()

    def _reconcile(self) -> ResidencyDelta:
        try:
            return self.residency.reconcile()
        finally:  # a pass whose loads raised still reports the drops it made (SlotResidency._load)
            if self._on_moves is not None:
                self._on_moves(self.residency.last_moves)

    # ----- per layer -------------------------------------------------------------------

    @property
    def layers_idle(self) -> bool:
        """This step's layers need no :meth:`enter_layer` and, but for the last layer's (which
        ends the step), no :meth:`exit_layer`: nothing is fetched, written back or parked
        (:attr:`LayerPipeline.idle`), or no pipeline runs (the identity layout's in-place step);
        an overflow step (served at rest) is never idle. The served adapter skips those calls
        (``LayeredTorchNativeAttnBackend._begin_layer``): an all-resident paged step then costs
        no kvplane call per layer but its KV write."""
        if self.overflow:
            return False
        return self.pipeline.tables is None or self.pipeline.idle

    def enter_layer(self, layer: int) -> None:
        """Before layer ``layer``'s KV write and attention: wait (on the stream) for its fetches."""
        self.pipeline.begin_layer(layer)

    def exit_layer(self, layer: int) -> None:
        """After layer ``layer``'s attention: write back its staged new tokens, launch the fetches
        its staging slots released."""
        self.pipeline.end_layer(layer)

    def rebind_step_loc(self, new_slots: torch.Tensor) -> None:
        """The step's new slots arrive as another tensor of the same values (SGLang's eager copy of
        a batch whose boundary already ran): :meth:`write` recognises them by identity."""
        self.step_loc, self._step_index = new_slots, None

    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """New K/V ``[n, H, D]`` of ``loc`` at ``layer``. The step's own slots go to their device rows
        (identity: in place by slot id; otherwise the step's row table) -- no host work; anything
        else (or an overflow step) is written at rest."""
        if loc is not self.step_loc or self.overflow:
            self.residency.settle()
            self.store.write_at_rest(layer, loc, k, v)
            self._mark_slots_written(loc)
        elif self.store.identity:
            index = self._step_index
            if index is None:  # once per step: the same ``loc`` comes back at every layer
                index = self._step_index = loc.to(self.store.device, torch.int64)
            k_layer, v_layer = self.store.layer_in_place(layer)
            self.store.write_into(k_layer, v_layer, index, k, v)
        else:
            tables = self.tables
            rows = tables.rows[layer]  # type: ignore[union-attr]
            self.store.write_rows(rows, k, v)
            parked = tables.token_writeback  # type: ignore[union-attr]
            if parked is not None:  # a decode step's new tokens of host-only layer-pages
                parked.park(layer, k, v)

    def write_recompute(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """Recomputed prefix K/V at ``layer`` (``[>= active, H, D]``, in the step's recompute
        token order, :class:`~sglang_ext.dataplane.recompute_rows.RecomputeRows`): the first
        ``active[layer]`` rows go to their transient (or identity) device rows, before the layer's
        attention reads them. Nothing is marked dirty or written back: the host copy is the
        original. Returns the rows written (0 without recompute or on an overflow step, whose
        at-rest read takes the prefix from host memory)."""
        rec = None if self.tables is None or self.overflow else self.tables.recompute
        if rec is None or rec.rows is None:
            return 0
        active = rec.active[layer]
        if active:
            rows = rec.rows[layer, :active]
            self.store.write_rows(rows, k[:active], v[:active])
        return active

    def token_rows(self, layer: int) -> torch.Tensor:
        """``[B, W]`` rows of :meth:`device_kv` holding every batch token at ``layer`` this step
        (non-identity layout; three device ops from the step's tables)."""
        if self.tables is None:
            raise RuntimeError("token_rows outside a staged step")
        return self.tables.token_rows(layer, self.page_size)

    def layer_in_place(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Identity layout: K and V of ``layer`` indexed by slot id (views)."""
        return self.store.layer_in_place(layer)

    def device_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The device page pool as flat K and V rows (views, no copy)."""
        return self.store.device_views()

    def move_kv(self, tgt: torch.Tensor, src: torch.Tensor) -> None:
        """Copy the K/V of slots ``src`` to slots ``tgt`` at every layer, at rest (waits for
        copies in flight); the target pages are marked written."""
        self.residency.settle()
        for layer in range(self.layers):
            k, v = self.store.read_kv(layer, src)
            self.store.write_at_rest(layer, tgt, k.clone(), v.clone())
        self._mark_slots_written(tgt)

    def _mark_slots_written(self, slots: torch.Tensor) -> None:
        """The pages of ``slots`` got KV written at rest."""
        self.residency.mark_written(torch.unique(slots.to("cpu", torch.int64) // self.page_size))

    def read_kv(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``slots`` at ``layer``, at rest (waits for copies in flight)."""
        self.residency.settle()
        return self.store.read_kv(layer, slots)
