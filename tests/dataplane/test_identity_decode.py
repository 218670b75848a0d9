"""The identity layout read through page tables (FlashInfer / Triton with nothing offloaded, the
CUDA default): steady decode steps take the journalled fast path and get their tables from the
last step's page lists (:class:`IdentityDecodeStep`, :class:`IdentityDecodeTables`), not from a
build that reads every request's slots.

The driver reads every layer of every request through the step's page table and CSR, as a paged
kernel does, against its shadow copy (``CoreDriver._read_paged``): a wrong table fails there. The
tables also equal what a general build makes for the same batch; controls break each.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_ext.dataplane.decode_continuity import DecodeContinuity
from sglang_ext.dataplane.identity_decode_tables import IdentityDecodeTables
from sglang_ext.dataplane.step_tables import StepTables
from tests.dataplane.core_driver import KV_MISMATCH, CoreDriver, make_core


def _driver(seed: int = 3) -> tuple[CoreDriver, list[str]]:
    core = make_core(None, pages=65, page_size=4)  # identity: every layer-page fits
    d = CoreDriver(core, seed=seed, fast_decode=True, paged_reads=True)
    rids = ["a", "b", "c"]
    for rid in rids:
        d.add(rid)
    assert d.step([("a", 5), ("b", 8), ("c", 2)])  # staggered: some step opens a page most steps
    return d, rids


def test_steady_steps_take_the_fast_path_and_every_read_is_right() -> None:
    d, rids = _driver()
    core = d.core
    assert core.store.identity and core.paged_reads
    for _ in range(24):
        assert d.step([(rid, 1) for rid in rids])  # every layer's read checked against the shadow
    assert core.identity_decode.steps == 24 and d.fast_steps == 24
    assert d.idle_steps >= 24  # nothing to launch: the layers skip the pool's per-layer calls
    d.check_at_rest()


def test_a_step_that_does_not_continue_the_last_one_is_built() -> None:
    """A request joining (or a prefill chunk) takes the general path, and the next steady steps
    continue from its lists."""
    d, rids = _driver(4)
    core = d.core
    assert d.step([(rid, 1) for rid in rids])
    d.add("d")
    before = core.identity_decode.steps
    assert d.step([*((rid, 1) for rid in rids), ("d", 3)])
    assert core.identity_decode.steps == before
    for _ in range(6):
        assert d.step([(rid, 1) for rid in [*rids, "d"]])
    assert core.identity_decode.steps == before + 6
    d.check_at_rest()


def test_the_tables_equal_a_general_build_of_the_same_batch() -> None:
    d, rids = _driver(5)
    core = d.core
    checked = 0

    def compare(layer: int) -> None:
        nonlocal checked
        tables = core.tables
        if layer or not isinstance(tables, IdentityDecodeTables):
            return
        lists = [np.asarray(d.pages(rid), dtype=np.int64) for rid in rids]
        lens = np.asarray([len(d.slots[rid]) for rid in rids], dtype=np.int64)
        core.settle()
        built = StepTables(core.store, lists, lens, np.ones(len(rids), dtype=np.int64), None,
                           lambda n: np.zeros(0, dtype=np.int64), token_tables=False)
        assert torch.equal(tables.tab, built.tab)
        for name in ("kv_indptr", "kv_lens", "last_page_len", "host_indptr", "host_last_page_len"):
            assert torch.equal(getattr(tables, name), getattr(built, name)), name
        stale = [lst[:-1] if i == 0 and lst.size > 1 else lst for i, lst in enumerate(lists)]  # control
        other = IdentityDecodeTables(core.store, stale, lens, core.identity_decode._layer_base)
        assert not torch.equal(other.tab, built.tab) or not torch.equal(other.kv_indptr, built.kv_indptr)
        checked += 1

    d.on_layer = compare
    for _ in range(10):
        assert d.step([(rid, 1) for rid in rids])
    assert checked == 10


def test_negative_control_a_table_missing_the_opened_page_is_caught(monkeypatch) -> None:
    """Tables that forget the page a new token opens: the paged read of that request fails."""
    real = DecodeContinuity.continued

    def forgetting(self, rids, seq_lens, slots, lists):  # noqa: ANN001, ANN202
        got = real(self, rids, seq_lens, slots, lists)
        if got is not None and got[0] and got[1] is not None:
            i = got[0][0]
            got[1][i] = got[1][i][:-1]
        return got

    monkeypatch.setattr(DecodeContinuity, "continued", forgetting)
    d, rids = _driver(6)
    with pytest.raises(AssertionError, match=KV_MISMATCH):
        for _ in range(8):
            d.step([(rid, 1) for rid in rids])


def test_all_resident_extends_get_identity_tables_equal_to_a_general_build() -> None:
    """Prefill and extend steps (several new tokens a request, a request joining) with every live
    layer-page resident get the identity row and CSR too, not StepTables' ``L x`` host build: the
    same ``tab`` and CSR as that build of the same batch, and every layer's paged read right
    (the driver's shadow check). Control: the lists of one request short of its last page differ."""
    d, rids = _driver(6)
    core = d.core
    checked, current = [], []

    def compare(layer: int) -> None:
        tables, batch = core.tables, current[-1]
        if layer or any(n == 1 for _, n in batch):
            return
        assert isinstance(tables, IdentityDecodeTables), type(tables)
        lists = [np.asarray(d.pages(rid), dtype=np.int64) for rid, _ in batch]
        lens = np.asarray([len(d.slots[rid]) for rid, _ in batch], dtype=np.int64)
        built = StepTables(core.store, lists, lens, np.asarray([n for _, n in batch], dtype=np.int64), None,
                           lambda n: np.zeros(0, dtype=np.int64), token_tables=False)
        assert torch.equal(tables.tab, built.tab)
        for name in ("kv_indptr", "kv_lens", "last_page_len"):
            assert torch.equal(getattr(tables, name), getattr(built, name)), name
        short = [lst[:-1] if i == 0 else lst for i, lst in enumerate(lists)]
        other = core.identity_decode.tables(short, lens)
        assert not torch.equal(other.kv_indptr, built.kv_indptr)
        checked.append(len(batch))

    d.on_layer = compare
    d.add("d")
    for batch in ([("a", 3), ("b", 6)], [("d", 9)], [("a", 2), ("c", 5), ("d", 4)]):
        current.append(batch)
        assert d.step(batch)
    assert checked == [2, 1, 3]
    d.check_at_rest()
