"""Advanced paged steps (``LayeredKVCore._advance_paged`` / ``PagedStepTables.advanced`` and
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

import numpy as np
import pytest
import torch

from sglang_ext.dataplane.layered_kv_core import LayeredKVCore
from sglang_ext.dataplane.map_mirror import MapMirror
from sglang_ext.dataplane.paged_step_tables import PagedStepTables
from tests.dataplane.core_driver import LAYERS, CoreDriver, make_core

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


def test_advanced_tables_equal_a_fresh_build(monkeypatch):
    checked = []
    original = LayeredKVCore._advance_paged

    def advance_and_compare(core: LayeredKVCore, opens: list[int], *args: object) -> bool:
        if not original(core, opens, *args):
            return False
        got = core.tables
        assert isinstance(got, PagedStepTables) and core._paged_last is not None
        _, lens, page_lists = core._paged_last
        ref = PagedStepTables(core.store, page_lists, np.asarray(lens, dtype=np.int64),
                              np.ones(len(lens), dtype=np.int64), core.step_loc.numpy().astype(np.int64),
                              lambda n: pytest.fail(f"a fresh build staged {n} pages"), token_tables=False)
        for name in ("tab", "rows", "kv_indptr", "kv_lens", "last_page_len"):
            assert np.array_equal(getattr(got, name).cpu().numpy(), getattr(ref, name).cpu().numpy()), name
        assert np.array_equal(got.dirty_ids, ref.dirty_ids) and np.array_equal(got.new_pages, ref.new_pages)
        assert got.fetches == ref.fetches == [] and got.writebacks == ref.writebacks == [None] * LAYERS
        assert got.staging_ids.size == ref.staging_ids.size == 0
        checked.append(bool(opens))
        return True

    monkeypatch.setattr(LayeredKVCore, "_advance_paged", advance_and_compare)
    d = _driver(seed=4)
    d.add("a")
    d.add("b")
    d.step([("a", 6), ("b", 2)])
    _decode(d, 10)
    d.add("c", share_from="a", share_pages=1)  # a prefix hit joins: the batch changes, then settles
    d.step([("c", 3)])
    _decode(d, 9, ("a", "b", "c"))
    assert len(checked) >= 8 and sum(checked) >= 3, checked  # advances that opened pages among them


def test_a_moved_map_staging_or_token_tables_build_the_step():
    d = _driver(seed=5)
    d.add("a")
    d.add("b")
    d.step([("a", 6), ("b", 2)])
    _decode(d, 3)
    core = d.core
    before = core.advanced_decode_steps
    assert before > 0
    d.want("a", [True, False, True])  # layer 1 of a to host: every step stages and fetches
    _decode(d, 6)
    assert core.advanced_decode_steps == before and core.paged_decode_steps == 9
    d.want("a", [True, True, True])  # back on the device: the move builds one step, then advance
    _decode(d, 6)
    assert core.advanced_decode_steps > before
    d.check_at_rest()
    e = _driver(paged_reads=False, seed=5)  # torch-native: token tables every step
    e.add("a")
    e.step([("a", 6)])
    _decode(e, 6, ("a",))
    assert e.core.paged_decode_steps == 6 and e.core.advanced_decode_steps == 0


def _run_until_advanced(d: CoreDriver) -> None:
    d.add("a")
    d.add("b")
    d.step([("a", 5), ("b", 3)])
    _decode(d, 12)


@pytest.mark.parametrize("forget", ["rows", "lens"])
def test_an_advance_that_forgets_the_token_step_is_caught(monkeypatch, forget):
    original = PagedStepTables.advanced

    def stale(self: PagedStepTables) -> PagedStepTables | None:
        nxt = original(self)
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

    def wrong(self: PagedStepTables, opens: np.ndarray, opened: np.ndarray, seq_lens: np.ndarray):  # noqa: ANN202
        nxt = original(self, opens, opened, seq_lens)
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
