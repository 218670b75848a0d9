"""A page that several staged requests share takes one staging page and is fetched once a layer
(``sglang_ext/dataplane/staging_columns.py``): KV exact at every layer and at rest, on the CPU
engine and on the simulated CUDA engine (kernel and copy-engine paths, every access ordered).
Controls: per-column staging (the old way) overflows the budget this fits and fetches more; an
owner that fetches nothing reads wrong KV."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from sglang_ext.dataplane import paged_step_tables, staging_columns
from sglang_ext.dataplane.staging_columns import fetch_entries, restaged, shared_columns
from tests.dataplane.core_driver import KV_MISMATCH, CoreDriver, make_core
from tests.dataplane.cuda_simulation import install, track_core


def _reference(pages: np.ndarray, private: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A loop: each new key (a page, or a private column) in first-place order gets the next rank."""
    rank, owners, seen = [], [], {}
    for i, p in enumerate(pages.tolist()):
        key = ("col", i) if private[i] else ("page", p)
        if key not in seen:
            seen[key] = len(owners)
            owners.append(i)
        rank.append(seen[key])
    return np.asarray(rank), np.asarray(owners)


@pytest.mark.parametrize("seed", range(6))
def test_shared_columns_equals_a_loop(seed):
    rng = np.random.default_rng(seed)
    runs = [np.arange(s, s + k) for s, k in zip(rng.integers(0, 30, 8), rng.integers(1, 9, 8), strict=True)]
    pages = np.concatenate(runs)  # ascending runs that overlap: shared prefixes
    private = rng.random(pages.size) < 0.2
    got = shared_columns(pages, private)
    rank, owners = _reference(pages, private)
    if owners.size == pages.size:
        assert got is None
    else:
        assert got is not None and np.array_equal(got[0], rank) and np.array_equal(got[1], owners)


def test_no_repeat_keeps_each_column_its_own_page():
    assert shared_columns(np.array([5, 6, 7, 1, 2])) is None
    assert shared_columns(np.array([5, 6, 5]), np.array([True, False, False])) is None  # the repeat is private
    rank, owners = shared_columns(np.array([5, 6, 5, 9]))  # type: ignore[misc]
    assert rank.tolist() == [0, 1, 0, 2] and owners.tolist() == [0, 1, 3]


def _prefix_batch(d: CoreDriver) -> None:
    """``a`` (17 tokens: 8 full pages and one more) and ``b``, ``c`` starting with its 8 full
    pages, all with layer 1 offloaded: the shared pages are host-only at layer 1."""
    d.add("a")
    assert d.step([("a", 17)])
    for rid in ("b", "c"):
        d.add(rid, share_from="a", share_pages=8)
        assert d.step([(rid, 3)])
    for rid in ("a", "b", "c"):
        d.want(rid, [True, False, True])


def _decode(d: CoreDriver, steps: int) -> list[tuple[int, int, int, int]]:
    """Decode steps of the three; per staged step ``(staging pages, distinct batch pages,
    layer-pages fetched, distinct host-only layer-pages of the batch)``; ``d.columns`` the
    batch's columns (pages with repeats) at each."""
    seen: list[tuple[int, int, int, int]] = []
    d.columns = []  # type: ignore[attr-defined]

    def at_layer(layer: int) -> None:
        t = d.core.tables
        if layer == 0 and t is not None and t.staging_ids is not None and t.staging_ids.size:
            distinct = np.unique(t.pages)
            host = int((d.core.store.map_np[:, distinct] < 0).sum())
            seen.append((int(t.staging_ids.size), int(distinct.size), int(t.fetch_layer_pages), host))
            d.columns.append(int(t.pages.size))  # type: ignore[attr-defined]

    d.on_layer = at_layer
    for _ in range(steps):
        assert d.step([("a", 1), ("b", 1), ("c", 1)])
    d.on_layer = None
    return seen


def _per_column(mp: pytest.MonkeyPatch) -> None:
    """The old way: every staged column its own staging page and its own fetch."""
    mp.setattr(staging_columns, "shared_columns", lambda pages, private=None: None)


@pytest.mark.parametrize("paged_reads", [False, True])
def test_a_shared_prefix_takes_one_staging_page_and_one_fetch_per_page(paged_reads, monkeypatch):
    d = CoreDriver(make_core(60), seed=4, paged_reads=paged_reads, fast_decode=True)
    _prefix_batch(d)
    seen = _decode(d, 4)  # every read inside every layer is checked against the shadow KV
    d.check_at_rest()
    assert len(seen) == 4 and d.core.overflow_steps == 0
    assert (d.core.staged_advances >= 2) == paged_reads, d.core.staged_advances  # the paged backends' advance
    # one staging page per distinct page; each host-only layer-page is fetched once
    assert all(staged == distinct and fetched == host for staged, distinct, fetched, host in seen), seen
    fetched = d.core.store.h2d_bytes
    with monkeypatch.context() as mp:  # control: per-column staging stages and fetches the prefix 3 times
        _per_column(mp)
        old = CoreDriver(make_core(60), seed=4, paged_reads=paged_reads)
        _prefix_batch(old)
        old_seen = _decode(old, 4)
        old.check_at_rest()
    assert all(staged > distinct and fetched > host for staged, distinct, fetched, host in old_seen), old_seen
    assert old.core.store.h2d_bytes > 1.5 * fetched


