"""SlotKVStore's dirty log: exact, and amortised O(marks) even when everything stays dirty."""

from __future__ import annotations

import numpy as np
import torch

from sglang_ext.dataplane.slot_kv_store import DIRTY_LOG_COMPACT, SlotKVStore
from sglang_ext.dataplane.slot_store_config import SlotStoreConfig

LAYERS, PAGES = 4, 40_000


def _store() -> SlotKVStore:
    """Identity layout (every layer-page fits): nothing ever writes the dirty pages back."""
    return SlotKVStore(SlotStoreConfig(
        layers=LAYERS, page_size=1, kv_heads=1, head_dim=1, logical_pages=PAGES,
        device_pages=LAYERS * PAGES, dtype=torch.float32, device="cpu",
    ))


def _run(store: SlotKVStore, marks: int, *, old_rule: bool = False) -> set[int]:
    """Mark much of the pool dirty, then ``marks`` decode-sized marks; returns the ids marked."""
    marked = set()
    first = np.arange(0, 3 * DIRTY_LOG_COMPACT // 2, dtype=np.int64)
    store.mark_dirty(first)
    marked.update(first.tolist())
    rng = np.random.default_rng(0)
    for _ in range(marks):
        ids = rng.choice(LAYERS * PAGES, size=8, replace=False).astype(np.int64)
        store.mark_dirty(ids)
        marked.update(ids.tolist())
        if old_rule:  # the fixed threshold: compacts again at every mark once the set is large
            store._dirty_compact_at = DIRTY_LOG_COMPACT
    return marked


def test_dirty_log_compacts_amortised_and_stays_exact():
    store = _store()
    marked = _run(store, 2_000)
    assert store.dirty_compactions <= 2
    assert set(store._dirty_ids().tolist()) == marked
    store.dirty_np.reshape(-1)[sorted(marked)[:10]] = False  # settled elsewhere: leaves the set
    assert set(store._dirty_ids().tolist()) == marked - set(sorted(marked)[:10])


def test_negative_control_fixed_threshold_compacts_every_mark():
    store = _store()
    _run(store, 100, old_rule=True)
    assert store.dirty_compactions > 90
