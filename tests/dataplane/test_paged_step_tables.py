"""PagedStepTables (the paged layout's tables, gathered on the device from the map mirror) equal
StepTables (built from the map on the host) at every step of the lifecycle scenarios: tables,
rows, CSR, launches with their indices, write-backs, dirty ids, staging. Controls: a mirror that
misses the map's writes, and a missed fetch, are caught."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from sglang_ext.dataplane import layered_kv_core
from sglang_ext.dataplane.paged_decode_step import PagedDecodeStep
from sglang_ext.dataplane.paged_step_tables import PagedStepTables
from sglang_ext.dataplane.step_tables import StepTables
from tests.dataplane.core_driver import PAGES, CoreDriver, make_core, offload_scenario


class _Capture:
    """An engine that returns the PageFetch it is asked to run."""

    def fetch_pages(self, spec, wait):  # noqa: ANN001, ANN201
        return spec


def _launches(t: StepTables, launches: list) -> list[tuple]:
    out = []
    for launch in launches:
        if launch is None:
            out.append(None)
            continue
        src, dst, host = t.launch_indices(launch)
        assert np.array_equal(src.cpu().numpy(), host[0]) and np.array_equal(dst.cpu().numpy(), host[1])
        out.append((launch.trigger, launch.layer, host[0].tolist(), host[1].tolist()))
    return out


def _page_fetches(got: PagedStepTables, has_kv: np.ndarray, layers: int) -> tuple[list[tuple], int]:
    """The fetches as StepTables lists them (pages holding KV), and the pages without KV copied
    too. Checks the device views the kernel reads against the host arrays the CPU copies from."""
    out, extra = [], 0
    for launch in got.fetches:
        spec = got.fetch(_Capture(), launch, ())
        reqs, flat, stage, starts, counts, _ = spec.host_arrays
        for view, arr in ((spec.reqs, reqs), (spec.flat, flat), (spec.stage, stage), (spec.starts, starts),
                          (spec.counts, counts)):
            assert np.array_equal(view.cpu().numpy(), arr)
        src, dst = spec.indices()
        assert src.size == launch.segments
        k = src.size // 2
        keep = has_kv[(src[:k] // 2) // layers]
        extra += int((~keep).sum())
        if keep.any():
            src_k = src[:k][keep]
            out.append((launch.trigger, launch.layer, np.concatenate([src_k, src_k + 1]).tolist(),
                        np.concatenate([dst[:k][keep], dst[k:][keep]]).tolist()))
    return out, extra


def _written_back(t: StepTables, layers: int) -> list[tuple[int, int]]:
    """The (layer, page) pairs the step writes back, sorted: from the per-layer page launches,
    or from a decode step's parked tokens (each checked against the token's place: the row of
    its position in its page, K and V; sources the buffer's rows of its slot)."""
    pairs = []
    for launch in t.writebacks:
        if launch is not None:
            _, dst, host = t.launch_indices(launch)
            assert np.array_equal(dst.cpu().numpy(), host[1])
            k = host[1][: launch.segments // 2]
            pairs += [(int(seg // 2 % layers), int(seg // 2 // layers)) for seg in k]
    tw = t.token_writeback
    if tw is not None:
        assert all(w is None for w in t.writebacks), "a decode step parks every token"
        src, dst, host = t.launch_indices(tw.launch)
        assert np.array_equal(src.cpu().numpy(), host[0]) and np.array_equal(dst.cpu().numpy(), host[1])
        n = tw.pairs
        src_k, src_v, dst_k, dst_v = host[0][:n], host[0][n:], host[1][:n], host[1][n:]
        m, ps = tw.tokens, (dst_v - dst_k)[0]
        assert np.all(dst_v - dst_k == ps) and np.all(src_v - src_k == m)
        seg, off = np.divmod(dst_k, ps)
        assert np.all(seg % 2 == 0)
        lens = t.kv_lens.cpu().numpy()
        slot, j = np.divmod(src_k, 2 * m)
        layer, page = seg // 2 % layers, seg // 2 // layers
        assert np.array_equal(np.asarray(tw.slots)[layer], slot) and np.array_equal(off, (lens[j] - 1) % ps)
        assert np.array_equal(page, t.new_pages[j]), "token j's page is request j's last page"
        pairs += list(zip(layer.tolist(), page.tolist(), strict=True))
    return sorted(pairs)


def assert_same_tables(got: PagedStepTables, ref: StepTables, has_kv: np.ndarray) -> None:
    assert np.array_equal(got.staging_ids, ref.staging_ids)
    assert np.array_equal(got.tab.cpu().numpy(), ref.tab.cpu().numpy())
    assert np.array_equal(got.rows.cpu().numpy(), ref.rows.cpu().numpy())
    for name in ("kv_indptr", "kv_lens", "last_page_len"):
        assert np.array_equal(getattr(got, name).cpu().numpy(), getattr(ref, name).cpu().numpy()), name
    fetches, extra = _page_fetches(got, has_kv, got.tab.shape[0])
    assert fetches == _launches(ref, ref.fetches)
    assert _written_back(got, layers=got.tab.shape[0]) == _written_back(ref, layers=got.tab.shape[0])
    assert np.array_equal(got.dirty_ids, ref.dirty_ids) and np.array_equal(got.new_pages, ref.new_pages)
    assert (got.fetch_layer_pages - extra, got.writeback_layer_pages, got.host_layer_pages) == (
        ref.fetch_layer_pages, ref.writeback_layer_pages, ref.host_layer_pages)
    if got._tok_at >= 0 or ref._tok_at >= 0:
        assert torch.equal(got.token_rows(0, 1), ref.token_rows(0, 1))


@pytest.fixture(params=[False, True], ids=["at-once", "deferred"])
def compared(monkeypatch, request) -> Iterator[list[int]]:
    """Every PagedStepTables the core builds is compared with a StepTables built on the same
    store state and staging ids; the list counts the comparisons (and the fetches seen). Each
    test runs twice: the tables' device half made at once, and deferred (a decode step's made
    at the comparison's first read of it, ``DeferredDevice``)."""
    seen = [0, 0, 0]
    deferring = request.param

    def both(store, pages, lens, counts, new_np, stage: Callable, *, token_tables: bool = True,  # noqa: ANN001
             resident: bool = False, defer: bool = False):
        # a resident build (the core knew no batch page host-only) must equal the host-built one too;
        # a deferred one (its device half made at the first read) too
        got = PagedStepTables(store, pages, lens, counts, new_np, stage, token_tables=token_tables,
                              resident=resident, defer=defer or deferring)
        seen[2] += got.pending
        if got.reserved:
            ids = got.staging_ids
            ref = StepTables(store, pages, lens, counts, new_np, lambda n: ids if n == ids.size else None,
                             token_tables=token_tables)
            assert ref.reserved, "StepTables asked for a different staging size"
            assert_same_tables(got, ref, store.has_kv_np)
            seen[0] += 1
            seen[1] += len(got.fetches)
        return got

    monkeypatch.setattr(layered_kv_core, "PagedStepTables", both)
    yield seen
    assert (seen[2] > 0) == (deferring and seen[0] > 0), seen  # the deferred runs did defer (decode steps)


def shared_prefix_scenario(d: CoreDriver) -> None:
    """Six layers, a shared prefix with different wants, pauses and a finish."""
    d.add("a")
    d.step([("a", 9)])
    d.add("b", share_from="a", share_pages=2)
    d.step([("b", 3)])
    d.want("a", [True, False, True, False, False, True])
    d.want("b", [False, True, True, True, False, False])
    for _ in range(5):
        d.step([("a", 1), ("b", 1)])
    d.want("a", [False] * 6, paused=True)
    d.step([("b", 2)])
    d.want("a", [True, True, False, False, True, True])
    d.step([("a", 1), ("b", 1)])
    d.finish("b")
    d.step([("a", 1)])
    d.check_at_rest()


def test_paged_tables_equal_host_built_tables(compared):
    offload_scenario(CoreDriver(make_core(PAGES + 6), seed=1))
    shared_prefix_scenario(CoreDriver(make_core(6 * 8, layers=6), seed=2))
    shared_prefix_scenario(CoreDriver(make_core(6 * 8, layers=6, page_size=1), seed=3))
    assert compared[0] >= 20 and compared[1] >= 10  # the comparison ran, over steps that fetch


@pytest.mark.parametrize("bound", [None, 0])
def test_decode_steps_park_their_tokens_unless_the_buffer_passes_its_bound(compared, monkeypatch, bound):
    """Decode steps that stage park their new tokens (one write-back launch a step); with the
    buffer's bound at 0 they write back pages per layer, launch for launch as the host-built
    tables; both keep the scenario bit-exact."""
    from sglang_ext.dataplane import paged_step_tables

    if bound is not None:
        monkeypatch.setattr(paged_step_tables, "PARK_MAX_BYTES", bound)
    seen = []
    real = PagedStepTables._count_launched

    def count(self):  # noqa: ANN001, ANN202
        real(self)
        if self.reserved and self._one_each and self.writeback_layer_pages:
            seen.append((self.token_writeback is not None, any(w is not None for w in self.writebacks)))

    monkeypatch.setattr(PagedStepTables, "_count_launched", count)
    offload_scenario(CoreDriver(make_core(PAGES + 6), seed=5))
    assert seen and set(seen) == ({(True, False)} if bound is None else {(False, True)})


def test_token_tables_equal_too(compared):
    core = make_core(PAGES + 6)
    assert core.token_tables
    offload_scenario(CoreDriver(core, seed=4))
    assert compared[0] > 0


def test_a_mirror_that_misses_map_writes_is_caught(compared, monkeypatch):
    """Control: dropping the onload's report leaves the device map stale; the tables differ."""
    from sglang_ext.dataplane.slot_kv_store import SlotKVStore

    real_onload = SlotKVStore.onload

    def onload_unreported(self, layers, pages, copy):  # noqa: ANN001
        mirror, self.mirror = self.mirror, None
        try:
            real_onload(self, layers, pages, copy)
        finally:
            self.mirror = mirror

    monkeypatch.setattr(SlotKVStore, "onload", onload_unreported)
    with pytest.raises(AssertionError):
        offload_scenario(CoreDriver(make_core(PAGES + 6), seed=1))


def test_a_missed_fetch_is_caught(monkeypatch):
    """Control: tables that drop their last fetch differ from the host-built ones."""
    real = PagedStepTables._fetch_launches

    def drop_last(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        reqs = real(self, *args, **kwargs)
        if self.fetches:
            self.fetches.pop()
        return reqs

    monkeypatch.setattr(PagedStepTables, "_fetch_launches", drop_last)
    caught = []

    def both(store, pages, lens, counts, new_np, stage, *, token_tables=True, resident=False, defer=False):  # noqa: ANN001
        got = PagedStepTables(store, pages, lens, counts, new_np, stage, token_tables=token_tables,
                              resident=resident, defer=defer)
        if got.reserved and got.fetches is not None:
            ids = got.staging_ids
            ref = StepTables(store, pages, lens, counts, new_np, lambda n: ids, token_tables=token_tables)
            try:
                assert_same_tables(got, ref, store.has_kv_np)
            except AssertionError:
                caught.append(1)
        return got

    monkeypatch.setattr(layered_kv_core, "PagedStepTables", both)
    d = CoreDriver(make_core(PAGES + 6), seed=1)
    try:
        offload_scenario(d)
    except AssertionError:
        pass  # the dropped fetch may also break the KV checks
    assert caught


def test_the_mirror_uploads_only_what_moved():
    """Steady decode steps under a fixed placement upload no map columns; a placement change
    uploads the moved request's pages, not the pool's."""
    core = make_core(PAGES + 6)
    d = CoreDriver(core, seed=6)
    d.add("a")
    d.add("b")
    d.step([("a", 5), ("b", 3)])
    d.want("a", [True, False, True])
    d.step([("a", 1), ("b", 1)])
    mirror = core.store.mirror
    assert mirror is not None
    d.step([("a", 1), ("b", 1)])
    before = mirror.synced_columns
    for _ in range(3):
        d.step([("a", 1), ("b", 1)])  # page 2: a new page every other step (at most 2 per step)
    assert mirror.synced_columns - before <= 3 * 2
    before = mirror.synced_columns
    d.want("b", [False, True, False])
    d.step([("a", 1), ("b", 1)])
    moved = mirror.synced_columns - before
    assert 0 < moved <= len(d.slots["b"]) // 2 + 2 < PAGES


def test_paged_steady_decode_steps_serve_exactly(compared):
    """Steady decode steps in the paged layout start from the last step's page lists
    (``prepare_decode_step``): every layer's reads stay bit-exact and the tables equal the
    host-built ones, with pages opened mid-run, pauses and a shared prefix."""
    d = CoreDriver(make_core(PAGES + 6), seed=7, fast_decode=True)
    offload_scenario(d)
    e = CoreDriver(make_core(6 * 8, layers=6), seed=8, fast_decode=True)
    shared_prefix_scenario(e)
    for driver in (d, e):
        assert driver.core.paged_decode_steps > 0 and driver.fast_steps == driver.core.paged_decode_steps


def test_a_paged_steady_step_that_drops_its_new_page_is_caught(monkeypatch):
    """Control: a fast path that forgets the page a new token opens fails the step's checks."""
    from sglang_ext.dataplane.decode_continuity import DecodeContinuity

    real, dropped = DecodeContinuity.continued, []

    def forgets(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        cont = real(self, *args, **kwargs)
        if cont is not None and cont[1] is not None:
            for i in cont[0]:  # the opening rows' lists without the page their token opens
                cont[1][i] = cont[1][i][:-1]
                dropped.append(i)
        return cont

    monkeypatch.setattr(DecodeContinuity, "continued", forgets)
    with pytest.raises((AssertionError, ValueError)):
        offload_scenario(CoreDriver(make_core(PAGES + 6), seed=7, fast_decode=True))
    assert dropped, "no step opened a page: the control proves nothing"


def test_a_free_that_cuts_a_running_request_sends_the_next_step_through_the_general_path():
    """SGLang may rewrite a running request's row when it frees pages (a prefix the tree already
    holds replaces the request's copy): after a ``page_freed`` that cuts a page of the batch the
    decode path declines and the general one reads the rows. A free nobody in the batch holds
    (a finished request's pages) changes nothing the batch holds: the decode path goes on."""
    for case in ("none", "unheld", "rewrite"):
        core = make_core(PAGES + 6)
        d = CoreDriver(core, seed=9, fast_decode=True)
        d.add("a")
        d.add("b")
        d.step([("a", 5), ("b", 3)])
        d.want("a", [True, False, True])
        d.step([("a", 1), ("b", 1)])
        before = core.paged_decode_steps
        if case == "unheld":
            core.page_freed([])
        elif case == "rewrite":
            assert d.rewrite_prefix("b", "a")
        d.step([("a", 1), ("b", 1)])
        assert core.paged_decode_steps == before + (0 if case == "rewrite" else 1), case
        d.check_at_rest()


def test_resident_builds_equal_host_built_tables(compared, monkeypatch):
    """A paged steady step whose new tokens open pages, the rest of the batch resident and the map
    changed only in the opened pages' columns, builds knowing the batch resident (the host-bit
    pass skipped) when the last tables do not advance (here: forced): its tables still equal the
    host-built ones, and every read is exact."""
    monkeypatch.setattr(PagedStepTables, "advanced_opening", lambda self, *args: None)
    core = make_core(PAGES + 10, page_size=4, pages=24)
    d = CoreDriver(core, seed=14, fast_decode=True, paged_reads=True)
    d.add("a")
    d.add("b")
    d.step([("a", 6), ("b", 2)])
    for _ in range(12):
        d.step([("a", 1), ("b", 1)])
    assert core.resident_builds >= 4 and compared[0] >= core.resident_builds
    d.check_at_rest()


def test_a_resident_build_of_a_batch_with_host_pages_is_caught(monkeypatch):
    """Control: a core that claims every steady step resident skips the staging of host-only
    pages; the scenario's checks fail (or the build refuses a host-only new-token page whose
    request is not staged: no staging page to write it back from)."""
    monkeypatch.setattr(PagedDecodeStep, "still_resident", lambda self, opened, unmoved: True)
    with pytest.raises((AssertionError, RuntimeError)):
        offload_scenario(CoreDriver(make_core(PAGES + 6), seed=7, fast_decode=True))


def test_a_prefill_chunk_fetches_only_the_pages_that_held_kv():
    """Scenario: a request whose layers are all on host (a tight budget) prefills a second chunk.
    Each layer's fetch copies the first chunk's pages, which the chunk's attention reads, and not
    the chunk's own new pages, which the layers write (before, those were copied from host too:
    as many bytes again for nothing at every offloaded layer). The KV stays exact inside every
    layer (the driver checks it); the control: the new pages are host-only at some layers, so
    fetching them would have shown in the count."""
    from tests.dataplane.core_driver import LAYERS

    core = make_core(30, pages=65)
    d = CoreDriver(core, seed=0)
    d.add("b")
    d.step([("b", 2)])
    d.want("b", [True] * LAYERS)
    d.add("a")
    d.want("a", [False] * LAYERS)
    d.step([("a", 16)])  # the first chunk: 8 pages of 2 tokens
    stats = core.store.engine.stats
    before = stats.h2d_segments
    d.step([("a", 16)])  # the second chunk: 8 new pages
    fetched = stats.h2d_segments - before
    core.settle()
    pages = np.asarray(d.pages("a"))
    old_host = int((core.store.map_np[:, pages[:8]] < 0).sum())
    new_host = int((core.store.map_np[:, pages[8:]] < 0).sum())
    assert old_host > 0 and new_host > 0, (old_host, new_host)
    assert fetched == 2 * old_host, (fetched, old_host, new_host)
    assert fetched != 2 * (old_host + new_host)
    d.check_at_rest()