def test_a_budget_per_column_staging_overflowed_serves_the_shared_prefix_staged(monkeypatch):
    """22 device pages hold the batch's 13-17 distinct pages' staging, not the 29-35 columns':
    before, every decode step overflowed to the at-rest path (host syncs inside the layers)."""
    d = CoreDriver(make_core(22), seed=4)
    _prefix_batch(d)
    assert len(_decode(d, 4)) == 4
    d.check_at_rest()
    assert d.core.overflow_steps == 0
    with monkeypatch.context() as mp:
        _per_column(mp)
        old = CoreDriver(make_core(22), seed=4)
        _prefix_batch(old)
        _decode(old, 4)
        old.check_at_rest()
    assert old.core.overflow_steps == 4


def test_an_owner_that_fetches_nothing_is_caught(monkeypatch):
    """Control: every staged entry marked a reader (nobody fetches the shared pages): the layer
    reads stale staging, and the driver's K/V check fails."""
    real = staging_columns.fetch_entries
    monkeypatch.setattr(paged_step_tables, "fetch_entries",
                        lambda stage_col, readers: real(stage_col, np.flatnonzero(stage_col >= 0)))
    d = CoreDriver(make_core(60), seed=4)
    _prefix_batch(d)
    with pytest.raises(AssertionError, match=KV_MISMATCH):
        _decode(d, 2)


def _simulated(monkeypatch: pytest.MonkeyPatch, dma: bool, run: Callable[[CoreDriver], list]) -> tuple:
    """``run`` (after :func:`_prefix_batch`, as the paged decode backends serve) on the simulated
    CUDA engine (``cuda_simulation.py``), every pool access traced; then every token checked at
    rest. Returns ``(sim, driver, what run returned)``."""
    with monkeypatch.context() as mp:
        sim = install(mp, dma=dma)
        core = make_core(60)
        track_core(sim, core)
        d = CoreDriver(core, seed=4, fast_decode=True, paged_reads=True)
        with sim.tracer():
            _prefix_batch(d)
            seen = run(d)
            d.check_at_rest()
    return sim, d, seen


@pytest.mark.parametrize("dma", [False, True])
def test_shared_staging_keeps_every_access_ordered(monkeypatch, dma):
    """The simulated CUDA engine (``cuda_simulation.py``): the kernel path and the copy engines'.
    The shared pages' owner (``a``) and readers (``b``, ``c``) have different offloaded layers,
    so the owner's fetch trigger is not the readers'. Every fetch, read and write-back of the
    staging pages is ordered by the engine's events alone."""
    def run(d: CoreDriver) -> list:
        d.want("a", [False, True, False])
        d.want("b", [True, False, False])
        seen = _decode(d, 3)
        for wants in ([True, False, False], [False, False, True]):
            d.want("c", wants)
            seen += _decode(d, 2)
        return seen

    sim, d, seen = _simulated(monkeypatch, dma, run)
    assert len(seen) == 7 and all(staged == distinct and fetched == host for staged, distinct, fetched, host in seen), seen
    # the shared pages were staged (fewer staging pages than columns) and some fetched
    assert all(staged < cols for (staged, *_), cols in zip(seen[-2:], d.columns[-2:], strict=True)), d.columns
    assert any(fetched for *_, fetched, _ in seen)
    assert sim.accesses >= 100 and sim.violations == [], sim.violations[:3]
    assert d.core.staged_advances >= 3, d.core.staged_advances  # steady steps kept the sharing, advanced


def test_the_staging_reserve_counts_a_shared_page_once():
    """The residency keeps free what the batch's staging takes: the distinct pages of the
    offloading requests (before, their pages with repeats: the shared prefix three times)."""
    d = CoreDriver(make_core(60), seed=4)
    _prefix_batch(d)
    res = d.core.residency
    held = [np.asarray(d.pages(rid)) for rid in ("a", "b", "c")]
    distinct = np.unique(np.concatenate(held)).size
    assert res.staging_reserve() == distinct == sum(p.size for p in held) - 2 * 8
    d.want("c", [True, True, True])  # c wants every layer: only its own pages leave the reserve
    assert res.staging_reserve() == distinct - (held[2].size - 8)
    d.want("a", [True, True, True])
    assert res.staging_reserve() == held[1].size  # b alone offloads: all its pages, the prefix too


def test_restaged_moves_owners_and_readers_of_a_taken_page():
    """An advanced step whose staging pages 11 and 13 were taken: every column on them, owner
    or reader, moves to the replacements; readers stay encoded, other columns are untouched."""
    stage_col = np.array([10, 11, 12, 11, 13, -1, 13, 10])
    readers = np.array([3, 6, 7])
    entries = fetch_entries(stage_col, readers)
    assert entries.tolist() == [10, 11, 12, -13, 13, -1, -15, -12]
    got = restaged(entries, np.array([13, 11]), np.array([20, 21]))
    assert got.tolist() == [10, 21, 12, -23, 20, -1, -22, -12]


def test_the_copy_engines_reuse_a_whole_fetchs_plan_with_readers(monkeypatch):
    """On the copy engines a fetch that copies every page its requests own (readers fetch none)
    takes the last layer's plan, shifted, without reading the map (``FetchRunCache``'s whole
    fetch): the readers' columns do not count against it. KV exact, every access ordered."""
    def run(d: CoreDriver) -> list:
        for rid in ("a", "b", "c"):
            d.want(rid, [True, False, False])  # layers 1 and 2 on host: two fetches a step
        return _decode(d, 4)

    sim, d, seen = _simulated(monkeypatch, True, run)
    runs = d.core.store.engine.fetch_runs
    assert len(seen) == 4 and all(staged < cols for (staged, *_), cols in zip(seen, d.columns, strict=True))
    assert runs.reused_whole >= 3 and runs.disagreed == 0, (runs.reused_whole, runs.disagreed)
    assert sim.violations == [], sim.violations[:3]
