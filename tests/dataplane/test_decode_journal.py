"""DecodeJournal: steady-decode bookkeeping leaves the step and is applied, exactly, by the first
reader of residency -- in one batch, or page by page when the batch path refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_ext.dataplane import decode_journal
from tests.dataplane.core_driver import LAYERS, CoreDriver, make_core


def _steady(fast: bool = True, page_size: int = 1) -> CoreDriver:
    """Identity core, two requests prefilled (the next decode step of both is steady)."""
    d = CoreDriver(make_core(None, pages=65, page_size=page_size), seed=3, fast_decode=fast)
    d.add("a")
    d.add("b")
    d.step([("a", 5), ("b", 3)])
    assert d.fast_steps == 0
    return d


def test_steady_steps_journal_and_the_first_reader_applies_them():
    d = _steady()
    core = d.core
    used = core.store.allocator.used_count
    for _ in range(3):
        d.step([("a", 1), ("b", 1)])  # inside every layer the KV reads back exact (the driver checks)
    assert d.fast_steps == 3 and len(core.residency.journal.entries) == 3
    assert core.store.allocator.used_count == used  # nothing placed during the steps
    stats = core.stats()  # a reader: applies the journal first
    assert not core.residency.journal.entries and core.residency.journal.batches == 1
    pages = {s for s in d.slots["a"] + d.slots["b"]}  # page size 1: a slot is a page
    assert stats.live_layer_pages == LAYERS * len(pages)
    new = d.slots["a"][-3:] + d.slots["b"][-3:]
    assert core.store.allocator.used_count == used + LAYERS * len(new)
    assert bool(core.store.dirty_np[:, new].all())
    d.check_at_rest()


def test_a_refused_batch_is_joined_page_by_page_exactly():
    """A journalled page already flagged as holding KV (a stale flag: SGLang reused a page whose
    free was never reported) makes the batch path refuse; the page-by-page path places and counts
    it all the same, marks it dirty, and the next reconciliation is a full one. Offloading it
    afterwards keeps its KV (the dirty mark wrote it back)."""
    d = _steady()
    core = d.core
    d.step([("a", 1), ("b", 1)])
    stale = d.slots["b"][-1]
    core.store.has_kv_np[stale] = True  # what the batch path checks
    full_before = core.residency.full_reconciles
    d.check_at_rest()  # read_kv settles
    journal = core.residency.journal
    assert (journal.slow, journal.batches) == (1, 0)
    assert bool((core.store.map_np[:, stale] >= 0).all()) and bool(core.store.dirty_np[:, stale].all())
    d.want("b", [False] * LAYERS)  # offload all of b: write-back of the dirty pages first
    assert core.residency.full_reconciles == full_before + 1
    d.step([("a", 1)])
    d.check_at_rest()
    assert not bool((core.store.map_np[:, stale] >= 0).any())


def test_the_batch_path_refusal_is_what_the_slow_path_catches():
    """Negative control for the test above: with the page-by-page path skipped the same journal
    leaves the stale page unplaced, and its KV (written in place) is lost at rest."""
    d = _steady()
    core = d.core
    d.step([("a", 1), ("b", 1)])
    core.store.has_kv_np[d.slots["b"][-1]] = True
    core.residency.journal._apply_each = lambda entries: None
    try:
        d.want("b", [False] * LAYERS)
        d.check_at_rest()
    except AssertionError:
        return
    raise AssertionError("the skipped page-by-page path went unnoticed")


def test_the_journal_is_bounded(monkeypatch):
    monkeypatch.setattr(decode_journal, "MAX_STEPS", 4)
    d = _steady()
    for _ in range(9):
        d.step([("a", 1), ("b", 1)])
    journal = d.core.residency.journal
    assert d.fast_steps == 9 and journal.batches == 2 and len(journal.entries) == 1
    d.check_at_rest()


def test_pages_of_several_tokens_mark_every_written_page():
    """Page size 2: a step that opens no page still journals the pages it wrote (dirty)."""
    d = _steady(page_size=2)
    core = d.core
    d.step([("a", 1), ("b", 1)])
    d.step([("a", 1), ("b", 1)])
    assert d.fast_steps == 2
    core.store.dirty_np[:] = False  # forget earlier marks: only the journal's count now
    core.settle()
    written = sorted({s // 2 for s in (d.slots["a"][-2:] + d.slots["b"][-2:])})
    assert np.flatnonzero(core.store.dirty_np.any(axis=0)).tolist() == written
    d.check_at_rest()


def test_the_step_declines_what_it_cannot_journal():
    """Outside the identity layout, or with an unknown request, nothing is recorded."""
    d = _steady()
    journal = d.core.residency.journal
    owners, pages = np.arange(1, dtype=np.int64), np.array([60], dtype=np.int64)
    assert not journal.record(["nobody"], owners, pages, None)
    staged = CoreDriver(make_core(120, pages=65), fast_decode=True)
    staged.add("a")
    staged.step([("a", 3)])
    assert not staged.core.residency.journal.record(["a"], owners, pages, None)
    assert not staged.core.residency.journal.entries
    # the paged layout's steady path declines a slot that does not continue the request...
    assert not staged.core.prepare_decode_step(["a"], [4], torch.tensor([61]))
    assert staged.core.paged_decode_steps == 0
    # ...and takes the one that does (control), journalling nothing
    nxt = staged.slots["a"][2] + 1  # position 3: the second slot of position 2's page
    assert staged.core.prepare_decode_step(["a"], [4], torch.tensor([nxt]))
    assert staged.core.paged_decode_steps == 1 and not staged.core.residency.journal.entries


def test_a_batch_naming_a_request_twice_is_not_journalled():
    """A request twice in one batch (not what SGLang builds) would give the steady application
    its pages out of order: the step declines it; the same step with distinct rows records."""
    d = _steady()
    journal = d.core.residency.journal
    assert not journal.record(["a", "a"], None, [60, 61], None)
    assert not journal.entries
    assert journal.record(["a", "b"], None, [60, 61], None)  # control: distinct rows record
    assert len(journal.entries) == 1


def test_free_pages_count_the_journal_without_applying_it():
    """The step report's free-page figure: journalled pages count as placed at every layer, the
    journal stays unapplied, and the figure is what applying it gives. Negative control: the
    free count of the allocator alone (the journal ignored) is off by exactly those pages."""
    d = _steady()
    core = d.core
    for _ in range(3):
        d.step([("a", 1), ("b", 1)])
    journal = core.residency.journal
    assert journal.pending_pages == 6
    unapplied = core.free_device_pages()
    assert len(journal.entries) == 3  # not applied
    ignored = core.store.allocator.free_count + core.residency.reclaimable_pages
    core.settle()
    assert journal.pending_pages == 0 and journal.batches == 1
    assert unapplied == core.free_device_pages()
    assert ignored - unapplied == LAYERS * 6  # the control: without the journal the figure is wrong


def test_free_pages_apply_the_journal_when_its_pages_repeat():
    """Pages that repeat (the batch path refuses them) are not estimated: the figure applies the
    journal and is exact. Page size 2: two steps of one request write one page."""
    d = _steady(page_size=2)
    core = d.core
    d.step([("a", 1), ("b", 1)])
    d.step([("a", 1), ("b", 1)])
    journal = core.residency.journal
    _, owners, pages, written = journal.entries[-1]
    assert journal.record(["a", "b"], owners, pages, written)  # the same pages journalled twice
    assert journal.pending_pages and journal.pending_layer_pages() is None
    core.free_device_pages()
    assert not journal.entries and journal.slow == 1
    d.check_at_rest()


@pytest.mark.parametrize("fast", [False, True])
def test_an_int32_step_index_writes_every_layer_in_place(fast, monkeypatch):
    """The step's new slots as int32: every layer's write takes the in-place path (the index is
    converted once per step; the step's object still identifies it). Negative control: a write
    with another object than the step's goes to the at-rest path."""
    d = _steady(fast=fast)
    d.loc_dtype = torch.int32
    at_rest: list[int] = []
    real = d.core.store.write_at_rest
    monkeypatch.setattr(d.core.store, "write_at_rest", lambda layer, *a: (at_rest.append(layer), real(layer, *a)))
    for _ in range(3):
        d.step([("a", 1), ("b", 1)])  # the driver checks the KV inside every layer
    assert at_rest == []
    d.check_at_rest()
    loc = torch.tensor(d.slots["a"][-1:], dtype=torch.int32)
    k = torch.zeros((1, *d.core.store.dev.shape[-2:]), dtype=d.core.store.dev.dtype)
    d.core.write(0, loc, k, k)  # not the step's object
    assert at_rest == [0]
