"""Advanced paged steps (``PagedDecodeStep.advance`` / ``PagedStepTables.advanced`` and
``.advanced_opening``): a steady decode step in the paged layout whose batch is still resident and
whose map did not change since the last step's tables, but for the pages its new tokens open, runs
on those tables advanced by one token -- no build (no page opened: no upload either; pages
opened: one insert, one upload). Every layer's reads go through the page tables and CSR as a
paged kernel reads them (CoreDriver ``paged_reads``) and must equal the shadow KV; the advanced
tables must equal a fresh build; the steps that must build (the map moved, staging, token tables)
do. Controls: an advance that forgets the rows' or the lengths' step, an opening advance that
misplaces the opened page, keeps its last-page length or its rows, and one that ignores a moved
map, are caught."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from sglang_ext.dataplane.block_allocator import BlockAllocator
from sglang_ext.dataplane.layered_kv_core import LayeredKVCore
from sglang_ext.dataplane.map_mirror import MapMirror
from sglang_ext.dataplane.opened_pages import OpenedPages
from sglang_ext.dataplane.paged_decode_step import PagedDecodeStep
from sglang_ext.dataplane.paged_step_tables import PagedStepTables
from sglang_ext.dataplane.staging_room import StagingRoom
from tests.dataplane.core_driver import CoreDriver, make_core

PS, PAGES = 4, 24
"""Page size 4: three of every four decode steps open no page."""


def _driver(*, paged_reads: bool = True, seed: int = 3) -> CoreDriver:
    core = make_core(PAGES + 10, page_size=PS, pages=PAGES)  # paged: 34 device pages < 3 x 24
    assert not core.store.identity
    return CoreDriver(core, seed=seed, fast_decode=True, paged_reads=paged_reads)


def _decode(d: CoreDriver, steps: int, rids: tuple[str, ...] = ("a", "b")) -> None:
    for _ in range(steps):
        assert d.step([(rid, 1) for rid in rids])


def test_resident_steady_steps_advance_and_read_exactly():
    d = _driver()
    d.add("a")
    d.add("b")
    d.step([("a", 5), ("b", 3)])
    _decode(d, 12)
    core = d.core
    # decode lens a 6..17, b 4..15: a opens a page at 9, 13, 17 (steps 4, 8, 12), b at 5, 9, 13
    # (steps 2, 6, 10); the first decode step builds (the prefill wrote 5 + 3 tokens); the rest advance
    assert core.paged_decode_steps == 12 and core.advanced_decode_steps == 12 - 1 - 6
    assert core.opened_advances == 6 and core.resident_builds == 1  # opening steps advance; the first builds
    d.check_at_rest()


@pytest.mark.parametrize("separate_sync", [False, True])
def test_an_opening_advance_makes_one_upload(monkeypatch, separate_sync):
    """A resident step that opens pages uploads its tables and the mirror's new columns in ONE
    staged copy (the mirror's sync and the splice read the columns there), where a separate
    mirror sync made two. The mirror runs its device path on the CPU (``staged``). Control
    (``separate_sync``): the sync made on its own, as before -- two uploads a step."""
    from sglang_ext.dataplane.pinned_upload_ring import PinnedUploadRing

    d = _driver()
    d.core.store.mirror.staged = True
    if separate_sync:
        monkeypatch.setattr(MapMirror, "sync_within", lambda self, pages, known=None: self.sync())
    uploads: list[int] = []
    real = PinnedUploadRing.upload
    monkeypatch.setattr(PinnedUploadRing, "upload", lambda self, values: (uploads.append(1), real(self, values))[1])
    opening = PagedStepTables.advanced_opening
    per_step: list[int] = []

    def counted(self, *args):  # noqa: ANN001, ANN002, ANN202
        before = len(uploads)
        nxt = opening(self, *args)
        per_step.append(len(uploads) - before)
        return nxt

    monkeypatch.setattr(PagedStepTables, "advanced_opening", counted)
    d.add("a")
    d.add("b")
    d.step([("a", 5), ("b", 3)])
    _decode(d, 12)
    assert d.core.opened_advances == 6 and len(per_step) == 6
    assert per_step == [2 if separate_sync else 1] * 6, per_step
    d.check_at_rest()  # and every layer's reads were exact (the driver)


def test_an_opening_advance_that_fails_leaves_the_opened_columns_due(monkeypatch):
    """The opening advance takes the opened pages' columns off the mirror's log and uploads them
    with its tables; when that upload raises, the columns are logged again, so the next sync
    brings the device copy back to the map (control: right after the failure it is stale)."""
    d = _driver()
    mirror = d.core.store.mirror
    d.add("a")
    d.add("b")
    d.step([("a", 5), ("b", 3)])
    _decode(d, 1)  # lens a 6, b 4: built; the next step opens b's page 2 (len 5) and advances
    failing = {"armed": True}
    real = PagedStepTables._upload

    def upload(self, *args):  # noqa: ANN001, ANN002, ANN202
        if failing["armed"]:
            failing["armed"] = False
            raise RuntimeError("simulated upload failure")
        return real(self, *args)

    monkeypatch.setattr(PagedStepTables, "_upload", upload)
    with pytest.raises(RuntimeError, match="simulated upload failure"):
        d.step([("a", 1), ("b", 1)])
    assert not failing["armed"] and mirror.pending  # the failure came from the opening advance
    current = torch.from_numpy(d.core.store.map_np.astype(np.int32))
    assert not torch.equal(mirror.dev.to(torch.int32), current)  # control: the opened column is stale
    mirror.sync()
    assert torch.equal(mirror.dev.to(torch.int32), current)


def _fresh_build(core: LayeredKVCore, got: PagedStepTables) -> PagedStepTables:
    """The step's tables built from scratch, staging (if any) in the same device pages as ``got``."""
    _, lens, page_lists = core._paged_last  # type: ignore[misc]
    staged = got._stage_np[got._stage_np >= 0] if got.staging_ids.size else np.zeros(0, dtype=np.int64)

    def stage(n: int) -> np.ndarray:
        assert n == staged.size, f"a fresh build staged {n} pages, the advance {staged.size}"
        return staged

    return PagedStepTables(core.store, page_lists, np.asarray(lens, dtype=np.int64),
                           np.ones(len(lens), dtype=np.int64), core.step_loc.numpy().astype(np.int64),
                           stage, token_tables=False)


def _assert_equal_tables(got: PagedStepTables, ref: PagedStepTables, uploaded: bool) -> None:
    """``uploaded``: ``got`` made its own upload (not a no-open resident advance, which steps the
    last upload's rows and lengths on the device): its int64 part (rows, write-back segments)
    equals the build's; a staged advance's int32 part (pages, staging, requests, fetch request
    ids, CSR) too, word for word (a resident opening advance uploads only the opened pages)."""
    staged = bool(got.staging_ids.size)
    for name in ("tab", "rows", "kv_indptr", "kv_lens", "last_page_len", *(("i32",) if staged else ())):
        assert np.array_equal(getattr(got, name).cpu().numpy(), getattr(ref, name).cpu().numpy()), name
    if uploaded:
        assert np.array_equal(got._int64_np, ref._int64_np), "rows and write-back segments"
    assert np.array_equal(got.dirty_ids, ref.dirty_ids) and np.array_equal(got.new_pages, ref.new_pages)
    assert got.fetches == ref.fetches and got.writebacks == ref.writebacks
    assert got.token_writeback == ref.token_writeback  # slots, launch, pairs (not the buffer)
    assert (got.fetch_layer_pages, got.writeback_layer_pages) == (ref.fetch_layer_pages, ref.writeback_layer_pages)
    assert np.array_equal(np.sort(got.staging_ids), np.sort(ref.staging_ids))
    if staged and not got._shared_staging:  # the next advance replaces taken staging pages at these columns
        assert np.array_equal(got._stage_np[got._stage_pos], got.staging_ids), "staging ids' columns"


def _comparing(monkeypatch: pytest.MonkeyPatch, defer: bool = False) -> list[tuple[bool, bool]]:
    """Every advance is compared with a fresh build; returns (opened, staged) per advance.
    ``defer``: the advances leave their device half to the comparison's first read (``DeferredDevice``)."""
    checked: list[tuple[bool, bool]] = []
    original = PagedDecodeStep.advance

    def advance_and_compare(step: PagedDecodeStep, opens: np.ndarray, *args: object) -> bool:
        step.core.defer_tables = step.core.pipeline.defer_start = defer  # as a graph that may take the step sets them
        if not original(step, opens, *args):
            return False
        core = step.core
        got = core.tables
        assert isinstance(got, PagedStepTables) and core._paged_last is not None
        assert got.pending == defer  # deferred: nothing read its device half yet
        assert ("_packed" in vars(got)) != defer  # nor packed its upload (StepTables._pack lazy): the comparison does
        ref, uploaded = _fresh_build(core, got), bool(opens.size or got.staging_ids.size)
        # the host half a replayed step reads (GraphStepBuffers, GraphStaging), still lazy when deferred
        assert all(np.array_equal(a, r) for a, r in zip(got._csr_np, ref._csr_np, strict=True)), "host CSR"
        if got.token_writeback is not None:  # a graph's park rows: read from the int64 part, nothing joined
            launch = got.token_writeback.launch
            for a, r in zip(got.launch_host_indices(launch), ref.launch_host_indices(launch), strict=True):
                assert np.array_equal(a, r), "parked tokens' write-back indices"
            assert ("_int64_np" in vars(got)) != defer
        assert not uploaded or np.array_equal(got._int64_np, ref._int64_np), "rows and write-back segments"
        assert ("_packed" in vars(got)) != defer  # the int64 parts alone were joined
        _assert_equal_tables(got, ref, uploaded)
        checked.append((bool(opens.size), bool(got.staging_ids.size)))
        return True

    monkeypatch.setattr(PagedDecodeStep, "advance", advance_and_compare)
    return checked


def _without_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """Staging given back goes on the free stack like any page (as in a pool with nothing free
    under it): the boundary's placement of opened pages then takes some of it."""
    free = BlockAllocator.free
    monkeypatch.setattr(BlockAllocator, "free", lambda a, ids, hold=False: free(a, ids))


def _retakes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(staging pages retaken, of how many) per staged advance."""
    kept: list[tuple[int, int]] = []
    renew = StagingRoom.renew

    def counted(room: StagingRoom, ids: np.ndarray, extra: int) -> tuple[int, np.ndarray | None]:
        got = renew(room, ids, extra)
        kept.append((got[0], int(ids.size)))
        return got

    monkeypatch.setattr(StagingRoom, "renew", counted)
    return kept


@pytest.mark.parametrize("defer", [False, True], ids=["at-once", "deferred"])
def test_advanced_tables_equal_a_fresh_build(monkeypatch, defer):
    checked = _comparing(monkeypatch, defer)
    d = _driver(seed=4)
    d.add("a")
    d.add("b")
    d.step([("a", 6), ("b", 2)])
    _decode(d, 10)
    d.add("c", share_from="a", share_pages=1)  # a prefix hit joins: the batch changes, then settles
    d.step([("c", 3)])
    _decode(d, 9, ("a", "b", "c"))
    assert len(checked) >= 8 and sum(o for o, _ in checked) >= 3, checked  # some opened pages


@pytest.mark.parametrize("held", [True, False], ids=["held", "taken"])
@pytest.mark.parametrize("defer", [False, True], ids=["at-once", "deferred"])
def test_staged_advances_equal_a_fresh_build_and_read_exactly(monkeypatch, defer, held):
    """A placed batch (layer 1 of ``a`` and layers 1-2 of ``b`` on the host): its steady steps
    advance the last tables with the same staging pages -- no page opened, or pages opened that
    stage and fetch at their requests' host layers -- and equal a fresh build staged in the same
    pages (fetch sizes, write-backs, rows, the int32 upload); every layer's reads are exact.
    Deferred: each advance's device half made at the comparison's first read. ``held``: the
    staging given back is held for the next step (``BlockAllocator.free(hold=True)``), so the
    boundary's placements take other pages and every advance retakes all of it; ``taken``: as
    in a pool with nothing free under it, the placements take some of it, replaced."""
    checked = _comparing(monkeypatch, defer)
    kept = _retakes(monkeypatch)
    if not held:
        _without_hold(monkeypatch)
    d = _driver(seed=8)
    d.add("a")
    d.add("b")
    d.step([("a", 6), ("b", 3)])  # staggered: a and b open pages on different steps
    _decode(d, 2)
    d.want("a", [True, False, True])
    d.want("b", [True, False, False])
    _decode(d, 14)
    core = d.core
    staged = [o for o, s in checked if s]
    assert core.staged_advances == len(staged) >= 10 and sum(staged) >= 5, checked
    assert core.stats().staged_advances_total == core.staged_advances
    if held:  # every advance reserved the last step's staging pages again, all of them
        assert kept and all(m == n for m, n in kept), kept
    else:  # the opened pages' placement took some of the last step's staging pages: replaced, still equal
        assert any(0 < m < n for m, n in kept) and any(m == n for m, n in kept), kept
    d.check_staging()
    d.check_at_rest()


@pytest.mark.parametrize("seed", range(4))
def test_taken_staging_is_replaced_in_its_own_columns_behind_an_opening_request(monkeypatch, seed):
    """Three staged requests in a pool with nothing free under the staging (the boundary's
    placements take some of it): when a request opens a page, the staged columns after it shift
    by one -- the first column of the next request included (it sits at the insertion point) --
    and a later advance replaces a taken staging page in the column that held it. Every advance
    equals a fresh build, the staging ids' columns are where the tables say, and every layer's
    reads are exact. Found by a mutation audit (session 87): with the shift's ``searchsorted``
    taking ``side="left"``, the two-request test above passed (it fails now, on the staging
    columns' check in ``_assert_equal_tables``), while here a taken page's
    replacement lands in the opened column and the real one keeps a page a placed layer-page now
    owns (its fetch overwrites that KV); 4 of these 4 seeds fail then."""
    checked = _comparing(monkeypatch)
    kept = _retakes(monkeypatch)
    _without_hold(monkeypatch)
    d = _driver(seed=seed)
    rids = ("a", "b", "c")
    for r in rids:
        d.add(r)
    d.step([(r, 2) for r in rids])
    _decode(d, 1, rids)
    for r, want in zip(rids, ([False, True, True], [True, False, False], [True, False, False]), strict=True):
        d.want(r, want)
    _decode(d, 16, rids)
    assert sum(s for _, s in checked) >= 8 and any(0 < m < n for m, n in kept), (checked, kept)
    d.check_staging()
    d.check_at_rest()


def test_a_moved_map_or_token_tables_build_the_step(monkeypatch):
    checked, kept = _comparing(monkeypatch), _retakes(monkeypatch)
    _without_hold(monkeypatch)  # the placement may take every staging page (below)
    d = _driver(seed=5)
    d.add("a")
    d.add("b")
    d.step([("a", 6), ("b", 2)])
    _decode(d, 3)
    core = d.core
    before, staged_before = core.advanced_decode_steps, core.staged_advances
    assert before > 0
    d.want("a", [True, False, True])  # layer 1 of a to host: the move builds one step, then they advance
    _decode(d, 6)
    assert core.advanced_decode_steps == before and core.staged_advances == staged_before + 5
    d.want("a", [True, True, True])  # back on the device: the move builds one step, then advance
    _decode(d, 6)
    assert core.advanced_decode_steps > before and core.staged_advances == staged_before + 5
    assert sum(staged for _, staged in checked) == 5
    assert any(m == 0 for m, _ in kept), kept  # the opened pages' placement took every staging page
    d.check_at_rest()
    e = _driver(paged_reads=False, seed=5)  # torch-native: token tables every step
    e.add("a")
    e.step([("a", 6)])
    _decode(e, 6, ("a",))
    assert e.core.paged_decode_steps == 6 and e.core.advanced_decode_steps == 0 and e.core.staged_advances == 0


def _run_until_advanced(d: CoreDriver) -> None:
    d.add("a")
    d.add("b")
    d.step([("a", 5), ("b", 3)])
    _decode(d, 12)


@pytest.mark.parametrize("forget", ["rows", "lens"])
def test_an_advance_that_forgets_the_token_step_is_caught(monkeypatch, forget):
    original = PagedStepTables.advanced

    def stale(self: PagedStepTables, *args: object) -> PagedStepTables | None:
        nxt = original(self, *args)
        if nxt is not None and forget == "rows":
            nxt.rows = self.rows  # the new tokens overwrite the last step's
        elif nxt is not None:
            nxt.kv_lens, nxt.last_page_len = self.kv_lens, self.last_page_len
        return nxt

    monkeypatch.setattr(PagedStepTables, "advanced", stale)
    with pytest.raises(AssertionError):
        _run_until_advanced(_driver())


def test_an_advance_that_misses_a_moved_map_is_caught(monkeypatch):
    """Control for the mirror check: with ``pending`` hidden, the step after a placement change
    advances over the old tables and its checks fail."""
    d = _driver(seed=6)
    d.add("a")
    d.add("b")
    d.step([("a", 6), ("b", 2)])
    _decode(d, 1)  # lens 7 / 3: the next step opens no page
    monkeypatch.setattr(MapMirror, "pending", property(lambda self: False))
    d.want("a", [True, False, True])
    with pytest.raises(AssertionError):
        _decode(d, 1)


@pytest.mark.parametrize("mistake", ["page_at_end", "last_len_kept", "stale_rows"])
def test_an_opening_advance_that_misplaces_the_page_is_caught(monkeypatch, mistake):
    """Controls for :meth:`PagedStepTables.advanced_opening`: the opened page inserted after the
    batch's last page instead of after its request's, the opened rows' ``last_page_len`` kept
    counting instead of restarting at 1, or the new tokens' rows left at the last page's next
    offset: each is caught by the reads (and none of them trips before an opening advance ran)."""
    original = PagedStepTables.advanced_opening
    ran = []

    def wrong(self: PagedStepTables, opens: np.ndarray, opened: np.ndarray, seq_lens: np.ndarray,  # noqa: ANN202
              *args: object):
        nxt = original(self, opens, opened, seq_lens, *args)
        if nxt is None:
            return None
        ran.append(1)
        b = nxt.batch
        if mistake == "page_at_end":  # the page tables' columns: opened pages all at the end
            keep = np.setdiff1d(np.arange(nxt.tab.shape[1]), nxt._starts_np[opens] + nxt._counts_np[opens] - 1)
            new = nxt._starts_np[opens] + nxt._counts_np[opens] - 1
            nxt.tab = torch.cat([nxt.tab[:, torch.from_numpy(keep)], nxt.tab[:, torch.from_numpy(new)]], dim=1)
        elif mistake == "last_len_kept":
            nxt._lens_pair[b + torch.from_numpy(opens)] = self.last_page_len[torch.from_numpy(opens)] + 1
        else:
            nxt.rows[:, torch.from_numpy(opens)] = self.rows[:, torch.from_numpy(opens)] + 1
        return nxt

    monkeypatch.setattr(PagedStepTables, "advanced_opening", wrong)
    with pytest.raises(AssertionError):
        _run_until_advanced(_driver())
    assert ran, "no opening advance ran: the control proves nothing"


def _staged_scenario(midway: Callable[[], None] | None = None) -> CoreDriver:
    """Layer 1 of ``a`` and layers 1-2 of ``b`` to the host, then 14 decode steps (``midway``
    called after the third)."""
    d = _driver(seed=8)
    d.add("a")
    d.add("b")
    d.step([("a", 6), ("b", 3)])
    _decode(d, 2)
    d.want("a", [True, False, True])
    d.want("b", [True, False, False])
    _decode(d, 3)
    if midway is not None:
        midway()
    _decode(d, 11)
    d.check_at_rest()
    return d


@pytest.mark.parametrize("mistake", ["stale_fetches", "taken_staging_kept"])
def test_a_staged_advance_that_keeps_stale_launches_or_staging_is_caught(monkeypatch, mistake):
    """Controls for :meth:`PagedStepTables.advanced_staged`: one that keeps the last step's fetch
    launches (their request ids' offsets and sizes from before the opened pages) is caught by the
    comparison with a fresh build -- on the CPU the copies come from the host arrays, so only the
    CUDA kernel would read the stale offsets; one whose renew claims every staging page back
    although the opened pages' placement took some (staging over placed pages) is caught by the
    step's checks (staging disjoint from placed pages, the layers' reads). Without the mistakes the same scenario
    passes (the tests above)."""
    ran = []
    if mistake == "stale_fetches":
        _comparing(monkeypatch)
        original = PagedStepTables.advanced_staged

        def stale(self: PagedStepTables, opens: np.ndarray, *args: object) -> PagedStepTables | None:
            nxt = original(self, opens, *args)
            if nxt is not None and opens.size:
                nxt.page_launches, nxt._fetch_list = self.page_launches, None
                ran.append(1)
            return nxt

        monkeypatch.setattr(PagedStepTables, "advanced_staged", stale)
    else:
        _without_hold(monkeypatch)  # the placement takes some staging pages
        def claims_all(room: StagingRoom, ids: np.ndarray, extra: int) -> tuple[int, np.ndarray | None]:
            m = room.store.allocator.retake(ids)  # what renew retakes, then claimed whole
            room.residency.staging_lent += m
            if m < ids.size:
                ran.append(1)
            more = room.take(extra)  # new pages for the opened ones only
            if more is None:
                room.give_back(ids[:m])
                return 0, None
            return int(ids.size), np.concatenate([ids, more])

        monkeypatch.setattr(StagingRoom, "renew", claims_all)
    with pytest.raises((AssertionError, ValueError)):
        _staged_scenario()
    assert ran, "the mistake never ran: the control proves nothing"


@pytest.mark.parametrize("defer", [False, True], ids=["at-once", "deferred"])
def test_an_opened_page_placed_unlike_its_requests_last_page_advances_exactly(monkeypatch, defer):
    """A staged advance that kept every staging page steps the last tables' rows and host-only
    places by one token and recomputes the opening requests' (their new pages' map columns): so
    an opened page placed at more layers than its request's last page (here: every layer,
    although the request keeps layer 1 on the host) advances to tables equal to a fresh build,
    and every layer reads exactly. The placement is forced through ``missing_pairs`` (every
    appended page wanted at every layer; :class:`OpenedPages` declining) once the batch is staged."""
    from sglang_ext.dataplane import slot_residency

    checked, kept = _comparing(monkeypatch, defer), _retakes(monkeypatch)
    real, armed, differed = slot_residency.missing_pairs, [False], []

    def every_layer(map_np, cols, masks):  # noqa: ANN001, ANN202
        return real(map_np, cols, [None] * len(masks) if armed[0] else masks)

    monkeypatch.setattr(slot_residency, "missing_pairs", every_layer)
    one_pass = OpenedPages.reconcile  # declines once armed: the general route (and missing_pairs) places
    monkeypatch.setattr(OpenedPages, "reconcile", lambda self, *a: None if armed[0] else one_pass(self, *a))
    original = PagedStepTables.advanced_staged

    def noted(self: PagedStepTables, opens: np.ndarray, opened: np.ndarray, *args: object) -> PagedStepTables | None:
        nxt = original(self, opens, opened, *args)
        if nxt is not None and opens.size and self._new_host is not None:
            old_last = np.take(self._store.map_np, self.new_pages[opens], axis=1) < 0
            differed.append(bool((old_last != (np.take(self._store.map_np, opened, axis=1) < 0)).any()))
        return nxt

    monkeypatch.setattr(PagedStepTables, "advanced_staged", noted)
    d = _staged_scenario(lambda: armed.__setitem__(0, True))
    assert any(differed), differed  # an opened page was placed unlike its request's last page
    assert all(m == n for m, n in kept[-len(differed):]), kept
    assert sum(1 for o, s in checked if o and s) >= len(differed)
    d.check_staging()
